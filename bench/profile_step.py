"""Where the train step's time goes, by source line: a `jax.profiler` trace of bench_step's step, each executed XLA
operation attributed to the line of olmo3eqx that produced it (forward or backward), and the matmul floor beside it.

    python bench/profile_step.py [--config tiny|small] [--steps 4] [--warmup 6] [--top 30]

The step is bench_step's (same config, batch, float32, one device). Wall time is split between the operations running
at each instant (two at once: half each), so the rows add up to the traced span; "no traced operation" is the time
between them (XLA:CPU's Eigen dots, the weight gradients among them, trace only their dispatch and finish on the
thread pool in such gaps). Each operation's line is the innermost olmo3eqx frame of its HLO stack trace, as JAX
records it (model.py:60 is Linear's matmul, attention.py the attention backends, ...).

The floor: the matmul FLOPs the compiled program executed in the traced steps (every dot, in fusions and loop bodies
alike, counted per execution) at the CPU's measured float32 matmul peak (flops.cpu_peak_flops); the step cannot run
faster than that with the same matmuls, and what the untimed step takes beyond it is everything else (attention's
softmax and data movement, norms, RoPE, the loss, the optimizer, copies). Prints a table last and writes
bench/results/profile_step.json. Run it without the test suite's XLA_FLAGS, on a quiet machine.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

if __name__ == "__main__":
    common.clean_xla_flags()  # before jax initialises

SOURCE_FILES = ("model.py", "attention.py", "loss.py", "optim.py", "step.py", "state.py")
"""olmo3eqx modules whose lines are named (the innermost frame among them names an operation)."""
NOT_TRACED = "(no traced operation)"


@dataclass(frozen=True)
class Frame:
    file: str
    function: str
    line: int


def _table(hlo: str, name: str) -> str:
    """One of the HLO module's stack-frame tables (FileNames, FunctionNames, FileLocations, StackFrames)."""
    match = re.search(rf"^{name}\n(.*?)(?=\n\n|\n[A-Z][A-Za-z]+\n|\Z)", hlo, re.S | re.M)
    return match.group(1) if match else ""


def stack_frames(hlo: str) -> dict[int, list[Frame]]:
    """stack_frame_id -> its frames, innermost first, from the compiled module's text."""
    files = {int(i): f for i, f in re.findall(r'^(\d+) "(.*)"$', _table(hlo, "FileNames"), re.M)}
    functions = {int(i): f for i, f in re.findall(r'^(\d+) "(.*)"$', _table(hlo, "FunctionNames"), re.M)}
    locations = {int(i): Frame(files[int(f)], functions[int(fn)], int(line)) for i, f, fn, line in re.findall(
        r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", _table(hlo, "FileLocations"), re.M)}
    # A frame's printed parent_frame_id is its caller's id plus one (0 before that: the outermost frame).
    callers = {int(i): (int(loc), int(parent) - 1) for i, loc, parent in re.findall(
        r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", _table(hlo, "StackFrames"), re.M)}
    chains = {}
    for frame_id in callers:
        chain, current = [], frame_id
        while current in callers and len(chain) < len(callers):
            location, current = callers[current]
            chain.append(locations[location])
        chains[frame_id] = chain
    return chains


INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", re.M)


def instructions(hlo: str) -> dict[str, str]:
    """Instruction name -> the rest of its line, over every computation of the module."""
    return {name: rest for name, rest in INSTRUCTION.findall(hlo)}


def computations(hlo: str) -> dict[str, str]:
    """Computation name -> its body (the lines between its braces)."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^%?([\w.\-]+) (?:\(.*?\) -> .*?)?\{\n(.*?)\n\}", hlo,
                                                      re.S | re.M)}


def _shape(text: str) -> list[int]:
    match = re.match(r"\w+\[([\d,]*)\]", text.strip())
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def dot_flops(hlo: str) -> dict[str, int]:
    """Instruction name -> matmul FLOPs of one execution: a dot's 2 * output elements * contracted size, a fusion's
    the sum of the dots in its computation."""
    lines = instructions(hlo)
    shapes = {name: _shape(rest) for name, rest in lines.items()}

    def of_dot(rest: str) -> int:
        m = re.search(r"dot\(%([\w.\-]+), %[\w.\-]+\).*?lhs_contracting_dims=\{([\d,]*)\}", rest)
        if not m or m.group(1) not in shapes:
            return 0
        lhs = shapes[m.group(1)]
        return 2 * math.prod(_shape(rest)) * math.prod(lhs[int(i)] for i in m.group(2).split(",") if i)

    bodies = computations(hlo)
    flops = {}
    for name, rest in lines.items():
        if re.search(r"\bdot\(", rest):
            flops[name] = of_dot(rest)
        called = re.search(r"\bfusion\(.*calls=%([\w.\-]+)", rest)
        if called and called.group(1) in bodies:
            inner = [r for _, r in INSTRUCTION.findall(bodies[called.group(1)]) if re.search(r"\bdot\(", r)]
            if inner:
                flops[name] = sum(of_dot(r) for r in inner)
    return flops


def labels(hlo: str) -> dict[str, str]:
    """Instruction name -> "forward|backward file:line function", the innermost olmo3eqx frame of its stack trace;
    "forward|backward (elsewhere)" when none (JAX's or the optimizer library's code)."""
    chains = stack_frames(hlo)
    out = {}
    for name, rest in instructions(hlo).items():
        op_name = re.search(r'op_name="([^"]*)"', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        direction = "backward" if op_name and "transpose(" in op_name.group(1) else "forward"
        ours = [f for f in chains.get(int(frame.group(1)), []) if Path(f.file).name in SOURCE_FILES
                and "olmo3eqx" in f.file] if frame else []
        if ours:
            f = ours[0]
            out[name] = f"{direction} {Path(f.file).name}:{f.line} {f.function.split('.<locals>.')[-1]}"
        else:
            out[name] = f"{direction} (elsewhere)"
    return out


def attribute(events: list[dict], label_of: dict[str, str]) -> tuple[collections.Counter, float]:
    """(label -> wall microseconds, traced span): each instant of the span split evenly between the operations
    running then (by label), NOT_TRACED where none runs. `events` are the trace's complete events ("X") of operations
    named in `label_of`."""
    points = sorted([(e["ts"], 1, i) for i, e in enumerate(events)] +
                    [(e["ts"] + e["dur"], -1, i) for i, e in enumerate(events)])
    wall: collections.Counter = collections.Counter()
    active: set[int] = set()
    last = None
    for t, kind, i in points:
        if last is not None and t > last:
            if active:
                for j in active:
                    wall[label_of[events[j]["name"]]] += (t - last) / len(active)
            else:
                wall[NOT_TRACED] += t - last
        last = t
        (active.add if kind == 1 else active.discard)(i)
    span = (points[-1][0] - points[0][0]) if points else 0.0
    return wall, span


def source_text(label: str, src: Path) -> str:
    """The source line a label names (empty when it names none)."""
    m = re.search(r" (\w+\.py):(\d+) ", label + " ")
    if not m:
        return ""
    path = src / m.group(1)
    lines = path.read_text().splitlines() if path.is_file() else []
    n = int(m.group(2))
    return lines[n - 1].strip() if 0 < n <= len(lines) else ""


def profile(config: str, steps: int, warmup: int, trace_dir: Path) -> dict:
    """Trace `steps` steps of bench_step's `config` after `warmup` untraced ones (and time `steps` untraced)."""
    import jax

    import bench_step

    model, seq, batch = bench_step.bench_configs()[config]
    cfg = common.train_config(model, seq, batch)
    step, state, tokens, mask = common.build_step(cfg)
    compiled = step.lower(state, tokens, mask).compile()
    for _ in range(warmup):
        state, _ = compiled(state, tokens, mask)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = compiled(state, tokens, mask)
    jax.block_until_ready((state, metrics))
    untraced = (time.perf_counter() - start) / steps
    jax.profiler.start_trace(str(trace_dir))
    for _ in range(steps):
        state, metrics = compiled(state, tokens, mask)
    jax.block_until_ready((state, metrics))
    jax.profiler.stop_trace()
    traces = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not traces:
        raise SystemExit(f"error: jax.profiler wrote no *.trace.json.gz under {trace_dir}")
    return {"hlo": compiled.as_text(), "trace": json.loads(gzip.open(traces[-1]).read()), "untraced_s": untraced,
            "tokens_per_step": seq * batch}


def summarize(hlo: str, trace: dict, steps: int) -> dict:
    """Per-label wall time per step, the traced span per step and the executed matmul FLOPs per step."""
    label_of = labels(hlo)
    flops = dot_flops(hlo)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("name") in label_of]
    if not events:
        raise SystemExit("error: no trace event names an instruction of the compiled step (has the trace format of "
                         "XLA:CPU changed?)")
    wall, span = attribute(events, label_of)
    executed = sum(flops.get(e["name"], 0) for e in events)
    return {"per_step_ms": {k: v / 1e3 / steps for k, v in wall.items()}, "span_ms": span / 1e3 / steps,
            "matmul_flops": executed / steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", help="one of bench_step's configs (tiny, small)")
    ap.add_argument("--steps", type=int, default=4, help="steps traced (and as many timed without the trace)")
    ap.add_argument("--warmup", type=int, default=6, help="untraced steps first")
    ap.add_argument("--top", type=int, default=30, help="rows of the table")
    ap.add_argument("--json", help="where to write the results (default bench/results/profile_step.json)")
    args = ap.parse_args(argv)

    from olmo3eqx import flops

    with tempfile.TemporaryDirectory() as tmp:
        run = profile(args.config, args.steps, args.warmup, Path(tmp))
    summary = summarize(run["hlo"], run["trace"], args.steps)
    peak = flops.cpu_peak_flops()
    floor_s = summary["matmul_flops"] / peak
    src = Path(__file__).resolve().parents[1] / "src" / "olmo3eqx"
    rows = []
    for label, ms in sorted(summary["per_step_ms"].items(), key=lambda kv: -kv[1])[:args.top]:
        rows.append({"ms": f"{ms:,.1f}", "share": f"{100 * ms / summary['span_ms']:.1f}%", "where": label,
                     "code": source_text(label, src)[:70]})
    tokens = run["tokens_per_step"]
    path = common.write_json(args.json or "profile_step.json", {
        "config": args.config, "steps": args.steps, "untraced_step_s": run["untraced_s"], "peak_flops": peak,
        "matmul_flops_per_step": summary["matmul_flops"], "matmul_floor_s": floor_s, **summary})
    print(f"\n{args.config}: step {run['untraced_s'] * 1e3:,.0f} ms untraced ({tokens / run['untraced_s']:,.0f} tokens/s), "
          f"{summary['span_ms']:,.0f} ms traced; matmul FLOPs executed {summary['matmul_flops'] / 1e9:.1f} G per step, "
          f"at the measured peak {peak / 1e9:.0f} GFLOP/s a floor of {floor_s * 1e3:,.0f} ms "
          f"({tokens / floor_s:,.0f} tokens/s); the rest of the step, {(run['untraced_s'] - floor_s) * 1e3:,.0f} ms, is "
          f"everything but the matmuls at peak. {path}")
    print(common.table(rows, [("ms", "ms/step"), ("share", "share"), ("where", "where (innermost olmo3eqx frame)"),
                              ("code", "code")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
