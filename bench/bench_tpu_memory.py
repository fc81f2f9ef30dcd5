"""The plan the MaxText reproduction ran, as compiled facts: the OLMo 3 7B stage-1 train step (4 x 8192 tokens per
device, global batch 512, splash attention) compiled ahead of time by XLA:TPU on this host for the 128-device slices
(tpu7x:4x4x4, 64 Ironwood chips of two devices each; v5p:8x8x2, 128 chips), for each remat policy and both head
shapes of the recipe (32 x 128 and 16 x 256: same parameters and FLOPs). Per compile: memory per device against the
HBM (fits or not), XLA's FLOPs per device-step, the compile time. Needs libtpu (pip install -e ".[tpu]").

    python bench/bench_tpu_memory.py [--topologies tpu7x:4x4x4,v5p:8x8x2] [--remat none,dots,dots_no_batch,full]
                                     [--heads 32x128,16x256] [--config PRESET] [--json FILE] [--markdown]

Each compile takes minutes on a 2-core host; results are merged into the JSON as they come (each cell with its
command, date and jax/libtpu versions), so a partial run keeps what it measured. Prints a table last; --markdown
prints the docs' table (docs/tpu-gpu.md) from the JSON without compiling (tests/test_tpu_results.py checks the docs
hold it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

if __name__ == "__main__":
    common.clean_xla_flags()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from olmo3eqx import aot, flops
from olmo3eqx.config import load_yaml

REPO = Path(__file__).resolve().parents[1]


def config(heads: str, remat: str):
    base = load_yaml(REPO / "configs" / "olmo3-7b-stage1.yaml")
    n, dim = (int(x) for x in heads.split("x"))
    model = dataclasses.replace(base.model, num_attention_heads=n, num_key_value_heads=n, head_dim=dim, remat=remat)
    return dataclasses.replace(base, model=model)


TEMPORARIES = re.compile(r"HLO temporaries \(([\d.]+G)\)")


def markdown(saved: dict) -> str:
    """The docs' table (docs/tpu-gpu.md) of the stored cells, in the order they were compiled."""
    lines = ["| topology | heads | remat | memory per device | HBM | fits | compile |", "|---|---|---|---|---|---|---|"]
    seen = set()
    for key, r in saved.items():
        topology, heads, remat = key.split("/")
        where = f"`{topology}`" if topology in seen else f"`{topology}` ({r['devices']} x {r['device_kind']})"
        seen.add(topology)
        hbm = r["hbm"] / aot.GIB
        if r["out_of_memory"]:
            found = TEMPORARIES.search(r["out_of_memory"])
            memory = f"over: temporaries {found.group(1)}" if found else f"over: {r['out_of_memory']}"
        else:
            memory = f"{r['memory']['total'] / aot.GIB:.2f} GiB (temporaries {r['memory']['temp'] / aot.GIB:.2f})"
        fits = ({False: "no", None: "?"}.get(r["fits"])
                or f"yes, {hbm - r['memory']['total'] / aot.GIB:.2f} GiB to spare")
        lines.append(f"| {where} | {heads.replace('x', ' x ')} | `{remat}` | {memory} | {hbm:.2f} GiB | {fits} | "
                     f"{r['compile_s']:.0f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topologies", default="tpu7x:4x4x4,v5p:8x8x2")
    ap.add_argument("--remat", default="none,dots,dots_no_batch,full")
    ap.add_argument("--heads", default="32x128,16x256")
    ap.add_argument("--config", default=None, help="a YAML preset instead of the 7B stage 1 (its own head shape)")
    ap.add_argument("--json", default=None, help="default docs/results/tpu_memory.json, or tpu_memory_<preset>.json "
                    "with --config (a preset's cells never mix with the 7B stage-1 table's)")
    ap.add_argument("--markdown", action="store_true", help="print the docs' table from the JSON and stop")
    args = ap.parse_args(argv)
    path = Path(args.json or common.TRACKED / (f"tpu_memory_{Path(args.config).stem}.json" if args.config
                                               else "tpu_memory.json"))
    saved = json.loads(path.read_text()).get("results", {}) if path.is_file() else {}
    if args.markdown:
        print(markdown(saved))
        return 0
    preset = load_yaml(args.config) if args.config else None
    head_shapes = ([f"{preset.model.num_attention_heads}x{preset.model.head_dim}"] if preset
                   else args.heads.split(","))  # a preset's own head shape (--heads is for the 7B stage 1)
    for topology in args.topologies.split(","):
        for heads in head_shapes:
            for remat in args.remat.split(","):
                cfg = (dataclasses.replace(preset, model=dataclasses.replace(preset.model, remat=remat)) if preset
                       else config(heads, remat))
                start = time.perf_counter()
                report = aot.compile_for(cfg, topology)
                seq = cfg.data.seq_len
                tokens = cfg.data.global_batch * seq / report.devices
                saved[f"{topology}/{heads}/{remat}"] = {
                    "provenance": common.provenance(), **dataclasses.asdict(report), "fits": report.fits,
                    "collectives": report.collectives.to_json() if report.collectives is not None else None,
                    "wall_s": time.perf_counter() - start,
                    "flops_py_per_device_step": flops.train_flops_per_token(cfg.model, seq) * tokens,
                    "flops_py_attention_per_device_step": 3 * flops.attention_flops_per_token(cfg.model, seq) * tokens,
                    "params": flops.param_count(cfg.model), "tokens_per_device": tokens}
                print(f"{topology} {heads} remat={remat}: " + "; ".join(report.lines()), flush=True)
                common.write_json(path, {"results": saved})
    rows = []
    for key, r in saved.items():
        topology, heads, remat = key.split("/")
        mem = r["memory"]
        rows.append({
            "topology": topology, "device": r["device_kind"], "heads": heads, "remat": remat,
            "mem": f"{mem['total'] / aot.GIB:.1f}" if mem else "over (XLA)",
            "hbm": f"{r['hbm'] / aot.GIB:.2f}", "fits": {True: "yes", False: "no", None: "?"}[r["fits"]],
            "flops": f"{r['flops'] / 1e12:,.0f}" if r["flops"] else "",
            "model": f"{(r['flops_py_per_device_step'] - r['flops_py_attention_per_device_step']) / 1e12:,.0f}",
            "compile": f"{r['compile_s']:.0f}"})
    what = Path(args.config).name if args.config else "OLMo 3 7B stage-1"
    print(f"\n{what} train step, per device, compiled by XLA:TPU on {common.machine()['cpus']} CPUs; {path}")
    print(common.table(rows, [("topology", "topology"), ("device", "device"), ("heads", "heads"), ("remat", "remat"),
                              ("mem", "memory GiB"), ("hbm", "HBM GiB"), ("fits", "fits"),
                              ("flops", "XLA TFLOP/step"), ("model", "flops.py TFLOP/step w/o attention"),
                              ("compile", "compile s")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
