"""Attention alone, forward + backward of one layer: olmo3eqx.attention's backends against torch's
scaled_dot_product_attention (causal flag for a global layer, a boolean band mask for a sliding one, as
`transformers` passes it), float32, the tiny config's shapes by default.

    python bench/bench_attention.py [--batch 16 --seq 256 --heads 4 --dim 64 --window 64] [--repeats 15]
    python bench/bench_attention.py --lengths 2048 4096 8192 16384 32768 65536 [--heads 4 --kv-heads 1 --dim 128
                                    --window 4096 --documents 4 --block 512] [--max-gib 12] [--repeats 3]

Interleaved repeats, median and best; prints a table last and writes bench/results/attention.json.

--lengths: one row per length and backend (flash, blocked, xla), batch 1, a global and a sliding layer: the
compiled forward+backward's memory (XLA's memory analysis: temporaries, the part that grows with the scores) and
its time, packed with `--documents` equal documents per row (segment ids). A compile whose memory exceeds
--max-gib is reported and not run. Writes bench/results/attention_lengths.json.
"""

from __future__ import annotations

import argparse
import os
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

from olmo3eqx.attention import attention


def jax_fn(impl: str, window: int | None, q, k, v):
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, window=window, impl=impl) ** 2),
                            argnums=(0, 1, 2)))
    return lambda: jax.block_until_ready(grad(q, k, v))


def torch_fn(window: int | None, q, k, v):
    import torch

    torch.set_num_threads(os.cpu_count())
    tq, tk, tv = (torch.tensor(np.asarray(x)).transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    seq = q.shape[1]
    mask = None
    if window is not None:
        i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
        mask = (j <= i) & (i - j < window)

    def run():
        for t in (tq, tk, tv):
            t.grad = None
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, is_causal=mask is None)
        (out**2).sum().backward()

    return run


def lengths_sweep(args) -> int:
    from olmo3eqx.flash import DEFAULT_BLOCK

    rows, results = [], {}
    load_before = os.getloadavg()
    for seq in args.lengths:
        keys = jax.random.split(jax.random.key(seq), 3)
        shapes = [(1, seq, args.heads, args.dim)] + [(1, seq, args.kv_heads, args.dim)] * 2
        q, k, v = (jax.random.normal(key, shape) for key, shape in zip(keys, shapes))
        seg = jnp.asarray(np.repeat(np.arange(args.documents), -(-seq // args.documents))[None, :seq], jnp.int32)
        for layer, window in (("global", None), ("sliding", args.window)):
            for impl in ("flash", "blocked", "xla"):
                block = args.block if impl == "flash" else None
                fn = jax.jit(jax.grad(lambda q, k, v, s, impl=impl, window=window, block=block: jnp.sum(attention(
                    q, k, v, window=window, impl=impl, segment_ids=s, block_q=block, block_kv=block) ** 2),
                    argnums=(0, 1, 2)))
                t = time.perf_counter()
                compiled = fn.lower(q, k, v, seg).compile()
                compile_s = time.perf_counter() - t
                mem = compiled.memory_analysis()
                temp = mem.temp_size_in_bytes / 2**30
                row = {"seq": seq, "layer": layer, "impl": impl, "temp": f"{temp:.3f}", "compile": f"{compile_s:.1f}",
                       "median": "not run", "best": ""}
                result = {"temp_gib": temp, "compile_s": compile_s}
                if temp <= args.max_gib:
                    jax.block_until_ready(compiled(q, k, v, seg))
                    times = []
                    for _ in range(args.repeats):
                        t = time.perf_counter()
                        jax.block_until_ready(compiled(q, k, v, seg))
                        times.append(time.perf_counter() - t)
                    row.update(median=f"{1e3 * common.median(times):.0f}", best=f"{1e3 * min(times):.0f}")
                    result["seconds"] = times
                else:
                    row["median"] = f"not run (> {args.max_gib} GiB)"
                results[f"{seq}/{layer}/{impl}"] = result
                rows.append(row)
                print(row, flush=True)
    load_after = os.getloadavg()
    path = common.write_json("attention_lengths.json", {"args": vars(args), "results": results,
                                                        "load_before": load_before, "load_after": load_after})
    print(f"\nattention forward+backward at batch 1 x {args.heads} heads ({args.kv_heads} kv) x {args.dim}, window "
          f"{args.window}, {args.documents} documents per row, flash blocks {args.block or DEFAULT_BLOCK}; float32; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; {path}")
    print(common.table(rows, [("seq", "tokens"), ("layer", "layer"), ("impl", "backend"), ("temp", "temp GiB"),
                              ("compile", "compile s"), ("median", "median ms"), ("best", "best ms")]))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="*", default=None)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--documents", type=int, default=4)
    ap.add_argument("--block", type=int, default=None)
    ap.add_argument("--max-gib", type=float, default=12.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    if args.lengths:
        return lengths_sweep(args)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (args.batch, args.seq, args.heads, args.dim)) for key in keys)
    rows, results = [], {}
    load_before = os.getloadavg()
    for layer, window in (("sliding", args.window), ("global", None)):
        fns = {"olmo3eqx blocked": jax_fn("blocked", window, q, k, v), "olmo3eqx flash": jax_fn("flash", window, q, k, v),
               "olmo3eqx xla": jax_fn("xla", window, q, k, v),
               "torch sdpa": torch_fn(window, q, k, v)}
        for f in fns.values():
            f()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, f in fns.items():
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
        ref = common.median(times["torch sdpa"])
        for name, ts in times.items():
            results[f"{layer}/{name}"] = ts
            rows.append({"layer": layer, "impl": name, "median": f"{1e3 * common.median(ts):.1f}",
                         "best": f"{1e3 * min(ts):.1f}", "vs": f"{ref / common.median(ts):.2f}x"})
    load_after = os.getloadavg()
    path = common.write_json("attention.json", {"args": vars(args), "seconds": results, "load_before": load_before,
                                                "load_after": load_after})
    print(f"\nattention forward+backward, batch {args.batch} x seq {args.seq} x {args.heads} heads x {args.dim}, "
          f"window {args.window}; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; {path}")
    print(common.table(rows, [("layer", "layer"), ("impl", "implementation"), ("median", "median ms"),
                              ("best", "best ms"), ("vs", "speed vs torch")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
