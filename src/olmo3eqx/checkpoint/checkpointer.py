"""The training checkpointer: one orbax `Composite` per saved step (the train state as one tree, the data-iterator
state, the config), saved in the background, restored from the newest step that loads.

A write that fails for the storage's sake (disk full, quota, I/O error), in the step loop's thread or in orbax's
background one, is one `StorageError` naming the directory, the bytes needed and free and the last intact checkpoint;
the checkpoints committed before it stay intact (orbax deletes old steps only after a new one commits).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp

from olmo3eqx import storage
from olmo3eqx.checkpoint.failures import (
    RESTORE_OUTCOMES, TENSORSTORE_ERRNO, remote_failure, restore_error, restore_failure, storage_errno,
)
from olmo3eqx.checkpoint.layout import COMMITTED, STATE, check_model_config, checkpoint_dir, is_remote
from olmo3eqx.checkpoint.retention import Retention
from olmo3eqx.config import ModelConfig
from olmo3eqx.errors import CheckpointLoadError, StorageError
from olmo3eqx.storage import StorePath

TRAIN_ITEMS = (STATE, "data", "config")
TORN = ".orbax-checkpoint-tmp"
"""The suffix of a step orbax had not committed when it stopped; rewriting that step replaces it."""
UNREADABLE = ".unreadable"
"""Suffix of what a resume sets aside of a damaged step: the marker beside it in a bucket, the step renamed locally."""


def agreed_steps(steps: list[int]) -> list[int]:
    """Process 0's `steps` on every process (a listing of a bucket may differ between hosts for a moment)."""
    if jax.process_count() == 1:
        return steps
    from jax.experimental import multihost_utils

    count = int(multihost_utils.broadcast_one_to_all(np.int32(len(steps))))
    mine = np.asarray(steps if jax.process_index() == 0 else [0] * count, np.int32).reshape(count)
    return [int(s) for s in multihost_utils.broadcast_one_to_all(mine)]


def agree(outcome: str) -> list[str]:
    """Every process's outcome (one of RESTORE_OUTCOMES), by process index, the same list on every process."""
    if jax.process_count() == 1:
        return [outcome]
    from jax.experimental import multihost_utils

    codes = multihost_utils.process_allgather(np.array([RESTORE_OUTCOMES.index(outcome)], np.int32))
    return [RESTORE_OUTCOMES[int(c)] for c in np.asarray(codes).reshape(-1)]


def tree_bytes(tree) -> int:
    """Bytes of a tree's arrays (concrete or ShapeDtypeStructs): what a checkpoint of it writes, uncompressed."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class QuietStorageFailures(logging.Filter):
    """orbax reports one failed write many times over: an error log with a traceback from each thread it passed
    through, a "Event loop is closed" traceback from each tensorstore callback into the event loop orbax has closed
    (dozens), asyncio's "exception was never retrieved" for each write future, and at exit one from each write
    coroutine left pending. Checkpointer raises the failure once, as a
    StorageError; this drops those echoes and nothing else (orbax's other logs, other unraisable exceptions)."""

    def __init__(self):
        super().__init__()
        self.orbax_dir = os.path.dirname(ocp.__file__)  # kept here: at exit, module globals may be gone

    def filter(self, record: logging.LogRecord) -> bool:
        failure = record.exc_info[1] if record.exc_info else None
        echo = record.pathname.startswith(self.orbax_dir) or record.name == "asyncio"  # "exception never retrieved"
        return not (echo and record.levelno >= logging.ERROR and
                    (storage_errno(failure) is not None or TENSORSTORE_ERRNO.search(record.getMessage())))

    def unraisable(self, u) -> None:
        loop_closed = isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"
        code = getattr(u.object, "cr_code", None)
        if not (loop_closed or (code is not None and code.co_filename.startswith(self.orbax_dir))):
            self.previous_hook(u)

    def install(self) -> None:
        absl_logger = logging.getLogger("absl")  # orbax logs through absl's logger
        if not any(isinstance(f, QuietStorageFailures) for f in absl_logger.filters):
            absl_logger.addFilter(self)
            logging.getLogger("asyncio").addFilter(self)
            self.previous_hook = sys.unraisablehook
            sys.unraisablehook = self.unraisable


class Checkpointer:
    """Composite checkpoints of a train state: `state` (the TrainState's arrays, one tree), `data` (the iterator
    state, JSON) and `config` (the resolved config, JSON). `checkpoints/N/` holds the state after N updates and a
    data state that has consumed exactly N global batches. Which steps are kept: Retention (keep, keep_every,
    permanent_every, last_step), each step saved with the permanence it is written with, and with `record` (what every
    step's custom metadata also holds: the chat templates of the run's data, olmo3eqx.data.template_record).

    Saves run in orbax's background thread (with async_save): a failure there surfaces at `poll()` (the loop calls
    it every step, so a run on a full disk stops at the step after the failed write, not at the next save), `save`,
    `wait` or `close`, always as StorageError when the storage is to blame."""

    def __init__(self, directory: str | StorePath, *, keep: int, keep_every: int = 0, permanent_every: int = 0,
                 last_step: int | None = None, async_save: bool = True, record: dict | None = None):
        self.directory = checkpoint_dir(directory, "run.dir", write=True)
        self.record = dict(record or {})
        self.remote = is_remote(self.directory)
        self.keep = keep
        self.retention = Retention(keep, keep_every, permanent_every, last_step, self.directory)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=self.retention, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=TRAIN_ITEMS)
        QuietStorageFailures().install()
        self.checkpoint_bytes: int | None = None
        """A checkpoint's size (check_space sets it), for the failure sentence."""
        self._writing: int | None = None  # the step of a save whose background write may not have ended
        self._failed = False

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def intact_steps(self) -> list[int]:
        """Committed steps, read from disk: after a failed save, orbax's own list has already dropped the steps it
        would have deleted had the save succeeded."""
        if not self.directory.exists():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and (p / COMMITTED).is_file())

    def free_bytes(self) -> int:
        """Free space for checkpoints: the file system's, plus what torn steps hold (their rewrite replaces them)."""
        torn = sum(directory_bytes(p) for p in self.directory.iterdir() if TORN in p.name)
        return shutil.disk_usage(self.directory).free + torn

    def check_space(self, state_bytes: int, warn) -> None:
        """Before the first save: StorageError when the free space cannot hold one more checkpoint (training on
        would end in a failed save), a warning when it cannot hold the checkpoint.keep + 1 that are on disk at once
        (orbax deletes the oldest only after the newest commits), + 2 with ephemeral checkpoints (the newest
        ephemeral one stays until the next save commits). A checkpoint's size is the newest one's on disk,
        else `state_bytes` (an upper bound: orbax compresses trained float32 weights by ~10%). A bucket has no free
        space to ask about: nothing is checked there (a quota that stops a write is a StorageError then)."""
        if self.remote:
            self.checkpoint_bytes = state_bytes
            return
        intact = self.intact_steps()
        size = directory_bytes(self.directory / str(intact[-1])) if intact else state_bytes
        self.checkpoint_bytes = size
        ephemeral = self.retention.permanent_every > 0
        free, at_peak = self.free_bytes(), max(1, self.keep + 1 + ephemeral - len(intact))
        if free < size:
            raise self.storage_error(f"{self.directory} has {format_bytes(free)} free, less than the "
                                     f"{format_bytes(size)} the next checkpoint needs")
        if free < at_peak * size:
            warn(f"warning: a checkpoint takes about {format_bytes(size)} and {at_peak} more will be on disk at "
                 f"once (checkpoint.keep {self.keep}{', the newest ephemeral one' if ephemeral else ''} and the one "
                 f"being written), but {self.directory} has "
                 f"{format_bytes(free)} free: room for {free // size}. Free space or lower checkpoint.keep before a "
                 f"save fails.")

    def storage_error(self, what: str, code: int = errno.ENOSPC) -> StorageError:
        """`what` went wrong (error number `code`), as the one sentence a user acts on."""
        if code in (errno.ENOSPC, errno.EDQUOT):
            fix = "free space there (or lower checkpoint.keep, or move run.dir to a larger disk)"
        else:
            fix = "check the storage"
        try:
            intact = self.intact_steps()
        except Exception:  # noqa: BLE001 - the store may be what failed; the sentence must still be said
            intact = None
        if intact is None:
            last = f"{fix} and relaunch to resume from the last intact checkpoint"
        elif intact:
            last = (f"the last intact checkpoint is {self.directory / str(intact[-1])}: {fix} and relaunch to resume "
                    f"from it")
        else:
            last = f"no checkpoint of this run is intact yet: {fix} and relaunch"
        return StorageError(f"{what}; {last}.")

    def _translate(self, action, step: int | None) -> None:
        try:
            action()
        except StorageError:
            self._failed, self._writing = True, None
            raise
        except Exception as e:
            code = storage_errno(e)
            reason = None  # a bucket's failure is said in its own words: it has no free space to report
            if self.remote:
                reason = remote_failure(e) or (os.strerror(code) if code is not None else None)
            if code is None and reason is None:
                raise
            self._failed, self._writing = True, None
            if reason is not None:
                raise self.storage_error(f"Checkpoint {step} could not be written to {self.directory} ({reason})",
                                         errno.EIO) from None
            need = (f"; a checkpoint needs about {format_bytes(self.checkpoint_bytes)}"
                    if self.checkpoint_bytes is not None else "")
            raise self.storage_error(
                f"Checkpoint {step} could not be written to {self.directory} ({os.strerror(code)}){need} and "
                f"{format_bytes(shutil.disk_usage(self.directory).free)} is free", code) from None

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        self.wait()  # orbax's save would wait for the previous background write anyway, and raise its failure
        self._translate(lambda: self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(eqx.filter(state, eqx.is_array)),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(config)), force=True,
            custom_metadata={**self.record, **self.retention.record(step)}), step)
        self._writing = step

    def poll(self) -> None:
        """StorageError if the background write has ended in failure; returns at once while it runs."""
        if self._writing is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Block until the background write has ended; StorageError if it failed."""
        self._translate(self.manager.wait_until_finished, self._writing)
        self._writing = None

    def restore(self, step: int, target):
        """(state, data_state) of `step`. `target` is the train state as sharded ShapeDtypeStructs of the current
        mesh (Layout.state_target()), so the restore lands resharded."""
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        return out[STATE], out["data"]

    def restore_latest(self, target, model_cfg: ModelConfig, warn=print):
        """(step, state, data state) of the newest checkpoint that restores; None when the directory has none.

        Only a step that is verifiably incomplete or damaged (restore_failure: 'corrupt') is skipped, with a warning,
        for the one before it; whatever else restoring raises stops here and sets nothing aside: a store that failed
        is a StorageError (exit 74: the relaunch resumes from the same step), running out of memory is
        CheckpointOutOfMemory, a model config that differs from `model_cfg` a ConfigError, anything else its own
        exception. With several processes, process 0's list of steps is the one tried, every process tries each
        step whatever happens on the others, and all take one verdict from everyone's outcome, so all restore the
        same step. Skipped steps are set aside once one restores (`_set_aside`); when some exist and none
        restores, CheckpointLoadError (never start from scratch over them)."""
        steps = agreed_steps(self.steps())
        skipped = []
        for step in reversed(steps):
            where = self.directory / str(step)
            outcome, value = self._attempt(step, target, model_cfg)
            outcomes = agree(outcome)
            verdict = max(outcomes, key=RESTORE_OUTCOMES.index)
            if verdict == "ok":
                self._set_aside(skipped)
                return step, *value
            seen = [i for i, o in enumerate(outcomes) if o == verdict]
            on = f" on process{'es' if len(seen) > 1 else ''} {', '.join(map(str, seen))}" if len(outcomes) > 1 \
                else ""
            reason = storage.first_line(value[1]) if outcome == verdict else "its own log says why"
            if verdict != "corrupt":
                raise restore_error(verdict, where, on, outcome, value[0], reason)
            if outcome == "corrupt" and jax.process_index() != 0:  # process 0 warns with the others' words
                print(f"warning (process {jax.process_index()}): checkpoint {where} is incomplete or damaged "
                      f"({reason}).", file=sys.stderr, flush=True)
            warn(f"warning: checkpoint {where} is incomplete or damaged{on} ({reason}); falling back to the "
                 f"previous one.")
            skipped.append((step, f"{verdict}{on}: {reason}"))
        if steps:
            raise CheckpointLoadError(
                f"None of the checkpoints in {self.directory} could be restored (steps {', '.join(map(str, steps))} "
                f"are incomplete or damaged: {'; '.join(r for _, r in skipped)}); refusing to start from scratch "
                f"over them. Fix or move the directory, or use a new run.name.")
        return None

    def _attempt(self, step: int, target, model_cfg: ModelConfig) -> tuple[str, Any]:
        """(outcome, (state, data state)) of restoring `step` on this process, or (outcome, (the exception, the link
        of its cause chain that decided the outcome)). orbax's restore ends in a barrier of every process, which a
        process that raised before it never reaches: the restorer here has none (its active processes are this one),
        so every process comes back, whatever happened, to `agree`."""
        me = jax.process_index()
        restorer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(), multiprocessing_options=(
            ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})))
        step_dir = self.directory / str(step)
        try:
            missing = [item for item in TRAIN_ITEMS if not (step_dir / item).exists()]
            if missing:  # orbax would raise a KeyError naming the item
                raise FileNotFoundError(f"{step_dir} has no {', '.join(missing)}")
            config = restorer.restore(step_dir, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
            check_model_config(config, model_cfg, str(step_dir))
            out = restorer.restore(step_dir, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
            return "ok", (out[STATE], out["data"])
        except Exception as e:  # noqa: BLE001 - classified by restore_failure; `agree` decides what it means
            outcome, said = restore_failure(e)
            return outcome, (e, said)
        finally:
            restorer.close()

    def _set_aside(self, skipped: list[tuple[int, str]]) -> None:
        """Take the skipped (newer) steps out of the way of the steps the resumed run writes again, keeping their
        files for inspection and copying nothing. On a bucket a marker `<step>.unreadable` beside the step says why,
        and the step's commit marker is deleted: orbax and every reader here then see a torn step, which the
        resumed run's save of that step replaces. Locally, where orbax commits a step by renaming it into place (its
        name is its commit), it is renamed `<step>.unreadable-<unix time>` (one metadata operation). Process 0
        does it while the others wait; then every process reads the steps again."""
        if not skipped:
            return
        if jax.process_index() == 0:
            stamp = int(time.time())
            for step, reason in skipped:
                step_dir = str(self.directory / str(step))
                if self.remote:
                    record = {"step": step, "skipped_at": stamp, "reason": reason}
                    storage.write_text(str(self.directory / f"{step}{UNREADABLE}"), json.dumps(record) + "\n")
                    storage.remove(storage.join(step_dir, COMMITTED))
                else:
                    os.replace(step_dir, self.directory / f"{step}{UNREADABLE}-{stamp}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("olmo3eqx: unreadable checkpoints set aside")
        storage.forget_listings(str(self.directory))  # what the restore listed holds the steps set aside
        self.manager.reload()

    def close(self) -> None:
        """Wait for the background write (StorageError if it fails) and close; after a failure, only close."""
        if not self._failed:
            self.wait()
        self.manager.close()
