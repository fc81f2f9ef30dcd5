"""Gradient accumulation over a data axis that runs across nodes: each data replica sums its micro-batches and the
step reduces them over data once (step.per_replica), so the bytes that cross nodes a step do not grow with the
accumulation, and the numbers are those of one micro-batch of the whole batch (float32 compute, to reassociation).

Two simulated nodes of 4 devices (mesh.node_devices 4, data 2 across them), the collectives read from the compiled
program (olmo3eqx.collectives, as the dry run prints them)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx import aot
from olmo3eqx import loss as loss_lib
from olmo3eqx.config import FULL, SLIDING, DataConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig
from olmo3eqx.model import cast_floating
from olmo3eqx.precision import traced_gathering
from olmo3eqx.sharding import batch_sharding, build_layout, on_mesh
from olmo3eqx.step import make_gradients

MODEL = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    layer_types=(SLIDING, FULL), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    sliding_window=8, eos_token_id=1, pad_token_id=2, compute_dtype="float32")
SEQ, BATCH = 32, 32
SCALARS = 64
"""Bytes per device of a few float32 scalars (the loss sums, the labelled-token count) all-reduced across nodes."""


def two_nodes(accum: int) -> TrainConfig:
    """data 2 (one per node) x fsdp 4 on 8 devices, BATCH rows in `accum` micro-batches."""
    per_device = BATCH // 8 // accum
    return TrainConfig(steps=10, model=MODEL, data=DataConfig(seq_len=SEQ, global_batch=BATCH),
                       optim=OptimConfig(lr=1e-3, warmup_steps=2),
                       mesh=MeshConfig(data=2, fsdp=4, node_devices=4,
                                       max_per_device_batch=per_device))


def tensor_nodes(accum: int) -> TrainConfig:
    """data 2 (one per node) x fsdp 2 x tensor 2 on 8 devices, BATCH rows in `accum` micro-batches."""
    return dataclasses.replace(two_nodes(accum), mesh=MeshConfig(data=2, fsdp=2, tensor=2, node_devices=4,
                                                                 max_per_device_batch=BATCH // 4 // accum))


def traffic(cfg):
    layout = build_layout(cfg)
    return aot.compile_step(cfg, layout, predict_time=False).collectives, layout


def gradients(cfg):
    """(grads, CE sum, z-loss sum) of the step's accumulation (step.make_gradients) on cfg's mesh."""
    layout = build_layout(cfg)
    mesh, fn = layout.mesh, make_gradients(cfg, layout)

    def grad(model, tokens, mask):
        return fn(cast_floating(model, jnp.float32), tokens, mask)[:3]

    jitted = jax.jit(on_mesh(mesh, traced_gathering(cfg.mesh.gather_dtype, grad)),
                     in_shardings=(layout.shardings.model, batch_sharding(mesh, 2), batch_sharding(mesh, 1)),
                     out_shardings=(layout.shardings.model, None, None))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL.vocab_size, (BATCH, SEQ)).astype(np.int32)
    mask = (rng.random(BATCH) > 0.2).astype(np.float32)
    return jitted(layout.init_state(cfg).model, tokens, mask)


def assert_same_numbers(cfg_a, cfg_b):
    (g_a, ce_a, z_a), (g_b, ce_b, z_b) = gradients(cfg_a), gradients(cfg_b)
    np.testing.assert_allclose(float(ce_a), float(ce_b), rtol=1e-6)
    np.testing.assert_allclose(float(z_a), float(z_b), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_a), jax.tree.leaves(g_b), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        # summed in another order: ~1e-6 of a leaf's norm; near-cancelling elements carry it at the leaf's scale
        assert np.linalg.norm(a - b) <= 4e-6 * np.linalg.norm(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_splash_attention_runs_in_the_replica_region():
    """Splash (TPU's kernel, interpreted on CPU) runs in its own shard_map, nested in the per-replica region over the
    rows left to it (fsdp): same numbers with and without accumulation."""
    def splash(accum):
        cfg = two_nodes(accum)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention_impl="splash"))

    assert_same_numbers(splash(1), splash(2))


def test_accumulation_does_not_multiply_the_bytes_that_cross_nodes(monkeypatch):
    """Accumulation 4 sends across nodes what accumulation 1 does (the loss's scalars aside): before, every
    micro-batch's gradients were all-reduced over data (4x). The loss in chunks (a small LOGITS_BUDGET) runs the
    per-device loss (loss.per_device) and the embedding's hierarchical gradient inside the per-replica region."""
    monkeypatch.setattr(loss_lib, "LOGITS_BUDGET", 1 << 10)
    (t1, layout1), (t4, layout4) = traffic(two_nodes(1)), traffic(two_nodes(4))
    assert (layout1.plan.accum_steps, layout4.plan.accum_steps) == (1, 4)
    assert t1.total(True) > 0
    assert abs(t4.total(True) - t1.total(True)) <= SCALARS, (t1.lines(), t4.lines())
    assert_same_numbers(two_nodes(1), two_nodes(4))


def test_a_tensor_split_accumulates_per_replica_too(monkeypatch):
    """With a tensor axis the micro-batches run in the per-replica region as well: accumulation 4 sends across nodes
    what accumulation 1 does (before, each micro-batch's gradients were all-reduced over data and the embedding's and
    LM head's over data and fsdp at once: 0.77 MiB per device a step here against 0.38). Its numbers: test_step's
    data 2 x fsdp 2 x tensor 2 row."""
    monkeypatch.setattr(loss_lib, "LOGITS_BUDGET", 1 << 10)
    (t1, layout1), (t4, layout4) = traffic(tensor_nodes(1)), traffic(tensor_nodes(4))
    assert (layout1.plan.accum_steps, layout4.plan.accum_steps) == (1, 4)
    assert t1.total(True) > 0
    assert abs(t4.total(True) - t1.total(True)) <= SCALARS, (t1.lines(), t4.lines())
