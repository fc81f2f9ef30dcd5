"""Context parallelism on CPU: the same train step (configs/tiny.yaml's model on packed documents at a longer
sequence) on 4 simulated CPU devices, once with the sequence whole on each device and the rows split over fsdp 4
(CP-1), once with each sequence split over context 4 (CP-4: fsdp 1, parameters sharded over the context ranks as
over fsdp; one instance a micro-batch, as the presets run, so 4 accumulation steps). Same model, batch, tokens per
device and weight memory; what differs is what attention communicates, and CP-4 gathers the weights and
reduce-scatters their gradients once a micro-batch.
Prints per variant the median step time, XLA:CPU's memory per device and every byte the compiled step sends
(olmo3eqx.collectives: per device and step, the ring algorithm's count), the part over the context axis (at fsdp 1
the weights' gathers too, beside the keys' and values' gathers, their gradients' reduce-scatters and the label
shift), the bytes CP-4 adds over CP-1, and the first step's loss (the same number: the split changes where the
work runs, not what is computed).

    python bench/bench_context.py [--seq 2048] [--batch 4] [--documents 8] [--steps 3] [--contexts 1 4]

Writes bench/results/context.json; the table last. Timings on simulated devices share the host's cores:
a CPU step of 4 devices runs their work on those cores, so the times say what the split costs in work and
communication on one host, not how a GPU node would scale.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common

DEVICES = 4

if __name__ == "__main__":
    common.clean_xla_flags()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={DEVICES}")


def variant_config(base, context: int):
    """`base` with the rows over fsdp and the sequence over `context` on the DEVICES devices, one instance a device
    (CP-1) or a context group (CP-N, as the presets run: the rest of the batch is accumulation). More than one
    instance a context group per micro-batch costs all-to-alls around every projection (the flattened rows x sequence
    of a group's instances do not split as the sequence does), which this benchmark leaves out."""
    mesh = dataclasses.replace(base.mesh, data=1, fsdp=DEVICES // context, context=context, tensor=1,
                               max_per_device_batch=1)
    return dataclasses.replace(base, mesh=mesh)


def measure(cfg, devices, steps: int, documents: int) -> dict:
    """One variant: the step compiled ahead of time and its collectives counted, then warm-up + `steps` timed
    steps, each on a different random packed batch."""
    import jax

    from olmo3eqx import aot
    from olmo3eqx.sharding import build_layout
    from olmo3eqx.step import make_train_step

    layout = build_layout(cfg, devices)
    report = aot.compile_step(cfg, layout, predict_time=False)
    traffic = report.collectives
    step, state = make_train_step(cfg, layout), layout.init_state(cfg)
    batches = common.random_batches(cfg, layout, steps + 1, documents=documents)
    start = time.perf_counter()
    state, metrics = step(state, *batches[0])
    first_loss = float(metrics["train/loss"])
    compile_and_first = time.perf_counter() - start
    times = []
    for batch in batches[1:]:
        start = time.perf_counter()
        state, metrics = step(state, *batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return {"mesh": dict(layout.mesh.shape), "batch": {"per_device": layout.plan.per_device_batch,
                                                       "accum": layout.plan.accum_steps},
            "tokens_per_device": layout.tokens_per_device(cfg.data.seq_len), "step_s": times,
            "compile_and_first_s": compile_and_first, "first_loss": first_loss, "memory": report.memory,
            "collectives": traffic.to_json(), "within_bytes": traffic.total(False),
            "context_bytes": traffic.by_axes().get(("context",), (0.0, 0.0))[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=2048, help="tokens per instance (split into --contexts chunks)")
    ap.add_argument("--batch", type=int, default=4, help="instances per step (global batch)")
    ap.add_argument("--documents", type=int, default=8, help="packed documents per instance")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1, DEVICES], help="context sizes compared")
    ap.add_argument("--json", default="context.json", help="results file (bench/results/ unless a path)")
    args = ap.parse_args(argv)

    import jax

    from olmo3eqx.config import load_yaml

    devices = jax.devices()[:DEVICES]
    if len(devices) < DEVICES:
        raise SystemExit(f"needs {DEVICES} devices, JAX has {len(devices)}: run it as its own process")
    tiny = load_yaml(common.REPO / "configs" / "tiny.yaml")
    model = dataclasses.replace(tiny.model, max_position_embeddings=args.seq)
    base = common.train_config(model, args.seq, args.batch, packing=True)
    results = {}
    for context in args.contexts:
        name = f"CP-{context}"
        results[name] = measure(variant_config(base, context), devices, args.steps, args.documents)
        print(name, {k: v for k, v in results[name].items() if k != "collectives"}, flush=True)
    mib, gib = 2**20, 2**30
    reference = results[f"CP-{args.contexts[0]}"]
    rows = []
    for name, r in results.items():
        median = common.median(r["step_s"])
        rows.append({"variant": name, "mesh": f"fsdp {r['mesh']['fsdp']} x context {r['mesh'].get('context', 1)}",
                     "batch": f"{r['batch']['per_device']} x {r['batch']['accum']}",
                     "tokens": f"{r['tokens_per_device']:,}", "step": f"{median * 1e3:,.0f}",
                     "tps": f"{args.batch * args.seq / median:,.0f}", "memory": f"{r['memory']['total'] / gib:.3f}",
                     "sent": f"{r['within_bytes'] / mib:,.2f}", "context": f"{r['context_bytes'] / mib:,.2f}",
                     "added": f"{(r['within_bytes'] - reference['within_bytes']) / mib:+,.2f}",
                     "loss": f"{r['first_loss']:.5f}"})
    path = common.write_json(args.json, {"args": vars(args), "model": dataclasses.asdict(model),
                                         "provenance": common.provenance(), "results": results})
    m = common.machine()
    print(f"\n{args.batch} x {args.seq} tokens a step ({args.documents} packed documents an instance), "
          f"configs/tiny.yaml's model, on {DEVICES} simulated CPU devices of one {m['cpus']}-core host (load average "
          f"{m['load_average'][0]:.1f}); median of {args.steps} steps; MiB each device sends per step (ring "
          f"algorithm; all within the host); {path}")
    print(common.table(rows, [("variant", "variant"), ("mesh", "mesh"), ("batch", "rows x accum"),
                              ("tokens", "tokens/device"),
                              ("step", "step ms"), ("tps", "tokens/s"), ("memory", "GiB/device"),
                              ("sent", "MiB sent/device"), ("context", "over context"),
                              ("added", f"vs {next(iter(results))}"), ("loss", "step-1 loss")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
