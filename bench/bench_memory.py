"""Memory of one train step per parameter, from XLA's compiled memory analysis (abstract inputs: nothing is
allocated or run): state (params + Adam moments, float32), a fresh output state, and temporaries (gradients,
activations, attention scores), with and without remat, per attention backend.

    python bench/bench_memory.py [--configs tiny,small] [--with-7b]

The compiled step aliases the new state to the donated old one ("new state" is what is not aliased; the CPU
runtime still copies at run time: donation is not honoured on CPU). Gradients count as temporaries. --with-7b adds one 7B layer period (4 layers) at seq 8192, per-device batch 1, the
stage-1 config otherwise: the attention scores dominate there. Prints a table last, writes
bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

if __name__ == "__main__":
    common.clean_xla_flags()

import jax

from olmo3eqx import flops
from olmo3eqx.config import load_yaml
from olmo3eqx.sharding import build_layout
from olmo3eqx.step import make_train_step

REPO = Path(__file__).resolve().parents[1]


def analyse(model, seq: int, batch: int) -> dict:
    cfg = common.train_config(model, seq, batch)
    layout = build_layout(cfg, jax.devices()[:1])
    step = make_train_step(cfg, layout)
    mem = step.lower(layout.state_target(), *layout.batch_target(seq)).compile().memory_analysis()
    return {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
            "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--remat", default="none,dots,full")
    ap.add_argument("--attention", default="blocked,xla")
    ap.add_argument("--with-7b", action="store_true")
    args = ap.parse_args(argv)
    from bench_step import bench_configs

    configs = {k: v for k, v in bench_configs().items() if k in args.configs.split(",")}
    if args.with_7b:
        seven = load_yaml(REPO / "configs" / "olmo3-7b-stage1.yaml").model
        configs["7b (4 layers)"] = (dataclasses.replace(seven, num_hidden_layers=4), 8192, 1)
    rows, results = [], {}
    for name, (model, seq, batch) in configs.items():
        for remat in args.remat.split(","):
            for impl in args.attention.split(","):
                m = dataclasses.replace(model, remat=remat, attention_impl=impl)
                r = analyse(m, seq, batch)
                n = flops.param_count(m)
                total = r["argument"] + r["output"] - r["alias"] + r["temp"]
                results[f"{name}/{remat}/{impl}"] = {**r, "params": n, "seq_len": seq, "batch": batch,
                                                     "bytes_per_param": total / n}
                rows.append({"config": name, "tokens": f"{batch}x{seq}", "remat": remat, "attention": impl,
                             "state": f"{r['argument'] / n:.1f}", "out": f"{(r['output'] - r['alias']) / n:.1f}",
                             "temp": f"{r['temp'] / n:.1f}", "total": f"{total / n:.1f}",
                             "gib": f"{total / 2**30:.2f}"})
    path = common.write_json("memory.json", {"results": results})
    print(f"\nbytes per parameter of one train step (float32 master weights and moments; compiled on "
          f"{jax.devices()[0].device_kind}); {path}")
    print(common.table(rows, [("config", "config"), ("tokens", "batch x seq"), ("remat", "remat"),
                              ("attention", "attention"), ("state", "state B/param"), ("out", "new state B/param"),
                              ("temp", "temporaries B/param"), ("total", "total B/param"), ("gib", "total GiB")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
