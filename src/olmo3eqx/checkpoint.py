"""Orbax checkpoints: one `Composite` per saved step, the train state saved and restored as one tree.

Layout of a checkpoint directory `C` (an orbax CheckpointManager root):
    C/<step>/state/      the train state's arrays as one tree (olmo3eqx.state.TrainState: model, opt_state, ...);
                         `convert.py hf-to-orbax` writes a state holding only {"model": ...}, as step 0, one leaf at
                         a time (save_model_leaves), and orbax-to-hf reads it back one leaf at a time
                         (restore_model_leaf)
    C/<step>/config/     the resolved config as JSON (at least {"model": {...}})
    C/<step>/data/       training checkpoints only: the data-iterator state (JSON)
Readers that need part of a state (the moments for `init_from`, one leaf for conversion) restore just those
top-level parts (`restore_parts`); nothing else is read. The model alone (`restore_model`: `init_from`, evaluation,
generation, `load_model`, `load_any`) is read leaf by leaf and stored chunk by stored chunk straight into the buffers
of the device shards it lands on, in the dtype asked for: a restore holds the weights it returns plus about one
stored chunk (orbax's own restore reads each shard whole in the stored dtype, then casts and copies it: 1.7x the
weights at its peak restoring a float32 checkpoint as float32, 2.1x as bfloat16, bench/bench_speak_memory.py).
save_model and save_model_leaves store arrays in chunks of at most CHUNK_BYTES; a training checkpoint's chunks are
its device shards.

A write that fails for the storage's sake (disk full, quota, I/O error), in the step loop's thread or in orbax's
background one, is one `StorageError` naming the directory, the bytes needed and free and the last intact checkpoint;
the checkpoints committed before it stay intact (orbax deletes old steps only after a new one commits).

Every directory here may be local or a gs:// or s3:// URL (olmo3eqx.storage). On a bucket orbax writes the arrays
through tensorstore's own gcs/s3 kvstores (orbax_s3 teaches it s3://) and the rest through etils.epath; a step is
written under its final name and committed by `commit_success.txt` written last (a bucket cannot rename a directory
atomically), so a step without one is torn, whoever wrote it.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
from etils import epath
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental import v1 as ocp_v1
from orbax.checkpoint.experimental.v1 import partial as ocp_partial

from olmo3eqx import exits, storage
from olmo3eqx.config import ModelConfig, from_dict, to_dict
from olmo3eqx.errors import CheckpointLoadError, CheckpointOutOfMemory, ConfigError, StorageError
from olmo3eqx.hf.weights import aligned_empty
from olmo3eqx.model import DTYPE, OLMo3, abstract_model
from olmo3eqx.sharding import is_leaf_like, model_shardings
from olmo3eqx.storage import StorePath

STATE = "state"
"""The item holding the train state (or a converted model) of every checkpoint step."""
CHUNK_BYTES = 64 * 2**20
"""Largest stored chunk of an array that save_model and save_model_leaves write: restore_model decodes one chunk at a
time, so this bounds what a restore holds beyond the weights (a chunk is compressed whole, so a larger one is read
whole whatever part of it is wanted)."""
COMMITTED = "commit_success.txt"
"""What orbax writes last into a step it commits on a bucket (and locally with async saves); convert.py's steps on a
bucket get one too."""


def checkpoint_dir(directory, what: str = "Checkpoint", *, write: bool = False) -> StorePath:
    """A checkpoint directory as the path object orbax takes: an absolute pathlib.Path, or an etils.epath.Path of a
    gs:// or s3:// URL (with orbax taught s3://)."""
    d = storage.path(directory, what, write=write)
    if isinstance(d, Path):
        return d.absolute()
    if str(d).startswith("s3://"):
        from olmo3eqx import orbax_s3

        orbax_s3.install()
    return d


def is_remote(directory) -> bool:
    return storage.is_url(directory)


def save_model(directory: str | StorePath, model: OLMo3, cfg: ModelConfig, step: int = 0, extra_config: dict | None = None):
    """Write `model` as step `step` of the checkpoint directory (blocking): a state of the model alone."""
    directory = checkpoint_dir(directory, write=True)
    config = {"model": to_dict(cfg), **(extra_config or {})}
    state = {"model": eqx.filter(model, eqx.is_array)}
    chunked = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), state)
    with ocp.CheckpointManager(directory, item_names=(STATE, "config")) as mngr:
        mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state, save_args=chunked),
            config=ocp.args.JsonSave(config)), force=True)
        mngr.wait_until_finished()


def _nest(path: tuple[str, ...], leaf) -> dict:
    """{"a": {"b": leaf}} for path ("a", "b"): one model leaf as a tree orbax saves and restores under the same keys
    as the leaf inside the saved OLMo3 (module attributes and dict keys name a leaf alike)."""
    for name in reversed(path):
        leaf = {name: leaf}
    return leaf


def save_model_leaves(directory: str | StorePath, cfg: ModelConfig, leaves: Iterable[tuple[tuple[str, ...], jax.Array]],
                      step: int = 0, extra_config: dict | None = None) -> None:
    """Write step `step` of the checkpoint directory from the model's leaves given one at a time as (attribute path,
    array), e.g. (("blocks", "mlp", "up_proj", "weight"), x): each is written (orbax's partial save) and released
    before the next is asked for, so memory stays near one leaf. The result is save_model's layout, read back by
    load_model and restore_parts. Staged under `<step>.partial` and renamed into place when complete. A directory in
    a bucket is staged in a local temporary directory (orbax's partial save cannot write a bucket: "Snapshot is not
    supported for CommitFileTemporaryPath"; TMPDIR must hold the checkpoint), then uploaded file by file, COMMITTED
    last. One process (the conversion tools run in one)."""
    if is_remote(directory):
        target = checkpoint_dir(directory, write=True)
        with tempfile.TemporaryDirectory(prefix="olmo3eqx-convert-") as tmp:
            save_model_leaves(tmp, cfg, leaves, step, extra_config)
            local = Path(tmp) / str(step)
            (local / COMMITTED).write_text(f"checkpoint step {step} written by olmo3eqx\n")
            storage.upload_tree(local, str(target / str(step)), last=[COMMITTED])
        return
    directory = checkpoint_dir(directory, write=True)
    staging, final = directory / f"{step}.partial", directory / str(step)
    directory.mkdir(parents=True, exist_ok=True)
    chunked = ocp_v1.Context()
    chunked.array.saving.storage_options.chunk_byte_size = CHUNK_BYTES
    with chunked:
        for path, leaf in leaves:
            ocp_partial.save(staging, {"model": _nest(path, leaf)})
            del leaf
        ocp_partial.finalize(staging)
    config = {"model": to_dict(cfg), **(extra_config or {})}
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(staging / "config", args=ocp.args.JsonSave(config))
    staging.rename(final)


def is_complete_step(p) -> bool:
    """A step directory holding a whole checkpoint: locally its state (orbax renames a step into place when it is
    whole), on a bucket its commit marker (written last)."""
    return (p / COMMITTED).exists() if is_remote(p) else (p / STATE).is_dir()


def complete_steps(path: str | StorePath) -> tuple[StorePath, list[int]]:
    """(manager root, its complete steps in order) of a manager root or a run directory."""
    path = checkpoint_dir(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {storage.redact(path)} does not exist; pass the directory convert.py or "
                                f"train.py wrote.")
    if (path / "checkpoints").is_dir():  # a run directory
        path = path / "checkpoints"
    steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and is_complete_step(p))
    if not steps:
        raise FileNotFoundError(f"No complete checkpoint step under {storage.redact(path)}; expected <step>/{STATE}/ "
                                f"subdirectories{f' with {COMMITTED}' if is_remote(path) else ''}.")
    return path, steps


def resolve_step_dir(path: str | StorePath) -> tuple[StorePath, int]:
    """Accept a manager root (newest complete step wins) or one step directory; return (root, step)."""
    path = checkpoint_dir(path)
    if path.name.isdigit() and is_complete_step(path):
        return path.parent, int(path.name)
    root, steps = complete_steps(path)
    return root, steps[-1]


def read_config(root: StorePath, step: int) -> dict:
    with ocp.CheckpointManager(root, item_names=("config",)) as mngr:
        return mngr.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]


def model_config_from_dict(d: dict, where: str) -> ModelConfig:
    try:
        return from_dict(ModelConfig, d["model"], "model")
    except (KeyError, ConfigError) as e:
        raise ConfigError(f"The config stored in checkpoint {where} is not a valid model config: {e}") from None


def saved_parts(root: StorePath, step: int) -> list[str]:
    """The top-level parts of a step's saved state (a training checkpoint: every TrainState field)."""
    # The item's handler reads the tree's own _METADATA; a Checkpointer would also look for a step-level
    # _CHECKPOINT_METADATA inside the item directory, which is never there, and log an absl warning every time.
    return list(ocp.PyTreeCheckpointHandler().metadata(epath.Path(str(root)) / str(step) / STATE).tree)


def restore_parts(root: StorePath, step: int, targets: dict[str, Any], restore_args=None) -> dict[str, Any]:
    """Top-level parts of a step's saved state, each restored onto its target (a tree like the part, whose array
    leaves are sharded ShapeDtypeStructs, see sharding.with_shardings; `restore_args`, a tree like `targets`, can ask
    for another type); the other parts are not read."""
    missing = sorted(set(targets) - set(saved_parts(root, step)))
    if missing:
        raise ConfigError(f"Checkpoint {root / str(step)} holds no {', '.join(missing)}; a converted checkpoint holds "
                          f"the model only.")
    restore_args = restore_args or ocp.checkpoint_utils.construct_restore_args(targets)
    args = ocp.args.PyTreeRestore(item=targets, restore_args=restore_args, partial_restore=True)
    with ocp.CheckpointManager(root, item_names=(STATE,)) as mngr:
        return dict(mngr.restore(step, args=ocp.args.Composite(state=args))[STATE])


VOCAB_AXIS = {"embed": 0, "lm_head.weight": 1}
"""The vocabulary axis of the model's two vocabulary-sized leaves (by attribute path): the embedding is [vocab, hidden],
the LM head's Linear weight [hidden, vocab]."""


def restore_model(root: StorePath, step: int, cfg: ModelConfig, sharding=None,
                  vocab_rows: int | None = None) -> OLMo3:
    """The model of `step` in cfg.param_dtype (cast as it is read, when the checkpoint stores another dtype), each leaf
    built on `sharding` (a tree of shardings like the model's arrays, or one; default the first device). Leaves are
    read one at a time, every device shard chunk by stored chunk straight into that shard's own buffer (which a CPU
    device adopts as is), and each process reads only the shards of its own devices: the restore holds the model it
    returns plus one stored chunk, whatever the checkpoint's dtype, mesh or process count. `vocab_rows`: the
    checkpoint's vocabulary when it is smaller than cfg.vocab_size; the embedding rows and LM-head columns past it
    read as zeros (pad_vocabulary fills them)."""
    if "model" not in saved_parts(root, step):
        raise ConfigError(f"Checkpoint {root / str(step)} holds no model; pass one that train.py or convert.py "
                          f"wrote.")
    abstract = abstract_model(cfg)
    params, static = eqx.partition(abstract, is_leaf_like)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = sharding if not isinstance(sharding, jax.sharding.Sharding) else jax.tree.map(lambda _: sharding, params)
    reader = StateReader(root / str(step) / STATE)
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)

    def stored_shape(name: str, like: jax.ShapeDtypeStruct) -> tuple[int, ...]:
        shape = list(like.shape)
        if vocab_rows is not None and name in VOCAB_AXIS:
            shape[VOCAB_AXIS[name]] = vocab_rows
        return tuple(shape)

    names = [jax.tree_util.keystr(path, simple=True, separator=".") for path, _ in leaves]
    arrays = [reader.read("model." + name, like, s, stored_shape(name, like))
              for name, (_, like), s in zip(names, leaves, jax.tree.leaves(shardings))]
    return eqx.combine(jax.tree.unflatten(tree, arrays), static)


class StateReader:
    """Arrays of a step's saved state read with tensorstore through the specs orbax reads them with (any of its
    layouts: OCDBT or not, zarr2 or zarr3, written by any number of processes, local or in a bucket)."""

    def __init__(self, state_dir: StorePath):
        from orbax.checkpoint._src.serialization import tensorstore_utils, types

        self.state_dir, self.tsu, self.types = state_dir, tensorstore_utils, types
        self.layout = json.loads((state_dir / "_METADATA").read_text())
        self.context = tensorstore_utils.get_ts_context(use_ocdbt=self.layout["use_ocdbt"])

    def open(self, name: str, dtype):
        """The stored array `name` (orbax's name: the tree path joined by dots), read as `dtype`."""
        import tensorstore as ts

        info = self.types.ParamInfo(name=name, parent_dir=self.state_dir, use_zarr3=self.layout["use_zarr3"],
                                    ts_context=self.context)
        spec = self.tsu.build_array_read_spec(info, use_ocdbt=self.layout["use_ocdbt"], target_dtype=dtype)
        return ts.open(spec.json, open=True, context=self.context).result()

    def read(self, name: str, like: jax.ShapeDtypeStruct, sharding: jax.sharding.Sharding,
             stored_shape: tuple[int, ...] | None = None) -> jax.Array:
        """Array `name` shaped like `like`, in its dtype, on `sharding`; each addressable shard filled one stored chunk
        at a time (a wider read would decode every chunk it spans before copying any). `stored_shape` (default like's,
        nowhere larger): the shape the checkpoint must hold; what lies past it reads as zeros."""
        stored = self.open(name, like.dtype)
        expected = tuple(like.shape) if stored_shape is None else tuple(stored_shape)
        if tuple(stored.shape) != expected:
            raise ConfigError(f"Array {name} of checkpoint {self.state_dir.parent} has shape {list(stored.shape)}, "
                              f"but its config implies {list(expected)}.")
        chunk = stored.chunk_layout.read_chunk.shape

        def shard(index: tuple[slice, ...]) -> np.ndarray:
            region = [range(n)[i] for n, i in zip(like.shape, index)]
            out = aligned_empty(tuple(len(r) for r in region), like.dtype)
            held = [range(r.start, min(r.stop, n)) for r, n in zip(region, expected)]  # what the checkpoint holds
            if held != region:
                out.fill(0)
            cells = [range(h.start - h.start % c, h.stop, c) for h, c in zip(held, chunk)]
            for corner in itertools.product(*cells):
                lo = [max(c, h.start) for c, h in zip(corner, held)]
                hi = [min(c + k, h.stop) for c, k, h in zip(corner, chunk, held)]
                part = tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, region))
                out[part] = stored[tuple(slice(a, b) for a, b in zip(lo, hi))].read().result()
            return out

        return jax.make_array_from_callback(tuple(like.shape), sharding, shard, dtype=like.dtype)


def restore_model_leaf(root: StorePath, step: int, path: tuple[str, ...], like: jax.ShapeDtypeStruct) -> np.ndarray:
    """One model leaf (attribute path, as in save_model_leaves) of a step's state, shaped `like`, as a host array (no
    device needs to hold it); no other array is read."""
    restore_args = _nest(path, ocp.RestoreArgs(restore_type=np.ndarray, dtype=like.dtype))
    tree = restore_parts(root, step, {"model": _nest(path, like)}, {"model": restore_args})["model"]
    for name in path:
        tree = tree[name]
    return tree


def open_model(ckpt_dir: str | StorePath) -> tuple[StorePath, int, ModelConfig]:
    """(manager root, step, model config) of a checkpoint directory (manager root, run dir or step dir)."""
    root, step = resolve_step_dir(ckpt_dir)
    return root, step, model_config_from_dict(read_config(root, step), str(root / str(step)))


def load_model(ckpt_dir: str | StorePath, sharding=None) -> tuple[OLMo3, ModelConfig]:
    """The model and its config from a checkpoint directory (manager root, run dir or step dir)."""
    root, step, cfg = open_model(ckpt_dir)
    return restore_model(root, step, cfg, sharding), cfg


class Loaded(NamedTuple):
    """A model to evaluate or generate with, and what its checkpoint says about it (load_any)."""

    model: OLMo3
    cfg: ModelConfig
    stored: dict | None
    """The config stored with an orbax checkpoint (a training run's: model, data, eval, ...); None for HF."""
    tokenizer: str | None
    """An HF directory's tokenizer.json, when it has one."""
    step: int
    run_dir: StorePath | None
    """The run directory of a training checkpoint."""


def speaking_config(cfg: ModelConfig, dtype: str | None) -> ModelConfig:
    """`cfg` with params and compute in `dtype` (None: cfg's compute dtype). The forward casts every weight to the
    compute dtype before using it, so weights held in that dtype give the same outputs in a fraction of the memory of
    float32 masters."""
    dtype = dtype or cfg.compute_dtype
    return dataclasses.replace(cfg, param_dtype=dtype, compute_dtype=dtype)


def load_any(ckpt: str, mesh, dtype: str | None = None) -> Loaded:
    """The model of `ckpt` (a run directory's newest step, its checkpoints/, one step, convert.py's output, local or in
    a bucket, or a local HF Olmo3 directory) restored straight onto `mesh` where training would shard it (one copy,
    each process reading only its own devices' shards), in `dtype` (params and compute; None: the checkpoint's compute
    dtype, float32 for an HF directory)."""
    from olmo3eqx.hf import config_json, weights

    if dtype is not None and dtype not in DTYPE:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPE)}.")
    if not storage.is_url(ckpt) and (Path(ckpt) / config_json.CONFIG_FILE).is_file():
        w = weights.open_hf(ckpt, DTYPE[dtype or "float32"])
        model = weights.load_weights(w, model_shardings(abstract_model(w.cfg), mesh))
        tokenizer = Path(ckpt) / "tokenizer.json"
        return Loaded(model, w.cfg, None, str(tokenizer) if tokenizer.is_file() else None, 0, None)
    root, step = resolve_step_dir(ckpt)
    stored = read_config(root, step)
    cfg = speaking_config(model_config_from_dict(stored, str(root / str(step))), dtype)
    model = restore_model(root, step, cfg, model_shardings(abstract_model(cfg), mesh))
    return Loaded(model, cfg, stored, None, step, root.parent if root.name == "checkpoints" else None)


# --- training checkpoints -------------------------------------------------------------------------

TRAIN_ITEMS = (STATE, "data", "config")


TENSORSTORE_ERRNO = re.compile(r"os_error_code='(\d+)'")
"""How tensorstore's errors (which orbax raises as ValueError) carry the OS error of a failed write."""
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})
"""OS errors that are the storage's fault (not a missing or unreadable input) when any write of a run fails."""
TORN = ".orbax-checkpoint-tmp"
"""The suffix of a step orbax had not committed when it stopped; rewriting that step replaces it."""


TENSORSTORE_UNREACHABLE = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|PERMISSION_DENIED|UNAUTHENTICATED|"
                                     r"RESOURCE_EXHAUSTED)\b")
"""tensorstore's status codes (in the text of the ValueError orbax raises) for a store that failed or refused."""


def remote_failure(e: BaseException | None) -> str | None:
    """What went wrong, in a few words, when `e` (or its cause) is a bucket's failure in a write (unreachable, refused,
    out of quota, an upload session the store dropped) rather than a bug; None otherwise."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if TENSORSTORE_UNREACHABLE.search(str(e)) or storage.failure_kind(e) is not None:
            return storage.first_line(e)
        e = e.__cause__ or e.__context__
    return None


def storage_errno(e: BaseException | None) -> int | None:
    """The OS error number of a storage failure (an OSError, or a tensorstore error anywhere on the cause chain);
    None when `e` is not one (a bug is not the disk's fault and keeps its traceback)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        found = TENSORSTORE_ERRNO.search(str(e))
        if found:
            return int(found.group(1))
        e = e.__cause__ or e.__context__
    return None


UNREADABLE = ".unreadable"
"""Suffix of what a resume sets aside of a damaged step: the marker beside it in a bucket, the step renamed locally."""
RESTORE_OUTCOMES = ("ok", "corrupt", "storage", "denied", "config", "memory", "error")
"""What restoring a step came to on one process, in the order processes' outcomes are weighed: the verdict is the
last any process reached, so a step is skipped only when every process restored it or found it damaged."""
TENSORSTORE_STATUS = re.compile(r"\b(DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|NOT_FOUND|UNAVAILABLE|"
                                r"DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|ABORTED|PERMISSION_DENIED|UNAUTHENTICATED)\b")
"""tensorstore's status codes, which orbax's errors carry in their text."""
STATUS_OUTCOMES = {"DATA_LOSS": "corrupt", "OUT_OF_RANGE": "corrupt", "FAILED_PRECONDITION": "corrupt",
                   "NOT_FOUND": "corrupt", "UNAVAILABLE": "storage", "DEADLINE_EXCEEDED": "storage",
                   "RESOURCE_EXHAUSTED": "storage", "ABORTED": "storage", "PERMISSION_DENIED": "denied",
                   "UNAUTHENTICATED": "denied"}
"""What each means in a read of a committed step: the data is not what its index says (a checksum or length that
does not match, a chunk that does not decode, a part missing), or the store failed or refused."""
OUT_OF_MEMORY = re.compile(r"out of memory", re.IGNORECASE)
"""XLA's and tensorstore's words for an allocation that failed (XLA: RESOURCE_EXHAUSTED: Out of memory ...)."""


def restore_failure(e: BaseException) -> tuple[str, BaseException]:
    """What an exception raised while restoring a committed step means, as one of RESTORE_OUTCOMES, and the link of
    its cause chain that says so (the first that does; orbax wraps tensorstore's words in its own): 'corrupt' only
    when the step itself is verifiably incomplete or damaged (a part of it missing; data shorter than its index
    says, or that does not decode: tensorstore's DATA_LOSS, OUT_OF_RANGE, FAILED_PRECONDITION, NOT_FOUND; metadata
    that does not parse), 'storage' when the store failed (unreachable, timed out, an I/O error), 'denied',
    'memory' (a device or the host ran out), 'config' (a ConfigError), else 'error' (a bug keeps its traceback)."""
    seen, link = set(), e
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        outcome = _restore_failure_of(link)
        if outcome is not None:
            return outcome, link
        link = link.__cause__ or link.__context__
    return "error", e


def _restore_failure_of(e: BaseException) -> str | None:
    if isinstance(e, storage.AccessDenied):
        return "denied"
    if isinstance(e, StorageError):
        return "storage"
    if isinstance(e, ConfigError):
        return "config"
    if isinstance(e, MemoryError) or OUT_OF_MEMORY.search(str(e)):
        return "memory"
    if isinstance(e, json.JSONDecodeError) or "incomplete checkpoint" in str(e):  # orbax's own completeness check
        return "corrupt"
    code = e.errno if isinstance(e, OSError) else None
    found = TENSORSTORE_ERRNO.search(str(e))
    code = int(found.group(1)) if found else code
    if code == errno.ENOMEM:
        return "memory"
    if code in STORAGE_ERRNOS or code in storage.TRANSIENT_ERRNOS:
        return "storage"
    found = TENSORSTORE_STATUS.search(str(e))
    if found:
        return STATUS_OUTCOMES[found.group(1)]
    kind = storage.failure_kind(e)
    return {"missing": "corrupt", "transient": "storage", "denied": "denied"}.get(kind)


def restore_error(verdict: str, where, on: str, outcome: str, value: BaseException, reason: str) -> BaseException:
    """The error a resume stops with when the processes' verdict on a step is `verdict` (not 'ok' or 'corrupt'):
    this process's own exception where it is the verdict's and already one sentence, else one naming the step."""
    if verdict == "storage":
        return StorageError(f"Checkpoint {where} could not be read{on} ({reason}); nothing was set aside: check that "
                            f"the store is reachable and relaunch to resume from it.")
    if verdict == "memory":
        return CheckpointOutOfMemory(
            f"Restoring checkpoint {where} ran out of memory{on} ({reason}); the checkpoint is kept: resume on "
            f"devices with more memory or on more of them (the state is sharded over them), or free host memory.")
    if outcome == verdict and isinstance(value, exits.CommandError):
        return value
    if verdict == "denied":
        return storage.AccessDenied(f"Reading checkpoint {where} was denied{on} ({reason}); check the credentials "
                                    f"this host uses for the store.")
    if verdict == "config":
        return ConfigError(f"Checkpoint {where} does not fit this run's config{on} ({reason}).")
    if outcome == verdict:
        return value
    return RuntimeError(f"Restoring checkpoint {where} failed{on}; that process's traceback says why.")


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


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which committed steps survive a save (an orbax PreservationPolicy): the newest `keep` permanent steps, every
    multiple of `keep_every`, and the newest step of all. With `permanent_every` (checkpoint.every when ephemeral
    checkpoints are on) only multiples of it and `last_step` are permanent: any other step (an ephemeral save, a
    preemption's) survives only while it is the newest, so it never pushes a permanent one out of `keep`. 0: every
    step is permanent (orbax's max_to_keep and keep_period). orbax asks after it has listed the step being saved, and
    deletes what this drops only once that step is committed (asynchronously in its finalize thread, after the
    commit): a crash in between leaves the older step too, never no checkpoint."""

    keep: int
    keep_every: int = 0
    permanent_every: int = 0
    last_step: int | None = None

    def permanent(self, step: int) -> bool:
        return not self.permanent_every or step % self.permanent_every == 0 or step == self.last_step

    def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
        steps = [info.step for info in checkpoints]
        newest = max(steps, default=None)
        kept = set(sorted(s for s in steps if self.permanent(s))[-self.keep:])
        return [s in kept or s == newest or (self.keep_every > 0 and s % self.keep_every == 0) for s in steps]


class Checkpointer:
    """Composite checkpoints of a train state: `state` (the TrainState's arrays, one tree), `data` (the iterator
    state, JSON) and `config` (the resolved config, JSON). `checkpoints/N/` holds the state after N updates and a
    data state that has consumed exactly N global batches. Which steps are kept: Retention (keep, keep_every,
    permanent_every, last_step).

    Saves run in orbax's background thread (with async_save): a failure there surfaces at `poll()` (the loop calls
    it every step, so a run on a full disk stops at the step after the failed write, not at the next save), `save`,
    `wait` or `close`, always as StorageError when the storage is to blame."""

    def __init__(self, directory: str | StorePath, *, keep: int, keep_every: int = 0, permanent_every: int = 0,
                 last_step: int | None = None, async_save: bool = True):
        self.directory = checkpoint_dir(directory, "run.dir", write=True)
        self.remote = is_remote(self.directory)
        self.keep = keep
        self.retention = Retention(keep, keep_every, permanent_every, last_step)
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
            config=ocp.args.JsonSave(config)), force=True), step)
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


# Fields that may change between a checkpoint and the run that loads it: they change how the model is computed,
# not what its parameters are.
COMPUTE_ONLY_FIELDS = ("remat", "remat_by_chip", "attention_impl", "attention_block_q", "attention_block_kv",
                       "scan_layers", "compute_dtype", "max_position_embeddings")


INIT_FROM_CHANGEABLE = ("rope_scaling",)
"""Fields a run started from a checkpoint (init_from) may also change: the long-context stage switches YaRN on
over weights trained with plain RoPE. A resumed run keeps them."""


def model_config_mismatch(saved: ModelConfig, current: ModelConfig, allow: tuple[str, ...] = ()) -> list[str]:
    def value(cfg: ModelConfig, name: str):
        # layer_types None is OLMo's rule spelled out: a converted config.json lists it, a preset leaves it unset.
        return cfg.resolved_layer_types if name == "layer_types" else getattr(cfg, name)

    return [f"{f.name} (checkpoint {value(saved, f.name)!r}, config {value(current, f.name)!r})"
            for f in dataclasses.fields(ModelConfig)
            if f.name not in COMPUTE_ONLY_FIELDS + allow and value(saved, f.name) != value(current, f.name)]


def check_model_config(saved: dict, current: ModelConfig, where: str, allow: tuple[str, ...] = ()) -> None:
    diff = model_config_mismatch(model_config_from_dict(saved, where), current, allow)
    if diff:
        raise ConfigError(f"The model config differs from checkpoint {where} in {', '.join(diff)}; use the "
                          f"checkpoint's values or start a new run (a new run.name).")


def init_from(path: str | StorePath, fresh, target, *, with_optimizer: bool, note=None):
    """`fresh` with the parts it takes from checkpoint `path` replaced: the model, and with `with_optimizer` the AdamW
    state (stage 2's start); step, data position and spike-guard history stay the fresh state's. `target` is as in
    Checkpointer.restore. A checkpoint with a smaller vocabulary than the config (AI2's released 100,278 rows against
    the 100,352 OLMo-core trains) gives its rows; the padding rows keep the fresh state's initialisation
    (pad_vocabulary), and `note` (a function of one line) says so."""
    root, step = resolve_step_dir(path)
    where = str(root / str(step))
    stored = read_config(root, step)
    current = fresh.model.cfg
    rows = model_config_from_dict(stored, where).vocab_size
    padded = rows < current.vocab_size
    check_model_config(stored, current, where, allow=INIT_FROM_CHANGEABLE + (("vocab_size",) if padded else ()))
    if with_optimizer and padded:
        raise ConfigError(f"Checkpoint {where} has {rows:,} vocabulary rows and the config {current.vocab_size:,}: "
                          f"a padded vocabulary starts with fresh moments, none are carried into rows the checkpoint "
                          f"never trained; drop --init-optimizer, or set model.vocab_size to {rows}.")
    if with_optimizer and "opt_state" not in saved_parts(root, step):
        raise FileNotFoundError(f"Checkpoint {where} has no optimizer state (a converted checkpoint has weights "
                                f"only); drop --init-optimizer to start with fresh moments.")
    shardings = jax.tree.map(lambda a: a.sharding, target.model)  # the target's leaves are sharded ShapeDtypeStructs
    model = restore_model(root, step, current, shardings, vocab_rows=rows if padded else None)
    if padded:
        model = pad_vocabulary(model, fresh.model, rows)
        if note is not None:
            note(f"padded the vocabulary from {rows:,} to {current.vocab_size:,} rows: embedding rows and LM-head "
                 f"columns {rows:,}-{current.vocab_size - 1:,} initialised as OLMo-core initialises them (truncated "
                 f"normal, std {current.initializer_range}, from run.seed); the checkpoint's tokenizer has no id "
                 f"that reaches them")
    state = eqx.tree_at(lambda s: s.model, fresh, model)
    if with_optimizer:
        opt_state = restore_parts(root, step, {"opt_state": target.opt_state})["opt_state"]
        state = eqx.tree_at(lambda s: s.opt_state, state, opt_state)
    return state


def pad_vocabulary(model: OLMo3, fresh: OLMo3, rows: int) -> OLMo3:
    """`model` with its embedding rows and LM-head columns from `rows` on taken from `fresh`: the padding of a
    vocabulary (OLMo-core pads the tokenizer's to a multiple of 128) initialised as every row of a fresh model is, the
    truncated normal of model.initializer_range from the run's seed, as OLMo-core's InitMethod.normal initialises its
    embedding and LM head. No token id reaches those rows (the tokenizer's ids are below `rows`); their LM-head
    columns stay in the softmax, as in OLMo-core's loss, which masks no logit. Each matrix is merged under jit on its
    own sharding, never whole on one device."""
    def merge(path, loaded, init):
        axis = VOCAB_AXIS.get(jax.tree_util.keystr(path, simple=True, separator="."))
        if axis is None:
            return loaded
        keep = lambda a, b: jnp.where(jax.lax.broadcasted_iota(jnp.int32, a.shape, axis) < rows, a, b)  # noqa: E731
        return jax.jit(keep, out_shardings=loaded.sharding)(loaded, init)

    params, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.tree_util.tree_map_with_path(merge, params, eqx.filter(fresh, eqx.is_array)), static)
