"""Object stores against local disk, on this host's loopback: the training loader's instances/s (8192 x uint32
instances, one ranged read each, the real iterator) from fake-gcs-server, moto's S3 and a Range-capable HTTP server,
next to what one host of a v5p-128 7B run needs; and checkpoint save (the blocking part and the background write)
and restore times with the peak host memory, each store in a process of its own, for a state of a few GB.

    python bench/bench_stores.py [--data-gib 0.5] [--ckpt-gib 2] [--seconds 10] [--threads 2,8]

The servers are the test suite's (tests/stores.py), each in a process of its own, and run on the same 2 cores as the
client, so a row measures the client's cost plus an emulator's (moto's S3 server is pure Python), not a cloud store's
latency or bandwidth. Writes bench/results/stores.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the emulator harness the tests use
RESULTS = Path(__file__).parent / "results" / "stores.json"
SEQ_LEN = 8192
NEEDED = 2.76
"""Instances/s one host of a v5p-128 7B stage-1 run consumes: 512 instances per step over 32 hosts, one step in
~5.8 s (reproduction's 44.5%-MFU-class throughput)."""
STORES = ("local", "gs", "s3", "http")


def write_tokens(out: Path, gib: float) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = 2**25  # 128 MiB of uint32: 4096 instances
    paths = []
    for i in range(max(1, round(gib * 2**30 / (4 * per_file)))):
        path = out / f"part-{i:03d}.npy"
        rng.integers(0, 100_000, per_file, dtype=np.uint32).tofile(path)
        paths.append(path)
    return paths


def place(stores, local: list[Path], store: str) -> list[str]:
    from olmo3eqx import storage

    if store == "local":
        return [str(p) for p in local]
    if store == "http":
        prefix = f"bench-{uuid.uuid4().hex[:6]}"
        urls = [stores.publish(p, prefix, p.name) for p in local]
        return [u.replace(stores.http.url, HTTP_SERVER.url) for u in urls]  # served from a process of its own
    url = stores.url(store, f"bench-{uuid.uuid4().hex[:6]}")
    for p in local:
        storage.write_bytes(storage.join(url, p.name), p.read_bytes())
    return [storage.join(url, p.name) for p in local]


class HttpProcess:
    """tests/stores.py's Range-capable server in a process of its own (in this one, it would share the GIL with the
    loader it serves)."""

    def __init__(self, root: Path):
        from stores import free_port, wait_listening

        port = free_port()
        code = (f"import sys, time; sys.path.insert(0, {str(ROOT / 'tests')!r}); from stores import HttpServer; "
                f"HttpServer(__import__('pathlib').Path({str(root)!r}), {port}); time.sleep(10**9)")
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        self.url = f"http://127.0.0.1:{port}"
        wait_listening(port)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


HTTP_SERVER: HttpProcess | None = None


def loader_rate(paths: list[str], *, threads: int, seconds: float) -> tuple[float, float]:
    """(seconds to open the files, instances/s of the iterator after a warm-up)."""
    from olmo3eqx.config import DataConfig
    from olmo3eqx.data import build_train_iterator

    t = time.perf_counter()
    cfg = DataConfig(paths=tuple(paths), token_dtype="uint32", num_threads=threads, prefetch=max(4, threads))
    it = build_train_iterator(cfg, seq_len=SEQ_LEN, global_batch=16, seed=0, shard_index=0, shard_count=1,
                              vocab_size=100_352)
    opened = time.perf_counter() - t
    for _ in range(4):
        next(it)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < seconds:
        n += len(next(it)["index"])
    return opened, n / (time.perf_counter() - t)


CKPT_CHILD = r"""
import json, os, resource, sys, time
import jax, jax.numpy as jnp
from olmo3eqx.checkpoint.checkpointer import Checkpointer
directory, gib = sys.argv[1], float(sys.argv[2])
n = int(gib * 2**30 / 4 / 8)
state = {f"w{i}": jnp.full((n,), i, jnp.float32) + jnp.arange(n, dtype=jnp.float32) for i in range(8)}
jax.block_until_ready(state)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
ck = Checkpointer(directory, keep=2, async_save=True)
t0 = time.perf_counter(); ck.save(1, state, {"batches_consumed": 1}, {"bench": True}); t1 = time.perf_counter()
ck.wait(); t2 = time.perf_counter()
saved_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
del state
t3 = time.perf_counter(); restored, _ = ck.restore(1, target); jax.block_until_ready(restored); t4 = time.perf_counter()
ok = all(float(restored[f"w{i}"][7]) == i + 7 for i in range(8))
ck.close()
print(json.dumps({"state_bytes": 8 * n * 4, "save_blocking_s": t1 - t0, "save_background_s": t2 - t1,
                  "restore_s": t4 - t3, "rss_before_save": base, "peak_rss_save": saved_peak,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "restored_ok": ok}))
"""


def checkpoint_row(stores, store: str, gib: float, tmp: Path) -> dict:
    directory = str(tmp / "ckpt") if store == "local" else stores.url(store, f"ckpt-{uuid.uuid4().hex[:6]}")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    p = subprocess.run([sys.executable, "-c", CKPT_CHILD, directory, str(gib)], env=env, capture_output=True,
                       text=True, timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"checkpoint bench on {store} failed:\n{p.stderr[-3000:]}")
    return {"store": store, **json.loads(p.stdout.strip().splitlines()[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-gib", type=float, default=0.5)
    p.add_argument("--ckpt-gib", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--threads", default="2,8", help="data.num_threads values to measure")
    p.add_argument("--stores", default=",".join(STORES))
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    from stores import Stores

    tmp = Path(tempfile.mkdtemp(prefix="olmo3eqx-stores-bench-"))
    global HTTP_SERVER
    stores = Stores(tmp / "servers")
    stores.start()
    HTTP_SERVER = HttpProcess(stores.http_root)
    os.environ.update(stores.env)
    names = args.stores.split(",")
    try:
        local = write_tokens(tmp / "tokens", args.data_gib)
        loader = []
        for store in names:
            paths = place(stores, local, store)
            for threads in map(int, args.threads.split(",")):
                opened, rate = loader_rate(paths, threads=threads, seconds=args.seconds)
                loader.append({"store": store, "threads": threads, "open_s": opened, "instances_per_s": rate})
                print(f"loader {store:<6} threads {threads}: {rate:8.1f} instances/s ({rate / NEEDED:6.1f}x a v5p-128 "
                      f"host's {NEEDED}), files opened in {opened:.2f} s", flush=True)
        ckpt = []
        for store in names:
            if store == "http":
                continue  # read only
            row = checkpoint_row(stores, store, args.ckpt_gib, tmp)
            ckpt.append(row)
            print(f"checkpoint {store:<6} {row['state_bytes'] / 2**30:.2f} GiB: save blocking "
                  f"{row['save_blocking_s']:.2f} s + background {row['save_background_s']:.2f} s, restore "
                  f"{row['restore_s']:.2f} s, peak RSS {row['peak_rss'] / 2**30:.2f} GiB (before saving "
                  f"{row['rss_before_save'] / 2**30:.2f}), restored intact: {row['restored_ok']}", flush=True)
    finally:
        HTTP_SERVER.stop()
        stores.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"loader": loader, "checkpoint": ckpt, "needed_per_host": NEEDED,
                                          "seq_len": SEQ_LEN, "cpus": os.cpu_count()}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
