"""Train-step throughput, side by side in one run: our jitted step against `transformers`' Olmo3 with torch AdamW,
same config, batch, dtype (float32) and threads; plus MFU against this CPU's measured float32 matmul peak.

    python bench/bench_step.py [--configs tiny,small] [--repeats 5] [--steps 2] [--attention auto,xla] [--unrolled]
                               [--malloc glibc,glibc-tuned,tcmalloc,jemalloc,hugetlb] [--cpu-devices 1,2]
                               [--ablate attention]

Each contender runs in its own worker process (its own heap and allocator; the others wait, idle). `--malloc` names
the host allocators every contender (ours and torch) is timed under, each in processes of its own: `glibc` (the C
library's malloc as it comes), `glibc-tuned` (GLIBC_TUNABLES with one arena, no mmap, no trim: what `python
train.py` runs under on a CPU host without tcmalloc, i.e. a fresh machine: olmo3eqx/tools/hostmem.py), `tcmalloc`
(preloaded, as train.py does where it is installed), `jemalloc` (preloaded, with `oversize_threshold:0` so large
blocks are cached too), `hugetlb` (glibc with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, transparent huge pages) and
`glibc-tuned-hugetlb` (both). The default is glibc, glibc-tuned and tcmalloc; a preloaded allocator that is not
installed is left out with a note. Why
it matters: XLA's CPU runtime mallocs each step's temporary buffer (GiBs) and frees it after the step, and glibc
returns a block that large to the kernel, so every step faults it in again (docs/performance.md). The `vs fastest
torch` column compares with the fastest torch contender. The ceiling printed per config is the tokens/s at 100% MFU
(the measured matmul peak over the FLOPs per token): no implementation can pass it without skipping work.

`--cpu-devices 1,2` adds our step with the host split into 2 XLA CPU devices
(`--xla_force_host_platform_device_count`), the batch data-parallel over them: each device runs its program on its
own thread, so the fusions that XLA:CPU runs on one thread run on both cores (the gradients are all-reduced).

`--ablate attention` adds a diagnostic contender: our step with the attention itself replaced by `q + k + v` (the
projections, QK-norm and RoPE kept; no scores, no softmax). It is not a model anyone should train; it bounds what any
attention backend could give: the step with attention at no cost. The footer says what share of our step the
attention takes.

Each repeat times `steps` back-to-back steps of every contender in turn (interleaved, so a burst of load from
another process hits all of them alike) after `--warmup` untimed steps each; tokens/s is the median over repeats.
The table is printed last and bench/results/step.json (or --json) written. Do not run it with the test suite's
XLA_FLAGS.
"""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

if __name__ == "__main__":
    common.clean_xla_flags()  # before jax initialises

from olmo3eqx import flops
from olmo3eqx.tools import hostmem
from olmo3eqx.config import ModelConfig, load_yaml

REPO = Path(__file__).resolve().parents[1]
MALLOC_VARIABLES = ("LD_PRELOAD", "GLIBC_TUNABLES", "MALLOC_CONF")
PROTOCOL = "@bench "
"""Prefix of the worker's protocol lines on stdout (anything else a library prints there is passed on)."""


def bench_configs() -> dict[str, tuple[ModelConfig, int, int]]:
    """name -> (model, seq_len, batch). tiny: the default run (configs/tiny.yaml). small: ~50M parameters, the
    window half the sequence as in OLMo 3's stage 1 (4096 of 8192)."""
    tiny = load_yaml(REPO / "configs" / "tiny.yaml")
    small = dataclasses.replace(
        tiny.model, vocab_size=8192, hidden_size=640, intermediate_size=1728, num_hidden_layers=8,
        num_attention_heads=10, num_key_value_heads=10, head_dim=64, sliding_window=256, max_position_embeddings=512)
    return {"tiny": (tiny.model, tiny.data.seq_len, tiny.data.global_batch), "small": (small, 512, 4)}


class JaxContender:
    def __init__(self, model: ModelConfig, seq: int, batch: int, devices: int = 1):
        import jax

        self.jax = jax
        self.cfg = common.train_config(model, seq, batch)
        t = time.perf_counter()
        self.step, self.state, self.tokens, self.mask = common.build_step(self.cfg, jax.devices()[:devices],
                                                                          axis="data")
        jax.block_until_ready(self.state)
        self.init_s = time.perf_counter() - t
        t = time.perf_counter()
        self.step = self.step.lower(self.state, self.tokens, self.mask).compile()
        self.compile_s = time.perf_counter() - t
        self.dots = len(re.findall(r"\bdot\(", self.step.as_text()))  # matmuls in the compiled program

    def run(self, steps: int) -> None:
        metrics = None
        for _ in range(steps):  # dispatched back to back; the host waits once, at the end
            self.state, metrics = self.step(self.state, self.tokens, self.mask)
        self.jax.block_until_ready((self.state, metrics))


class TorchContender:
    def __init__(self, model: ModelConfig, seq: int, batch: int):
        import torch
        from transformers import Olmo3Config, Olmo3ForCausalLM

        from olmo3eqx.hf.config_json import config_to_hf

        torch.set_num_threads(os.cpu_count())
        torch.manual_seed(0)
        d = {k: v for k, v in config_to_hf(model, "float32").items() if k not in ("architectures", "model_type")}
        hf_cfg = Olmo3Config(**d)
        hf_cfg._attn_implementation = "sdpa"
        self.model = Olmo3ForCausalLM(hf_cfg).float().train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=0.1)
        self.tokens = torch.randint(0, model.vocab_size, (batch, seq))
        self.torch = torch
        self.init_s = self.compile_s = 0.0
        self.dots = None

    def run(self, steps: int) -> None:
        for _ in range(steps):
            loss = self.model(input_ids=self.tokens, labels=self.tokens).loss
            loss.backward()
            self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


def without_attention(q, k, v, **_):
    """The `--ablate attention` stand-in for olmo3eqx.attention.attention: q plus k and v repeated over each kv head's
    query heads, so the projections, QK-norm and RoPE still run and still get gradients, but no scores, softmax or
    weighted sum do."""
    import jax.numpy as jnp

    return q + jnp.repeat(k + v, q.shape[-2] // k.shape[-2], axis=-2)


def worker(spec: dict) -> int:
    """A contender's process: build it, say `ready`, then time `run N` requests from stdin until `quit`."""
    if spec.get("ablate") == "attention":
        import olmo3eqx.model

        olmo3eqx.model.attention = without_attention  # the name Attention.__call__ calls
    model, seq, batch = bench_configs()[spec["config"]]
    model = dataclasses.replace(model, **spec.get("overrides", {}))
    if spec["kind"] == "jax":
        contender = JaxContender(model, seq, batch, spec.get("devices", 1))
    else:
        contender = TorchContender(model, seq, batch)

    def say(**msg) -> None:
        print(PROTOCOL + json.dumps(msg), flush=True)

    say(ready=True, init_s=contender.init_s, compile_s=contender.compile_s, dots=contender.dots)
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["run"]:
            t = time.perf_counter()
            contender.run(int(command[1]))
            say(seconds=time.perf_counter() - t)
        elif command[:1] == ["quit"]:
            break
    return 0


class Worker:
    """The parent's handle on one contender's worker process (see `worker`)."""

    def __init__(self, spec: dict, env: dict[str, str]):
        self.spec = spec
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._receive()
        self.init_s, self.compile_s, self.dots = ready["init_s"], ready["compile_s"], ready["dots"]

    def _receive(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL):
                return json.loads(line[len(PROTOCOL):])
            sys.stdout.write(line)  # a library's own output: pass it on
        raise RuntimeError(f"bench worker {self.spec} exited with code {self.proc.wait()} (its stderr is above)")

    def run(self, steps: int) -> float:
        self.proc.stdin.write(f"run {steps}\n")
        self.proc.stdin.flush()
        return self._receive()["seconds"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait()


HUGE_PAGES = {"glibc.malloc.hugetlb": "1"}
ABLATED = "no attention: diagnostic"
"""The tag of `--ablate attention`'s contender (see the module doc)."""
MALLOCS = ("glibc", "glibc-tuned", "glibc-tuned-hugetlb", "tcmalloc", "jemalloc", "hugetlb")


def malloc_env(name: str, env: dict[str, str]) -> dict[str, str] | None:
    """The environment that runs a worker under allocator `name` (see the module doc); None if not installed."""
    if name == "glibc":
        return env
    if name == "glibc-tuned":
        return hostmem.tuned_glibc_env(env)
    if name == "glibc-tuned-hugetlb":
        return hostmem.with_tunables(hostmem.tuned_glibc_env(env), HUGE_PAGES)
    if name == "hugetlb":
        return hostmem.with_tunables(env, HUGE_PAGES)  # transparent huge pages (glibc >= 2.35)
    if name == "tcmalloc":
        library = hostmem.find_tcmalloc()
        return hostmem.preload_env(env, library) if library else None
    if name == "jemalloc":
        library = ctypes.util.find_library("jemalloc")
        return hostmem.preload_env(env, library) if library else None
    raise SystemExit(f"error: --malloc {name!r}: choose from {', '.join(MALLOCS)}")


def contender_specs(args, env: dict[str, str]) -> dict[str, tuple[dict, dict[str, str]]]:
    """contender name -> (worker spec without the config, worker environment), for every allocator asked for."""
    first = args.attention.split(",")[0]
    specs = {}
    for malloc in args.malloc.split(","):
        worker_env = malloc_env(malloc, env)
        if worker_env is None:
            print(f"note: --malloc {malloc}: not installed here, left out")
            continue
        tag = "" if malloc == "glibc" else f", {malloc}"
        for impl in args.attention.split(","):
            specs[f"olmo3eqx ({impl}{tag})"] = ({"kind": "jax", "overrides": {"attention_impl": impl}}, worker_env)
        for n in (int(x) for x in args.cpu_devices.split(",") if x and int(x) > 1):
            flags = " ".join(filter(None, [worker_env.get("XLA_FLAGS", ""),
                                           f"--xla_force_host_platform_device_count={n}"]))
            specs[f"olmo3eqx ({first}{tag}, {n} CPU devices)"] = (
                {"kind": "jax", "overrides": {"attention_impl": first}, "devices": n},
                {**worker_env, "XLA_FLAGS": flags})
        if args.unrolled:
            specs[f"olmo3eqx ({first}{tag}, unrolled)"] = (
                {"kind": "jax", "overrides": {"attention_impl": first, "scan_layers": False}}, worker_env)
        if args.ablate == "attention":
            specs[f"olmo3eqx ({first}{tag}, {ABLATED})"] = (
                {"kind": "jax", "overrides": {"attention_impl": first}, "ablate": "attention"}, worker_env)
        if not args.no_torch:
            specs[f"transformers+torch{f' ({malloc})' if tag else ''}"] = ({"kind": "torch"}, worker_env)
    return specs


def measure(workers: dict[str, Worker], tokens_per_step: int, steps: int, repeats: int,
            warmup: int) -> dict[str, list[float]]:
    for w in workers.values():
        w.run(warmup)  # first-call work, caches, and the allocator's heap growing to its steady size (see --warmup)
    rates: dict[str, list[float]] = {name: [] for name in workers}
    for _ in range(repeats):
        for name, w in workers.items():
            rates[name].append(steps * tokens_per_step / w.run(steps))
    return rates


def fastest_torch(results: dict[str, dict]) -> dict[str, dict]:
    """config -> the torch contender with the highest median tokens/s (its result plus "contender": its name)."""
    best: dict[str, dict] = {}
    for key, r in results.items():
        name, cname = key.split("/", 1)
        if cname.startswith("transformers+torch") and r["median"] > best.get(name, {"median": 0.0})["median"]:
            best[name] = {**r, "contender": cname}
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps per timed repeat")
    ap.add_argument("--warmup", type=int, default=6,
                    help="untimed steps of each contender first: under the tuned glibc the heap grows over the first "
                         "~5 steps (page faults; measured: 2 warm-up steps left the first two of five repeats of tiny "
                         "at 2,137-2,331 tokens/s against 3,499-4,008 for the rest)")
    ap.add_argument("--attention", default="auto", help="comma-separated model.attention_impl values to time")
    ap.add_argument("--unrolled", action="store_true", help="also time model.scan_layers=False")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--ablate", choices=["attention"],
                    help="also time our step with the attention replaced by q + k + v (a diagnostic, not a model: the "
                         "step with attention at no cost)")
    ap.add_argument("--cpu-devices", default="1",
                    help="comma-separated CPU device counts for our step (N > 1: the host split into N XLA devices, "
                         "the batch data-parallel over them, each device's program on its own thread)")
    ap.add_argument("--malloc", default="glibc,glibc-tuned,tcmalloc",
                    help=f"comma-separated host allocators to time every contender under: {', '.join(MALLOCS)} "
                         f"(hugetlb: glibc with GLIBC_TUNABLES=glibc.malloc.hugetlb=1)")
    ap.add_argument("--json", help="where to write the results (default bench/results/step.json)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))

    load_before = os.getloadavg()
    peak = flops.cpu_peak_flops(refresh=True)
    configs = bench_configs()
    env = dict(os.environ)
    rows, results = [], {}
    specs = contender_specs(args, env)
    for name in args.configs.split(","):
        model, seq, batch = configs[name]
        workers: dict[str, Worker] = {}
        try:
            for cname, (spec, worker_env) in specs.items():
                print(f"{name}: starting {cname}", flush=True)
                workers[cname] = Worker({**spec, "config": name}, worker_env)
            rates = measure(workers, seq * batch, args.steps, args.repeats, args.warmup)
        finally:
            for w in workers.values():
                w.close()
        per_token = flops.train_flops_per_token(model, seq)
        for cname, r in rates.items():
            results[f"{name}/{cname}"] = {"tokens_per_s": r, "median": common.median(r), "flops_per_token": per_token,
                                          "seq_len": seq, "batch": batch, "params": flops.param_count(model),
                                          "init_s": workers[cname].init_s, "compile_s": workers[cname].compile_s,
                                          "dots": workers[cname].dots,
                                          "env": {k: specs[cname][1].get(k) for k in MALLOC_VARIABLES}}
    peak_after = flops.cpu_peak_flops(refresh=True)
    peak = max(peak, peak_after)  # a peak is an upper bound: load only lowers a measurement
    load_after = os.getloadavg()
    ceilings = {}  # config -> tokens/s at 100% MFU
    best_torch = fastest_torch(results)
    for key, r in results.items():
        name, cname = key.split("/", 1)
        ceilings[name] = peak / r["flops_per_token"]
        torch_r = best_torch.get(name)
        med = r["median"]
        r["mfu"] = med * r["flops_per_token"] / peak
        rows.append({"config": name, "params": f"{r['params'] / 1e6:.1f}M", "contender": cname,
                     "tok_s": f"{med:,.0f}", "range": f"{min(r['tokens_per_s']):,.0f}-{max(r['tokens_per_s']):,.0f}",
                     "vs_torch": f"{med / torch_r['median']:.2f}x" if torch_r else "",
                     "gflops": f"{med * r['flops_per_token'] / 1e9:.1f}", "mfu": f"{100 * r['mfu']:.1f}%",
                     "compile_s": f"{r['compile_s']:.1f}" if cname.startswith("olmo3eqx") else ""})
    path = common.write_json(args.json or "step.json", {"peak_flops": peak, "ceiling_tokens_per_s": ceilings,
                                           "fastest_torch": {n: r["contender"] for n, r in best_torch.items()},
                                           "load_before": load_before, "load_after": load_after,
                                           "steps_per_repeat": args.steps, "repeats": args.repeats,
                                           "warmup_steps": args.warmup,
                                           "results": results})
    print(f"\nfloat32 matmul peak (best 2048^3, cached or measured now): {peak / 1e9:.0f} GFLOP/s (MFU's denominator); "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; {os.cpu_count()} CPUs; {path}")
    for name, ceiling in ceilings.items():
        torch_r = best_torch.get(name)
        need = (f"; 1.3x the fastest torch ({torch_r['contender']}) would be {1.3 * torch_r['median']:,.0f} "
                f"({1.3 * torch_r['median'] / ceiling:.0%} of it)") if torch_r else ""
        print(f"{name}: ceiling at 100% MFU {ceiling:,.0f} tokens/s{need}")
        for key, r in results.items():
            cname = key.split("/", 1)[1]
            base = cname.replace(f", {ABLATED}", "")  # the same contender with its attention
            if key.startswith(f"{name}/") and base != cname and f"{name}/{base}" in results:
                full = results[f"{name}/{base}"]["median"]
                print(f"{name}: attention takes {1 - full / r['median']:.0%} of {base}'s step (the step without it: "
                      f"{r['median']:,.0f} tokens/s, {r['median'] / full:.2f}x)")
    print(common.table(rows, [("config", "config"), ("params", "params"), ("contender", "contender"),
                              ("tok_s", "tokens/s (median)"), ("range", "range"), ("vs_torch", "vs fastest torch"),
                              ("gflops", "model GFLOP/s"), ("mfu", "MFU"), ("compile_s", "compile s")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
