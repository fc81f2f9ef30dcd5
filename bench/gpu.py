"""Single-GPU benchmark for an H100/H200, one command under 8 minutes: tokens/s, MFU and memory of the real train
step (bfloat16 compute, float32 master weights and Adam moments) for OLMo-3-shaped models, cuDNN flash attention
against the window-aware blocked einsums, the flash backend in plain JAX and JAX's Pallas GPU kernel (global
layers; "auto" picks neither of the last two for unpacked bf16 batches until this says which is fastest), and the
two head shapes of equal parameters and FLOPs. Writes one JSON.

    python bench/gpu.py          # on the GPU: bench/results/gpu.json
    python bench/gpu.py --tiny   # toy sizes on any backend (tests/test_bench.py)

Variants (each with attention cudnn, blocked, flash and pallas):
- "tiny": configs/tiny.yaml's model (3.4M, seq 256, batch 16);
- "1b": configs/olmo3-1b.yaml (width 2048, 16 layers, window 4096 of 8192, batch 4) with 16 x 128 and 8 x 256 heads;
- "7b-2l": two of the 7B's layers, one sliding and one global (width 4096, MLP 11008, 100k vocabulary, batch 4 x
  8192), with the 7B recipe's 32 x 128 and 16 x 256 heads.
MFU is against the device's dense bf16 peak (olmo3eqx.flops.PEAK_FLOPS), FLOPs window-aware, the all-global
(MaxText) figure beside it. Memory: XLA's compiled memory analysis of the step. The XLA GPU
flags train.py applies (olmo3eqx.jaxenv) are applied here too unless XLA_FLAGS is set. A variant that fails (out of
memory, an unsupported kernel) is a result, not a crash; cudnn and pallas variants are skipped off GPU; no variant
starts after
--budget-s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

if __name__ == "__main__":
    common.clean_xla_flags()
    from olmo3eqx import jaxenv

    print(jaxenv.prepare(os.environ) or "not an NVIDIA GPU host: no XLA GPU flags")

import jax

from olmo3eqx import flops
from olmo3eqx.config import FULL, SLIDING, ModelConfig, load_yaml

REPO = Path(__file__).resolve().parents[1]
ATTENTION = ("cudnn", "blocked", "flash", "pallas")
GPU_ONLY = ("cudnn", "pallas")
"""Skipped off a GPU: cuDNN has no CPU kernel, the Pallas GPU kernel would run in interpret mode (slow)."""


def variants(tiny: bool) -> list[tuple[str, ModelConfig, int, int]]:
    """(name, model, seq_len, per-device batch) for every variant, in the order they run."""
    small = load_yaml(REPO / "configs" / "tiny.yaml").model
    one_b = load_yaml(REPO / "configs" / "olmo3-1b.yaml").model
    seven = dataclasses.replace(load_yaml(REPO / "configs" / "olmo3-7b-stage1.yaml").model, num_hidden_layers=2,
                                layer_types=(SLIDING, FULL))
    shapes = {"tiny": (small, 256, 16, (small.head_dim,)), "1b": (one_b, 8192, 4, (128, 256)),
              "7b-2l": (seven, 8192, 4, (128, 256))}
    if tiny:  # the same structure at toy widths: windows shorter than the sequence, two head shapes
        toy = dict(vocab_size=512, intermediate_size=128, sliding_window=16, eos_token_id=1, pad_token_id=2)
        shapes = {"tiny": (dataclasses.replace(small, **toy, hidden_size=32, num_hidden_layers=2), 32, 2, (16,)),
                  "1b": (dataclasses.replace(one_b, **toy, hidden_size=64, num_hidden_layers=4), 32, 2, (16, 32)),
                  "7b-2l": (dataclasses.replace(seven, **toy, hidden_size=64), 32, 2, (16, 32))}
    out = []
    for tag, (base, seq, batch, head_dims) in shapes.items():
        for head_dim in head_dims:
            heads = base.hidden_size // head_dim
            for impl in ATTENTION:
                m = dataclasses.replace(base, num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
                                        compute_dtype="bfloat16", param_dtype="float32", attention_impl=impl,
                                        remat="dots")
                out.append((f"{tag} {heads}x{head_dim} {impl}", m, seq, batch))
    return out


def run_variant(model: ModelConfig, seq: int, batch: int, steps: int, repeats: int) -> dict:
    cfg = common.train_config(model, seq, batch)
    t = time.perf_counter()
    step, state, tokens, mask = common.build_step(cfg)
    compiled = step.lower(state, tokens, mask).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    compiled_bytes = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                               - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    for _ in range(2):
        state, metrics = compiled(state, tokens, mask)
    jax.block_until_ready(metrics)
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, tokens, mask)
        jax.block_until_ready((state, metrics))
        rates.append(steps * seq * batch / (time.perf_counter() - t))
    return {"tokens_per_s": common.median(rates), "all_rates": rates, "compile_s": compile_s,
            "compiled_bytes": compiled_bytes, "loss": float(metrics["train/loss"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke test)")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated substrings: run only variants whose name has one")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no variant after this many seconds")
    ap.add_argument("--json", default=None, help="where to write the results (default bench/results/gpu.json)")
    args = ap.parse_args(argv)

    start = time.perf_counter()
    device = jax.devices()[0]
    peak = flops.peak_flops(device)
    on_gpu = jax.default_backend() == "gpu"
    rows, results = [], {}
    for name, model, seq, batch in variants(args.tiny):
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        n = flops.param_count(model)
        row = {"variant": name, "params": f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M",
               "tokens": f"{batch}x{seq}"}
        rows.append(row)
        if model.attention_impl in GPU_ONLY and not on_gpu:
            row["tok_s"] = f"skipped ({model.attention_impl} needs a GPU)"
            results[name] = {"skipped": row["tok_s"]}
            continue
        if time.perf_counter() - start > args.budget_s:
            row["tok_s"] = "skipped (time budget)"
            results[name] = {"skipped": row["tok_s"]}
            continue
        try:
            r = run_variant(model, seq, batch, args.steps, args.repeats)
        except Exception as e:  # noqa: BLE001 - an OOM or unsupported kernel is a result, not a crash
            row["tok_s"] = f"failed: {str(e).splitlines()[0][:80]}"
            results[name] = {"error": str(e)[:2000]}
            continue
        per_token = flops.train_flops_per_token(model, seq)
        per_token_global = flops.train_flops_per_token(model, seq, window_aware=False)
        tps = r["tokens_per_s"]
        gib = lambda b: f"{b / 2**30:.1f}" if b else "n/a"  # noqa: E731
        row.update(tok_s=f"{tps:,.0f}", tflops=f"{tps * per_token / 1e12:.3g}",
                   mfu=f"{100 * tps * per_token / peak:.1f}%" if peak else "n/a",
                   mfu_global=f"{100 * tps * per_token_global / peak:.1f}%" if peak else "n/a",
                   mem=gib(r["compiled_bytes"]),
                   compile_s=f"{r['compile_s']:.0f}")
        results[name] = {**r, "seq_len": seq, "batch": batch, "params": n, "flops_per_token": per_token,
                         "flops_per_token_all_global": per_token_global,
                         "mfu": tps * per_token / peak if peak else None, "model": dataclasses.asdict(model)}
    path = common.write_json(args.json or ("gpu_tiny.json" if args.tiny else "gpu.json"),
                             {"peak_flops": peak, "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": results,
                              "wall_s": time.perf_counter() - start})
    print(f"\n{device.device_kind} ({jax.default_backend()}), peak {peak / 1e12 if peak else float('nan'):.1f} "
          f"TFLOP/s; {time.perf_counter() - start:.0f} s in all; {path}")
    print(common.table(rows, [("variant", "variant"), ("params", "params"), ("tokens", "batch x seq"),
                              ("tok_s", "tokens/s"), ("tflops", "TFLOP/s"), ("mfu", "MFU"),
                              ("mfu_global", "MFU all-global"), ("mem", "compiled GiB"),
                              ("compile_s", "compile s")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
