"""The TPU cost model (olmo3eqx.costmodel) against published measurements of dense 7-8B models, each predicted at the
configuration its source states: the model's shape as olmo3eqx's config expresses it (bench/published/*.yaml, or a
preset), the chips, the tokens per device, the sequence, and the nearest remat olmo3eqx has; what the source does
not state is named in the row with the value the prediction assumed, and what differs between the two programs
(the model's block, the splash kernel's backward, the XLA flags) is named too. Each prediction is one
`train.py --dry-run --target T` (printed per row). The ratio is raw: predicted over measured tokens per second per
chip, nothing taken off; the model's error is the spread of all the ratios.

    python bench/bench_tpu_validate.py [--only KEY,...] [--redo] [--json docs/results/tpu_validation.json]
        [--markdown]

Each 7B compile takes 10-40 minutes on a 2-core host; results are merged into the JSON as they come, so a partial
run keeps what it measured and a rerun skips the rows it has (--redo to compile again). --markdown prints the docs'
table (docs/tpu-gpu.md) from the JSON without compiling; tests/test_tpu_results.py checks the docs hold it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

if __name__ == "__main__":
    common.clean_xla_flags()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO = Path(__file__).resolve().parents[1]
MAXTEXT_V5P_FLAGS = ("--xla_tpu_scoped_vmem_limit_kib=98304 --xla_tpu_enable_async_collective_fusion=true "
                     "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true "
                     "--xla_tpu_enable_async_collective_fusion_multiple_steps=true "
                     "--xla_tpu_overlap_compute_collective_tc=true --xla_enable_async_all_gather=true "
                     "--xla_tpu_enable_data_parallel_all_reduce_opt=true "
                     "--xla_tpu_data_parallel_opt_different_sized_ops=true")
"""The Trillium recipes' flags that this libtpu knows and that olmo3eqx's v5p flags also are (MaxText's
DENSE_VMEM_LIMIT_FLAG, CF_FOR_ALL_GATHER, DATA_PARALLEL_OVERLAP); their SparseCore, layout and host-offload flags
are left out."""
DEVICES_PER_CHIP = (("tpu7", 2), ("tpu v4", 2))
"""JAX devices per chip in the compiled topology: Ironwood's two TensorCores show as two devices; libtpu's v4
topologies have one device per TensorCore (v4:2x2x1 is 8 devices on 4 chips; a v4 host runs them as one megacore
device per chip). Every other chip here: one."""
CHIP_PEAK = (("tpu7", 2307e12), ("tpu v4", 275e12), ("v6 lite", 918e12), ("tpu v5", 459e12))
"""bf16 peak per chip, for the MFU columns (olmo3eqx.flops has it per device)."""


@dataclass(frozen=True)
class Published:
    """One published measurement and the dry run that predicts it."""

    key: str
    what: str
    """Model and chip."""
    source: str
    """Where it is published (URL, or repository path at a commit)."""
    says: str
    """The source's own statement of the measurement, numbers as printed."""
    tokens_per_chip_s: float
    """The measurement as tokens per second per chip (derived from `says` as `derived` states)."""
    derived: str
    """How tokens_per_chip_s follows from `says` (empty when the source states it)."""
    stated: str
    """The configuration the source states."""
    assumed: str
    """What the source does not state, and the value the prediction takes there."""
    differs: str
    """What differs between the measured program and the predicted one."""
    topology: str
    args: tuple[str, ...]
    """train.py arguments (config and flags) of the dry run; --dry-run --target are added."""

    def argv(self) -> list[str]:
        return [*self.args, "--dry-run", "--target", self.topology]

    def command(self) -> str:
        return "python train.py " + " ".join(shlex.quote(a) for a in self.argv())


STAGE1 = "configs/olmo3-7b-stage1.yaml"
STAGE2 = "configs/olmo3-7b-stage2.yaml"
BLOG = ("[Google Developers Blog, 'Reproducing OLMo 3 7B Pre-training in MaxText' (2026-09-24)]"
        "(https://developers.googleblog.com/reproducing-olmo-3-7b-pre-training-in-maxtext-case-study-of-large-scale-"
        "training-on-tpus/)")
"""Sources are Markdown links, as the docs' table shows them (`--markdown`)."""
LAUNCHER = ("[MaxText's stage-1 launcher, run_olmo3_7b_stage1.sh @e591f30cbbf2 (committed 2026-05-13)]"
            "(https://github.com/AI-Hypercomputer/maxtext/blob/e591f30cbbf2/src/maxtext/trainers/pre_train/scripts/"
            "olmo/run_olmo3_7b_stage1.sh)")
TPU_RECIPES = "https://github.com/AI-Hypercomputer/tpu-recipes/blob/c8cfe2f68908"


def recipe(path: str) -> str:
    """A link to a file of AI-Hypercomputer/tpu-recipes at the commit the measurements were read at."""
    return f"[AI-Hypercomputer/tpu-recipes @c8cfe2f68908 {path}]({TPU_RECIPES}/{path})"
OLMO_STEP_TFLOP = 1565.154802139136
"""MaxText's count of the OLMo 3 7B stage-1 step per device (every layer global, 4 x 8192 tokens): the blog's
'1565 TFLOPs', and olmo3eqx.flops' all-global count (flops.train_flops_per_token(window_aware=False))."""
OLMO_TOKEN_FLOP = OLMO_STEP_TFLOP * 1e12 / (4 * 8192)
SAME_REMAT = "--model.remat-by-chip"  # with no entries: model.remat holds on every chip


def trillium_recipe(config: str, chips: int, per_device: int, micro_batch: int | None = None) -> tuple[str, ...]:
    """Dry-run arguments for a MaxText Trillium recipe of tpu-recipes: FSDP over `chips`, `per_device` rows of the
    config's sequence per step (in micro-batches of `micro_batch` rows when given), the nearest of our remat
    policies to their custom one (q/k/v offloaded to host), splash blocks 2048, their dense flags."""
    return ("--config", config, "--data.global-batch", str(chips * per_device), "--mesh.max-per-device-batch",
            str(micro_batch or per_device), "--model.remat", "qkv_proj_offloaded", "--model.attention-block-q",
            "2048", "--model.attention-block-kv", "2048", f"--mesh.tpu-flags={MAXTEXT_V5P_FLAGS}")


PUBLISHED = (
    Published(
        key="olmo3-7b-ironwood",
        what="OLMo 3 7B stage 1, 32 x 128 heads, Ironwood",
        source=BLOG,
        says="~510-513 TFLOP/s/device (stage 1 on 512 and on 128 devices); 508 TFLOP/s/device, 44.2% MFU, "
             "1565 TFLOPs (its head-shape comparison)",
        tokens_per_chip_s=2 * 511.5e12 / OLMO_TOKEN_FLOP,
        derived="511.5 TFLOP/s per device / MaxText's 47.76 GFLOP per token (1565 TFLOP per device-step of 4 x 8192 "
                "tokens) x 2 devices per chip",
        stated="Ironwood; global batch 512 x 8192; 1565 TFLOP per device-step, so 4 x 8192 tokens per device (128 "
               "devices, 64 chips); splash blocks 2048; the XLA flags of " + LAUNCHER
               + " (SparseCore offload, 64 MiB VMEM)",
        assumed="remat: not stated for the measured run ('extended rematerialisation of the attention and MLP "
                "projections'; the launcher today saves all projections but the MLP's up projection): predicted "
                "at save_qkv_proj, the nearest of ours that fits 4 x 8192 (theirs keeps more, recomputes less)",
        differs="their splash: fused backward (7 matmuls per block pair, ours 9) and tokamax's kernel",
        topology="tpu7x:4x4x4",
        args=("--config", STAGE1, "--model.remat", "save_qkv_proj", SAME_REMAT)),
    Published(
        key="olmo3-7b-16x256-ironwood",
        what="OLMo 3 7B stage 1, 16 x 256 heads, Ironwood",
        source=BLOG,
        says="571 TFLOP/s/device (49.6% MFU), 1565 TFLOPs; +12.4% over 32 x 128",
        tokens_per_chip_s=2 * 571e12 / OLMO_TOKEN_FLOP,
        derived="571 TFLOP/s per device / MaxText's 47.76 GFLOP per token x 2 devices per chip",
        stated="as the 32 x 128 row, heads 16 x 256 (an ablation run for 30,000 steps)",
        assumed="remat and splash blocks: not stated for the ablation: as the 32 x 128 row (save_qkv_proj, 2048)",
        differs="as the 32 x 128 row",
        topology="tpu7x:4x4x4",
        args=("--config", STAGE1, "--model.remat", "save_qkv_proj", SAME_REMAT, "--model.num-attention-heads", "16",
              "--model.num-key-value-heads", "16", "--model.head-dim", "256", "--model.attention-block-q", "2048",
              "--model.attention-block-kv", "2048")),
    Published(
        key="olmo3-7b-stage2-v5p",
        what="OLMo 3 7B stage 2, v5p",
        source=BLOG,
        says="57.4% MFU (stage 2 on TPU v5p, 'changing only the device type')",
        tokens_per_chip_s=0.574 * 459e12 / OLMO_TOKEN_FLOP,
        derived="57.4% of v5p's 459 TFLOP/s / MaxText's 47.76 GFLOP per token (the count the Ironwood figures use)",
        stated="v5p; stage 2's global batch 256 x 8192; the stage-1 launcher otherwise",
        assumed="slice and tokens per device: not stated: predicted on 128 chips (v5p:8x8x2), 2 x 8192 per "
                "device; remat: not stated: minimal, the nearest of ours to the launcher's (it keeps attention's "
                "output and not the MLP's up projection; minimal the reverse); splash blocks: not stated: 512",
        differs="their splash: fused backward; olmo3eqx's v5p XLA flags (MaxText's dense flags), not the "
                "launcher's Ironwood set",
        topology="v5p:8x8x2",
        args=("--config", STAGE2, "--model.remat", "minimal", SAME_REMAT)),
    Published(
        key="llama3.1-8b-v6e-8",
        what="Llama 3.1 8B, Trillium v6e-8",
        source=recipe("training/trillium/Llama3.1-8B-MaxText/v6e-8/README.md"),
        says="completed step: 14, seconds: 3.443, TFLOP/s/device: 413.433, Tokens/s/device: 7138.890",
        tokens_per_chip_s=7138.890,
        derived="",
        stated="8 chips; per_device_batch_size 3, max_target_length 8192; FSDP over all; remat custom (block "
               "input, q/k/v and out projections offloaded to host, the rest recomputed); splash blocks 2048, "
               "fused backward; MaxText tpu-recipes-v0.1.4, JAX 0.6.1",
        assumed="",
        differs="remat qkv_proj_offloaded (q/k/v to host; not the block input or out projection); our splash's "
                "unfused backward; OLMo's block and QK-norm; XLA flags: only MaxText's dense set",
        topology="v6e:2x4",
        args=trillium_recipe("bench/published/llama3.1-8b.yaml", chips=8, per_device=3)),
    Published(
        key="llama3.1-8b-v6e-256",
        what="Llama 3.1 8B, Trillium v6e-256",
        source=recipe("training/trillium/Llama3.1-8B-MaxText/v6e-256/README.md") + "; [MaxText "
               "docs/reference/models/tiering.md](https://github.com/AI-Hypercomputer/maxtext/blob/main/docs/"
               "reference/models/tiering.md) (Gold: 45.46% MFU, 7,207 tokens/s/device)",
        says="completed step: 14, seconds: 4.546, TFLOP/s/device: 417.397, Tokens/s/device: 7207.336",
        tokens_per_chip_s=7207.336,
        derived="",
        stated="256 chips; per_device_batch_size 4, max_target_length 8192; otherwise as the v6e-8 row",
        assumed="",
        differs="as the v6e-8 row",
        topology="v6e:16x16",
        args=trillium_recipe("bench/published/llama3.1-8b.yaml", chips=256, per_device=4)),
    Published(
        key="mistral-7b-v6e-8",
        what="Mistral 7B, Trillium v6e-8",
        source=recipe("training/trillium/Mistral-7B-MaxText/README.md"),
        says="completed step: 6, seconds: 6.320, TFLOP/s/device: 431.981, Tokens/s/device: 7776.813",
        tokens_per_chip_s=7776.813,
        derived="",
        stated="8 chips; per_device_batch_size 6, max_target_length 8192; remat custom (block input, q/k/v and "
               "out projections offloaded); splash blocks 2048, fused backward; MaxText tpu-recipes-v0.1.2, "
               "JAX 0.5.2",
        assumed="",
        differs="the 6 rows per device as 3 micro-batches of 2: in one of 6 or 2 of 3, qkv_proj_offloaded does not "
                "fit the 31.25 GiB HBM (XLA:TPU refused 38.87 and 31.37 GiB of temporaries; full at 6: 34.71; "
                "theirs also offloads the block inputs to the host); otherwise as the Llama 3.1 8B v6e-8 row",
        topology="v6e:2x4",
        args=trillium_recipe("bench/published/mistral-7b.yaml", chips=8, per_device=6, micro_batch=2)),
    Published(
        key="openllama-7b-v4",
        what="OpenLLaMA 7B (EasyLM), TPU v4",
        source="[openlm-research/open_llama README.md]"
               "(https://github.com/openlm-research/open_llama/blob/main/README.md)",
        says="'Overall we reach a throughput of over 2200 tokens / second / TPU-v4 chip for our 7B model.'",
        tokens_per_chip_s=2200,
        derived="",
        stated="TPU v4; LLaMA 7B's architecture, context length (2048) and training hyperparameters (LLaMA's "
               "global batch: 4M tokens); data parallelism combined with FSDP; EasyLM (JAX)",
        assumed="slice: not stated: a v4-512 (256 chips; the 4M-token batch is 8 x 2048 per chip); remat: not "
                "stated: full; the mix of data parallelism and FSDP: not stated: FSDP over all devices",
        differs="libtpu's v4 topology compiles one device per TensorCore (4 x 2048 each), where a v4 host runs one "
                "megacore device per chip; XLA's attention in place of splash at 2048 tokens is not modelled: "
                "splash; OLMo's block and QK-norm",
        topology="v4:8x8x4",
        args=("--config", "bench/published/llama-7b.yaml", "--data.global-batch", "2048",
              "--mesh.max-per-device-batch", "4")),
)


def per_chip(device_kind: str, table) -> float:
    kind = device_kind.lower()
    return next((v for key, v in table if key in kind), 1)


def predict(row: Published) -> dict:
    """The dry run of `row` compiled here: memory, the prediction, and the model's FLOPs per token (window-aware)."""
    from olmo3eqx import aot, flops
    from olmo3eqx.train import parse_args

    cfg, _ = parse_args(row.argv())
    start = time.perf_counter()
    report = aot.compile_for(cfg, row.topology)
    p = report.prediction
    return {
        "command": row.command(), "provenance": common.provenance(),
        "devices": report.devices, "device_kind": report.device_kind, "memory": report.memory, "hbm": report.hbm,
        "fits": report.fits, "out_of_memory": report.out_of_memory, "compile_s": report.compile_s,
        "wall_s": time.perf_counter() - start, "prediction_error": report.prediction_error,
        "flops_per_token": flops.train_flops_per_token(cfg.model, cfg.data.seq_len),
        "prediction": None if p is None else {
            "seconds": p.seconds, "tokens_per_device": p.tokens_per_device, "mfu": p.mfu,
            "model_flops": p.model_flops, "pieces": [dataclasses.asdict(x) for x in p.pieces],
            "attention": p.attention, "add_back": p.add_back, "compile_s": p.compile_s}}


def ratios(saved: dict) -> dict[str, float]:
    """Predicted over measured tokens per second per chip, for every row with a prediction."""
    out = {}
    for row in PUBLISHED:
        r = saved.get(row.key)
        if r and r["prediction"]:
            p = r["prediction"]
            predicted = p["tokens_per_device"] / p["seconds"] * per_chip(r["device_kind"], DEVICES_PER_CHIP)
            out[row.key] = predicted / row.tokens_per_chip_s
    return out


def spread(saved: dict) -> tuple[float, float]:
    """(lowest, highest) ratio of all predicted rows."""
    values = ratios(saved).values()
    return min(values), max(values)


def model_error(saved: dict) -> float:
    """The relative error a comparison of two predictions must beat: highest over lowest ratio, less one (a
    prediction can sit anywhere in the spread, so two of them can be that far apart with no real difference)."""
    low, high = spread(saved)
    return high / low - 1


def markdown(saved: dict) -> str:
    """The docs' table of every row (docs/tpu-gpu.md), the spread, and each row's source and conditions in a
    collapsible note below the table (mkdocs-material's `???`)."""
    lines = ["| measured | predicted tokens/s per chip (MFU) | measured tokens/s per chip (MFU) | predicted / measured "
             "|", "|---|---|---|---|"]
    notes = []
    found = ratios(saved)
    for row in PUBLISHED:
        r = saved.get(row.key)
        measured = f"{row.tokens_per_chip_s:,.0f}"
        if r and r["prediction"]:
            p = r["prediction"]
            chips = per_chip(r["device_kind"], DEVICES_PER_CHIP)
            tokens = p["tokens_per_device"] / p["seconds"] * chips
            peak = per_chip(r["device_kind"], CHIP_PEAK)
            predicted = f"{tokens:,.0f} ({100 * tokens * r['flops_per_token'] / peak:.1f}%)"
            if r["fits"] is False:
                predicted += (f"; ours needs {r['memory']['total'] / 2**30:.1f} GiB per device of "
                              f"{r['hbm'] / 2**30:.2f}")
            measured += f" ({100 * row.tokens_per_chip_s * r['flops_per_token'] / peak:.1f}%)"
            ratio = f"{found[row.key]:.2f}"
        else:
            predicted = "not compiled" if r is None else f"none: {r['out_of_memory'] or r['prediction_error']}"
            ratio = ""
        lines.append(f"| {row.what} | {predicted} | {measured} | {ratio} |")
        derived = f" ({row.derived})" if row.derived else ""
        notes += [f"    - **{row.what}.** Source: {row.source}: {row.says}{derived}. Stated: {row.stated}. "
                  f"Not stated, the prediction assumes: {row.assumed or 'nothing'}. What differs: {row.differs}.", ""]
    if found:
        low, high = spread(saved)
        lines.append("")
        lines.append(f"{len(found)} published measurements predicted; predicted / measured from {low:.2f} to "
                     f"{high:.2f}: two predictions differ by more than the model's measured error only when they are "
                     f"more than {100 * model_error(saved):.0f}% apart.")
    lines += ["", '??? note "Each row: its source, the configuration it states, what the prediction assumes, what '
              'differs"', ""] + notes
    return "\n".join(lines).rstrip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated row keys (default: every row)")
    ap.add_argument("--json", default=str(common.TRACKED / "tpu_validation.json"))
    ap.add_argument("--redo", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print the docs' table from the JSON and stop")
    args = ap.parse_args(argv)
    path = Path(args.json)
    saved = json.loads(path.read_text()).get("results", {}) if path.is_file() else {}
    if args.markdown:
        print(markdown(saved))
        return 0
    wanted = set(filter(None, args.only.split(",")))
    unknown = wanted - {row.key for row in PUBLISHED}
    if unknown:
        print(f"error: --only names no row {sorted(unknown)}; rows: {[row.key for row in PUBLISHED]}", file=sys.stderr)
        return 2
    for row in PUBLISHED:
        if (wanted and row.key not in wanted) or (row.key in saved and not args.redo):
            continue
        print(f"{row.key}: {row.command()}", flush=True)
        saved[row.key] = predict(row)
        common.write_json(path, {"results": saved})
        found, r = ratios(saved), saved[row.key]
        said = (f"predicted / measured {found[row.key]:.3f}" if row.key in found else
                f"no prediction ({r['out_of_memory'] or r['prediction_error']})")
        print(f"{row.key}: {said}", flush=True)
    print(markdown(saved))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
