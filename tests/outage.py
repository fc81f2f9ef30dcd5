"""The outage run of issue 62's storage row, shared by tests/test_remote_run.py (once) and bench/bench_outage.py (ten
times): two `train.py` processes over jax.distributed (gloo on loopback) write one run directory in moto's S3; once
checkpoint 4 is committed the store is taken away for good, so process 0's next flush of metrics.jsonl (before the
next checkpoint) fails after the storage retries. Every process must then end, within seconds, with exit 74.

The storage retries (OLMO3EQX_STORAGE_RETRY_SECONDS) are scaled down to 2 s; the lease (OLMO3EQX_LEASE_SECONDS) is
left long, so what stops the run is process 0's failed write, not the lease every process agrees on."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from olmo3eqx import storage

ROOT = Path(__file__).resolve().parents[1]
PROCESSES = 2
STEPS = 400
"""More steps than the run reaches: it must stop at the outage, not finish."""
CONFIG = """
run: {name: outage, seed: 0}
model: {vocab_size: 384, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2,
        num_key_value_heads: 1, head_dim: 16, sliding_window: 16, eos_token_id: 256, pad_token_id: 257,
        compute_dtype: float32, layer_types: [sliding_attention, full_attention]}
data: {seq_len: 32, global_batch: 4, paths: [TOKENS], prefetch: 0, num_threads: 0}
optim: {lr: 3.0e-3, warmup_steps: 2}
checkpoint: {every: 4, keep: 2}
eval: {every: 0}
log: {every: 1, progress: false}
"""
RETRY_SECONDS = "2"
LEASE_SECONDS = "600"


@dataclass
class Outcome:
    codes: list[int | None]
    """Each process's exit status (negative: the signal that ended it); None: still running at the deadline (then
    killed)."""
    stderr: list[str]
    error_at: float | None
    """time.monotonic() of the first `error` line any process printed."""
    exited_at: list[float | None]

    def seconds_to_exit(self) -> float | None:
        """From the first error line to the last process's exit; None when a process did not exit or none erred."""
        if self.error_at is None or None in self.exited_at:
            return None
        return max(self.exited_at) - self.error_at


class Stderr:
    """A process's stderr, read as it comes; the time of its first line starting with `error`."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.error_at: float | None = None
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc) -> None:
        for line in proc.stderr:
            if self.error_at is None and line.startswith("error"):
                self.error_at = time.monotonic()
            self.lines.append(line)


def write_tokens(directory: Path) -> Path:
    """A small token file in OLMo's format (raw uint16) with its metadata.json."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokens.npy"
    np.random.default_rng(0).integers(0, 256, 200_000, dtype=np.uint16).tofile(path)
    (directory / "metadata.json").write_text('{"dtype": "uint16"}')
    return path


def environment(process: int, port: int) -> dict:
    import os

    e = dict(os.environ)
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        e.pop(k, None)
    e.update(XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0",
             JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(PROCESSES),
             JAX_PROCESS_ID=str(process), OLMO3EQX_STORAGE_RETRY_SECONDS=RETRY_SECONDS,
             OLMO3EQX_LEASE_SECONDS=LEASE_SECONDS)
    return e


def outage_run(stores, workdir: Path, deadline_s: float = 600.0, after_error_s: float = 120.0) -> Outcome:
    """Run the scenario in `workdir` (the config, the token file, each process's working directory); wait at most
    `deadline_s` in all and `after_error_s` after the first error line, then kill what still runs."""
    from stores import free_port

    cfg = workdir / "outage.yaml"
    cfg.write_text(CONFIG.replace("TOKENS", str(write_tokens(workdir / "tokens"))))
    root = stores.url("s3", f"outage-{uuid.uuid4().hex[:6]}")
    committed = storage.join(root, "outage", "checkpoints", "4", "commit_success.txt")
    port = free_port()
    procs, readers = [], []
    for i in range(PROCESSES):
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), "--config", str(cfg), "--run.dir", root, "--steps", str(STEPS),
             "--dist.heartbeat-timeout", "100"],
            env=environment(i, port), cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True))
        readers.append(Stderr(procs[-1]))
    exited_at: list[float | None] = [None] * PROCESSES
    start = time.monotonic()
    try:
        while not storage.exists(committed):
            if any(p.poll() is not None for p in procs) or time.monotonic() - start > deadline_s:
                break
            time.sleep(0.2)
        stores.relays["s3"].down()  # for good: until every process has exited
        while None in exited_at:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if exited_at[i] is None and p.poll() is not None:
                    exited_at[i] = now
            error_at = min(filter(None, (r.error_at for r in readers)), default=None)
            if now - start > deadline_s or (error_at is not None and now - error_at > after_error_s):
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        stores.relays["s3"].up()
    for r in readers:
        r.thread.join(timeout=10)
    return Outcome([p.returncode if t is not None else None for p, t in zip(procs, exited_at)],
                   ["".join(r.lines) for r in readers],
                   min(filter(None, (r.error_at for r in readers)), default=None), exited_at)
