"""A plan for a TPU slice from XLA:TPU's own models: a preset's train step (the OLMo 3 7B's by default, or the 32B's)
compiled ahead of time on this host for a topology, over a grid of remat policy x head shape x mesh (pure FSDP, or
FSDP x tensor) x splash blocks x per-device batch (accumulation keeps the global batch) x XLA flags, each cell with
its memory per device against the HBM and its predicted step time, TFLOP/s and MFU (olmo3eqx.costmodel: the
compiler's cost model with every loop counted, splash modelled by hand; a model, not a measurement). The best
predicted cell that fits with --headroom GiB to spare is printed last, overall and with the config's own head shape
(the preset's model).

    python bench/bench_tpu_plan.py --topology tpu7x:4x4x4 [--config configs/olmo3-7b-stage1.yaml]
        [--remat full,save_qkv_proj] [--heads 32x128,16x256] [--tensor 1,2] [--blocks default,1024]
        [--per-device 4,2] [--flags auto,none] [--json bench/results/tpu_plan.json]

Every cell is what `train.py --config C --dry-run --target T` with those flags prints. Each 7B compile takes 10-35
minutes on a 2-core host, a 32B one longer (the step, then its layer group and loss chunk alone); results are merged
into the JSON as they come, so a partial run keeps what it measured and a rerun skips the cells it has (--redo to
compile again).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

if __name__ == "__main__":
    common.clean_xla_flags()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from olmo3eqx import aot
from olmo3eqx.config import load_yaml

REPO = Path(__file__).resolve().parents[1]


def cell_config(base, heads: str, remat: str, tensor: int, blocks: str, per_device: int, flags: str):
    n, dim = (int(x) for x in heads.split("x"))
    block = None if blocks == "default" else int(blocks)
    model = dataclasses.replace(base.model, num_attention_heads=n, num_key_value_heads=n * base.model.num_key_value_heads
                                // base.model.num_attention_heads, head_dim=dim, remat=remat, remat_by_chip=(),
                                attention_block_q=block, attention_block_kv=block)
    mesh = dataclasses.replace(base.mesh, tensor=tensor, fsdp=-1, max_per_device_batch=per_device, tpu_flags=flags)
    return dataclasses.replace(base, model=model, mesh=mesh)


def row(key: str, r: dict) -> dict:
    _, topology, heads, remat, tensor, blocks, per_device, flags = key.split("/")
    mem = r.get("memory")
    p = r.get("prediction")
    spare = (r["hbm"] - mem["total"]) / aot.GIB if mem and r.get("hbm") else None
    return {"topology": topology, "heads": heads, "remat": remat, "tensor": tensor, "blocks": blocks,
            "batch": f"{r['per_device_batch']} x {r['accum']}", "flags": flags,
            "mem": f"{mem['total'] / aot.GIB:.1f}" if mem else "over",
            "spare": spare, "spare_gib": "" if spare is None else f"{spare:.1f}",
            "fits": {True: "yes", False: "no", None: "?"}[r["fits"]],
            "step": f"{p['seconds']:.3f}" if p else "",
            "tflops": f"{p['model_flops'] / p['seconds'] / 1e12:.0f}" if p else "",
            "mfu": f"{100 * p['mfu']:.1f}" if p and p.get("mfu") else "",
            "maxtext": f"{p['maxtext_flops'] / p['seconds'] / 1e12:.0f}" if p else "",
            "compile": f"{r['compile_s'] + (p or {}).get('compile_s', 0):.0f}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="tpu7x:4x4x4")
    ap.add_argument("--config", default=str(REPO / "configs" / "olmo3-7b-stage1.yaml"))
    ap.add_argument("--remat", default="full")
    ap.add_argument("--heads", default="32x128,16x256")
    ap.add_argument("--tensor", default="1")
    ap.add_argument("--blocks", default="default", help="splash block (query = key/value); 'default': the chip's")
    ap.add_argument("--per-device", default="4", help="mesh.max_per_device_batch values")
    ap.add_argument("--flags", default="auto", help="mesh.tpu_flags values: auto, none")
    ap.add_argument("--headroom", type=float, default=2.0,
                    help="GiB of HBM a plan must leave spare to be chosen (the runtime's own use; XLA:TPU's memory "
                         "analysis is the program's)")
    ap.add_argument("--json", default=str(common.RESULTS / "tpu_plan.json"))
    ap.add_argument("--redo", action="store_true")
    args = ap.parse_args(argv)
    path = Path(args.json)
    saved = json.loads(path.read_text()).get("results", {}) if path.is_file() else {}
    base = load_yaml(args.config)
    grid = itertools.product(args.heads.split(","), args.remat.split(","), args.tensor.split(","),
                             args.blocks.split(","), args.per_device.split(","), args.flags.split(","))
    for heads, remat, tensor, blocks, per_device, flags in grid:
        key = "/".join((Path(args.config).name, args.topology, heads, remat, tensor, blocks, per_device, flags))
        if key in saved and not args.redo:
            continue
        cfg = cell_config(base, heads, remat, int(tensor), blocks, int(per_device), flags)
        start = time.perf_counter()
        report = aot.compile_for(cfg, args.topology)
        from olmo3eqx.sharding import build_layout

        plan = build_layout(cfg, aot.topology_devices(args.topology)).plan
        p = report.prediction
        saved[key] = {
            "memory": report.memory, "hbm": report.hbm, "fits": report.fits, "out_of_memory": report.out_of_memory,
            "compile_s": report.compile_s, "wall_s": time.perf_counter() - start, "device_kind": report.device_kind,
            "per_device_batch": plan.per_device_batch, "accum": plan.accum_steps,
            "prediction": None if p is None else {
                "seconds": p.seconds, "mfu": p.mfu, "model_flops": p.model_flops, "maxtext_flops": p.maxtext_flops,
                "pieces": [dataclasses.asdict(x) for x in p.pieces], "attention": p.attention,
                "compile_s": p.compile_s},
            "prediction_error": report.prediction_error}
        print(f"{key}: " + " | ".join(report.lines()), flush=True)
        common.write_json(path, {"results": saved})
    rows = [row(k, r) for k, r in saved.items() if k.startswith(f"{Path(args.config).name}/{args.topology}/")]
    rows.sort(key=lambda r: -float(r["mfu"] or 0))
    print(f"\n{Path(args.config).name} on {args.topology}: per device, XLA:TPU's memory and predicted time "
          f"(olmo3eqx.costmodel; a model, not a measurement); {path}")
    print(common.table(rows, [("heads", "heads"), ("remat", "remat"), ("tensor", "tensor"), ("blocks", "splash"),
                              ("batch", "per dev x accum"), ("flags", "flags"), ("mem", "GiB"),
                              ("spare_gib", "spare"), ("fits", "fits"), ("step", "step s"), ("tflops", "TFLOP/s"),
                              ("mfu", "MFU %"),
                              ("maxtext", "TFLOP/s MaxText count"), ("compile", "compile s (step + loop bodies)")]))
    chosen = [r for r in rows if r["fits"] == "yes" and r["mfu"] and r["spare"] >= args.headroom]
    own = f"{base.model.num_attention_heads}x{base.model.head_dim}"
    for what, best in (("best that fits", chosen[0] if chosen else None),
                       (f"best with the preset's heads ({own})", next((r for r in chosen if r["heads"] == own), None))):
        if best is not None:
            print(f"{what} with {args.headroom:g} GiB to spare: heads {best['heads']}, remat {best['remat']}, tensor "
                  f"{best['tensor']}, splash {best['blocks']}, {best['batch']} per device, flags {best['flags']}: "
                  f"MFU {best['mfu']}% predicted, {best['spare']:.2f} GiB spare")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
