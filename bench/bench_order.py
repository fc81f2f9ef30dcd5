"""OLMo-core's global order at stage-1 size, and the loader in that order against ours.

    python bench/bench_order.py [--instances 723872768] [--gib 0.5] [--seconds 6] [--verify]

1. Builds and caches one epoch's index for OLMo 3 stage 1 (1,413,814 batches x 512 = 723,872,768 instances, a
   2.9 GB uint32 file) in a fresh process, as a run's first process does: wall time and peak RSS (VmHWM). Then the
   reload a resumed run or another process pays (a fresh process maps the file and reads one global batch), and
   global-batch lookups per second at random rows (page faults on a cold map). --verify also rebuilds the index
   with OLMo-core's own line (np.arange + PCG64(seed + 1).shuffle, in memory) and compares the bytes.
2. Loader throughput, instances/s of 8192 uint32 tokens, for one host of a 16-host job (global batch 512, this
   process's 32-instance slice), data.order ours vs olmo-core, next to what a 7B stage-1 step (512 x 8192) on a
   TPU v5p-128 slice (64 chips, 16 hosts) consumes at 57.4% MFU: the MaxText reproduction's stage-2 figure on v5p
   (its slice not stated; its stage 1 ran on Ironwood), borrowed as the rate of a stage-1 step here.

Prints a table and writes bench/results/order.json. Token files are freshly written, so reads come from the page
cache: this measures the loader's CPU cost, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

STAGE1_INSTANCES = 1_413_814 * 512
SEED = 34521
SEQ_LEN = 8192
GLOBAL_BATCH = 512
HOSTS = 16
"""A v5p-128 slice: 64 chips, 4 per host."""
CHIPS = 64
MAXTEXT_V5P_MFU = 0.574
"""The MaxText reproduction's MFU on v5p, measured in stage 2 (256 x 8192 per step, slice not stated): no stage-1
figure on v5p was published, so a stage-1 step's need is estimated at this rate."""
VOCAB = 100352
LISTINGS = 500
"""Times each token file is listed in the loader rows' data (0.5 GiB x 500: 8.2M instances, 16,000 rows)."""
RESULTS = Path(__file__).parent / "results" / "order.json"

BUILD = """
import json, os, sys, time
from pathlib import Path
from olmo3eqx.data.order import cached_epoch_index
t, cpu = time.perf_counter(), os.times()
index = cached_epoch_index(Path(sys.argv[1]), num_instances=int(sys.argv[2]), seed=int(sys.argv[3]), epoch=1,
                           chunk_size=1)
seconds, end = time.perf_counter() - t, os.times()
hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))
print(json.dumps({"seconds": seconds, "cpu_seconds": end.user + end.system - cpu.user - cpu.system,
                  "peak_rss_bytes": hwm * 1024}))
"""
RELOAD = """
import json, sys, time
import numpy as np
from olmo3eqx.data.order import OlmoCoreOrder
t = time.perf_counter()
order = OlmoCoreOrder(int(sys.argv[2]), seed=int(sys.argv[3]), global_batch=512, chunk_size=1,
                      cache_dir=sys.argv[1])
first = order(order.batches_per_epoch // 2)
seconds = time.perf_counter() - t
rows = np.random.default_rng(0).integers(0, order.batches_per_epoch, 2000)
t = time.perf_counter()
for r in rows.tolist():
    order(r)
lookups = rows.size / (time.perf_counter() - t)
hwm = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))
print(json.dumps({"seconds": seconds, "random_batches_per_s": lookups, "peak_rss_bytes": hwm * 1024}))
"""


def run_child(code: str, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages, so the reload reads it (best effort, Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def index_rows(instances: int, tmp: Path, verify: bool) -> tuple[list, dict]:
    from olmo3eqx.data.order import olmo_core_index_name

    path = tmp / olmo_core_index_name(num_instances=instances, seed=SEED, epoch=1, chunk_size=1)
    build = run_child(BUILD, path, instances, SEED)
    size = os.path.getsize(path)
    drop_from_page_cache(path)
    cold = run_child(RELOAD, tmp, instances, SEED)
    warm = run_child(RELOAD, tmp, instances, SEED)
    rows = [(f"build + cache one epoch's index ({instances:,} instances, {size / 1e9:.2f} GB)",
             f"{build['seconds']:,.1f} s", f"{build['cpu_seconds']:,.1f} s of CPU, peak RSS "
                                            f"{build['peak_rss_bytes'] / 2**30:.2f} GiB"),
            ("reload: map the cached index + first global batch (page cache dropped)", f"{cold['seconds']:.3f} s",
             f"{cold['random_batches_per_s']:,.0f} random batches/s, peak RSS "
             f"{cold['peak_rss_bytes'] / 2**20:,.0f} MiB"),
            ("reload: the same, file in the page cache", f"{warm['seconds']:.3f} s",
             f"{warm['random_batches_per_s']:,.0f} random batches/s")]
    results = {"instances": instances, "index_bytes": size, "build": build, "reload_cold": cold, "reload_warm": warm}
    if verify:
        t, cpu = time.perf_counter(), os.times()
        want = np.arange(instances, dtype=np.uint32)
        np.random.Generator(np.random.PCG64(SEED + 1)).shuffle(want)  # OLMo-core's _build_global_indices
        results["olmo_core_line_seconds"] = time.perf_counter() - t
        end = os.times()
        results["olmo_core_line_cpu_seconds"] = end.user + end.system - cpu.user - cpu.system
        same = bool(np.array_equal(np.memmap(path, dtype=np.uint32, mode="r"), want))
        results["identical_to_olmo_core_line"] = same
        rows.append(("OLMo-core's own line in memory (arange + PCG64 shuffle), for comparison",
                     f"{results['olmo_core_line_seconds']:,.1f} s",
                     f"{results['olmo_core_line_cpu_seconds']:,.1f} s of CPU; bytes identical: {same}"))
    path.unlink()
    return rows, results


def write_tokens(out: Path, gib: float, listings: int) -> list[str]:
    """uint32 files of Zipf-distributed ids, 128 MiB each (as bench_data.py), each listed `listings` times: enough
    instances that the measured seconds stay inside epoch 1 (an epoch boundary would time an index build) while
    the tokens stay in the page cache."""
    rng = np.random.default_rng(0)
    total, per_file = max(SEQ_LEN, int(gib * 2**30 / 4)), 2**25
    paths = []
    for i, start in enumerate(range(0, total, per_file)):
        path = out / f"part-{i:03d}.npy"
        (np.minimum(rng.zipf(1.2, min(per_file, total - start)), VOCAB) - 1).astype(np.uint32).tofile(path)
        paths.append(str(path))
    return paths * listings


def loader_rate(paths: list[str], order: str, index_dir: Path, seconds: float) -> float:
    from olmo3eqx.config import DataConfig
    from olmo3eqx.data import build_train_iterator
    from olmo3eqx.data.source import instances_in

    cfg = DataConfig(paths=tuple(paths), token_dtype="uint32", order=order, seq_len=SEQ_LEN,
                     global_batch=GLOBAL_BATCH, num_threads=1, prefetch=4)
    it = build_train_iterator(cfg, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, seed=SEED, shard_index=0,
                              shard_count=HOSTS, vocab_size=VOCAB, index_dir=index_dir)
    # At most half of this host's share of epoch 1, however fast the loader runs here: the prefetch reads ahead, and
    # crossing into epoch 2 would time an index build.
    instances = sum(instances_in(os.path.getsize(p) // np.dtype(np.uint32).itemsize, SEQ_LEN, None) for p in paths)
    budget = instances // GLOBAL_BATCH * (GLOBAL_BATCH // HOSTS) // 2
    for _ in range(4):
        next(it)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds and n < budget:
        n += next(it)["tokens"].shape[0]
    rate = n / (time.perf_counter() - start)
    if it.epoch:
        raise SystemExit(f"the {order} row crossed an epoch boundary: raise LISTINGS")
    return rate


def v5p_need() -> dict:
    from olmo3eqx import flops
    from olmo3eqx.config import ModelConfig

    step_flops = flops.train_flops_per_token(ModelConfig(), SEQ_LEN) * GLOBAL_BATCH * SEQ_LEN
    step_s = step_flops / (CHIPS * dict(flops.PEAK_FLOPS)["v5p"] * MAXTEXT_V5P_MFU)
    return {"step_s": step_s, "global_instances_per_s": GLOBAL_BATCH / step_s,
            "per_host_instances_per_s": GLOBAL_BATCH / HOSTS / step_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=STAGE1_INSTANCES, help="instances of the index to build")
    parser.add_argument("--gib", type=float, default=0.5, help="synthetic uint32 token data for the loader rows")
    parser.add_argument("--seconds", type=float, default=6.0, help="measuring time per loader row")
    parser.add_argument("--verify", action="store_true", help="compare with OLMo-core's in-memory line (+2.9 GB)")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                           "load_average_before": os.getloadavg()}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows, results["index"] = index_rows(args.instances, tmp, args.verify)
        (tmp / "tokens").mkdir()
        paths = write_tokens(tmp / "tokens", args.gib, LISTINGS)
        need = v5p_need()
        results["v5p_128_need"] = need
        for order in ("ours", "olmo-core"):
            rate = loader_rate(paths, order, tmp / "data_order", args.seconds)
            results[f"loader_{order}_instances_per_s"] = rate
            rows.append((f"loader, order {order}: 1 thread, 8192 x uint32, one host's 32 of 512", f"{rate:,.0f} inst/s",
                         f"{rate / need['per_host_instances_per_s']:,.0f}x one v5p-128 host's need"))
        rows.append((f"needed per host by a 7B stage-1 step on v5p-128 ({need['step_s']:.1f} s/step at "
                     f"{MAXTEXT_V5P_MFU:.1%} MFU, the reproduction's stage-2 figure)",
                     f"{need['per_host_instances_per_s']:.2f} inst/s",
                     f"{need['global_instances_per_s']:.1f} inst/s over all {HOSTS} hosts"))
    results["machine"]["load_average_after"] = os.getloadavg()
    width = max(len(r[0]) for r in rows)
    print(f"order benchmark ({os.cpu_count()} cpus, load average {results['machine']['load_average_before'][0]:.1f} "
          f"before, {results['machine']['load_average_after'][0]:.1f} after)")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
