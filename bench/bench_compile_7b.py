"""Compile time of the OLMo 3 7B forward from abstract arrays (nothing is materialised), scanning over the
3-sliding + 1-global layer period vs unrolling all 32 layers.

    python bench/bench_compile_7b.py [--seq-len 8192] [--out bench/results/compile_7b.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from olmo3eqx.config import load_yaml
from olmo3eqx.model import abstract_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "compile_7b.json"))
    args = p.parse_args()
    base = load_yaml(ROOT / "configs" / "olmo3-7b-stage1.yaml").model
    rows = []
    for scan in (True, False):
        cfg = dataclasses.replace(base, scan_layers=scan)
        model = abstract_model(cfg)
        tokens = jax.ShapeDtypeStruct((args.seq_len,), jnp.int32)
        t0 = time.perf_counter()
        lowered = jax.jit(lambda m, t: m(t)).lower(model, tokens)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        rows.append({"scan_layers": scan, "lower_s": t1 - t0, "compile_s": t2 - t1,
                     "hlo_chars": len(lowered.as_text())})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    print(f"{'7B forward':<22}{'lower s':>10}{'compile s':>12}{'HLO chars':>16}")
    for r in rows:
        name = "scan over period 4" if r["scan_layers"] else "unrolled 32 layers"
        print(f"{name:<22}{r['lower_s']:>10.2f}{r['compile_s']:>12.2f}{r['hlo_chars']:>16,}")


if __name__ == "__main__":
    main()
