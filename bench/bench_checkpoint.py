"""Checkpoint save time: the blocking part (until `save()` returns and training may continue) vs the async part
(writing in the background), and restore time, for the tiny config and a 1B-shaped model.

    python bench/bench_checkpoint.py [--configs tiny olmo3-1b-2l] [--out bench/results/checkpoint.json]

`olmo3-1b-2l` is configs/olmo3-1b.yaml cut to 2 layers (545M parameters, 6.1 GiB of fp32 state with AdamW): the
full 1.48B model (17 GiB of state) and its host copy do not fit this 24 GiB machine; per-byte costs carry over.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
import time
from pathlib import Path

import jax

from olmo3eqx.checkpoint.checkpointer import Checkpointer
from olmo3eqx.config import load_yaml, to_dict
from olmo3eqx.flops import param_count
from olmo3eqx.sharding import build_layout

ROOT = Path(__file__).resolve().parents[1]


def config(name: str):
    if name == "olmo3-1b-2l":
        cfg = load_yaml(ROOT / "configs" / "olmo3-1b.yaml")
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_hidden_layers=2))
    return load_yaml(ROOT / "configs" / f"{name}.yaml")


def bench(name: str, repeats: int = 3) -> dict:
    cfg = config(name)
    layout = build_layout(cfg)
    state = layout.init_state(cfg)
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    blocking, background, restore = [], [], []
    tmp = Path(tempfile.mkdtemp(prefix="olmo3eqx-ckpt-bench-"))
    try:
        ck = Checkpointer(tmp, keep=2, async_save=True)
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            ck.save(step, state, {"batches_consumed": step}, to_dict(cfg))
            t1 = time.perf_counter()
            ck.wait()
            t2 = time.perf_counter()
            blocking.append(t1 - t0)
            background.append(t2 - t1)
        del state  # restore into freed memory: two copies of a large state do not fit beside the host buffers
        for _ in range(repeats):
            t0 = time.perf_counter()
            restored, _ = ck.restore(repeats, layout.state_target())
            jax.block_until_ready(restored)
            restore.append(time.perf_counter() - t0)
            del restored
        ck.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"config": name, "params": param_count(cfg.model), "state_bytes": nbytes,
            "save_blocking_s": med(blocking), "save_async_s": med(background), "restore_s": med(restore),
            "first_save_blocking_s": blocking[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["tiny", "olmo3-1b-2l"])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "checkpoint.json"))
    args = p.parse_args()
    rows = [bench(c) for c in args.configs]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"{'config':<14}{'params':>15}{'state GiB':>11}{'save blocking s':>17}{'save async s':>14}"
          f"{'restore s':>11}")
    for r in rows:
        print(f"{r['config']:<14}{r['params']:>15,}{r['state_bytes'] / 2**30:>11.2f}{r['save_blocking_s']:>17.3f}"
              f"{r['save_async_s']:>14.3f}{r['restore_s']:>11.3f}")


if __name__ == "__main__":
    main()
