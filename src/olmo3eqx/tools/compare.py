"""Compare two runs: both runs' curves of train loss, every held-out set and every downstream task metric, the
largest difference at matching steps, windowed deltas, the memorisation verdict, and PNGs of the curves.

    olmo3eqx-compare runs/A runs/B [--x tokens] [--windows 4] [--out compare.png]

A run's points are its metrics.jsonl plus, for steps and metrics it lacks, the eval/step_<N>.json files of
`olmo3eqx-eval --all-checkpoints`. The runs are aligned on step (or on train/tokens). Printed:
- per metric (train/loss, eval/<set>/loss, eval/downstream/<task>/<metric>): the points both runs have at the same
  step, each run's last value there, and the largest |A - B| over them with its step;
- windowed deltas of train loss, held-out losses and each task's primary metric: the common range cut into equal
  windows, each delta A minus B of the two runs' mean in that window;
- the verdict on the last window holding held-out (or downstream) points of both runs, with the rule the OLMo 3
  reproduction's repeated-data bug taught: one run's train loss clearly lower while its held-out loss and its
  downstream bits per byte are not (equal or worse) is memorisation (or repeated data), not better modelling;
  and every earlier window where the same rule finds the signature (repeated data can look like progress only
  for a while: a small model shown each batch several times in a row trains lower at first, then falls behind
  for the data it never reads; more windows, `--windows`, resolve shorter episodes).
  Downstream is judged on each task's `bpb` (a held-out loss on the tasks' gold answers, lower is better): its
  relative gain must follow the relative train gain; accuracies are shown, not judged (at small scale they sit
  at chance, and the seed's runs never differed by more than 0.005 in them).
Written: `--out` (train loss, held-out losses and each task's primary metric side by side) and, per downstream
metric, `<out stem>_<metric>.png` with a panel per task.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from olmo3eqx import exits, storage
from olmo3eqx.errors import ConfigError
from olmo3eqx.metrics import read_metrics

DESCRIPTION = ("Compare two runs: their loss, held-out and downstream curves, "
               "the largest differences at matching steps, and PNGs.")
"""--help's description (the module doc's first line is not a sentence on its own)."""

TRAIN = "train/loss"
DOWNSTREAM = "eval/downstream/"
TRAIN_TOL = 0.02
"""A train-loss delta beyond this (nats) counts as one run training lower."""
HELDOUT_FRACTION = 0.5
"""... and the run is flagged when its held-out loss improved by less than this fraction of that train delta (and
its downstream bpb by less than this fraction of the train loss's relative gain)."""
PANELS_PER_ROW = 5


def eval_files(run_dir: str) -> list[dict]:
    """The records of <run>/eval/step_<N>.json (olmo3eqx-eval), as {"step": N, metric: value}; none when
    `run_dir` names a metrics file or is on a web server."""
    records = []
    if run_dir.endswith(".jsonl") or storage.scheme(run_dir) in storage.READ_ONLY:  # a web server has no listing
        return records
    for path in storage.glob(storage.join(run_dir, "eval", "step_*.json")):
        d = json.loads(storage.read_text(path))
        records.append({"step": int(d["step"]), **d.get("metrics", {})})
    return records


def series(run_dir: str | Path, x: str = "step") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """metric -> (x values, values), sorted by x; after a resume the last record of a step wins; eval files fill
    in (step, metric) points metrics.jsonl lacks. With x='tokens', every record takes the tokens of the run's
    train records (tokens per step from train/tokens)."""
    by_step: dict[str, dict[int, float]] = {}
    for rec in read_metrics(run_dir):
        for k, v in rec.items():
            if k in ("step", "time") or not isinstance(v, (int, float)):
                continue
            by_step.setdefault(k, {})[int(rec["step"])] = float(v)
    for rec in eval_files(storage.check(run_dir, "run")):
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)):
                by_step.setdefault(k, {}).setdefault(rec["step"], float(v))
    scale = 1.0
    if x == "tokens":
        tok = by_step.get("train/tokens")
        if not tok:
            raise ConfigError(f"{run_dir} logs no train/tokens; compare it by step.")
        scale = float(np.median([t / s for s, t in tok.items() if s > 0]))
    out = {}
    for k, points in by_step.items():
        steps = np.array(sorted(points))
        out[k] = (steps * scale, np.array([points[s] for s in steps]))
    return out


def heldout_keys(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) & set(b) if k.startswith("eval/") and not k.startswith(DOWNSTREAM)
                  and k.endswith("/loss"))


def task_keys(a: dict, b: dict) -> list[str]:
    """Every downstream metric both runs log: eval/downstream/<task>/<metric>."""
    return sorted(k for k in set(a) & set(b) if k.startswith(DOWNSTREAM))


def task_of(key: str) -> str:
    return key[len(DOWNSTREAM):].rsplit("/", 1)[0]


def metric_of(key: str) -> str:
    return key.rsplit("/", 1)[1]


def window_mean(s: tuple[np.ndarray, np.ndarray], lo: float, hi: float, first: bool) -> float:
    x, y = s
    sel = ((x >= lo) if first else (x > lo)) & (x <= hi) & np.isfinite(y)
    return float(y[sel].mean()) if sel.any() else math.nan


@dataclass
class Match:
    """A metric at the steps both runs logged it."""

    points: int
    last_a: float
    last_b: float
    max_diff: float  # largest |A - B|
    at: float  # its x


def matching(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> Match | None:
    common, ia, ib = np.intersect1d(a[0], b[0], return_indices=True)
    ok = np.isfinite(a[1][ia]) & np.isfinite(b[1][ib])
    if not ok.any():
        return None
    diff = np.abs(a[1][ia] - b[1][ib])[ok]
    i = int(np.argmax(diff))
    return Match(int(ok.sum()), float(a[1][ia][ok][-1]), float(b[1][ib][ok][-1]), float(diff[i]),
                 float(common[ok][i]))


@dataclass
class Comparison:
    x: str
    edges: list[float]
    deltas: dict[str, list[float]]  # metric -> A - B per window
    verdict: str | None  # "A", "B" or None: which run shows the memorisation signature
    reason: str
    earlier: list[tuple[int, str, str]] = field(default_factory=list)  # (window, run, reason): signatures before
    heldout: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=list)  # every downstream metric both runs log
    matches: dict[str, Match] = field(default_factory=dict)


def compare(a: dict, b: dict, *, x: str = "step", windows: int = 4) -> Comparison:
    if TRAIN not in a or TRAIN not in b:
        raise ConfigError(f"Both runs need {TRAIN} in their metrics.jsonl.")
    lo = max(a[TRAIN][0][0], b[TRAIN][0][0])
    hi = min(a[TRAIN][0][-1], b[TRAIN][0][-1])
    if hi <= lo:
        raise ConfigError(f"The runs share no {x} range (A {a[TRAIN][0][0]:g}..{a[TRAIN][0][-1]:g}, "
                         f"B {b[TRAIN][0][0]:g}..{b[TRAIN][0][-1]:g}).")
    edges = list(np.linspace(lo, hi, windows + 1))
    held, tasks = heldout_keys(a, b), task_keys(a, b)
    windowed = [TRAIN, *held, *(k for k in tasks if metric_of(k) in ("primary", "bpb"))]
    deltas = {k: [window_mean(a[k], edges[i], edges[i + 1], i == 0) - window_mean(b[k], edges[i], edges[i + 1], i == 0)
                  for i in range(windows)] for k in windowed}
    bpb = [k for k in tasks if metric_of(k) == "bpb"]
    levels = {k: [0.5 * (window_mean(a[k], edges[i], edges[i + 1], i == 0) +
                         window_mean(b[k], edges[i], edges[i + 1], i == 0)) for i in range(windows)]
              for k in (TRAIN, *bpb)}
    verdict, reason, earlier = judge(deltas, levels, held, bpb)
    matches = {k: m for k in [TRAIN, *held, *tasks] if (m := matching(a[k], b[k])) is not None}
    return Comparison(x, edges, deltas, verdict, reason, earlier, held, tasks, matches)


def judge(deltas: dict[str, list[float]], levels: dict[str, list[float]], held: list[str],
          bpb: list[str]) -> tuple[str | None, str, list[tuple[int, str, str]]]:
    """The signature on the last window where every held-out (and downstream bpb) delta is known (the run it names
    or None, and why), and every earlier such window that shows it (1-based window, run, why)."""
    judged = held + bpb
    if not judged:
        return (None, "no held-out loss or downstream task logged by both runs: cannot tell memorisation from "
                "progress", [])
    usable = [i for i in range(len(deltas[TRAIN]))
              if math.isfinite(deltas[TRAIN][i]) and all(math.isfinite(deltas[k][i]) for k in judged)]
    if not usable:
        return None, "no window holds held-out or downstream points of both runs", []
    earlier = [(i + 1, run, why) for i in usable[:-1]
               for run, why in [judge_window(deltas, levels, held, bpb, i)] if run is not None]
    return (*judge_window(deltas, levels, held, bpb, usable[-1]), earlier)


def judge_window(deltas: dict[str, list[float]], levels: dict[str, list[float]], held: list[str],
                 bpb: list[str], i: int) -> tuple[str | None, str]:
    """The signature in window `i` (0-based; every judged delta known there): the run it names, or None, and why."""
    train = deltas[TRAIN][i]
    if abs(train) <= TRAIN_TOL:
        return None, f"train losses agree (delta {train:+.4f} in window {i + 1})"
    # Orient so that `lower` is the run training lower (sign +1 for A); its held-out gain must track its train gain.
    lower, sign = ("A", -1.0) if train < 0 else ("B", 1.0)
    t = sign * train
    flat, seen = [], []
    if held:
        h = sign * float(np.mean([deltas[k][i] for k in held]))
        flat.append(h < HELDOUT_FRACTION * t)
        seen.append(f"held-out loss {abs(h):.4f} {'lower' if h > 0 else 'higher'}")
    if bpb:
        relative_train = t / levels[TRAIN][i]
        d = sign * float(np.mean([deltas[k][i] / levels[k][i] for k in bpb]))
        flat.append(d < HELDOUT_FRACTION * relative_train)
        seen.append(f"downstream bpb {abs(d):.2%} {'lower' if d > 0 else 'higher'} against {relative_train:.2%} "
                    f"in train loss")
    detail = f"run {lower}'s train loss is {t:.4f} lower, its " + ", its ".join(seen) + f" (window {i + 1})"
    if all(flat):
        return lower, detail + ": memorisation or repeated data, not better modelling"
    if any(flat):
        return None, detail + ": held-out and downstream disagree, inconclusive"
    return None, detail + ": a real improvement"


def short(v: float) -> str:
    """A window edge in at most 4 significant digits with a K/M/B/T suffix: 10.49M, not 1.049e+07."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(v) >= scale:
            return f"{v / scale:.4g}{unit}"
    return f"{v:.4g}"


def format_table(c: Comparison) -> str:
    names = list(c.matches)
    width = max([len(n) for n in [*names, *c.deltas]] + [10]) + 2
    lines = [f"{'metric':<{width}}{'points':>8}{'A last':>12}{'B last':>12}{'max |A-B|':>12}{f'at {c.x}':>12}"]
    for n in names:
        m = c.matches[n]
        lines.append(f"{n:<{width}}{m.points:>8}{m.last_a:>12.4f}{m.last_b:>12.4f}{m.max_diff:>12.4f}{m.at:>12.6g}")
    labels = [f"{short(c.edges[i])}-{short(c.edges[i + 1])}" for i in range(len(c.edges) - 1)]
    col = max([16] + [len(label) + 2 for label in labels])  # a gap between headers however long the edges
    lines += ["", f"windows of {c.x}", f"{'delta A-B':<{width}}" + "".join(f"{label:>{col}}" for label in labels)]
    for n in c.deltas:
        lines.append(f"{n:<{width}}" + "".join(f"{v:>+{col}.4f}" if math.isfinite(v) else f"{'-':>{col}}"
                                               for v in c.deltas[n]))
    sig = f"MEMORISATION SIGNATURE in run {c.verdict}: " if c.verdict else "no memorisation signature: "
    before = [f"earlier, MEMORISATION SIGNATURE in run {run} in window {i} ({labels[i - 1]}): {why}"
              for i, run, why in c.earlier]
    return "\n".join(lines + ["", *before, sig + c.reason])


def plot_panels(a: dict, b: dict, keys: list[str], titles: list[str], c: Comparison, names: tuple[str, str],
                out: str) -> str:
    """Both runs' curves of each key, one panel per key, to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(len(keys), PANELS_PER_ROW)
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, k, title in zip(axes.flat, keys, titles):
        for s, name, style in ((a, names[0], "-"), (b, names[1], "--")):
            xs, ys = s[k]
            ax.plot(xs, ys, style, marker="o" if k != TRAIN else None, markersize=3, label=name)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(c.x)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if c.verdict:
        fig.suptitle(f"memorisation signature in {names['AB'.index(c.verdict)]}", color="red")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=100, format="png")
    plt.close(fig)
    storage.makedirs(storage.parent(out) or ".")
    storage.write_bytes(out, png.getvalue())
    return out


def plot(a: dict, b: dict, c: Comparison, names: tuple[str, str], out: str | Path) -> list[str]:
    """`out`: train loss, every held-out loss and every task's primary metric; then one PNG per downstream metric
    (`<stem>_<metric>.png`), a panel per task."""
    out = storage.check(out, "--out", write=True)
    stem, suffix = os.path.splitext(out)
    primary = [k for k in c.tasks if metric_of(k) == "primary"]
    keys = [TRAIN, *c.heldout, *primary]
    titles = [TRAIN, *c.heldout, *(f"{task_of(k)} (primary)" for k in primary)]
    written = [plot_panels(a, b, keys, titles, c, names, out)]
    for metric in dict.fromkeys(metric_of(k) for k in c.tasks if metric_of(k) != "primary"):
        keys = [k for k in c.tasks if metric_of(k) == metric]
        written.append(plot_panels(a, b, keys, [f"{task_of(k)} {metric}" for k in keys], c, names,
                                   f"{stem}_{metric}{suffix}"))
    return written


@exits.command
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("run_a", help="run directory (or its metrics.jsonl) A")
    p.add_argument("run_b", help="run directory (or its metrics.jsonl) B")
    p.add_argument("--x", choices=("step", "tokens"), default="step", help="align the runs by step or by tokens")
    p.add_argument("--windows", type=int, default=4, help="equal windows the common range is cut into")
    p.add_argument("--out", default="compare.png", help="PNG of both runs' curves (and <stem>_<metric>.png)")
    args = p.parse_args(argv)
    if args.windows < 1:
        p.error("--windows must be at least 1")
    a, b = series(args.run_a, args.x), series(args.run_b, args.x)
    c = compare(a, b, x=args.x, windows=args.windows)
    names = (f"A: {storage.basename(args.run_a)}", f"B: {storage.basename(args.run_b)}")
    print(f"A = {storage.redact(args.run_a)}, B = {storage.redact(args.run_b)}")
    print(format_table(c))
    for path in plot(a, b, c, names, args.out):
        print(f"wrote {storage.redact(path)}")
    return exits.OK


if __name__ == "__main__":
    sys.exit(main())
