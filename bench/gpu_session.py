"""Every GPU check of the project in one command, for a lent GPU machine whose time is short (one call, minutes):

    python bench/gpu_session.py --out $OUT --deadline-s 560

1. The default run (`python train.py`) twice on that machine: on its CPU (JAX_PLATFORMS=cpu, in the background, on
   half the cores) and on its GPU; every held-out evaluation compared (the gate: within 0.02 nats, step 0 within
   1e-3) and against the figures the README prints (measured on a 2-core CPU machine).
2. Attention alone (bench/gpu_attention.py): cuDNN's packed layout for documents checked against "xla" in float32,
   then timed against cuDNN without documents, flash and Pallas, at the 1B's layer and the 7B's stage-3 layer.
3. The 1B train step (bench/gpu.py): cuDNN without and with packed documents, blocked (refused before compiling),
   a kernel profile of the first; then one change at a time toward OLMo-core's MFU (XLA options, remat); a 7B-shaped
   model of 8 layers.
4. What float32 matmuls cost on the GPU at JAX's default precision and at "highest", and the tiny model's step with
   each attention backend (compile and step time).
Each part is skipped when too little of --deadline-s is left for it; results are written as they come
($OUT/session.json from the driver, $OUT/checks.json from the GPU process, logs beside), so a run cut short still
returns what it finished. The driver imports no JAX (the GPU is the subprocesses').
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_HELDOUT = {0: 6.0937, 50: 2.2817, 100: 1.9985, 150: 1.7612, 200: 1.6716}
"""The README's held-out losses of the default run (2-core CPU machine, Python 3.11.7, jax 0.10.2)."""
GATE_NATS, GATE_STEP0 = 0.02, 1e-3


def heldout(run_dir: Path) -> dict[int, float]:
    out = {}
    path = run_dir / "tiny" / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "eval/heldout/loss" in rec:
            out[rec["step"]] = rec["eval/heldout/loss"]
    return out


def compare(a: dict[int, float], b: dict[int, float]) -> dict:
    steps = sorted(set(a) & set(b))
    gaps = {s: abs(a[s] - b[s]) for s in steps}
    return {"steps": steps, "max_gap": max(gaps.values(), default=None), "gaps": gaps,
            "within_gate": bool(steps) and max(gaps.values()) <= GATE_NATS and gaps.get(0, 1) <= GATE_STEP0}


def driver(args) -> int:
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/gpu_session")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    session: dict = {"started": time.time(), "python": sys.version.split()[0]}

    def save():
        session["wall_s"] = time.perf_counter() - start
        (out / "session.json").write_text(json.dumps(session, indent=1) + "\n")

    cores = os.cpu_count() or 2
    pin = ["taskset", "-c", f"{cores // 2}-{cores - 1}"] if shutil.which("taskset") and cores >= 4 else []
    cpu_log = open(out / "cpu_run.log", "w")
    cpu = subprocess.Popen([*pin, sys.executable, "train.py", "--run.dir", str(work / "cpu")], cwd=REPO,
                           env=dict(env, JAX_PLATFORMS="cpu"), stdout=cpu_log, stderr=subprocess.STDOUT)
    t = time.perf_counter()
    with open(out / "gpu_run.log", "w") as log:
        try:
            rc = subprocess.run([sys.executable, "train.py", "--run.dir", str(work / "gpu")], cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, timeout=args.default_run_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    session["gpu_default_run"] = {"rc": rc, "wall_s": time.perf_counter() - t, "heldout": heldout(work / "gpu")}
    print(f"GPU default run: rc {rc}, {session['gpu_default_run']['wall_s']:.0f} s, held-out "
          f"{session['gpu_default_run']['heldout']}", flush=True)
    save()

    left = args.deadline_s - (time.perf_counter() - start) - args.reserve_s
    with open(out / "checks.log", "w") as log:
        try:
            rc = subprocess.run([sys.executable, __file__, "--inner", "--out", str(out), "--deadline-s", str(left)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=max(left, 1) + 20
                                ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    session["checks_rc"] = rc
    save()

    wait = max(1.0, args.deadline_s - (time.perf_counter() - start) - 5)
    try:
        session["cpu_default_run_rc"] = cpu.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        cpu.kill()
        session["cpu_default_run_rc"] = "killed at the deadline"
    cpu_log.close()
    gpu_h, cpu_h = session["gpu_default_run"]["heldout"], heldout(work / "cpu")
    session["cpu_default_run"] = {"heldout": cpu_h}
    session["gpu_vs_cpu"] = compare(gpu_h, cpu_h)
    session["gpu_vs_readme"] = compare(gpu_h, README_HELDOUT)
    session["cpu_vs_readme"] = compare(cpu_h, README_HELDOUT)
    save()
    print(f"held-out GPU {gpu_h}\nheld-out CPU {cpu_h}\nGPU vs CPU: {session['gpu_vs_cpu']}\n"
          f"GPU vs README: {session['gpu_vs_readme']}\nCPU vs README: {session['cpu_vs_readme']}")
    print((out / "checks.log").read_text()[-6000:])
    return 0


def inner(args) -> int:
    """The GPU process: every in-process check in priority order, each within what is left of --deadline-s."""
    sys.path.insert(0, str(REPO / "bench"))
    import common

    common.clean_xla_flags()
    from olmo3eqx import jaxenv

    print(jaxenv.prepare(os.environ), flush=True)
    import gpu
    import gpu_attention

    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checks: dict = {}
    tmp = Path("/tmp/gpu_session/json")
    tmp.mkdir(parents=True, exist_ok=True)

    def part(name: str, need_s: float, fn):
        left = args.deadline_s - (time.perf_counter() - start)
        if left < need_s:
            checks[name] = {"skipped": f"{left:.0f} s left, needs ~{need_s:.0f}"}
        else:
            t = time.perf_counter()
            try:
                checks[name] = fn(left)
            except BaseException as e:  # noqa: BLE001 - keep going; the JSON says what failed
                checks[name] = {"error": repr(e)[:3000]}
            checks[name + " (s)"] = time.perf_counter() - t
        (out / "checks.json").write_text(json.dumps(checks, indent=1, default=str) + "\n")
        print(f"== {name}: {time.perf_counter() - start:.0f} s in", flush=True)

    def attention_run(argv):
        def fn(left):
            path = tmp / f"attention_{len(checks)}.json"
            gpu_attention.main([*argv, "--budget-s", str(max(10.0, left - 40)), "--json", str(path)])
            return json.loads(path.read_text())
        return fn

    def step_run(argv):
        def fn(left):
            path = tmp / f"gpu_{len(checks)}.json"
            tiny = ["--tiny"] if args.tiny else []
            named = [a.replace("16x128", "4x16").replace("32x128", "4x16") if args.tiny else a for a in argv]
            gpu.main([*named, *tiny, "--steps", "4", "--repeats", "3", "--json", str(path),
                      "--budget-s", str(left - 60)])
            return json.loads(path.read_text())["results"]
        return fn

    if args.tiny:  # off a GPU: the plumbing at toy sizes (tests/test_bench.py)
        attention_run = (lambda run: lambda argv: run([a for a in argv if a not in ("--shapes", "1b", "7b-stage3")]))(
            attention_run)
    part("attention 1b", 100, attention_run(["--shapes", "1b", "--max-runs", "16", "64", "256", "--repeats", "5"]))
    part("1b step: cudnn, cudnn docs, blocked, profile", 150, step_run(
        ["--only", "1b 16x128 cudnn$,1b 16x128 cudnn docs$,1b 16x128 blocked$", "--profile", "3"]))
    docs = checks.get("1b step: cudnn, cudnn docs, blocked, profile", {}).get("1b 16x128 cudnn docs", {})
    if "error" in docs:  # e.g. a cuDNN without the sliding window in its packed layout: global layers alone on it
        from olmo3eqx import cudnn_packed

        packed_or = cudnn_packed.attention_or
        cudnn_packed.attention_or = lambda fallback, *a, window: (
            fallback(*a) if window is not None else packed_or(fallback, *a, window=window))
        part("1b step: cudnn docs, sliding layers on flash", 100, step_run(["--only", "1b 16x128 cudnn docs$"]))
        cudnn_packed.attention_or = packed_or
    part("attention 7b stage 3", 60, attention_run(["--shapes", "7b-stage3", "--repeats", "3"]))
    part("1b step: cudnn, triton gemm off", 70, step_run(
        ["--only", "1b 16x128 cudnn$", "--compiler-option", "xla_gpu_enable_triton_gemm=false"]))
    part("1b step: cudnn, remat minimal", 70, step_run(["--only", "1b 16x128 cudnn$", "--remat", "minimal"]))
    part("1b step: cudnn, 8 rows", 80, step_run(["--only", "1b 16x128 cudnn$", "--per-device-batch", "8"]))
    part("7b 8 layers step: cudnn", 100, step_run(
        ["--only", "7b-8l 32x128 cudnn$", "--layers-7b", "8", "--per-device-batch", "2"]))
    part("float32 matmul precision", 20, precision)
    part("tiny step per attention backend", 60, tiny_backends)
    part("1b step: flash docs, pallas docs", 130, step_run(["--only", "1b 16x128 flash docs$,1b 16x128 pallas docs$"]))
    return 0


def precision(left) -> dict:
    """An f32 matmul on the GPU at the default precision and at "highest": time and error against float64."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = 4096
    a, b = (np.random.default_rng(i).standard_normal((n, n)).astype(np.float32) for i in range(2))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    out = {}
    for name in ("default", "high", "highest"):
        f = jax.jit(lambda x, y: jnp.matmul(x, y, precision=None if name == "default" else name))
        x, y = jnp.asarray(a), jnp.asarray(b)
        f(x, y).block_until_ready()
        t = time.perf_counter()
        for _ in range(10):
            r = f(x, y)
        r.block_until_ready()
        s = (time.perf_counter() - t) / 10
        err = float(np.linalg.norm(np.asarray(r, np.float64) - ref) / np.linalg.norm(ref))
        out[name] = {"ms": 1e3 * s, "tflops": 2 * n**3 / s / 1e12, "rel_error": err}
    return out


def tiny_backends(left) -> dict:
    """configs/tiny.yaml's float32 step on the GPU per attention backend: first call (compile) and step time."""
    import dataclasses

    import jax

    import common
    from olmo3eqx.config import load_yaml

    base = load_yaml(REPO / "configs" / "tiny.yaml")
    out = {}
    start = time.perf_counter()
    for impl, prec in (("flash", None), ("xla", None), ("flash", "highest"), ("blocked", None)):
        if time.perf_counter() - start > left - 20:
            out[f"{impl} {prec}"] = {"skipped": "time"}
            continue
        model = dataclasses.replace(base.model, attention_impl=impl)
        cfg = common.train_config(model, base.data.seq_len, base.data.global_batch)
        t = time.perf_counter()
        with jax.default_matmul_precision(prec or "default"):
            step, state, layout = common.build_run(cfg)
            data = common.random_batches(cfg, layout, 2)
            compiled = step.lower(state, *data[0]).compile()
        compile_s = time.perf_counter() - t
        state, m = compiled(state, *data[0])
        jax.block_until_ready(m)
        t = time.perf_counter()
        for i in range(20):
            state, m = compiled(state, *data[i % 2])
        jax.block_until_ready(m)
        out[f"{impl} {prec or 'default'}"] = {"compile_s": compile_s, "step_ms": (time.perf_counter() - t) / 20 * 1e3}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where the JSONs and logs go ($OUT on the device machine)")
    ap.add_argument("--deadline-s", type=float, default=560.0, help="finish within this many seconds")
    ap.add_argument("--reserve-s", type=float, default=25.0, help="kept for the last comparison")
    ap.add_argument("--default-run-s", type=float, default=150.0, help="time limit of the GPU default run")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help="the GPU process's checks only, at toy sizes (any host)")
    args = ap.parse_args(argv)
    return inner(args) if args.inner or args.tiny else driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
