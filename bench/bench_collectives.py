"""Every byte a 7B step communicates, before and after the mesh learned nodes and slices (2026-12-06), and what it costs on GPU clusters of 1 to 128 nodes.

The train step is compiled ahead of time (olmo3eqx.aot.compile_step: nothing allocated or run) and its program's
collectives counted (olmo3eqx.collectives: kind, dtype, runs per step, bytes each device sends by the ring algorithm,
mesh axes, within or across a node/slice). TPU targets compile with XLA:TPU (libtpu) for a topology that is not here:
`v5p:8x8x2` (one 128-chip slice) and `2xv5p:8x8x1` (two 64-chip slices over the data-centre network); GPU targets
(`16xh100x8`) are partitioned for simulated CPU devices and compiled by XLA:CPU, whose program stands in for XLA:GPU's.

    python bench/bench_collectives.py [--config configs/olmo3-7b-stage1.yaml]
        [--targets v5p:8x8x2 2xv5p:8x8x1 16xh100x8] [--variants before after]
    python bench/bench_collectives.py --gpu-plan [--nodes 1 2 16 128]

Variants: `before` is the program as it was until 2026-12-06 (mesh.gather_dtype xla: the casts where XLA places them;
fsdp over every device as the presets put it, across nodes/slices allowed); `after` gathers weights in the compute
dtype and reduces gradients in float32 (mesh.gather_dtype compute) with data across nodes/slices and fsdp within
(mesh.data = the number of nodes or slices). Each cell is what `train.py --config C --dry-run --target T` with those
flags prints. Cells are merged into docs/results/collectives.json (keyed by config, target, variant); `--markdown`
prints the tables the docs hold, from that file.

`--gpu-plan` compiles the after-variant for N nodes of 8 H100s and sets the bytes against the links' nominal
bandwidth (NVLINK_BPS within a node, NETWORK_BPS across) and the step's compute against the 1B's measured MFU on one
H200 (MEASURED_MFU): a plan, which says where the network, not the GPUs, would bound the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

RESULTS = common.TRACKED / "collectives.json"
TARGETS = ("v5p:8x8x2", "2xv5p:8x8x1", "16xh100x8")
NODES = (1, 2, 16, 128)
GPUS_PER_NODE = 8
NVLINK_BPS = 450e9
"""Bytes per second one H100 SXM sends over NVLink 4 (900 GB/s both directions together, NVIDIA's data sheet)."""
NETWORK_BPS = 50e9
"""Bytes per second one GPU sends across nodes: one 400 Gb/s InfiniBand NDR (or equal RoCE) adapter per GPU, as in a
DGX H100 or an HGX H100 node with 8 adapters."""
PEAK_FLOPS = 989e12
"""Dense bf16 peak of an H100 SXM (and an H200), FLOP/s."""
MEASURED_MFU = 0.374
"""The 1B step's MFU measured on one H200 (docs/tpu-gpu.md, bench/measured/h200-2026-12-04): the compute time a
plan assumes; the 7B on H100s is not measured."""

if __name__ == "__main__":
    common.clean_xla_flags()
    os.environ["JAX_PLATFORMS"] = "cpu"
    _gpu_plan = "--gpu-plan" in sys.argv
    _nodes = [int(a) for a in sys.argv[sys.argv.index("--nodes") + 1:] if a.isdigit()] if "--nodes" in sys.argv else []
    _count = max([n * GPUS_PER_NODE for n in (_nodes or NODES)] if _gpu_plan else
                 [int(t.split("x")[0]) * int(t.split("x")[2]) for t in sys.argv if t.count("x") == 2 and "h" in t]
                 or [128])
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_count}")


def variant_config(cfg, variant: str, granules: int):
    mesh = cfg.mesh
    if variant == "before":
        mesh = dataclasses.replace(mesh, gather_dtype="xla", data=1, fsdp=-1, cross_nodes=True)
    elif variant == "after":
        mesh = dataclasses.replace(mesh, gather_dtype="compute", data=granules, fsdp=-1)
    else:
        raise SystemExit(f"unknown variant {variant!r}: before or after")
    return dataclasses.replace(cfg, mesh=mesh)


def flags(variant: str, granules: int) -> str:
    """The train.py flags that give the variant's program."""
    if variant == "before":
        return "--mesh.gather-dtype xla --mesh.data 1 --mesh.fsdp -1 --mesh.cross-nodes True"
    return f"--mesh.gather-dtype compute --mesh.data {granules} --mesh.fsdp -1"


def compile_cell(base, config: str, target: str, variant: str, tensor: int = 1) -> dict:
    """One target x variant of `base` (loaded from `config`, the path its command names) compiled and counted: the
    JSON cell."""
    import jax

    from olmo3eqx import aot
    from olmo3eqx.config import for_chip
    from olmo3eqx.sharding import build_layout

    gpu = aot.gpu_node(target)
    if gpu is not None:
        devices, kind, granules = jax.devices()[:gpu.count], gpu.device_kind, gpu.nodes
    else:
        devices = aot.topology_devices(target)
        kind = devices[0].device_kind
        granules = len({getattr(d, "slice_index", 0) for d in devices})
    cfg = for_chip(variant_config(base, variant, granules), kind)
    if tensor > 1:
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, tensor=tensor))
    if gpu is not None:
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, node_devices=gpu.per_node))
    start = time.perf_counter()
    layout = build_layout(cfg, devices)
    # XLA:TPU's predicted time for one slice (several slices: the cost model does not see the network)
    report = aot.compile_step(cfg, layout, gpu, predict_time=granules == 1 and variant == "after")
    traffic = report.collectives
    command = (f"python train.py --config {config} --dry-run --target {target} {flags(variant, granules)}"
               + (f" --mesh.tensor {tensor}" if tensor > 1 else ""))
    return {"command": command, "provenance": common.provenance(), "target": target, "variant": variant,
            "device_kind": report.device_kind, "devices": report.devices, "granules": granules,
            "mesh": dict(layout.mesh.shape), "gather_dtype": cfg.mesh.gather_dtype,
            "batch": {"per_device": layout.plan.per_device_batch, "accum": layout.plan.accum_steps},
            "memory": report.memory, "hbm": report.hbm, "xla_flops": report.flops, "compile_s": report.compile_s,
            "wall_s": time.perf_counter() - start, "collectives": None if traffic is None else traffic.to_json(),
            "prediction": prediction(report.prediction), "prediction_error": report.prediction_error,
            "tokens_per_device": layout.tokens_per_device(cfg.data.seq_len)}


def prediction(p) -> dict | None:
    """XLA:TPU's predicted step (olmo3eqx.costmodel.Prediction) as bench_tpu_plan.py stores it."""
    if p is None:
        return None
    return {"seconds": p.seconds, "mfu": p.mfu, "model_flops": p.model_flops, "maxtext_flops": p.maxtext_flops,
            "pieces": [dataclasses.asdict(x) for x in p.pieces], "attention": p.attention, "add_back": p.add_back,
            "compile_s": p.compile_s}


def load() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {"results": {}}


def save(results: dict) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def key(config: str, target: str, variant: str, tensor: int = 1) -> str:
    return f"{Path(config).name}/{target}/{variant}" + (f"/tensor{tensor}" if tensor > 1 else "")


def summary(cell: dict) -> dict[str, float]:
    """GiB each device sends per step: by link, and the weights' gathers and gradients' reductions by dtype."""
    rows = cell["collectives"]["rows"]
    gib = 2**30
    out = {"within": cell["collectives"]["within_bytes_per_device"] / gib,
           "across": cell["collectives"]["across_bytes_per_device"] / gib}
    for r in rows:
        name = f"{r['kind']} {r['dtype']}"
        out[name] = out.get(name, 0.0) + r["bytes_per_device"] / gib
    return out


def markdown(stored: dict) -> str:
    """The before/after table of docs/tpu-gpu.md."""
    lines = ["| target | program | mesh | GiB/device | sent within a node/slice, GiB | across, GiB | "
             "all-gathers (count, dtype) | reductions: reduce-scatter, all-reduce (count, dtype) |", "|---|---|---|---|---|---|---|---|"]
    for k, cell in stored["results"].items():
        if "/tensor" in k or cell["target"] not in TARGETS:
            continue
        rows = cell["collectives"]["rows"]

        def kinds(*names):
            found: dict[str, int] = {}
            for r in rows:
                if r["kind"] in names and r["bytes_per_device"] > 0:
                    found[r["dtype"]] = found.get(r["dtype"], 0) + r["count"]
            return ", ".join(f"{n} {d}" for d, n in sorted(found.items())) or "none"

        mesh = " x ".join(f"{a} {n}" for a, n in cell["mesh"].items() if n > 1)
        memory = cell["memory"]["total"] / 2**30 if cell["memory"] else float("nan")
        s = summary(cell)
        lines.append(f"| {cell['target']} | {cell['variant']} | {mesh} | {memory:,.2f} | {s['within']:,.1f} | "
                     f"{s['across']:,.1f} | {kinds('all-gather')} | {kinds('reduce-scatter', 'all-reduce')} |")
    return "\n".join(lines)


def plan_row(cell: dict, config) -> dict:
    from olmo3eqx import flops

    s = summary(cell)
    per_token = flops.train_flops_per_token(config.model, config.data.seq_len)
    compute = per_token * cell["tokens_per_device"] / (PEAK_FLOPS * MEASURED_MFU)
    nvlink, network = s["within"] * 2**30 / NVLINK_BPS, s["across"] * 2**30 / NETWORK_BPS
    return {"nodes": cell["granules"], "mesh": " x ".join(f"{a} {n}" for a, n in cell["mesh"].items() if n > 1),
            "memory": cell["memory"]["total"] / 2**30, "within": s["within"], "across": s["across"],
            "nvlink_s": nvlink, "network_s": network, "compute_s": compute,
            "bound": "network" if network > compute else "compute"}


def plan_markdown(stored: dict, config) -> str:
    lines = ["| nodes x 8 H100 | mesh | GiB/device (XLA:CPU) | NVLink GiB/step | network GiB/step | NVLink s | "
             "network s | compute s at 37.4% MFU | bound by |", "|---|---|---|---|---|---|---|---|---|"]
    cells = sorted((c for c in stored["results"].values() if c["variant"] == "after" and "H100" in c["device_kind"]),
                   key=lambda c: c["granules"])
    for cell in cells:
        r = plan_row(cell, config)
        lines.append(f"| {r['nodes']} | {r['mesh']} | {r['memory']:,.2f} | {r['within']:,.1f} | {r['across']:,.1f} | "
                     f"{r['nvlink_s']:.2f} | {r['network_s']:.2f} | {r['compute_s']:.2f} | {r['bound']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(common.REPO / "configs" / "olmo3-7b-stage1.yaml"))
    ap.add_argument("--targets", nargs="+", default=list(TARGETS))
    ap.add_argument("--variants", nargs="+", default=["before", "after"])
    ap.add_argument("--gpu-plan", action="store_true", help="the GPU cluster planning table (after-variant)")
    ap.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
    ap.add_argument("--markdown", action="store_true", help="print the docs' tables from the stored JSON only")
    args = ap.parse_args(argv)

    from olmo3eqx.config import load_yaml

    base = load_yaml(args.config)
    shown = Path(args.config).resolve()
    config = str(shown.relative_to(common.REPO) if shown.is_relative_to(common.REPO) else shown)
    stored = load()
    if args.markdown:
        print(markdown(stored))
        print()
        print(plan_markdown(stored, base))
        return 0
    jobs = ([(f"{n}xh100x{GPUS_PER_NODE}" if n > 1 else f"h100x{GPUS_PER_NODE}", "after") for n in args.nodes]
            if args.gpu_plan else [(t, v) for t in args.targets for v in args.variants])
    for target, variant in jobs:
        dp = (int(target.split("x")[0]) * GPUS_PER_NODE) if target[0].isdigit() else GPUS_PER_NODE
        # a batch row per data-parallel device at least: beyond global_batch devices, split rows over tensor
        tensor = max(1, -(-dp // base.data.global_batch)) if "h100" in target else 1
        cell = compile_cell(base, config, target, variant, tensor)
        stored = load()  # as it is now: another run may have stored cells since this one started
        stored["results"][key(args.config, target, variant, tensor)] = cell
        save(stored)
        s = summary(cell)
        print(f"{target} {variant}: mesh {cell['mesh']}, {cell['memory']['total'] / 2**30:.2f} GiB/device, "
              f"{s['within']:,.1f} GiB within / {s['across']:,.1f} GiB across per device-step, compile "
              f"{cell['compile_s']:.0f} s", flush=True)
    print(markdown(stored))
    if args.gpu_plan:
        print(plan_markdown(stored, base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
