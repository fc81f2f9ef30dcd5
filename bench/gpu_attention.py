"""Attention alone on a GPU, forward + backward of one layer in bfloat16: cuDNN without documents against the
backends that mask packed documents (cuDNN's packed layout, flash in plain JAX, the Pallas GPU kernel), first
checked against "xla" with the segment mask in float32, then timed. Writes one JSON.

    python bench/gpu_attention.py                  # the 1B's layer (16 x 128 heads, 4 x 8192, window 4096) and
                                                   # the 7B stage-3 layer (32 x 128, 1 x 65536)
    python bench/gpu_attention.py --max-runs 16 64 256    # cuDNN's packed kernel built for that many documents a row

Documents: each row cut at --documents - 1 random places (the same packing a "docs" variant of bench/gpu.py feeds).
The check: relative error (||out - ref|| / ||ref||) of the output and of dq, dk, dv against "xla" computed in float32
from the same bfloat16 inputs, for a global and a sliding layer with grouped-query heads, on batches within and beyond
the packed kernel's document count (the second takes flash, decided on the device). Off a GPU only the flash rows
run (a smoke test; tests/test_bench.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

if __name__ == "__main__":
    common.clean_xla_flags()

import jax
import jax.numpy as jnp
import numpy as np

from olmo3eqx import cudnn_packed
from olmo3eqx.attention import attention
from olmo3eqx.data.packed import segment_ids

SHAPES = {"1b": dict(batch=4, seq=8192, heads=16, kv_heads=16, dim=128, window=4096),
          "7b-stage3": dict(batch=1, seq=65536, heads=32, kv_heads=32, dim=128, window=4096)}
TINY = {"tiny": dict(batch=2, seq=256, heads=4, kv_heads=2, dim=32, window=64)}


def packed_ids(batch: int, seq: int, documents: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = [np.diff(np.concatenate([[0], np.sort(rng.choice(np.arange(1, seq), documents - 1, replace=False)),
                                       [seq]])) for _ in range(batch)]
    return segment_ids(np.stack(lengths).astype(np.int32), seq)


def qkv(batch, seq, heads, kv_heads, dim, dtype=jnp.bfloat16, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (batch, seq, heads, dim), dtype), jax.random.normal(kk, (batch, seq, kv_heads, dim),
            dtype), jax.random.normal(kv, (batch, seq, kv_heads, dim), dtype))


def fwd_bwd(impl: str, window, segments):
    """jit(q, k, v, cot -> (out, dq, dk, dv))."""
    def f(q, k, v, cot):
        out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, window=window, impl=impl, segment_ids=segments),
                           q, k, v)
        return (out, *vjp(cot))
    return jax.jit(f)


def check(impl: str, documents: int, window, on_gpu: bool) -> dict:
    """Relative errors of `impl` with packed documents against xla in float32 (GQA, 2 x 2048)."""
    shape = dict(batch=2, seq=2048, heads=8, kv_heads=2, dim=128) if on_gpu else dict(batch=2, seq=128, heads=4,
                                                                                      kv_heads=2, dim=32)
    q, k, v = qkv(**shape)
    cot = jax.random.normal(jax.random.key(9), q.shape, q.dtype)
    seg = jnp.asarray(packed_ids(shape["batch"], shape["seq"], documents))
    got = fwd_bwd(impl, window, seg)(q, k, v, cot)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, cot)]
    want = fwd_bwd("xla", window, seg)(*f32)
    rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))  # noqa: E731
    return {name: rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}


def time_it(impl: str, shape: dict, window, documents: int, repeats: int) -> dict:
    q, k, v = qkv(*(shape[x] for x in ("batch", "seq", "heads", "kv_heads", "dim")))
    cot = jax.random.normal(jax.random.key(9), q.shape, q.dtype)
    seg = None if not documents else jnp.asarray(packed_ids(shape["batch"], shape["seq"], documents))
    f = fwd_bwd(impl, window, seg)
    t = time.perf_counter()
    jax.block_until_ready(f(q, k, v, cot))
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(q, k, v, cot))
        times.append(time.perf_counter() - t)
    return {"ms": 1e3 * common.median(times), "best_ms": 1e3 * min(times), "first_call_s": compile_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="*", default=None, help=f"of {sorted(SHAPES)} (default all; off a GPU: tiny)")
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--max-runs", type=int, nargs="*", default=[cudnn_packed.MAX_RUNS],
                    help="cudnn_packed.MAX_RUNS values to time the packed kernel at")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--backends", nargs="*", default=None, help="time only these (cudnn, flash, pallas)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no timing after this many seconds")
    ap.add_argument("--json", default=None, help="default bench/results/gpu_attention.json")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    results: dict = {"checks": {}, "timings": {}}
    rows = []
    impls = ("cudnn", "flash", "pallas") if on_gpu else ("flash",)
    for impl in () if args.skip_checks else impls:  # correctness first: documents within MAX_RUNS (packed kernel) and beyond it (flash)
        for documents in (5, cudnn_packed.MAX_RUNS + 3) if impl == "cudnn" else (5,):
            for window in (None, 512):
                key = f"{impl} docs={documents} window={window}"
                try:
                    results["checks"][key] = check(impl, documents, window, on_gpu)
                except Exception as e:  # noqa: BLE001 - a kernel that refuses is a result
                    results["checks"][key] = {"error": str(e)[:1500]}
                print(f"check {key}: {results['checks'][key]}", flush=True)
    shapes = {k: SHAPES[k] for k in args.shapes} if args.shapes else (SHAPES if on_gpu else TINY)
    for tag, shape in shapes.items():
        cases = [("cudnn", 0, None)] if on_gpu else []
        cases += [("cudnn", args.documents, m) for m in args.max_runs] if on_gpu else []
        cases += [("flash", args.documents, None)] + ([("pallas", args.documents, None)] if on_gpu else [])
        for impl, documents, max_runs in [c for c in cases if not args.backends or c[0] in args.backends]:
            for layer, window in (("global", None), ("sliding", shape["window"])):
                if impl == "pallas" and window is not None:
                    continue  # the Pallas kernel has no window (sliding layers take flash)
                key = f"{tag} {layer} {impl}" + (f" docs{documents}" if documents else "") + \
                      (f" max_runs={max_runs}" if max_runs else "")
                if time.perf_counter() - start > args.budget_s:
                    results["timings"][key] = {"skipped": "time budget"}
                    continue
                if max_runs:
                    cudnn_packed.MAX_RUNS = max_runs
                try:
                    r = time_it(impl, shape, window, documents, args.repeats)
                except Exception as e:  # noqa: BLE001
                    r = {"error": str(e)[:1500]}
                results["timings"][key] = r
                rows.append({"case": key, "ms": f"{r['ms']:.2f}" if "ms" in r else r["error"].splitlines()[0][:70],
                             "best": f"{r['best_ms']:.2f}" if "ms" in r else "",
                             "first": f"{r['first_call_s']:.1f}" if "ms" in r else ""})
                print(f"{key}: {r}", flush=True)
    path = common.write_json(args.json or "gpu_attention.json", {**results, "shapes": shapes,
                                                                 "wall_s": time.perf_counter() - start})
    print(f"\n{jax.devices()[0].device_kind}; {time.perf_counter() - start:.0f} s; {path}")
    print(common.table(rows, [("case", "layer, backend"), ("ms", "fwd+bwd median ms"), ("best", "best ms"),
                              ("first", "first call s")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
