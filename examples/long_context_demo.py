"""A tiny stage 3 on this CPU: configs/tiny.yaml's model trained at its stage-1 length, then extended to 4x that length
with packed documents, document masking and YaRN on the full-attention layers (from the stage-1 checkpoint, weights
and moments), as configs/olmo3-7b-stage3.yaml extends the 7B. Prints the held-out loss at the long and the short
length before (the stage-1 model as trained, and the same weights with YaRN switched on) and after the extension.

    python examples/long_context_demo.py [--out runs/long-context-demo] [--stage1-steps 80] [--stage3-steps 40]
                                         [--long 4096] [--control]

--long: stage 3's length (a power of two: OLMo-core's packer), 16x stage 1's by default, one packed instance per
step (the same 4,096 tokens per step as stage 1); YaRN's factor is long / 256. Attention at that length uses the
flash backend ("auto" with packed documents): memory linear in the sequence.

--control also continues stage 1 for as many steps at 256 with the same tokens per step and schedule, plain
RoPE, no packing: what the same compute buys without the extension.

Both stages run through train.py; the held-out set is the embedded corpus's held-out split (contiguous windows of
byte tokens that cross documents, so long-range context helps), the same instances for every model.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHORT = 256
"""configs/tiny.yaml's seq_len: the stage-1 length."""
LONG = 16 * SHORT
"""Stage 3's default length (--long)."""
TOKENS_PER_STEP = 16 * SHORT
HELDOUT_TOKENS = 65536
"""Held-out tokens scored at each length (the same tokens, cut into long or short windows)."""


def train(out: Path, name: str, flags: list[str]) -> None:
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs" / "tiny.yaml"),
           "--run.dir", str(out), "--run.name", name, "--eval.every", "100000", "--log.every", "20", *flags]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)


def continue_flags(out: Path, steps: int) -> list[str]:
    """From the stage-1 checkpoint (weights and moments): warmup then linear to 0, one checkpoint at the end."""
    return ["--steps", str(steps), "--init-from", str(out / "stage1" / "checkpoints"), "--init-optimizer",
            "--optim.lr", "1e-3", "--optim.warmup-steps", "10", "--optim.schedule", "linear",
            "--optim.final-lr-ratio", "0", "--checkpoint.every", str(steps)]


def stage3_flags(out: Path, steps: int, long: int) -> list[str]:
    factor = long / SHORT
    return continue_flags(out, steps) + [
        "--data.packing", "--data.seq-len", str(long), "--data.global-batch", str(max(1, TOKENS_PER_STEP // long)),
        "--model.max-position-embeddings", str(long), "--model.rope-scaling.rope-type", "yarn",
        "--model.rope-scaling.factor", str(factor),
        "--model.rope-scaling.original-max-position-embeddings", str(SHORT),
        "--model.rope-scaling.attention-factor", str(0.1 * math.log(factor) + 1)]


def heldout_loss(model, seq_len: int) -> float:
    """Mean next-token cross-entropy (nats per token) of `model` over the first HELDOUT_TOKENS held-out tokens."""
    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np

    from olmo3eqx.config import DataConfig
    from olmo3eqx.data import TokenSource, heldout_files
    from olmo3eqx.loss import label_weights, loss_sums

    source = TokenSource(heldout_files(DataConfig()), seq_len=seq_len, vocab_size=model.cfg.vocab_size)
    tokens = jnp.asarray(source.read(np.arange(HELDOUT_TOKENS // seq_len)))
    weights = label_weights(tokens, jnp.ones(tokens.shape[0]))
    ce, _ = eqx.filter_jit(loss_sums)(model, tokens, weights, 0.0)
    return float(ce / jnp.sum(weights))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "long-context-demo")
    parser.add_argument("--stage1-steps", type=int, default=80)
    parser.add_argument("--stage3-steps", type=int, default=40)
    parser.add_argument("--long", type=int, default=LONG, help="stage 3's length (a power of two, > 256)")
    parser.add_argument("--control", action="store_true", help="also continue stage 1 at 256 as long")
    args = parser.parse_args(argv)
    if args.long <= SHORT or args.long & (args.long - 1) or HELDOUT_TOKENS % args.long:
        parser.error(f"--long must be a power of two above {SHORT} and at most {HELDOUT_TOKENS}, got {args.long}")
    factor = args.long // SHORT
    train(args.out, "stage1", ["--steps", str(args.stage1_steps), "--checkpoint.every", str(args.stage1_steps)])
    train(args.out, "stage3", stage3_flags(args.out, args.stage3_steps, args.long))
    if args.control:
        train(args.out, "control", continue_flags(args.out, args.stage3_steps))

    from olmo3eqx import checkpoint

    stage1, cfg1 = checkpoint.load_model(args.out / "stage1" / "checkpoints")
    stage3, cfg3 = checkpoint.load_model(args.out / "stage3" / "checkpoints")
    yarn_only = dataclasses.replace(stage1, cfg=cfg3)  # stage-1 weights, stage 3's RoPE scaling and length
    rows = [("stage 1 (plain RoPE, trained at 256)", stage1),
            (f"stage 1 weights + YaRN x{factor}, no training", yarn_only),
            (f"stage 3 ({args.stage3_steps} steps at {args.long}, packed, YaRN x{factor})", stage3)]
    if args.control:
        rows.append((f"control: stage 1 + {args.stage3_steps} steps at {SHORT}, plain RoPE",
                     checkpoint.load_model(args.out / "control" / "checkpoints")[0]))
    print(f"\nheld-out loss (nats/token, {HELDOUT_TOKENS:,} held-out tokens of the default corpus)")
    print(f"| model | at {args.long} (long) | at {SHORT} (short) |")
    print("|---|---|---|")
    for name, model in rows:
        print(f"| {name} | {heldout_loss(model, args.long):.4f} | {heldout_loss(model, SHORT):.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
