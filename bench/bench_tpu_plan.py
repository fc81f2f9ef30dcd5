"""A plan for a TPU slice from XLA:TPU's own models: a preset's train step (the OLMo 3 7B's by default, or the 32B's)
compiled ahead of time on this host for a topology, over a grid of remat policy x head shape x mesh (pure FSDP, or
FSDP x tensor) x splash blocks x per-device batch (accumulation keeps the global batch) x XLA flags, each cell with
its memory per device against the HBM and its predicted step time, TFLOP/s and MFU (olmo3eqx.costmodel: the
compiler's cost model with every loop counted, splash modelled by hand; a model, not a measurement). The best
predicted cell that fits with --headroom GiB to spare is printed last, overall and with the config's own head shape
(the preset's model), and then the remat a preset should take: a policy other than `full` only when its predicted
gain over `full` (same heads, mesh, blocks, batch and flags) is larger than the model's measured error (the spread
of bench/bench_tpu_validate.py's ratios), since a smaller gain is not known to be one.

    python bench/bench_tpu_plan.py --topology tpu7x:4x4x4 [--config configs/olmo3-7b-stage1.yaml]
        [--remat full,save_qkv_proj] [--heads 32x128,16x256] [--tensor 1,2] [--blocks default,1024]
        [--per-device 4,2] [--flags auto,none] [--json docs/results/tpu_plan.json]

Every cell is what `train.py --config C --dry-run --target T` with those flags prints. Each 7B compile takes 10-35
minutes on a 2-core host, a 32B one longer (the step, then its layer group and loss chunk alone); results are merged
into the JSON as they come (each cell with its command, date and jax/libtpu versions), so a partial run keeps what
it measured and a rerun skips the cells it has (--redo to compile again). --markdown prints the docs' table of a
config's cells on the topology from the JSON, without compiling.
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

from bench_tpu_validate import model_error

from olmo3eqx import aot
from olmo3eqx.config import load_yaml

REPO = Path(__file__).resolve().parents[1]
HEADROOM = 2.0
"""GiB of HBM a plan must leave spare to be chosen (the runtime's own use; XLA:TPU's memory analysis is the
program's)."""


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


def compile_cell(base, topology: str, heads: str, remat: str, tensor: str, blocks: str, per_device: str,
                 flags: str) -> dict:
    """One cell compiled for `topology` (printed as the dry run prints it) and what the JSON keeps of it."""
    from olmo3eqx.sharding import build_layout

    cfg = cell_config(base, heads, remat, int(tensor), blocks, int(per_device), flags)
    start = time.perf_counter()
    report = aot.compile_for(cfg, topology)
    plan = build_layout(cfg, aot.topology_devices(topology)).plan
    p = report.prediction
    print(f"{topology} {heads} {remat} tensor {tensor} blocks {blocks} per device {per_device} flags {flags}: "
          + " | ".join(report.lines()), flush=True)
    return {
        "provenance": common.provenance(),
        "memory": report.memory, "hbm": report.hbm, "fits": report.fits, "out_of_memory": report.out_of_memory,
        "compile_s": report.compile_s, "wall_s": time.perf_counter() - start, "device_kind": report.device_kind,
        "per_device_batch": plan.per_device_batch, "accum": plan.accum_steps, "xla_flops": report.flops,
        "prediction": None if p is None else {
            "seconds": p.seconds, "mfu": p.mfu, "model_flops": p.model_flops, "maxtext_flops": p.maxtext_flops,
            "pieces": [dataclasses.asdict(x) for x in p.pieces], "attention": p.attention, "add_back": p.add_back,
            "compile_s": p.compile_s},
        "prediction_error": report.prediction_error}


def preset_remat(rows: list[dict], error: float) -> tuple[dict | None, dict | None, float]:
    """(the cell a preset takes, the best cell it passed over or None, that cell's predicted gain over `full`):
    among `rows` (cells that fit, best predicted first), the best one when its predicted MFU beats that of `full`
    with the same heads, mesh, blocks, batch and flags by more than `error`, else that `full` cell; (None, best,
    nan) when no such `full` cell was compiled (a gain over nothing is not known)."""
    best = rows[0]
    same = ("heads", "tensor", "blocks", "batch", "flags")
    full = next((r for r in rows if r["remat"] == "full" and all(r[k] == best[k] for k in same)), None)
    if full is None:
        return None, best, float("nan")
    gain = float(best["mfu"]) / float(full["mfu"]) - 1
    return (best, None, gain) if gain > error else (full, best if best is not full else None, gain)


def markdown(rows: list[dict], chosen: dict | None) -> str:
    """The docs' table of one config's cells on one topology (docs/tpu-gpu.md), the preset's choice in bold."""
    out = ["| heads | remat | tensor | splash | per device x accumulation | flags | GiB per device (spare) | step "
           "| TFLOP/s | MFU | MaxText count | compile |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        remat = "<code>" + r["remat"].replace("_", "_<wbr>") + "</code>"  # breaks at its `_`s in a narrow column
        remat = f"**{remat}**" if r is chosen else remat
        mem = f"{r['mem']} ({r['spare_gib']})" if r["spare_gib"] else r["mem"]
        out.append(f"| {r['heads']} | {remat} | {r['tensor']} | {r['blocks']} | {r['batch']} | {r['flags']} | {mem} "
                   f"| {r['step']} s | {r['tflops']} | {r['mfu']}% | {r['maxtext']} | {int(r['compile']):,} s |")
    return "\n".join(out)


def plan_rows(saved: dict, config: str, topology: str) -> list[dict]:
    """The cells of `config` (a preset's file name) on `topology`, best predicted MFU first."""
    rows = [row(k, r) for k, r in saved.items() if k.startswith(f"{config}/{topology}/")]
    return sorted(rows, key=lambda r: -float(r["mfu"] or 0))


def candidates(rows: list[dict], heads: str, headroom: float = HEADROOM) -> list[dict]:
    """The rows a preset with `heads` may take: its head shape, predicted, fitting with `headroom` GiB to spare."""
    return [r for r in rows if r["heads"] == heads and r["fits"] == "yes" and r["mfu"] and r["spare"] >= headroom]


def docs_table(saved: dict, config: str, topology: str, heads: str, error: float) -> str:
    """The docs' table of `config` on `topology` (docs/tpu-gpu.md), the cell the preset with `heads` takes in bold."""
    rows = plan_rows(saved, config, topology)
    mine = candidates(rows, heads)
    return markdown(rows, preset_remat(mine, error)[0] if mine else None)


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
    ap.add_argument("--headroom", type=float, default=HEADROOM,
                    help="GiB of HBM a plan must leave spare to be chosen (the runtime's own use)")
    ap.add_argument("--json", default=str(common.TRACKED / "tpu_plan.json"))
    ap.add_argument("--validation", default=str(common.TRACKED / "tpu_validation.json"),
                    help="bench/bench_tpu_validate.py's results: the model's measured error")
    ap.add_argument("--redo", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print the docs' table from the JSON and stop")
    args = ap.parse_args(argv)
    path = Path(args.json)
    saved = json.loads(path.read_text()).get("results", {}) if path.is_file() else {}
    validation = Path(args.validation)
    error = model_error(json.loads(validation.read_text())["results"]) if validation.is_file() else None
    name = Path(args.config).name
    base = load_yaml(args.config)
    if not args.markdown:
        grid = itertools.product(args.heads.split(","), args.remat.split(","), args.tensor.split(","),
                                 args.blocks.split(","), args.per_device.split(","), args.flags.split(","))
        for cell in grid:
            key = "/".join((name, args.topology, *cell))
            if key not in saved or args.redo:
                saved[key] = compile_cell(base, args.topology, *cell)
                common.write_json(path, {"results": saved})
    rows = plan_rows(saved, name, args.topology)
    chosen = [r for r in rows if r["fits"] == "yes" and r["mfu"] and r["spare"] >= args.headroom]
    own = f"{base.model.num_attention_heads}x{base.model.head_dim}"
    mine = candidates(rows, own, args.headroom)
    if args.markdown:
        if error is None:
            print(f"error: no {validation}: the preset's choice needs the model's measured error", file=sys.stderr)
            return 2
        print(docs_table(saved, name, args.topology, own, error))
        return 0
    print(f"\n{name} on {args.topology}: per device, XLA:TPU's memory and predicted time "
          f"(olmo3eqx.costmodel; a model, not a measurement); {path}")
    print(common.table(rows, [("heads", "heads"), ("remat", "remat"), ("tensor", "tensor"), ("blocks", "splash"),
                              ("batch", "per dev x accum"), ("flags", "flags"), ("mem", "GiB"),
                              ("spare_gib", "spare"), ("fits", "fits"), ("step", "step s"), ("tflops", "TFLOP/s"),
                              ("mfu", "MFU %"),
                              ("maxtext", "TFLOP/s MaxText count"), ("compile", "compile s (step + loop bodies)")]))
    for what, best in (("best that fits", chosen[0] if chosen else None),
                       (f"best with the preset's heads ({own})", mine[0] if mine else None)):
        if best is not None:
            print(f"{what} with {args.headroom:g} GiB to spare: heads {best['heads']}, remat {best['remat']}, tensor "
                  f"{best['tensor']}, splash {best['blocks']}, {best['batch']} per device, flags {best['flags']}: "
                  f"MFU {best['mfu']}% predicted, {best['spare']:.2f} GiB spare")
    if mine and error is None:
        print(f"no {validation}: the model's error is unknown, so no remat is chosen for the preset")
    elif mine:
        take, passed, gain = preset_remat(mine, error)
        if take is None:
            why = f"no `full` cell beside {passed['remat']} to compare it with: compile --remat full too"
        elif passed is not None:
            why = f"{passed['remat']} predicts {gain:+.1%} over full, within the model's measured error of {error:.0%}"
        elif take["remat"] == "full":
            why = "full is the best predicted"
        else:
            why = f"{gain:+.1%} over full, more than the model's measured error of {error:.0%}"
        print(f"the preset takes remat {take['remat'] if take else '?'} here: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
