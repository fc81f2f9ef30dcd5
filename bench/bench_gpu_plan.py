"""The 7B stage-3 step (65,536-token packed instances, document masking, YaRN) planned for an 8-GPU node on this
host: the train step partitioned over 8 simulated CPU devices and compiled by XLA:CPU, whose memory analysis stands in
for XLA:GPU's (an estimate: the compilers fuse and schedule differently), for each attention backend, remat policy
and mesh (pure FSDP, FSDP x tensor, FSDP x context), against an H100's (80 GB) and an H200's (141 GB) memory.

    python bench/bench_gpu_plan.py [--config configs/olmo3-7b-stage3.yaml] [--attention flash blocked]
                                   [--remat full dots] [--tensor 1 2 4 8] [--context 1 8] [--layers N]

Each cell is what `python train.py --config C --target h100x8 --dry-run --model.attention-impl A --model.remat R
--mesh.tensor T --mesh.context C` prints (pairs with tensor x context over 8 left out). Writes
bench/results/gpu_plan.json; the table last.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

NODES = ("h100x8", "h200x8")

if __name__ == "__main__":
    common.clean_xla_flags()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "olmo3-7b-stage3.yaml"))
    ap.add_argument("--attention", nargs="+", default=["flash", "blocked"])
    ap.add_argument("--remat", nargs="+", default=["full", "dots"])
    ap.add_argument("--tensor", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a quicker, smaller plan)")
    args = ap.parse_args(argv)

    import dataclasses

    import jax

    from olmo3eqx import aot
    from olmo3eqx.config import load_yaml
    from olmo3eqx.sharding import build_layout

    base = load_yaml(args.config)
    if args.layers:
        base = dataclasses.replace(base, model=dataclasses.replace(base.model, num_hidden_layers=args.layers,
                                                                   layer_types=None))
    nodes = {name: aot.gpu_node(name) for name in NODES}
    rows, results = [], []
    for attention in args.attention:
        for remat in args.remat:
            for tensor, context in itertools.product(args.tensor, args.context):
                if tensor * context > 8:
                    continue
                model = dataclasses.replace(base.model, attention_impl=attention, remat=remat, remat_by_chip=())
                mesh = dataclasses.replace(base.mesh, fsdp=-1, tensor=tensor, context=context)
                cfg = dataclasses.replace(base, model=model, mesh=mesh)
                layout = build_layout(cfg, jax.devices()[:8])
                report = aot.compile_step(cfg, layout, nodes["h100x8"])
                total = report.memory["total"] / aot.GIB
                split = f"tensor {tensor}" + (f" x context {context}" if context > 1 else "")
                row = {"attention": attention, "remat": remat, "mesh": f"fsdp {8 // (tensor * context)} x {split}",
                       "batch": f"{layout.plan.per_device_batch} x {layout.plan.accum_steps}",
                       "memory": f"{total:.2f}", "temp": f"{report.memory['temp'] / aot.GIB:.2f}",
                       "compile": f"{report.compile_s:.1f}"}
                for name, node in nodes.items():
                    row[name] = ("fits" if total * aot.GIB <= node.hbm else "no") + f" ({node.hbm / aot.GIB - total:+.1f})"
                rows.append(row)
                results.append({**row, "memory_bytes": report.memory})
                print(row, flush=True)
    path = common.write_json("gpu_plan.json", {"args": vars(args), "cells": results})
    print(f"\n{Path(args.config).name} ({base.model.num_hidden_layers} layers, seq {base.data.seq_len}, global batch "
          f"{base.data.global_batch}) on 8 simulated devices, XLA:CPU's memory analysis per device (GiB); margins "
          f"against an H100 (79.65 GiB) and an H200 (140.40 GiB); {path}")
    print(common.table(rows, [("attention", "attention"), ("remat", "remat"), ("mesh", "mesh"),
                              ("batch", "per device x accum"), ("memory", "GiB/device"), ("temp", "temporaries"),
                              ("h100x8", "H100 (GiB spare)"), ("h200x8", "H200 (GiB spare)"),
                              ("compile", "compile s")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
