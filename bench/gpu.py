"""Single-GPU benchmark for an H100/H200: tokens/s, MFU and memory of the real train step (bfloat16 compute, float32
master weights and Adam moments) for OLMo-3-shaped models, cuDNN flash attention against the window-aware blocked
einsums, the flash backend in plain JAX and JAX's Pallas GPU kernel, with and without packed documents, and the two
head shapes of equal parameters and FLOPs. Writes one JSON.

    python bench/gpu.py                       # on the GPU: bench/results/gpu.json
    python bench/gpu.py --only "1b 16x128 cudnn" --profile 3 --compiler-option xla_gpu_enable_triton_gemm=false
    python bench/gpu.py --tiny                # toy sizes on any backend (tests/test_bench.py)

Variants (attention cudnn, blocked, flash and pallas; "docs": packed rows of --documents documents each, segment ids
masking attention to each document, as data.packing's batches):
- "tiny": configs/tiny.yaml's model (3.4M, seq 256, batch 16);
- "1b": configs/olmo3-1b.yaml (width 2048, 16 layers, window 4096 of 8192, batch 4) with 16 x 128 and 8 x 256 heads;
- "7b-2l": two of the 7B's layers, one sliding and one global (width 4096, MLP 11008, 100k vocabulary, batch 4 x
  8192), with the 7B recipe's 32 x 128 and 16 x 256 heads.
The step runs over --batches different random batches in turn (one batch repeated is memorised within steps, which
says nothing of speed but makes the printed loss meaningless). MFU is against the device's dense bf16 peak
(olmo3eqx.flops.PEAK_FLOPS), FLOPs window-aware, the all-global (MaxText) figure beside it; packed documents are
counted as the model's FLOPs (the attention a document mask skips is not subtracted). Memory: XLA's compiled memory
analysis of the step. The XLA GPU flags train.py applies (olmo3eqx.jaxenv) are applied here too unless XLA_FLAGS is
set; --compiler-option adds XLA options to the step's compile. --profile N traces N steps of each variant with
jax.profiler and sums the GPU's kernel time by kind (matmuls, attention, fusions, copies) and by kernel. A variant
that fails (out of memory, an unsupported kernel, a refusal) is a result, not a crash; cudnn and pallas variants
are skipped off GPU; no variant starts after --budget-s.
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


DOCUMENT_ATTENTION = ("cudnn", "flash", "pallas")
"""Backends that take packed documents ("docs" variants); blocked can, but its global layers keep quadratic scores."""


def variants(tiny: bool, layers_7b: int = 2) -> list[tuple[str, ModelConfig, int, int, bool]]:
    """(name, model, seq_len, per-device batch, packed) for every variant, in the order they run."""
    small = load_yaml(REPO / "configs" / "tiny.yaml").model
    one_b = load_yaml(REPO / "configs" / "olmo3-1b.yaml").model
    seven_full = load_yaml(REPO / "configs" / "olmo3-7b-stage1.yaml").model
    seven = dataclasses.replace(seven_full, num_hidden_layers=layers_7b,
                                layer_types=seven_full.resolved_layer_types[:layers_7b] if layers_7b > 2
                                else (SLIDING, FULL))
    tag7 = f"7b-{layers_7b}l"
    shapes = {"tiny": (small, 256, 16, (small.head_dim,)), "1b": (one_b, 8192, 4, (128, 256)),
              tag7: (seven, 8192, 4, (128, 256))}
    if tiny:  # the same structure at toy widths: windows shorter than the sequence, two head shapes
        toy = dict(vocab_size=512, intermediate_size=128, sliding_window=16, eos_token_id=1, pad_token_id=2)
        shapes = {"tiny": (dataclasses.replace(small, **toy, hidden_size=32, num_hidden_layers=2), 32, 2, (16,)),
                  "1b": (dataclasses.replace(one_b, **toy, hidden_size=64, num_hidden_layers=4), 32, 2, (16, 32)),
                  tag7: (dataclasses.replace(seven, **toy, hidden_size=64), 32, 2, (16, 32))}
    out = []
    for tag, (base, seq, batch, head_dims) in shapes.items():
        for head_dim in head_dims:
            heads = base.hidden_size // head_dim
            for impl in ATTENTION:
                for packed in (False, True) if impl in DOCUMENT_ATTENTION else (False,):
                    m = dataclasses.replace(base, num_attention_heads=heads, num_key_value_heads=heads,
                                            head_dim=head_dim, compute_dtype="bfloat16", param_dtype="float32",
                                            attention_impl=impl, remat="dots")
                    out.append((f"{tag} {heads}x{head_dim} {impl}" + (" docs" if packed else ""), m, seq, batch,
                                packed))
    return out


def run_variant(model: ModelConfig, seq: int, batch: int, steps: int, repeats: int, packed: bool = False,
                documents: int = 8, batches: int = 4, compiler_options: dict | None = None,
                profile_steps: int = 0) -> dict:
    cfg = common.train_config(model, seq, batch, packing=packed)
    t = time.perf_counter()
    step, state, layout = common.build_run(cfg)
    data = common.random_batches(cfg, layout, batches, documents)
    compiled = step.lower(state, *data[0]).compile(compiler_options=compiler_options or None)
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    compiled_bytes = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                               - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    for i in range(2):
        state, metrics = compiled(state, *data[i % batches])
    jax.block_until_ready(metrics)
    rates, n = [], 0
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, *data[n % batches])
            n += 1
        jax.block_until_ready((state, metrics))
        rates.append(steps * seq * batch / (time.perf_counter() - t))
    out = {"tokens_per_s": common.median(rates), "all_rates": rates, "compile_s": compile_s,
           "compiled_bytes": compiled_bytes, "loss": float(metrics["train/loss"]), "packed": packed,
           "documents": documents if packed else None, "compiler_options": compiler_options or {}}
    if profile_steps:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            jax.profiler.start_trace(tmp)
            t = time.perf_counter()
            for _ in range(profile_steps):
                state, metrics = compiled(state, *data[n % batches])
                n += 1
            jax.block_until_ready((state, metrics))
            traced_s = time.perf_counter() - t
            jax.profiler.stop_trace()
            out["profile"] = kernel_profile(Path(tmp), profile_steps, traced_s)
    return out


KERNEL_KINDS = (
    ("attention (cuDNN)", ("cudnn", "fmha", "flash_fprop", "flash_bprop", "sdpa")),
    ("attention (Pallas/Triton)", ("mha", "pallas")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "sm90_", "sm80_", "nvjet", "matmul", "dot")),
    ("copy/transpose", ("memcpy", "memset", "copy", "transpose", "dynamic_update_slice", "dynamic-update-slice")),
    ("reduction fusion", ("reduce", "reduction")),
    ("elementwise/loop fusion", ("fusion", "loop_", "input_", "triton", "wrapped_")),
)
"""How kernel names are grouped (the first kind whose substrings match the lower-cased name)."""


def kernel_profile(trace_dir: Path, steps: int, wall_s: float) -> dict:
    """GPU kernel time per step from a jax.profiler trace: by kind (KERNEL_KINDS), the top kernels by name, the time
    the GPU ran any kernel (busy) against the wall time of the traced steps."""
    import collections
    import gzip
    import json

    traces = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not traces:
        return {"error": f"no trace under {trace_dir}"}
    events = json.loads(gzip.open(traces[-1]).read()).get("traceEvents", [])
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {pid for pid, name in names.items() if "gpu" in name.lower() and "/device:" in name.lower()}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]
    if not kernels:  # say what the trace held instead, to read by hand
        seen = collections.Counter(f"{names.get(e.get('pid'), e.get('pid'))}: {e['name']}" for e in events
                                   if e.get("ph") == "X")
        return {"error": "no GPU kernel events", "processes": sorted(map(str, names.values())),
                "events": dict(seen.most_common(30))}
    by_name, by_kind = collections.Counter(), collections.Counter()
    for e in kernels:
        name = e["name"]
        by_name[name] += e["dur"]
        low = name.lower()
        by_kind[next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")] += e["dur"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, end = 0.0, -1.0
    for a, b in spans:  # the union of kernel intervals: time the GPU ran anything
        if b > end:
            busy += b - max(a, end)
            end = b
    per_step = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731 - ms per step
    return {"wall_ms_per_step": round(wall_s * 1e3 / steps, 3), "busy_ms_per_step": per_step(busy),
            "kernel_ms_per_step": per_step(sum(by_kind.values())), "kernels_per_step": len(kernels) // steps,
            "by_kind_ms": {k: per_step(v) for k, v in by_kind.most_common()},
            "top_kernels_ms": {k[:160]: per_step(v) for k, v in by_name.most_common(25)},
            "device_processes": sorted(names[p] for p in gpu)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke test)")
    ap.add_argument("--steps", type=int, default=5, help="steps per timed repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated names: run only variants whose name has one of them "
                    "(a trailing '$' asks for the name exactly)")
    ap.add_argument("--documents", type=int, default=8, help="documents per row in the 'docs' variants")
    ap.add_argument("--batches", type=int, default=4, help="different random batches the step cycles through")
    ap.add_argument("--remat", default=None, help="model.remat for every variant (default: each variant's, dots)")
    ap.add_argument("--per-device-batch", type=int, default=None, help="rows per step instead of each variant's")
    ap.add_argument("--layers-7b", type=int, default=2, help="layers of the 7B-shaped variants")
    ap.add_argument("--compiler-option", action="append", default=[], metavar="NAME=VALUE",
                    help="an XLA option for the step's compile (repeatable), e.g. xla_gpu_enable_triton_gemm=false")
    ap.add_argument("--max-runs", type=int, default=None, help="documents a row cuDNN's packed kernel is built for "
                    "(olmo3eqx.cudnn_packed.MAX_RUNS)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS", help="trace this many steps per variant")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no variant after this many seconds")
    ap.add_argument("--json", default=None, help="where to write the results (default bench/results/gpu.json)")
    args = ap.parse_args(argv)
    options = {k: {"true": True, "false": False}.get(v.lower(), v)
               for k, v in (o.split("=", 1) for o in args.compiler_option)}
    if args.max_runs:
        from olmo3eqx import cudnn_packed

        cudnn_packed.MAX_RUNS = args.max_runs

    start = time.perf_counter()
    device = jax.devices()[0]
    peak = flops.peak_flops(device)
    on_gpu = jax.default_backend() == "gpu"
    rows, results = [], {}
    for name, model, seq, batch, packed in variants(args.tiny, args.layers_7b):
        if args.only and not any(name == s[:-1] if s.endswith("$") else s in name for s in args.only.split(",")):
            continue
        if args.remat:
            model = dataclasses.replace(model, remat=args.remat)
        batch = args.per_device_batch or batch
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
            r = run_variant(model, seq, batch, args.steps, args.repeats, packed, args.documents, args.batches,
                            options, args.profile)
        except Exception as e:  # noqa: BLE001 - an OOM, unsupported kernel or refusal is a result, not a crash
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
                   mem=gib(r["compiled_bytes"]), compile_s=f"{r['compile_s']:.0f}", loss=f"{r['loss']:.3f}")
        results[name] = {**r, "seq_len": seq, "batch": batch, "params": n, "flops_per_token": per_token,
                         "flops_per_token_all_global": per_token_global,
                         "mfu": tps * per_token / peak if peak else None, "model": dataclasses.asdict(model)}
    path = common.write_json(args.json or ("gpu_tiny.json" if args.tiny else "gpu.json"),
                             {"peak_flops": peak, "xla_flags": os.environ.get("XLA_FLAGS", ""), "results": results,
                              "argv": sys.argv[1:] if argv is None else argv, "wall_s": time.perf_counter() - start})
    print(f"\n{device.device_kind} ({jax.default_backend()}), peak {peak / 1e12 if peak else float('nan'):.1f} "
          f"TFLOP/s; {time.perf_counter() - start:.0f} s in all; {path}")
    print(common.table(rows, [("variant", "variant"), ("params", "params"), ("tokens", "batch x seq"),
                              ("tok_s", "tokens/s"), ("tflops", "TFLOP/s"), ("mfu", "MFU"),
                              ("mfu_global", "MFU all-global"), ("mem", "compiled GiB"),
                              ("compile_s", "compile s"), ("loss", "last loss")]))
    for name, r in results.items():
        if "profile" in r:
            print(f"\n{name}: GPU kernel time per step by kind (ms): {r['profile'].get('by_kind_ms')}; "
                  f"busy {r['profile'].get('busy_ms_per_step')} of {r['profile'].get('wall_ms_per_step')} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
