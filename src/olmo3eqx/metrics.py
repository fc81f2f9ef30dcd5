"""Metric sinks: `metrics.jsonl`, TensorBoard, optional W&B, and a progress bar.

Whether this process logs is the caller's decision (`enabled`, normally `jax.process_index() == 0`).
`metrics.jsonl` holds one JSON object per line: `"step"` (int), `"time"` (unix seconds) and slash-named
metrics (`train/loss`, `perf/mfu`, `eval/<set>/loss`). Values are plain ints and floats; a non-finite
float (NaN, +-inf) is written as `null`, which keeps every line valid JSON and reads back as NaN in
`read_metrics` and pandas. A resumed run appends; old lines stay (steps logged after the last checkpoint
of the interrupted run then appear twice, the later line being the resumed run's). A process killed inside a write,
or a disk that filled up mid-line, leaves a torn last line: `read_metrics` skips it and the next run's logger drops
it before appending.

A run directory in a bucket (gs://, s3://) holds the same files. An object cannot be appended to line by line, so
there each file's new lines (and TensorBoard's events) are kept in memory and appended to the object at once
(olmo3eqx.storage.append_bytes: GCS compose, S3 multipart copy) every REMOTE_FLUSH_SECONDS, before every checkpoint
(so the lines of every step a checkpoint holds are in the bucket before it commits) and at the end. A kill loses
only lines of steps after the last checkpoint, which the resumed run logs again, as it does locally.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import struct
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from olmo3eqx import flops, storage
from olmo3eqx.config import LogConfig
from olmo3eqx.errors import ConfigError

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_id"
"""In the run directory: the id of the W&B run every launch of the run logs into (written by the first)."""
TB_DIR = "tb"
REMOTE_FLUSH_SECONDS = 30.0
"""How often the lines logged to a run directory in a bucket are appended to their objects (and before each
checkpoint, and at the end)."""


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"loss": x}} -> {"train/loss": x}."""
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, name + "/"))
        else:
            out[name] = v
    return out


def to_python(value: Any) -> int | float:
    """A Python int (integer or bool scalars) or float (floating scalars) from a number or 0-d array."""
    if isinstance(value, (bool, int, float)):
        return int(value) if isinstance(value, (bool, int)) else float(value)
    arr = np.asarray(value)
    if arr.ndim != 0:
        raise ValueError(f"Metrics must be scalars, got an array of shape {arr.shape}; reduce it before logging.")
    if np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        return int(arr)
    return float(arr)


def fetch(metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """Bring a (possibly nested) dict of device scalars to the host at once: one `jax.device_get`,
    keys joined with '/'. Blocks until the step that produced them has finished."""
    flat = _flatten(metrics)
    host = jax.device_get(flat)
    return {k: to_python(v) for k, v in host.items()}


class PendingMetrics:
    """Step `step`'s metrics, still on device. Create it right after dispatching the step (this starts
    the device-to-host copies), dispatch the next step, then call `.result()`: the host never waits for
    a step before the following one is queued."""

    def __init__(self, step: int, metrics: Mapping[str, Any]):
        self.step = step
        self._metrics = metrics
        for leaf in jax.tree.leaves(metrics):
            if isinstance(leaf, jax.Array):
                leaf.copy_to_host_async()

    def result(self) -> dict[str, int | float]:
        return fetch(self._metrics)


class MetricsQueue:
    """The one-step-late fetch of a training loop. `push(step, metrics)` queues step t's device metrics (starting
    their copy to the host) and returns step t-1's, fetched: by then step t is dispatched, so the host never
    stalls the device. `flush()` returns what is queued now (before a checkpoint or an evaluation must know the
    state is finite). Both give (step, values) or None when nothing was queued."""

    def __init__(self):
        self._pending: PendingMetrics | None = None

    def push(self, step: int, metrics: Mapping[str, Any]) -> tuple[int, dict[str, int | float]] | None:
        previous, self._pending = self._pending, PendingMetrics(step, metrics)
        return None if previous is None else (previous.step, previous.result())

    def flush(self) -> tuple[int, dict[str, int | float]] | None:
        previous, self._pending = self._pending, None
        return None if previous is None else (previous.step, previous.result())


class ThroughputMeter:
    """Throughput between consecutive `measure(step)` calls: perf/tokens_per_s, perf/tflops_per_device and, with
    a known peak, perf/mfu. The first call only starts the clock (the steps before it include compilation)."""

    def __init__(self, *, start_step: int, tokens_per_step: int, flops_per_token: float, num_devices: int,
                 peak_flops: float | None):
        self.step, self.time = start_step, None
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.num_devices, self.peak_flops = num_devices, peak_flops

    def measure(self, step: int) -> dict[str, float]:
        now = time.perf_counter()
        out = {}
        if self.time is not None and step > self.step:
            tps = (step - self.step) * self.tokens_per_step / (now - self.time)
            out["perf/tokens_per_s"] = tps
            out["perf/tflops_per_device"] = tps * self.flops_per_token / self.num_devices / 1e12
            mfu = flops.mfu(tps, self.flops_per_token, self.num_devices, self.peak_flops)
            if mfu is not None:
                out["perf/mfu"] = mfu
        self.time, self.step = now, step
        return out


TAIL_CHUNK = 1 << 16
"""Bytes read at a time from a file's end when looking for its last newline."""


def drop_torn_tail(path: Path) -> None:
    """Truncate `path` after its last newline (a torn last line: the writer was killed, or the disk filled, in it)."""
    with open(path, "r+b") as f:
        pos = f.seek(0, os.SEEK_END)
        if pos == 0:
            return
        f.seek(pos - 1)
        if f.read(1) == b"\n":
            return
        while pos > 0:
            start = max(0, pos - TAIL_CHUNK)
            f.seek(start)
            newline = f.read(pos - start).rfind(b"\n")
            if newline >= 0:
                f.truncate(start + newline + 1)
                return
            pos = start
        f.truncate(0)


class RemoteLog:
    """A file in a bucket that lines are appended to: `write` keeps them, `flush` appends what was kept to the
    object in one atomic append (a reader never sees part of a line)."""

    def __init__(self, url: str):
        self.name, self._pending = url, []

    def write(self, data: bytes) -> int:
        self._pending.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        if self._pending:
            storage.append_bytes(self.name, b"".join(self._pending))
            self._pending = []

    def close(self) -> None:
        self.flush()


def open_append(path: str | Path):
    """`path` opened to append lines: a local file unbuffered (a line is on disk, or its write raised, when
    `append_line` returns; closing never writes), its torn last line dropped first so the next line starts a line
    of its own; a URL as a RemoteLog."""
    if storage.is_url(path):
        return RemoteLog(str(path))
    path = Path(path)
    if path.is_file():
        drop_torn_tail(path)
    return open(path, "ab", buffering=0)


def flush(file) -> None:
    """Append what a RemoteLog keeps (a local file has nothing kept)."""
    if isinstance(file, RemoteLog):
        file.flush()


def write_all(file, data: bytes) -> None:
    """Write all of `data` to an unbuffered file (a write may take part of it); an OSError (a full disk) names the
    file."""
    try:
        while data:
            data = data[file.write(data):]
    except OSError as e:
        raise OSError(e.errno, e.strerror, file.name) from None


def append_line(file, text: str) -> None:
    """Write `text` and a newline to a file from `open_append`."""
    write_all(file, (text + "\n").encode())


class TensorBoardEvents:
    """A TensorBoard event file (TFRecord frames of tensorboardX's Event protos) written in the caller's thread, one
    unbuffered write per event. tensorboardX's SummaryWriter writes from a thread of its own: on a full disk that
    thread dies with a traceback and its bounded queue then blocks the training loop forever; here the write raises
    OSError in the loop (train.py reports it as one sentence), and closing writes nothing."""

    def __init__(self, logdir: str | Path):
        from tensorboardX.proto import event_pb2

        self.event = event_pb2.Event
        storage.makedirs(str(logdir))
        name = storage.join(str(logdir), f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}")
        self._file = RemoteLog(name) if storage.is_url(name) else open(name, "ab", buffering=0)
        self._write(self.event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event) -> None:
        from tensorboardX.record_writer import masked_crc32c

        data = event.SerializeToString()
        header = struct.pack("Q", len(data))
        write_all(self._file, header + struct.pack("I", masked_crc32c(header)) + data +
                  struct.pack("I", masked_crc32c(data)))

    def scalar(self, tag: str, value: float | int, step: int) -> None:
        from tensorboardX.summary import scalar

        self._write(self.event(wall_time=time.time(), step=step, summary=scalar(tag, value)))

    def text(self, tag: str, text: str, step: int = 0) -> None:
        from tensorboardX.summary import text as text_summary

        self._write(self.event(wall_time=time.time(), step=step, summary=text_summary(tag, text)))

    def flush(self) -> None:
        flush(self._file)

    def close(self) -> None:
        self._file.close()


class IndexLog:
    """With `enabled`, appends {"step", "index"} (the global instance ids of each step's batch) to
    run_dir/indices/process_<i>.jsonl, one line per step, across resumes like metrics.jsonl; a no-op otherwise."""

    def __init__(self, run_dir: str | Path, process_index: int, enabled: bool):
        self._file = None
        if enabled:
            storage.makedirs(storage.join(str(run_dir), "indices"))
            self._file = open_append(storage.join(str(run_dir), "indices", f"process_{process_index}.jsonl"))

    def write(self, step: int, index: np.ndarray) -> None:
        if self._file is not None:
            append_line(self._file, json.dumps({"step": step, "index": index.tolist()}))

    def flush(self) -> None:
        """In a bucket: append the lines kept since the last flush (train.py calls it before each checkpoint)."""
        if self._file is not None:
            flush(self._file)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


SKIPPED_FILE = "skipped_batches.jsonl"


class SkipLog:
    """The batches of the steps whose update was skipped for a NaN/inf loss or gradient norm: process 0 appends
    {"step", "loss", "grad_norm", "index"} (`index`: the global instance ids of the whole batch, gathered from every
    process) to run_dir/skipped_batches.jsonl, each line in the run directory (or its bucket) before the next step.
    Every process calls `write` at the same step (each holds only its own rows of the batch); the file exists once a
    step was skipped."""

    def __init__(self, run_dir: str | Path, primary: bool):
        self.path = storage.join(str(run_dir), SKIPPED_FILE)
        self.primary = primary
        self._file = None

    def write(self, step: int, index: np.ndarray, loss: float, grad_norm: float) -> None:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            # as uint32 pairs: JAX without x64 would cut int64 ids to int32
            pairs = np.ascontiguousarray(index, dtype=np.int64).view(np.uint32)
            index = np.ascontiguousarray(multihost_utils.process_allgather(pairs, tiled=True)).view(np.int64)
        if self.primary:
            if self._file is None:
                self._file = open_append(self.path)
            append_line(self._file, json.dumps({"step": int(step), "loss": _json_value(loss),
                                                "grad_norm": _json_value(grad_norm), "index": index.tolist()}))
            flush(self._file)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _json_value(v: int | float) -> int | float | None:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a run directory or the file), `null` read back as NaN. A torn
    last line (the process died mid-write) is ignored; a malformed line elsewhere is an error. Lines
    come in file order: after a resume, steps past the last checkpoint can appear twice."""
    path = storage.check(path, "metrics")
    if not path.endswith(".jsonl") and (storage.is_url(path) or os.path.isdir(path)):
        path = storage.join(path, METRICS_FILE)
    if not storage.isfile(path):
        raise FileNotFoundError(f"No metrics file at {storage.redact(path)}; pass a run directory or its "
                                f"{METRICS_FILE}.")
    lines = storage.read_text(path).splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ConfigError(f"{storage.redact(path)} line {i + 1} is not valid JSON: {line[:80]!r}.") from None
        records.append({k: math.nan if v is None else v for k, v in rec.items()})
    return records


def open_wandb(wandb, run_dir: str, cfg: LogConfig, config_dict: Mapping[str, Any] | None):
    """(the W&B run of `run_dir`, the first step to send it). The first launch stores a new run id in
    run_dir/WANDB_ID_FILE; every launch resumes that run (resume="allow": created if W&B does not have it). A
    relaunch recomputes the steps after its checkpoint, which the W&B run may already hold, and W&B drops (with a
    warning each) any step below the one it has reached: the first step to send is the higher of W&B's own (online,
    its server's) and one past the highest in metrics.jsonl, which logs every step before W&B does (offline W&B
    knows nothing of earlier launches; in a bucket metrics.jsonl lags by up to REMOTE_FLUSH_SECONDS, so offline W&B
    may get the steps of a killed launch's last seconds again). Its files go to the run directory, or with a run
    directory in a bucket to this host's cache (storage.local_cache_dir). allow_val_change: a relaunch may change
    compute-only settings (the mesh of a resized run)."""
    id_file = storage.join(run_dir, WANDB_ID_FILE)
    run_id = storage.read_text(id_file).strip() if storage.isfile(id_file) else ""
    if not run_id:
        run_id = secrets.token_hex(6)  # W&B takes any id free of / \ # ? % :
        storage.write_text(id_file, run_id + "\n")
    metrics_file = storage.join(run_dir, METRICS_FILE)
    logged = [r["step"] for r in read_metrics(metrics_file)] if storage.isfile(metrics_file) else []
    local = storage.local_cache_dir() / "wandb" if storage.is_url(run_dir) else run_dir
    run = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, group=cfg.wandb_group,
                     name=storage.basename(run_dir), id=run_id, resume="allow", dir=str(local),
                     config=dict(config_dict or {}), allow_val_change=True)
    return run, max(run.step, max(logged, default=-1) + 1)


class MetricsLogger:
    """Writes each `log(step, metrics)` to every sink enabled in `cfg`; a no-op when not `enabled`.

    Sinks: `run_dir/metrics.jsonl` (always), TensorBoard events in `run_dir/tb/` (cfg.tensorboard),
    W&B (cfg.wandb, when `wandb` is importable; a warning otherwise), a tqdm bar on stderr
    (cfg.progress) showing step, loss, tokens/s, MFU (named `mfu_label`: flops.mfu_label) and ETA. `config_dict` goes
    to W&B's config and to TensorBoard as text. Use as a context manager or call `close()`.
    """

    def __init__(self, run_dir: str | Path, cfg: LogConfig, total_steps: int, enabled: bool = True,
                 config_dict: Mapping[str, Any] | None = None, mfu_label: str = "mfu"):
        self.enabled = enabled
        self.mfu_label = mfu_label
        self.total_steps = total_steps
        self._progress = enabled and cfg.progress
        self._bar = None
        self._tb = None
        self._wandb = None
        self._wandb_from = 0  # the first step the W&B run does not have yet
        self._file = None
        self._flushed = time.monotonic()
        if not enabled:
            return
        run_dir = str(run_dir)
        storage.makedirs(run_dir)
        self._file = open_append(storage.join(run_dir, METRICS_FILE))
        if cfg.tensorboard:
            self._tb = TensorBoardEvents(storage.join(run_dir, TB_DIR))
            if config_dict is not None:
                self._tb.text("config", "```\n" + json.dumps(config_dict, indent=2, default=str) + "\n```")
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                warnings.warn("log.wandb is true but the `wandb` package is not installed; W&B logging is off "
                              "(pip install wandb, or pass --log.no-wandb).", stacklevel=2)
            else:
                self._wandb, self._wandb_from = open_wandb(wandb, run_dir, cfg, config_dict)
                if self._wandb_from > 0:
                    self.print(f"W&B: resumed run {self._wandb.id}, which has steps up to {self._wandb_from - 1}: "
                               f"any of those this launch logs again is not sent to it")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record `metrics` (flat or nested dict of scalars, host or device) as step `step`."""
        if not self.enabled:
            return
        values = {k: to_python(v) for k, v in _flatten(metrics).items()}
        record = {"step": int(step), "time": time.time(), **{k: _json_value(v) for k, v in values.items()}}
        append_line(self._file, json.dumps(record, allow_nan=False))
        if self._tb is not None:
            for k, v in values.items():
                self._tb.scalar(k, v, int(step))
        if self._wandb is not None and step >= self._wandb_from:
            self._wandb.log(values, step=int(step))
        if self._progress:
            self._update_bar(int(step), values)
        if time.monotonic() - self._flushed >= REMOTE_FLUSH_SECONDS:
            self.flush()

    def log_text(self, step: int, texts: Mapping[str, str]) -> None:
        """Record text values (generated samples) as step `step`: one metrics.jsonl line with them as strings
        (readers of numbers skip them), TensorBoard text events; not W&B or the progress bar."""
        if not self.enabled or not texts:
            return
        record = {"step": int(step), "time": time.time(), **{k: str(v) for k, v in texts.items()}}
        append_line(self._file, json.dumps(record))
        if self._tb is not None:
            for k, v in texts.items():
                self._tb.text(k, "```\n" + str(v) + "\n```", int(step))

    def flush(self) -> None:
        """Append the lines (and events) kept for a run directory in a bucket; nothing for a local one."""
        self._flushed = time.monotonic()
        if self._file is not None:
            flush(self._file)
        if self._tb is not None:
            self._tb.flush()

    def _update_bar(self, step: int, values: dict[str, int | float]) -> None:
        if self._bar is None:
            from tqdm import tqdm

            # Start at the first logged step so a resumed run's rate and ETA count only this session.
            self._bar = tqdm(total=self.total_steps, initial=step, file=sys.stderr, unit="step",
                             dynamic_ncols=True)
        elif step > self._bar.n:
            self._bar.update(step - self._bar.n)
        shown = {}
        if "train/loss" in values:
            shown["loss"] = f"{values['train/loss']:.4f}"
        if "perf/tokens_per_s" in values:
            shown["tok/s"] = f"{values['perf/tokens_per_s']:,.0f}"
        if "perf/mfu" in values:
            shown[self.mfu_label] = f"{100 * values['perf/mfu']:.1f}%"
        if shown:
            self._bar.set_postfix(shown, refresh=False)
        self._bar.refresh()

    def print(self, message: str) -> None:
        """Print a line to stderr without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
