"""Generation benchmark: time to first token and decode tokens/s of olmo3eqx.generate against `transformers`'
generate on the same model (the same weights, converted with save_hf), greedy, float32, on this CPU; and the KV
cache of the 7B at 8K and 65K tokens.

    python bench/bench_generate.py [--configs tiny,small] [--batches 1,16] [--prompt 64] [--new 128] [--repeats 3]

Each contender generates once untimed (compiles), then `--repeats` interleaved timed rounds: max_new_tokens=1
(prefill and the first token: time to first token) and max_new_tokens=--new; decode tokens/s is batch x (new - 1)
over the difference. EOS is disabled on both sides so every row makes --new tokens. Ours runs with chunk 16
(16 decode steps per device program, what `generate` uses for batches) and chunk 1 (one program per token, what
the CLI streams with). torch runs with as many threads as the machine has cores, XLA as olmo3eqx-generate starts it
(jaxenv.SPEAKING_XLA_FLAGS: the memory-minimising scheduler).
Prints a table and writes bench/results/generate.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import common

from olmo3eqx import jaxenv

common.clean_xla_flags()
jaxenv.prepare_speaking(common.os.environ)  # XLA started as olmo3eqx-generate starts it

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench_step import bench_configs  # noqa: E402
from olmo3eqx import decode as dec  # noqa: E402
from olmo3eqx.config import ModelConfig  # noqa: E402
from olmo3eqx.generate import generate  # noqa: E402
from olmo3eqx.model import init_model  # noqa: E402


def cache_table() -> list[dict]:
    """The 7B's cache per sequence (bfloat16), against one that kept every column on every layer."""
    cfg = dataclasses.replace(ModelConfig(), compute_dtype="bfloat16")
    rows = []
    for length in (8192, 65536):
        ours = dec.cache_bytes(cfg, 1, length)
        full = dataclasses.replace(cfg, sliding_window=length)
        rows.append({"tokens": length, "cache_gib": ours / 2**30, "all_full_gib": dec.cache_bytes(full, 1, length)
                     / 2**30})
    return rows


def time_ours(model, prompts, new: int, chunk: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    generate(model, prompts, max_new_tokens=1, eos_id=-1, chunk=chunk)
    t1 = time.perf_counter()
    generate(model, prompts, max_new_tokens=new, eos_id=-1, chunk=chunk)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def time_torch(ref, ids, new: int) -> tuple[float, float]:
    import torch

    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0,
                  temperature=None, top_p=None, top_k=None, use_cache=True)
    with torch.no_grad():
        t0 = time.perf_counter()
        ref.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        t1 = time.perf_counter()
        ref.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=128, help="new tokens per row")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import torch
    import transformers

    from olmo3eqx.hf import save_hf

    torch.set_num_threads(max(1, common.os.cpu_count() or 1))
    configs = bench_configs()
    results = {"machine": common.machine(), "args": vars(args), "rows": [], "cache_7b": cache_table()}
    for name in args.configs.split(","):
        model_cfg = dataclasses.replace(configs[name][0], param_dtype="float32", compute_dtype="float32",
                                        max_position_embeddings=max(configs[name][0].max_position_embeddings,
                                                                    args.prompt + args.new + 16))
        model = init_model(model_cfg, jax.random.key(0))
        with tempfile.TemporaryDirectory() as tmp:
            save_hf(model, model_cfg, Path(tmp))
            ref = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        for batch in (int(b) for b in args.batches.split(",")):
            rng = np.random.default_rng(batch)
            prompts = rng.integers(0, 256, (batch, args.prompt)).tolist()
            ids = torch.tensor(prompts)
            contenders = {"olmo3eqx chunk 16": lambda: time_ours(model, prompts, args.new, 16),
                          "olmo3eqx chunk 1": lambda: time_ours(model, prompts, args.new, 1),
                          "transformers": lambda: time_torch(ref, ids, args.new)}
            for run in contenders.values():
                run()  # compile / warm up
            times = {k: [] for k in contenders}
            for _ in range(args.repeats):
                for k, run in contenders.items():
                    times[k].append(run())
            for k, ts in times.items():
                ttft = common.median([t[0] for t in ts])
                decode = common.median([t[1] - t[0] for t in ts])
                row = {"config": name, "batch": batch, "contender": k, "ttft_ms": 1e3 * ttft,
                       "decode_tokens_per_s": batch * (args.new - 1) / decode,
                       "total_tokens_per_s": batch * args.new / common.median([t[1] for t in ts])}
                results["rows"].append(row)
                print(f"{name:<6} batch {batch:>3}  {k:<18} ttft {row['ttft_ms']:8.1f} ms  decode "
                      f"{row['decode_tokens_per_s']:9.1f} tokens/s  (whole generation {row['total_tokens_per_s']:8.1f})",
                      flush=True)
    print()
    print(f"{'config':<6} {'batch':>5}  {'contender':<18} {'TTFT ms':>9} {'decode tok/s':>13} {'vs transformers':>16}")
    for r in results["rows"]:
        ref_row = next(x for x in results["rows"] if x["config"] == r["config"] and x["batch"] == r["batch"]
                       and x["contender"] == "transformers")
        ratio = r["decode_tokens_per_s"] / ref_row["decode_tokens_per_s"]
        print(f"{r['config']:<6} {r['batch']:>5}  {r['contender']:<18} {r['ttft_ms']:9.1f} "
              f"{r['decode_tokens_per_s']:13.1f} {ratio:15.2f}x")
    print()
    for r in results["cache_7b"]:
        print(f"7B KV cache, bfloat16, one sequence of {r['tokens']:>6} tokens: {r['cache_gib']:.2f} GiB "
              f"(sliding layers bounded by their 4096-token window; all 32 layers full would be "
              f"{r['all_full_gib']:.2f} GiB)")
    print(f"wrote {common.write_json('generate.json', results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
