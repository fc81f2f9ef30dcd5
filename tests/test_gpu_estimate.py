"""olmo3eqx.gpu_estimate: the roofline arithmetic against hand computations. Hand-written XLA:GPU-shaped programs
(a GEMM fusion inside loops of stated trip counts, an all-gather within a node and across two) in the default suite;
with jax's CUDA plugin (-m gpu_small), programs XLA:GPU compiles for compile-only H100s: one GEMM, the same GEMM in a
loop, the GEMM as cuBLAS's custom call, an all-gather over 8 GPUs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from olmo3eqx.aot import gpu_spec
from olmo3eqx.gpu_estimate import estimate, figures_from_target, gpu_for

REPO = Path(__file__).resolve().parents[1]
H100 = gpu_for("NVIDIA H100 80GB HBM3")
N = 2048  # a bf16 N^3 GEMM: 17.4 us of FLOPs at 989 TFLOP/s against 7.5 us of bytes at 3.35 TB/s (compute-bound)

GEMM = f"""
%gemm (p0: bf16[{N},{N}], p1: bf16[{N},{N}]) -> bf16[{N},{N}] {{
  %p0 = bf16[{N},{N}]{{1,0}} parameter(0)
  %p1 = bf16[{N},{N}]{{1,0}} parameter(1)
  ROOT %dot = bf16[{N},{N}]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}

%inner (t: (s32[], bf16[{N},{N}])) -> (s32[], bf16[{N},{N}]) {{
  %t = (s32[], bf16[{N},{N}]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[{N},{N}]{{1,0}} get-tuple-element(%t), index=1
  %y = bf16[{N},{N}]{{1,0}} fusion(%x, %x), kind=kCustom, calls=%gemm
  ROOT %r = (s32[], bf16[{N},{N}]{{1,0}}) tuple(%i, %y)
}}

%outer (t2: (s32[], bf16[{N},{N}])) -> (s32[], bf16[{N},{N}]) {{
  %t2 = (s32[], bf16[{N},{N}]{{1,0}}) parameter(0)
  ROOT %w = (s32[], bf16[{N},{N}]{{1,0}}) while(%t2), condition=%cond, body=%inner, backend_config={{"known_trip_count":{{"n":"7"}}}}
}}

%cond (c: (s32[], bf16[{N},{N}])) -> pred[] {{
  %c = (s32[], bf16[{N},{N}]{{1,0}}) parameter(0)
  ROOT %f = pred[] constant(false)
}}

ENTRY %main (a: bf16[{N},{N}]) -> bf16[{N},{N}] {{
  %a = bf16[{N},{N}]{{1,0}} parameter(0)
  %once = bf16[{N},{N}]{{1,0}} fusion(%a, %a), kind=kCustom, calls=%gemm
  %zero = s32[] constant(0)
  %init = (s32[], bf16[{N},{N}]{{1,0}}) tuple(%zero, %once)
  %loop = (s32[], bf16[{N},{N}]{{1,0}}) while(%init), condition=%cond, body=%outer, backend_config={{"known_trip_count":{{"n":"3"}}}}
  ROOT %out = bf16[{N},{N}]{{1,0}} get-tuple-element(%loop), index=1
}}
"""
GATHER = """
ENTRY %main (x: f32[4,16]) -> f32[32,16] {
  %x = f32[4,16]{1,0} parameter(0)
  %ags = (f32[4,16]{1,0}, f32[32,16]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  ROOT %agd = f32[32,16]{1,0} all-gather-done(%ags)
}
"""


def test_gemm_fusion_costs_flops_over_peak_and_loops_multiply_by_trip_count():
    est = estimate(GEMM, H100)
    flops = 2 * N**3
    by_count = sorted((k.count, k.flops, k.kind) for k in est.kernels)
    assert by_count == [(1, flops, "matmul"), (21, flops, "matmul")]  # once, then 3 x 7 in the nested loops
    assert est.compute_s == pytest.approx(22 * flops / 989e12, rel=1e-12)
    assert est.unknown_loops == 0


def test_memory_bound_kernel_costs_its_bytes_over_hbm():
    small = GEMM.replace(f"{N}", "64")  # 64^3: 0.5 MFLOP against 24 KiB, bound by the bytes
    est = estimate(small, H100)
    once = next(k for k in est.kernels if k.count == 1)
    assert once.bytes == 3 * 64 * 64 * 2
    assert once.seconds == pytest.approx(once.bytes / 3.35e12, rel=1e-12)


SCAN_STEP = """
%take (w: bf16[8,64,64], i: s32[]) -> bf16[64,64] {
  %w = bf16[8,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = bf16[1,64,64]{2,1,0} dynamic-slice(%w, %i, %z, %z), dynamic_slice_sizes={1,64,64}
  ROOT %r = bf16[64,64]{1,0} bitcast(%ds)
}

%put (buf: bf16[8,64,64], u: bf16[64,64], j: s32[]) -> bf16[8,64,64] {
  %buf = bf16[8,64,64]{2,1,0} parameter(0)
  %u = bf16[64,64]{1,0} parameter(1)
  %j = s32[] parameter(2)
  %zero = s32[] constant(0)
  %u3 = bf16[1,64,64]{2,1,0} bitcast(%u)
  ROOT %dus = bf16[8,64,64]{2,1,0} dynamic-update-slice(%buf, %u3, %j, %zero, %zero)
}

ENTRY %main (w: bf16[8,64,64], i: s32[]) -> bf16[8,64,64] {
  %w = bf16[8,64,64]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %one = bf16[64,64]{1,0} fusion(%w, %i), kind=kLoop, calls=%take
  ROOT %two = bf16[8,64,64]{2,1,0} fusion(%w, %one, %i), kind=kLoop, calls=%put
}
"""


def test_a_scan_step_moves_its_slice_not_the_stacked_array():
    """A layer scan's step reads one layer of the stacked weights (a fusion that only dynamic-slices its operand)
    and writes one layer of the stacked outputs in place (a dynamic-update-slice root): 8 KiB each, not 64 KiB."""
    layer, index = 64 * 64 * 2, 4
    moved = {k.name: k.bytes for k in estimate(SCAN_STEP, H100).kernels}
    assert moved == {"one": layer + index + layer, "two": layer + layer + index}  # (read, read, write), in place


def test_collective_costs_its_bytes_over_the_link_it_crosses():
    mesh = Mesh(np.asarray(jax.devices()[:8]), ("fsdp",))
    sent = 7 / 8 * 32 * 16 * 4  # ring all-gather: (n-1)/n of the gathered f32[32,16]
    one_node = estimate(GATHER, H100, mesh=mesh)
    assert (one_node.within_bytes, one_node.across_bytes) == (sent, 0.0)
    assert one_node.communication_s == pytest.approx(sent / 450e9, rel=1e-12)
    two_nodes = estimate(GATHER, H100, mesh=mesh, granules=np.repeat([0, 1], 4))
    assert two_nodes.communication_s == pytest.approx(sent / 50e9, rel=1e-12)
    assert two_nodes.seconds == two_nodes.communication_s  # no compute: the step is the communication


def test_figures_match_xlas_device_descriptions():
    """The table's datasheet figures against what XLA's own H100 and H200 descriptions state (rates x cores x
    clock x 2): within 0.2% (XLA's 1.8295 GHz tensor clock, 3.352 TB/s)."""
    for name, kind in (("h100_sxm", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200 141GB HBM3e")):
        stated = figures_from_target(gpu_spec(f"{name}.txtpb"))
        gpu = gpu_for(kind)
        assert set(stated) == {"hbm", "bf16_flops", "fp8_flops", "tf32_flops", "fp32_flops"}
        for field, value in stated.items():
            assert getattr(gpu, field) == pytest.approx(value, rel=2e-3), (name, field)


def test_unknown_gpu_is_refused_by_name():
    with pytest.raises(ValueError, match="no roofline figures for 'NVIDIA A40'"):
        gpu_for("NVIDIA A40")


def test_lines_name_it_an_estimate_with_its_mfu():
    est = estimate(GEMM, H100, tokens_per_device=1000, model_flops=22.0 * 2 * N**3)
    text = "\n".join(est.lines())
    assert "ESTIMATE" in text and "not a measurement" in text
    assert "implied MFU 100.0%" in text  # the model FLOPs are exactly the GEMMs, each at peak


needs_cuda = pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None and
                                importlib.util.find_spec("jax_cuda13_plugin") is None,
                                reason="jax's CUDA plugin is not installed (pip install \"jax[cuda12]\")")


def h100s(count: int) -> list:
    from jax.experimental import topologies

    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    text = gpu_spec("h100_sxm.txtpb")
    return list(topologies.get_topology_desc(platform="cuda", target_config=text, topology=f"1x1x{count}").devices)


@pytest.mark.gpu_small
@needs_cuda
def test_compiled_gemm_and_loop_on_an_h100():
    mesh = Mesh(np.asarray(h100s(1)), ("x",))
    a = jax.ShapeDtypeStruct((N, N), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    one = estimate(jax.jit(lambda x, y: x @ y).lower(a, a).compile().as_text(), H100)
    assert one.compute_s == pytest.approx(2 * N**3 / 989e12, rel=1e-9)
    cublas = jax.jit(lambda x, y: x @ y).lower(a, a).compile({"xla_gpu_enable_triton_gemm": False}).as_text()
    assert "__cublas$lt$matmul" in cublas  # the same GEMM as a cuBLAS custom call
    assert estimate(cublas, H100).compute_s == pytest.approx(2 * N**3 / 989e12, rel=1e-9)
    looped = jax.jit(lambda x, y: jax.lax.fori_loop(0, 5, lambda i, z: (z @ y).astype(z.dtype), x))
    five = estimate(looped.lower(a, a).compile().as_text(), H100)
    gemm = next(k for k in five.kernels if k.kind == "matmul")
    assert (gemm.count, gemm.flops) == (5, 2 * N**3)
    assert five.by_kind()["matmul"][0] == pytest.approx(5 * 2 * N**3 / 989e12, rel=1e-9)
    # the rest is XLA's copies of the carried array (and the loop counter), each at its bytes over HBM
    rest = [k for k in five.kernels if k.kind == "memory"]
    assert five.compute_s - five.by_kind()["matmul"][0] == pytest.approx(
        sum(k.count * k.bytes for k in rest) / 3.35e12, rel=1e-9)


@pytest.mark.gpu_small
@needs_cuda
def test_compiled_all_gather_over_8_h100s():
    mesh = Mesh(np.asarray(h100s(8)), ("fsdp",))
    x = jax.ShapeDtypeStruct((8 * 1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
    gathered = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(mesh, P()))
    est = estimate(gathered.lower(x).compile().as_text(), H100, mesh=mesh)
    sent = 7 / 8 * 8 * 1024 * 1024 * 2
    assert (est.within_bytes, est.across_bytes) == (sent, 0.0)
    assert est.communication_s == pytest.approx(sent / 450e9, rel=1e-12)


@pytest.mark.gpu_small
@needs_cuda
def test_compiled_cudnn_attention_counts_its_visible_pairs():
    """cuDNN's fused attention on an H100, causal and with a window of 256 keys: forward 2 matmuls and backward 5,
    each 2 x head_dim FLOPs per visible (query, key) pair: queries x mean_keys (flops.mean_keys)."""
    from olmo3eqx.flops import mean_keys

    mesh = Mesh(np.asarray(h100s(1)), ("x",))
    b, s, h, d = 2, 1024, 4, 128
    x = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    for window in (None, 256):
        def loss(q, k, v):
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn",
                                               local_window_size=None if window is None else (window - 1, 0))
            return out.astype(jnp.float32).sum()

        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().as_text()
        kernels = [k for k in estimate(text, H100).kernels if k.kind == "attention"]
        pairs = b * h * s * mean_keys(s, window)
        assert sorted(k.flops for k in kernels) == [2 * 2 * d * pairs, 5 * 2 * d * pairs], window
