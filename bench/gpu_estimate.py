"""The step-time estimate from XLA:GPU's compiled program (olmo3eqx.gpu_estimate) against what GPUs measured: the 1B
on one H200 (docs/tpu-gpu.md) and two published 7B figures on H100 nodes. Each case's train step is compiled here,
on any host, for compile-only GPUs (jax's CUDA plugin: `pip install "jax[cuda12]"` matching the installed jax); the
estimate, the MFU it implies and estimate / measured are printed, however they fall. Writes one JSON.

    python bench/gpu_estimate.py                 # every case: bench/results/gpu_estimate.json
    python bench/gpu_estimate.py --only 1b       # cases whose name holds "1b"

The cases, each at the configuration its source states (what it does not state is said as an assumption):
- "1b-h200": configs/olmo3-1b.yaml as bench/gpu.py ran it ("1b 16x128 cudnn": 4 x 8192 tokens, remat dots, cuDNN
  attention) on one H200: 41,151 tokens/s, 37.4% MFU (docs/tpu-gpu.md, bench/measured/h200-2026-12-04/).
- "olmo-core-7b": OLMo-core's 7B (src/scripts/train/OLMo-7B.py when its README stated 10,000 tokens/s per H100 in
  bf16 and 13,000 with FP8): OLMo 2 7B's shape (Llama 2 7B's, QK-norm, OLMo's block, dolma2 vocabulary 100,352),
  every layer global, 4,096 tokens, 2 instances per GPU and micro-batch, 1,024 a step, FSDP with bf16 weights and
  float32 gradient reduction. Assumed: one node of 8 H100s (the script's launch default), cuDNN attention (it ran
  flash-attn or torch's SDPA). It ran no activation checkpointing; ours with remat none needs 231 GiB a GPU (XLA:GPU's
  rematerialization pass says so and gives up), so remat dots: the same matmuls, elementwise work recomputed. The FP8 figure is held against the bf16 program's estimate:
  no FP8 program is compiled here.
- "maxtext-llama2-7b": NVIDIA's MaxText recipe (JAX-Toolbox, rosetta/rosetta/projects/maxtext/README.md): Llama 2 7B,
  8 H100 80G SXM, 2 x 4,096 per GPU, FSDP 8, cuDNN flash attention (Transformer Engine), remat minimal_flash (ours:
  minimal_with_context), 0.721 s a step, 22.19 sequences/s: 11,361 tokens/s per GPU. In our model: OLMo's block and
  QK-norm where Llama has pre-norm and none (elementwise work the estimate costs by its bytes).

XLA's GPU flags are the ones train.py sets on a GPU host (olmo3eqx.jaxenv.GPU_XLA_FLAGS) unless XLA_FLAGS is set.
Every case compiles the whole model (the layer scan compiles one group however deep the model is).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

if __name__ == "__main__":
    from olmo3eqx import jaxenv

    os.environ.setdefault("XLA_FLAGS", " ".join(jaxenv.GPU_XLA_FLAGS))
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the plugin's check calls the driver

import common

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    target: str
    """XLA's device description the compile-only GPUs are made from: olmo3eqx/gpu_specs/<target>.txtpb (aot.gpu_spec)."""
    gpus: int
    model: dict
    """Fields of the model, over `base`'s."""
    base: str
    seq_len: int
    micro_batch: int
    """Rows per GPU and micro-batch."""
    global_batch: int
    measured: tuple[tuple[str, float], ...]
    """(what, tokens/s per GPU) measured or published."""
    source: str


ALL_GLOBAL = ("full_attention",) * 32
CASES = (
    Case("1b-h200", "h200", 1, dict(attention_impl="cudnn", remat="dots"), "configs/olmo3-1b.yaml", 8192, 4, 4,
         (("measured, bf16", 41_151.0),),
         "docs/tpu-gpu.md 'GPU: measured on one H200' (bench/gpu.py, variant '1b 16x128 cudnn'), 2026-12-04"),
    Case("olmo-core-7b", "h100_sxm", 8,
         dict(vocab_size=100_352, layer_types=ALL_GLOBAL, attention_impl="cudnn", remat="dots"),
         "configs/olmo3-7b-stage1.yaml", 4096, 2, 1024,
         (("published, bf16", 10_000.0), ("published, FP8", 13_000.0)),
         "allenai/OLMo-core README.md @8c03ca8a2 (2024-09-26), 'Official training scripts': 7B, 4K, BF16 10,000 TPS, "
         "FP8 13,000 TPS per device on H100s; src/scripts/train/OLMo-7B.py at the same commit"),
    Case("maxtext-llama2-7b", "h100_sxm", 8,
         dict(vocab_size=32_000, layer_types=ALL_GLOBAL, rope_theta=10_000.0, attention_impl="cudnn",
              remat="minimal_with_context", eos_token_id=2, pad_token_id=0),
         "configs/olmo3-7b-stage1.yaml", 4096, 2, 16,
         (("published, bf16", 22.19 * 4096 / 8),),
         "NVIDIA/JAX-Toolbox rosetta/rosetta/projects/maxtext/README.md @5a25a146 (2024-05-01; unchanged to "
         "5de03fdc, 2025-09-10): 7B, H100 80G SXM, 8 GPUs, BS/GPU 2, FSDP 8, Flash, minimal_flash, 0.721 s, "
         "22.19 sequences/s"),
)


def train_config(case: Case):
    """The case's TrainConfig: its model over the base preset's, FSDP over all its GPUs, micro-batches of
    case.micro_batch rows."""
    from olmo3eqx.config import DataConfig, MeshConfig, load_yaml

    base = load_yaml(REPO / case.base)
    model = dataclasses.replace(base.model, compute_dtype="bfloat16", param_dtype="float32", **case.model)
    cfg = common.train_config(model, case.seq_len, case.global_batch)
    return dataclasses.replace(cfg, data=DataConfig(seq_len=case.seq_len, global_batch=case.global_batch),
                               mesh=MeshConfig(fsdp=-1, max_per_device_batch=case.micro_batch,
                                                               node_devices=min(8, case.gpus)))


def run_case(case: Case) -> dict:
    """Compile the case's train step for its compile-only GPUs and estimate it."""
    from jax.experimental import topologies

    from olmo3eqx import flops, gpu_estimate
    from olmo3eqx.aot import gpu_spec
    from olmo3eqx.sharding import build_layout
    from olmo3eqx.step import make_train_step

    cfg = train_config(case)
    text = gpu_spec(f"{case.target}.txtpb")
    devices = list(topologies.get_topology_desc(platform="cuda", target_config=text,
                                                topology=f"1x1x{case.gpus}").devices)
    start = time.perf_counter()
    layout = build_layout(cfg, devices)
    compiled = make_train_step(cfg, layout).lower(layout.state_target(),
                                                  *layout.batch_target(cfg.data.seq_len)).compile()
    compile_s = time.perf_counter() - start
    est = gpu_estimate.estimate_step(cfg, layout, compiled)
    mem = compiled.memory_analysis()
    per_token = flops.train_flops_per_token(cfg.model, cfg.data.seq_len)
    return {"name": case.name, "device_kind": devices[0].device_kind, "gpus": case.gpus, "compile_s": compile_s,
            "source": case.source, "params": flops.param_count(cfg.model), "flops_per_token": per_token,
            "accum_steps": layout.plan.accum_steps, "micro_batch": layout.plan.micro_batch,
            "seq_len": cfg.data.seq_len, "estimate_lines": est.lines(), "step_s": est.seconds,
            "compute_s": est.compute_s, "communication_s": est.communication_s,
            "tokens_per_s": est.tokens_per_s, "mfu": est.mfu, "by_kind": est.by_kind(),
            "target_figures": gpu_estimate.figures_from_target(text),
            "memory_gib": None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                                    - mem.alias_size_in_bytes + mem.temp_size_in_bytes) / 2**30,
            "against": [{"what": what, "tokens_per_s": tps, "mfu": tps * per_token / est.gpu.bf16_flops,
                         "ratio": est.tokens_per_s / tps} for what, tps in case.measured]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated: run only cases whose name holds one of them")
    ap.add_argument("--json", default="gpu_estimate.json", help="file name under bench/results/")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    results = []
    for case in CASES:
        if args.only and not any(s in case.name for s in args.only.split(",")):
            continue
        r = run_case(case)
        results.append(r)
        print(f"\n== {case.name}: {r['params'] / 1e9:.2f}B on {r['gpus']} x {r['device_kind']} (compile-only), "
              f"{r['micro_batch'] // r['gpus']} x {r['seq_len']} tokens per GPU and micro-batch, {r['accum_steps']} micro-batch(es); "
              f"compiled in {r['compile_s']:.0f} s, XLA:GPU's memory {r['memory_gib']:.1f} GiB per GPU")
        print("\n".join(r["estimate_lines"]))
        for a in r["against"]:
            print(f"  against {a['what']}: {a['tokens_per_s']:,.0f} tokens/s per GPU (MFU {100 * a['mfu']:.1f}%): "
                  f"estimate / {a['what'].split(',')[0]} = {a['ratio']:.2f}")
        print(f"  source: {r['source']}")
    path = common.write_json(args.json, {"results": results, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                                         "wall_s": time.perf_counter() - start})
    print(f"\n{len(results)} case(s) in {time.perf_counter() - start:.0f} s; {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
