"""Supervised fine-tuning in miniature: the tiny model (configs/tiny.yaml, byte tokens) trained on a generated
arithmetic chat set ("What is 12+7?" -> "The answer is 19.") once with the loss on the assistant's tokens only (the
label masks `olmo3eqx-prepare chat` writes) and once on every token, then asked held-out questions (sums of pairs
never trained on) through the byte chat template. Prints, per run, the held-out assistant-token loss, the share of
answers in the trained format ("The answer is N." then EOS) and the share that are right.

    python bench/bench_sft.py                     # 60 steps a run (docs/fine-tuning.md says what it printed)
    python bench/bench_sft.py --steps 50 --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"
MAX_OPERAND = 49
"""Questions add two integers in [0, MAX_OPERAND]."""
HELDOUT_EVERY = 10
"""A pair (a, b) is held out when (7a + b) % HELDOUT_EVERY == 0: a tenth of the pairs, never trained on."""
TRAIN_CONVERSATIONS = 4000
HELDOUT_QUESTIONS = 200
SYSTEM_SHARE = 0.3
"""Share of training conversations that open with a system message (the template renders it; nothing is learned
from it)."""
SYSTEM = "Answer in one sentence."
ANSWER = re.compile(r"The answer is (-?\d+)\.")
NEW_TOKENS = 24
"""Most tokens generated per answer ("The answer is 98." and EOS are 18)."""


def pairs(held_out: bool) -> list[tuple[int, int]]:
    return [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)
            if ((7 * a + b) % HELDOUT_EVERY == 0) == held_out]


def conversation(a: int, b: int, system: bool) -> dict:
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    return {"messages": messages + [{"role": "user", "content": f"What is {a}+{b}?"},
                                    {"role": "assistant", "content": f"The answer is {a + b}."}]}


def train_rows(n: int = TRAIN_CONVERSATIONS, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    train = pairs(held_out=False)
    picks = rng.integers(0, len(train), n)
    return [conversation(*train[i], bool(rng.random() < SYSTEM_SHARE)) for i in picks]


def heldout_pairs(n: int = HELDOUT_QUESTIONS, seed: int = 1) -> list[tuple[int, int]]:
    held = pairs(held_out=True)
    rng = np.random.default_rng(seed)
    return [held[i] for i in rng.choice(len(held), min(n, len(held)), replace=False)]


def prepare(out: Path, n: int = TRAIN_CONVERSATIONS) -> dict:
    from olmo3eqx.data.chat import prepare_chat

    src = out / "arithmetic.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in train_rows(n)))
    return prepare_chat([str(src)], tokenizer="bytes", out=out / "sft", progress=False)


def run_config(out: Path, name: str, steps: int, masks: bool, overrides: dict | None = None) -> Path:
    """configs/tiny.yaml on the prepared files, packed, with or without the label masks; no evaluation."""
    cfg = yaml.safe_load(TINY.read_text())
    cfg["run"] = {"name": name, "dir": str(out / "runs"), "seed": 0}
    cfg["steps"] = steps
    cfg["data"] |= {"paths": [str(out / "sft" / "token_ids_part_*.npy")], "packing": True,
                    "cache_dir": str(out / "cache"),
                    "label_mask_paths": [str(out / "sft" / "labels_mask_part_*.npy")] if masks else []}
    cfg["optim"] |= {"warmup_steps": max(1, steps // 10)}
    cfg["eval"] = {"every": 0, "samples": []}
    cfg["checkpoint"] = {"every": steps}
    cfg["log"] = {"every": 10, "tensorboard": False}  # metrics.jsonl is what is read back
    for key, value in (overrides or {}).items():
        cfg.setdefault(key, {}).update(value) if isinstance(value, dict) else cfg.__setitem__(key, value)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(config: Path) -> list[dict]:
    from olmo3eqx.train import main

    if main(["--config", str(config)]) != 0:
        raise SystemExit(f"training {config} failed")
    cfg = yaml.safe_load(config.read_text())
    log = Path(cfg["run"]["dir"]) / cfg["run"]["name"] / "metrics.jsonl"
    return [r for r in map(json.loads, log.read_text().splitlines()) if "train/loss" in r]


def assistant_loss(model, chat, questions: list[tuple[int, int]]) -> float:
    """Mean cross-entropy of the held-out conversations' labelled (assistant) tokens."""
    import jax
    import jax.numpy as jnp

    from olmo3eqx.data.prepare import BYTE_PAD

    encoded = [chat.tokenize(conversation(a, b, False)["messages"]) for a, b in questions]
    width = max(ids.size for ids, _ in encoded)
    tokens = np.full((len(encoded), width), BYTE_PAD, np.int32)
    mask = np.zeros((len(encoded), width), bool)
    for row, (ids, m) in enumerate(encoded):
        tokens[row, :ids.size], mask[row, :ids.size] = ids, m
    logp = jax.nn.log_softmax(model(jnp.asarray(tokens)).astype(jnp.float32), axis=-1)[:, :-1]
    picked = jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:, None]), axis=-1)[..., 0]
    return float(-(picked * mask[:, 1:]).sum() / mask[:, 1:].sum())


def ask(model, chat, questions: list[tuple[int, int]]) -> dict:
    """Greedy answers to the held-out questions: the shares in the trained format and right."""
    from olmo3eqx.generate import generate
    from olmo3eqx.tasks import Tokenizer

    prompts = [chat.encode(conversation(a, b, False)["messages"][:1], add_generation_prompt=True)
               for a, b in questions]
    done = generate(model, prompts, max_new_tokens=NEW_TOKENS, decode=Tokenizer.load("bytes").decode)
    formatted = [c.finish == "eos" and ANSWER.fullmatch(c.text) is not None for c in done]
    right = [f and int(ANSWER.fullmatch(c.text)[1]) == a + b for f, c, (a, b) in zip(formatted, done, questions)]
    return {"format_rate": float(np.mean(formatted)), "correct_rate": float(np.mean(right)),
            "examples": [f"What is {a}+{b}? -> {c.text!r} ({c.finish})"
                         for (a, b), c in list(zip(questions, done))[:3]]}


def evaluate(run_dir: Path, questions: list[tuple[int, int]]) -> dict:
    from olmo3eqx.checkpoint.model import load_model
    from olmo3eqx.data.chat import ChatTokenizer

    model, _ = load_model(str(run_dir))
    chat = ChatTokenizer("bytes")
    return {"heldout_assistant_loss": assistant_loss(model, chat, questions)} | ask(model, chat, questions)


RUNS = {"assistant-only": True, "all-tokens": False}
"""The runs compared: name -> whether the loss is on the assistant's tokens only (the label masks)."""


def miniature(out: Path, steps: int, questions: int = HELDOUT_QUESTIONS, conversations: int = TRAIN_CONVERSATIONS,
              overrides: dict | None = None, runs: tuple[str, ...] = tuple(RUNS)) -> dict:
    """The runs on one prepared set; {run: {first/last train loss, seconds, held-out results}}."""
    meta = prepare(out, conversations)
    held = heldout_pairs(questions)
    results = {"prepared": {k: meta[k] for k in ("conversations", "tokens", "labelled_tokens")}}
    for name in runs:
        masks = RUNS[name]
        t0 = time.perf_counter()
        losses = train(run_config(out, name, steps, masks, overrides))
        seconds = time.perf_counter() - t0
        results[name] = {"steps": steps, "first_loss": losses[0]["train/loss"], "last_loss": losses[-1]["train/loss"],
                         "train_seconds": round(seconds, 1)} | evaluate(out / "runs" / name, held)
    return results


def table(results: dict) -> str:
    lines = ["| run | steps | train/loss first -> last | held-out assistant loss | format | right | s |",
             "|---|---|---|---|---|---|---|"]
    for name in (n for n in RUNS if n in results):
        r = results[name]
        lines.append(f"| {name} | {r['steps']} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} | "
                     f"{r['heldout_assistant_loss']:.3f} | {r['format_rate']:.1%} | {r['correct_rate']:.1%} | "
                     f"{r['train_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="training steps of each run")
    p.add_argument("--questions", type=int, default=HELDOUT_QUESTIONS, help="held-out questions asked")
    p.add_argument("--out", default="runs/bench_sft", help="working directory (prepared data, runs)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; give another --out or delete it.")
    out.mkdir(parents=True, exist_ok=True)
    results = miniature(out, args.steps, args.questions)
    print(json.dumps(results["prepared"]))
    for name in RUNS:
        print(name, *results[name]["examples"], sep="\n  ")
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
