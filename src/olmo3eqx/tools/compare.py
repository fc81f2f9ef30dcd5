"""Compare two runs: windowed deltas, the memorisation signature, and a PNG of both runs' curves.

Deltas are of train loss, held-out losses and task metrics.

    python -m olmo3eqx.compare runs/A runs/B [--x tokens] [--windows 4] [--out compare.png]

Both runs' metrics.jsonl are aligned on step (or on train/tokens) over the range both cover, cut into equal
windows; each delta is A minus B of the two runs' mean in that window. The signature the OLMo 3 reproduction's
data bug left (repeated data): one run's train loss clearly below the other's while its held-out losses are
not (delta ~0 or worse). It is judged on the last window holding held-out points of both runs.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from olmo3eqx import exits
from olmo3eqx.metrics import read_metrics

TRAIN = "train/loss"
TRAIN_TOL = 0.02
"""A train-loss delta beyond this (nats) counts as one run training lower."""
HELDOUT_FRACTION = 0.5
"""... and the run is flagged when its held-out loss improved by less than this fraction of that train delta."""


def series(run_dir: str | Path, x: str = "step") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """metric -> (x values, values), sorted by x; after a resume the last record of a step wins. With
    x='tokens', eval records take the tokens of the run's train records (tokens per step from train/tokens)."""
    by_step: dict[str, dict[int, float]] = {}
    for rec in read_metrics(run_dir):
        for k, v in rec.items():
            if k in ("step", "time") or not isinstance(v, (int, float)):
                continue
            by_step.setdefault(k, {})[int(rec["step"])] = float(v)
    scale = 1.0
    if x == "tokens":
        tok = by_step.get("train/tokens")
        if not tok:
            raise ValueError(f"{run_dir} logs no train/tokens; compare it by step.")
        scale = float(np.median([t / s for s, t in tok.items() if s > 0]))
    out = {}
    for k, points in by_step.items():
        steps = np.array(sorted(points))
        out[k] = (steps * scale, np.array([points[s] for s in steps]))
    return out


def heldout_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) & set(b) if k.startswith("eval/") and k.endswith("/loss"))


def task_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) & set(b) if k.startswith("eval/") and k.rsplit("/", 1)[1] in
                  ("acc", "acc_per_char", "bpb"))


def window_mean(s: tuple[np.ndarray, np.ndarray], lo: float, hi: float, first: bool) -> float:
    x, y = s
    sel = ((x >= lo) if first else (x > lo)) & (x <= hi) & np.isfinite(y)
    return float(y[sel].mean()) if sel.any() else math.nan


@dataclass
class Comparison:
    x: str
    edges: list[float]
    deltas: dict[str, list[float]]  # metric -> A - B per window
    verdict: str | None  # "A", "B" or None: which run shows the memorisation signature
    reason: str
    heldout: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)


def compare(a: dict, b: dict, *, x: str = "step", windows: int = 4) -> Comparison:
    if TRAIN not in a or TRAIN not in b:
        raise ValueError(f"Both runs need {TRAIN} in their metrics.jsonl.")
    lo = max(a[TRAIN][0][0], b[TRAIN][0][0])
    hi = min(a[TRAIN][0][-1], b[TRAIN][0][-1])
    if hi <= lo:
        raise ValueError(f"The runs share no {x} range (A {a[TRAIN][0][0]:g}..{a[TRAIN][0][-1]:g}, "
                         f"B {b[TRAIN][0][0]:g}..{b[TRAIN][0][-1]:g}).")
    edges = list(np.linspace(lo, hi, windows + 1))
    held, tasks = heldout_keys(a, b), task_keys(a, b)
    deltas = {}
    for k in [TRAIN, *held, *tasks]:
        deltas[k] = [window_mean(a[k], edges[i], edges[i + 1], i == 0) -
                     window_mean(b[k], edges[i], edges[i + 1], i == 0) for i in range(windows)]
    verdict, reason = judge(deltas, held)
    return Comparison(x, edges, deltas, verdict, reason, held, tasks)


def judge(deltas: dict[str, list[float]], held: list[str]) -> tuple[str | None, str]:
    """The signature on the last window where every held-out delta is known."""
    if not held:
        return None, "no held-out loss logged by both runs: cannot tell memorisation from real progress"
    usable = [i for i in range(len(deltas[TRAIN]))
              if math.isfinite(deltas[TRAIN][i]) and all(math.isfinite(deltas[k][i]) for k in held)]
    if not usable:
        return None, "no window holds held-out points of both runs"
    i = usable[-1]
    train = deltas[TRAIN][i]
    heldout = float(np.mean([deltas[k][i] for k in held]))
    if abs(train) <= TRAIN_TOL:
        return None, f"train losses agree (delta {train:+.4f} in window {i + 1})"
    # Orient so that `lower` is the run training lower; its held-out gain must track its train gain.
    lower, t, h = ("A", -train, -heldout) if train < 0 else ("B", train, heldout)
    if h < HELDOUT_FRACTION * t:
        change = f"only {h:.4f} lower" if h > 0 else f"{-h:.4f} higher"
        return lower, (f"run {lower}'s train loss is {t:.4f} lower but its held-out loss is {change} "
                       f"(window {i + 1}): memorisation or repeated data, not better modelling")
    return None, f"run {lower} is lower on train ({t:.4f}) and on held-out ({h:.4f}): a real improvement"


def format_table(c: Comparison) -> str:
    names = list(c.deltas)
    width = max(len(n) for n in names) + 2
    head = f"{'delta A-B':<{width}}" + "".join(
        f"{f'{c.edges[i]:.4g}-{c.edges[i + 1]:.4g}':>16}" for i in range(len(c.edges) - 1))
    lines = [f"windows of {c.x}", head]
    for n in names:
        lines.append(f"{n:<{width}}" + "".join(f"{v:>+16.4f}" if math.isfinite(v) else f"{'-':>16}"
                                               for v in c.deltas[n]))
    sig = f"MEMORISATION SIGNATURE in run {c.verdict}: " if c.verdict else "no memorisation signature: "
    return "\n".join(lines + ["", sig + c.reason])


def plot(a: dict, b: dict, c: Comparison, names: tuple[str, str], out: str | Path) -> Path:
    """Train loss and every held-out loss, both runs on one axis each, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [TRAIN, *c.heldout]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, k in zip(axes[0], panels):
        for s, name, style in ((a, names[0], "-"), (b, names[1], "--")):
            xs, ys = s[k]
            ax.plot(xs, ys, style, marker="o" if k != TRAIN else None, markersize=3, label=name)
        ax.set_title(k)
        ax.set_xlabel(c.x)
        ax.grid(alpha=0.3)
        ax.legend()
    if c.verdict:
        fig.suptitle(f"memorisation signature in {names['AB'.index(c.verdict)]}", color="red")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_a", help="run directory (or its metrics.jsonl) A")
    p.add_argument("run_b", help="run directory (or its metrics.jsonl) B")
    p.add_argument("--x", choices=("step", "tokens"), default="step", help="align the runs by step or by tokens")
    p.add_argument("--windows", type=int, default=4, help="equal windows the common range is cut into")
    p.add_argument("--out", default="compare.png", help="PNG of both runs' train and held-out curves")
    args = p.parse_args(argv)
    if args.windows < 1:
        p.error("--windows must be at least 1")
    try:
        a, b = series(args.run_a, args.x), series(args.run_b, args.x)
        c = compare(a, b, x=args.x, windows=args.windows)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exits.BAD_INPUT
    names = (f"A: {Path(args.run_a).name}", f"B: {Path(args.run_b).name}")
    print(f"A = {args.run_a}, B = {args.run_b}")
    print(format_table(c))
    print(f"wrote {plot(a, b, c, names, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
