"""Memory of speaking from a checkpoint: peak host RSS and device bytes while a 7B-shaped model of a few layers is
loaded (checkpoint.load_any, what olmo3eqx-eval, olmo3eqx-generate and the lm-eval adapter do) and generates, against
the bytes of the weights it holds.

    python bench/bench_speak_memory.py [--layers 2] [--dtype float32] [--new 16] [--dir /tmp] [--ckpt C] [--keep]

The checkpoint (unless --ckpt names one): random float32 weights of the 7B's width (hidden 4096, 32 heads of 128, MLP
11008, vocab 100352), --layers deep, written leaf by leaf by checkpoint.save_model_leaves, as `convert.py hf-to-orbax`
writes (stored chunks of at most checkpoint.CHUNK_BYTES). Each reader then runs in a fresh process on one CPU device
(`--child`), where a device's memory is this host's memory, and measures:

- host: the process's resident set, sampled every 2 ms by a thread reading /proc/self/status (and getrusage's
  high-water mark), above its level just before loading (Python, JAX and its CPU client started, nothing loaded);
- device: the bytes of jax.live_arrays() after loading and, while tokens stream out, during generation; plus the
  largest temporary buffer of the compiled prefill and decode programs (XLA's memory_analysis).

Runs (`--runs`, reader/scheduler): reader `ours` (load_any: leaves one at a time, each device shard filled chunk by
stored chunk, cast as read) or `orbax` (orbax's own restore of the same model onto the same sharding in the same
dtype: the path before load_any); scheduler `memory` (jaxenv.SPEAKING_XLA_FLAGS, which the eval and generate commands
set) or `concurrency` (XLA:CPU's default, what a Python caller gets unless it sets XLA_FLAGS).
Generation: greedy, one prompt of --prompt tokens, --new tokens, 16 decode steps per program. Prints a table (peaks as
a multiple of the weights' bytes) and writes bench/results/speak_memory.json; the checkpoint is deleted unless --keep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
WIDTHS = {"7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                     head_dim=128, vocab_size=100352),
          "tiny": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=4,
                       head_dim=16, vocab_size=1000)}
"""The 7B's width (configs/olmo3-7b-stage1.yaml's) and a toy one for the test."""


def model_config(width: str, layers: int):
    from olmo3eqx.config import load_yaml

    seven = load_yaml(ROOT / "configs" / "olmo3-7b-stage1.yaml").model
    return dataclasses.replace(seven, **WIDTHS[width], num_hidden_layers=layers, eos_token_id=0, pad_token_id=1,
                               remat="none", remat_by_chip=())


def write_checkpoint(path: Path, cfg, seed: int = 0) -> None:
    """Random float32 weights (normal, std 0.02), one leaf in memory at a time."""
    import numpy as np

    from olmo3eqx.checkpoint.model import save_model_leaves
    from olmo3eqx.hf import weights
    from olmo3eqx.model import abstract_model

    abstract = abstract_model(cfg)
    rng = np.random.default_rng(seed)

    def leaves():
        for p in weights.leaf_groups(weights.tensor_specs(cfg)):
            like = weights.leaf_of(abstract, p)
            yield p, rng.standard_normal(like.shape, dtype=np.float32) * np.float32(0.02)

    save_model_leaves(path, cfg, leaves())


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakRss:
    """The highest resident set seen since the last reset(), sampled every 2 ms."""

    def __init__(self):
        self.peak = rss()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        while True:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def reset(self) -> int:
        time.sleep(0.05)
        self.peak = rss()
        return self.peak


def live_bytes() -> int:
    import jax

    return sum(x.nbytes for x in jax.live_arrays())


def program_temps(model, prompt: int, new: int, chunk: int) -> dict:
    """XLA's temporary bytes of the prefill and decode programs generate() runs for one prompt."""
    import jax
    import jax.numpy as jnp

    from olmo3eqx import decode as dec
    from olmo3eqx.generate import bucket

    width, steps = bucket(prompt), -(-new // chunk) * chunk
    max_len = width + steps
    tokens, pad = jax.ShapeDtypeStruct((1, width), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
    prefill = jax.jit(lambda m, t, p: dec.prefill(m, t, p, max_len)).lower(model, tokens, pad).compile()
    _, cache = jax.eval_shape(lambda m, t, p: dec.prefill(m, t, p, max_len), model, tokens, pad)
    one = jax.ShapeDtypeStruct((1,), jnp.int32)
    decode = jax.jit(lambda m, c, t, d, s: dec.decode_chunk(m, c, t, d, s, max_len, chunk, dec.Sampler(), -1)).lower(
        model, cache, one, jax.ShapeDtypeStruct((1,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.uint32)).compile()
    return {"prefill": prefill.memory_analysis().temp_size_in_bytes,
            "decode": decode.memory_analysis().temp_size_in_bytes}


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def speak(ckpt: str, reader: str, dtype: str, prompt: int, new: int) -> dict:
    """Load and generate in this (fresh) process; its memory above the RSS it had just before loading."""
    import jax
    import numpy as np

    from olmo3eqx.checkpoint.model import load_any, open_model, restore_parts, speaking_config
    from olmo3eqx.config import MeshConfig
    from olmo3eqx.generate import generate
    from olmo3eqx.model import abstract_model
    from olmo3eqx.sharding import make_mesh, model_shardings, with_shardings

    meter = PeakRss()
    mesh = make_mesh(MeshConfig())
    jax.block_until_ready(jax.numpy.zeros(8))  # the CPU client started before the baseline
    base, high_before = meter.reset(), maxrss()

    def peak() -> int:
        """The sampled peak, or the kernel's high-water mark once it has risen past its level before loading (a
        sampler can miss a spike shorter than its period)."""
        return max(meter.peak, maxrss() if maxrss() > high_before else 0) - base

    t0 = time.perf_counter()
    if reader == "ours":
        model = load_any(ckpt, mesh, dtype).model
    else:
        import equinox as eqx

        from olmo3eqx.sharding import is_leaf_like

        root, step, cfg = open_model(ckpt)
        abstract = abstract_model(speaking_config(cfg, dtype))
        target = with_shardings(abstract, model_shardings(abstract, mesh))
        restored = restore_parts(root, step, {"model": target})["model"]
        model = eqx.combine(restored, eqx.partition(abstract, is_leaf_like)[1])
    jax.block_until_ready(model)
    load_s = time.perf_counter() - t0
    after_load = {"live": live_bytes(), "rss": rss() - base, "peak_rss": peak()}
    during = []
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    [c] = generate(model, [rng.integers(2, model.cfg.vocab_size, prompt).tolist()], max_new_tokens=new, eos_id=-1,
                   decode=lambda ids: " " * len(ids), on_text=lambda _r, _t: during.append(live_bytes()), mesh=mesh)
    return {"weights_bytes": sum(x.nbytes for x in jax.tree.leaves(model) if hasattr(x, "nbytes")),
            "load_s": load_s, "generate_s": time.perf_counter() - t0, "tokens": len(c.tokens), "after_load": after_load,
            "live_generating": max(during), "peak_rss": peak(), "baseline_rss": base}


def temps(ckpt: str, dtype: str, prompt: int, new: int) -> dict:
    """The compiled programs' temporaries, from the checkpoint's config alone (nothing loaded)."""
    from olmo3eqx.checkpoint.model import open_model, speaking_config
    from olmo3eqx.model import abstract_model

    _, _, cfg = open_model(ckpt)
    return program_temps(abstract_model(speaking_config(cfg, dtype)), prompt, new, 16)


def child(mode: str, ckpt: str, reader: str, dtype: str, prompt: int, new: int, scheduler: str) -> dict:
    from olmo3eqx import jaxenv

    if scheduler == "memory":
        jaxenv.prepare_speaking(os.environ)  # as the eval and generate commands do, before JAX starts
    if mode == "temps":
        return temps(ckpt, dtype, prompt, new)
    return speak(ckpt, reader, dtype, prompt, new)


def run_child(args: list[str]) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.pop("XLA_FLAGS", None)  # one CPU device, as one accelerator
    proc = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_speak_memory --child {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        mode, ckpt, reader, dtype, prompt, new, scheduler = argv[1:]
        print(json.dumps(child(mode, ckpt, reader, dtype, int(prompt), int(new), scheduler)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", choices=sorted(WIDTHS), default="7b", help="tiny: a toy model (the test's)")
    p.add_argument("--dtype", default="float32",
                   help="what the weights are loaded in: float32, the compute dtype on CPU (XLA:CPU computes a bfloat16 "
                        "matmul in float32 and, in the decode loop, converts every weight before the first step)")
    p.add_argument("--runs", default="ours/memory,ours/concurrency,orbax/memory",
                   help="reader/scheduler pairs: reader ours or orbax; scheduler memory (jaxenv.SPEAKING_XLA_FLAGS, "
                        "what the commands set) or concurrency (XLA:CPU's default)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new", type=int, default=16, help="new tokens")
    p.add_argument("--ckpt", default=None, help="an existing checkpoint to load instead of writing one")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: the system temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "speak_memory.json"))
    a = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "bench"))
    from common import write_json

    work = None
    if a.ckpt is None:
        work = Path(tempfile.mkdtemp(prefix="olmo3eqx-speak-bench-", dir=a.dir))
        cfg = model_config(a.width, a.layers)
        t0 = time.perf_counter()
        write_checkpoint(work / "ckpt", cfg)
        print(f"wrote a float32 checkpoint of {a.layers} layers at {a.width} width in {time.perf_counter() - t0:.0f} s")
    ckpt = a.ckpt or str(work / "ckpt")
    try:
        rows = {}
        for run in a.runs.split(","):
            reader, scheduler = run.split("/")
            args = [ckpt, reader, a.dtype, str(a.prompt), str(a.new), scheduler]
            r = {"reader": reader, "scheduler": scheduler, "dtype": a.dtype, **run_child(["speak", *args]),
                 "temps": run_child(["temps", *args])}
            r["peak_device"] = max(r["after_load"]["live"], r["live_generating"] + max(r["temps"].values()))
            rows[run] = r
    finally:
        if work is not None and not a.keep:
            shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'reader/scheduler':<18}  {'weights GB':>10}  {'load s':>6}  {'host peak':>9}  {'after load':>10}  "
          f"{'device peak':>11}  {'live gen':>8}  {'prefill tmp':>11}  {'decode tmp':>10}   (x weights; host: RSS "
          f"above the process before loading)")
    for name, r in rows.items():
        w = r["weights_bytes"]
        print(f"{name:<18}  {w / GB:>10.2f}  {r['load_s']:>6.1f}  {r['peak_rss'] / w:>9.3f}  "
              f"{r['after_load']['rss'] / w:>10.3f}  {r['peak_device'] / w:>11.3f}  {r['live_generating'] / w:>8.3f}  "
              f"{r['temps']['prefill'] / w:>11.3f}  {r['temps']['decode'] / w:>10.3f}")
    print(f"generated {next(iter(rows.values()))['tokens']} tokens after a {a.prompt}-token prompt; "
          f"baseline RSS {next(iter(rows.values()))['baseline_rss'] / GB:.2f} GB")
    path = write_json(Path(a.json), {"args": vars(a), "results": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
