"""Compile time of the train step against depth: 4, 16 and 32 layers of the tiny config's width, with the scan over
OLMo 3's 4-layer period (model.scan_layers, the default) and, for contrast, unrolled.

    python bench/bench_compile.py [--depths 4,16,32] [--unrolled-depths 4,16] [--remat dots|full|none|dots_no_batch]

Times tracing+lowering and XLA compilation of the jitted step separately (abstract inputs: nothing is run), each
depth in a fresh subprocess so no cache is shared; prints a table last and writes bench/results/compile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

REPO = Path(__file__).resolve().parents[1]

CHILD = """
import dataclasses, json, sys, time
sys.path.insert(0, {bench!r})
import jax
import common
from olmo3eqx.config import load_yaml
from olmo3eqx.sharding import build_layout
from olmo3eqx.step import make_train_step
tiny = load_yaml({config!r})
model = dataclasses.replace(tiny.model, num_hidden_layers={depth}, scan_layers={scan}, remat={remat!r})
cfg = common.train_config(model, tiny.data.seq_len, tiny.data.global_batch)
layout = build_layout(cfg, jax.devices()[:1])
step = make_train_step(cfg, layout)
t0 = time.perf_counter()
lowered = step.lower(layout.state_target(), *layout.batch_target(cfg.data.seq_len))
t1 = time.perf_counter()
lowered.compile()
t2 = time.perf_counter()
print(json.dumps({{"lower_s": t1 - t0, "compile_s": t2 - t1}}))
"""


def measure(depth: int, scan: bool, remat: str) -> dict:
    code = CHILD.format(bench=str(Path(__file__).parent), config=str(REPO / "configs" / "tiny.yaml"), depth=depth,
                        scan=scan, remat=remat)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="4,16,32")
    ap.add_argument("--unrolled-depths", default="4,16")
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per point; the fastest is reported")
    ap.add_argument("--remat", default="dots", help="model.remat: dots (the default), full (the 7B recipe's), none, ...")
    args = ap.parse_args(argv)
    common.clean_xla_flags()
    load_before = os.getloadavg()
    points = [(int(d), True) for d in args.depths.split(",")]
    points += [(int(d), False) for d in args.unrolled_depths.split(",") if d]
    results, rows = {}, []
    for depth, scan in points:
        runs = [measure(depth, scan, args.remat) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["lower_s"] + r["compile_s"])
        results[f"{depth}/{'scan' if scan else 'unrolled'}"] = {"runs": runs, "best": best}
    base = results[f"{points[0][0]}/scan"]["best"]
    base_total = base["lower_s"] + base["compile_s"]
    for key, r in results.items():
        depth, mode = key.split("/")
        b = r["best"]
        total = b["lower_s"] + b["compile_s"]
        rows.append({"depth": depth, "mode": mode, "lower": f"{b['lower_s']:.1f}", "compile": f"{b['compile_s']:.1f}",
                     "total": f"{total:.1f}", "ratio": f"{total / base_total:.2f}x"})
    load_after = os.getloadavg()
    name = "compile.json" if args.remat == "dots" else f"compile_remat_{args.remat}.json"
    path = common.write_json(name, {"remat": args.remat, "results": results, "load_before": load_before,
                                              "load_after": load_after})
    print(f"\ntrain step of configs/tiny.yaml's width (seq 256, batch 16), remat {args.remat}, at several depths; "
          f"best of {args.repeats} "
          f"fresh processes; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; {path}")
    print(common.table(rows, [("depth", "layers"), ("mode", "layers as"), ("lower", "trace+lower s"),
                              ("compile", "XLA compile s"), ("total", "total s"),
                              ("ratio", f"vs {points[0][0]} layers scanned")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
