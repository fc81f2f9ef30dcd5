"""Single-GPU benchmark, written for an H200: OLMo-3-shaped models in bfloat16 (float32 master weights and Adam
moments), cuDNN attention (model.attention_impl auto), the real sharded train step; tokens/s and MFU for the head
variants and remat policies; one table; the whole run bounded by --budget-s (default 7 minutes).

    python bench/gpu.py                # on the GPU
    python bench/gpu.py --tiny         # the same variants at toy sizes, on any backend (tests/test_bench.py)

Variants: "1b" is configs/olmo3-1b.yaml (width 2048, 16 layers, 100k vocab, window 4096 of 8192) with 16 heads
x 128 against 8 x 256; "7b-layers" is four of the 7B's own layers (width 4096, 11008) with the two head shapes
the 7B recipe compares, 32 x 128 and 16 x 256 (same parameters and FLOPs); remat none / dots / full on the 1b.
MFU is against the device's dense bf16 peak (olmo3eqx.flops.PEAK_FLOPS), FLOPs window-aware; the all-global
(MaxText) figure beside it. A variant that fails (e.g. out of memory) is reported, not fatal.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

if __name__ == "__main__":
    common.clean_xla_flags()

import jax

from olmo3eqx import flops
from olmo3eqx.config import ModelConfig, load_yaml

REPO = Path(__file__).resolve().parents[1]


def variants(tiny: bool) -> list[tuple[str, ModelConfig, int, int]]:
    """(name, model, seq_len, per-device batch). At --tiny the same structure at toy widths, head_dim 16 vs 32."""
    base = load_yaml(REPO / "configs" / "olmo3-1b.yaml").model
    base = dataclasses.replace(base, compute_dtype="bfloat16", param_dtype="float32", attention_impl="auto")
    seq, batch, narrow, wide = 8192, 4, 128, 256
    seven = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 4}
    if tiny:
        base = dataclasses.replace(base, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   sliding_window=16, eos_token_id=1, pad_token_id=2)
        seq, batch, narrow, wide = 32, 2, 16, 32
        seven = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}

    def model(head_dim: int, remat: str, **over) -> ModelConfig:
        m = dataclasses.replace(base, **over, remat=remat)
        n = m.hidden_size // head_dim
        return dataclasses.replace(m, num_attention_heads=n, num_key_value_heads=n, head_dim=head_dim)

    models = [("1b", model(narrow, "dots")), ("1b", model(wide, "dots")), ("1b", model(narrow, "none")),
              ("1b", model(narrow, "full")), ("7b-layers", model(narrow, "dots", **seven)),
              ("7b-layers", model(wide, "dots", **seven))]
    return [(f"{tag} {m.num_attention_heads}x{m.head_dim} remat={m.remat}", m, seq, batch) for tag, m in models]


def run_variant(model: ModelConfig, seq: int, batch: int, steps: int, repeats: int) -> dict:
    cfg = common.train_config(model, seq, batch)
    t = time.perf_counter()
    step, state, tokens, mask = common.build_step(cfg)
    compiled = step.lower(state, tokens, mask).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    peak_bytes = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
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
    loss = float(metrics["train/loss"])
    return {"tokens_per_s": common.median(rates), "all_rates": rates, "compile_s": compile_s,
            "peak_bytes": peak_bytes, "loss": loss}


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
    rows, results = [], {}
    for name, model, seq, batch in variants(args.tiny):
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        n = flops.param_count(model)
        row = {"variant": name, "params": f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"}
        if time.perf_counter() - start > args.budget_s:
            row["tok_s"] = "skipped (time budget)"
            rows.append(row)
            continue
        try:
            r = run_variant(model, seq, batch, args.steps, args.repeats)
        except Exception as e:  # noqa: BLE001 - an OOM or unsupported kernel is a result, not a crash
            row["tok_s"] = f"failed: {str(e).splitlines()[0][:80]}"
            rows.append(row)
            results[name] = {"error": str(e)[:2000]}
            continue
        per_token = flops.train_flops_per_token(model, seq)
        per_token_global = flops.train_flops_per_token(model, seq, window_aware=False)
        tps = r["tokens_per_s"]
        row.update(tok_s=f"{tps:,.0f}", tflops=f"{tps * per_token / 1e12:.3g}",
                   mfu=f"{100 * tps * per_token / peak:.1f}%" if peak else "n/a",
                   mfu_global=f"{100 * tps * per_token_global / peak:.1f}%" if peak else "n/a",
                   mem=f"{r['peak_bytes'] / 2**30:.1f}" if r["peak_bytes"] else "n/a",
                   compile_s=f"{r['compile_s']:.0f}")
        rows.append(row)
        results[name] = {**r, "seq_len": seq, "batch": batch, "flops_per_token": per_token,
                         "flops_per_token_all_global": per_token_global,
                         "mfu": tps * per_token / peak if peak else None, "model": dataclasses.asdict(model)}
    path = common.write_json(args.json or ("gpu_tiny.json" if args.tiny else "gpu.json"),
                             {"peak_flops": peak, "results": results, "wall_s": time.perf_counter() - start})
    print(f"\n{device.device_kind} ({jax.default_backend()}), peak {peak / 1e12 if peak else float('nan'):.1f} "
          f"TFLOP/s; {time.perf_counter() - start:.0f} s in all; {path}")
    print(common.table(rows, [("variant", "variant"), ("params", "params"),
                              ("tok_s", "tokens/s"), ("tflops", "TFLOP/s"), ("mfu", "MFU"),
                              ("mfu_global", "MFU all-global"), ("mem", "step GiB"), ("compile_s", "compile s")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
