"""The "splash" backend (Pallas splash attention, in interpret mode on this CPU) against a float64 numpy reference
and `jax.nn.dot_product_attention`: sliding (a LocalMask) and global (a CausalMask) layers, grouped- and multi-query
heads, sequences the blocks do not divide, several blocks per sequence, float32 and bfloat16, forward and
gradients; under a mesh (shard_map over batch and heads); and the whole model against `transformers`' Olmo3.

Interpret mode is slow (seconds per kernel), so the shapes are the smallest that still give several blocks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import olmo3eqx.attention as attention_module
from olmo3eqx import hf
from olmo3eqx.attention import BATCH_AXES, attention, splash_blocks
from olmo3eqx.sharding import BATCH_AXES as LAYOUT_BATCH_AXES, AXES, on_mesh
from test_attention import inputs, reference

BLOCK = 128  # the smallest splash block: a 256-token sequence is 2 x 2 blocks

# (seq, heads, kv_heads, dim, window)
CASES = [
    (256, 4, 4, 32, None),  # global: causal over 2 x 2 blocks, one all-masked block skipped
    (200, 8, 2, 32, 37),  # sliding, GQA, padded to 256: a window that ends inside a block
    (256, 4, 1, 16, 150),  # sliding, multi-query, the window reaches back across a block boundary
]


def splash(window, block=BLOCK):
    return jax.jit(lambda q, k, v: attention(q, k, v, window=window, impl="splash", block_q=block, block_kv=block))


def xla(window):
    return jax.jit(lambda q, k, v: attention(q, k, v, window=window, impl="xla"))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_gradients_match_the_references(case):
    seq, heads, kv_heads, dim, window = case
    q, k, v = inputs(seq, heads, kv_heads, dim)
    out = splash(window)(q, k, v)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), reference(q, k, v, window), atol=2e-6, rtol=2e-5)
    cot = jax.random.normal(jax.random.key(7), q.shape)

    def grads(fn):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * cot), argnums=(0, 1, 2)))(q, k, v)

    for a, b in zip(grads(splash(window)), grads(xla(window))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


def test_bfloat16_forward_and_gradients_close_to_dot_product_attention():
    seq, heads, kv_heads, dim, window = CASES[1]
    q, k, v = inputs(seq, heads, kv_heads, dim, jnp.bfloat16)
    ours, theirs = splash(window)(q, k, v), xla(window)(q, k, v)
    assert ours.dtype == jnp.bfloat16
    ref = reference(*(x.astype(jnp.float32) for x in (q, k, v)), window)
    # bf16 inputs, probabilities and values: ~3 significant digits (as the blocked backend's test).
    np.testing.assert_allclose(np.asarray(ours, np.float32), ref, atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), atol=2e-2, rtol=2e-2)
    g = [jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(
        q, k, v) for f in (splash(window), xla(window))]
    for a, b in zip(*g):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, atol=0.1 * np.abs(b).max(), rtol=5e-2)


def test_off_by_one_window_is_detected():
    """The comparison can fail: the kernel's window one key wider differs from the reference."""
    seq, heads, kv_heads, dim, window = CASES[1]
    q, k, v = inputs(seq, heads, kv_heads, dim)
    out = np.asarray(splash(window + 1)(q, k, v))
    assert np.abs(out - reference(q, k, v, window)).max() > 1e-2
    np.testing.assert_allclose(out, reference(q, k, v, window + 1), atol=2e-6, rtol=2e-5)


def test_blocks_follow_the_config_and_the_sequence():
    # on this CPU the default block is DEFAULT_SPLASH_BLOCK (512), clipped to the sequence rounded up to 128 lanes
    assert splash_blocks(8192, None, None) == (8192, 512, 512)
    assert splash_blocks(8192, 2048, 1024) == (8192, 2048, 1024)
    assert splash_blocks(29, None, None) == (128, 128, 128)
    assert splash_blocks(300, 256, None) == (768, 256, 384)  # padded to a multiple of both blocks


@pytest.mark.parametrize("kind, dim, block", [("TPU7x", 128, 2048), ("TPU7x", 256, 1024), ("TPU v5", 128, 512),
                                               ("TPU v5", 256, 512), ("cpu", 256, 512)])
def test_default_blocks_per_chip_and_head_width(monkeypatch, kind, dim, block):
    """Ironwood's 2048 blocks, halved for 256-wide heads (2048 x 256 overflows its scoped VMEM); 512 elsewhere."""
    monkeypatch.setattr(attention_module, "target_device", lambda: ("tpu", kind))
    assert splash_blocks(8192, None, None, dim) == (8192, block, block)
    assert splash_blocks(8192, 256, None, dim) == (8192, 256, block)  # a configured block wins


def test_under_a_mesh_each_shard_runs_the_kernel_on_its_batch_rows_and_heads():
    """With the mesh in context (as the train step traces), splash runs in a shard_map: batch over data x fsdp,
    heads over tensor, the same numbers as without a mesh."""
    assert BATCH_AXES == LAYOUT_BATCH_AXES
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), AXES, axis_types=(AxisType.Auto,) * 3)
    seq, heads, kv_heads, dim, window = CASES[1]
    q, k, v = (jnp.stack([x, x * 0.5 + 1, -x, x * 2]) for x in inputs(seq, heads, kv_heads, dim))
    sharded = jax.jit(on_mesh(mesh, splash(window)))
    batch = NamedSharding(mesh, P(LAYOUT_BATCH_AXES))
    q, k, v = (jax.device_put(x, batch) for x in (q, k, v))
    assert "shard_map" in str(jax.make_jaxpr(on_mesh(mesh, splash(window)))(q, k, v))
    np.testing.assert_allclose(np.asarray(sharded(q, k, v)), np.asarray(xla(window)(q, k, v)), atol=1e-5, rtol=2e-5)


def test_whole_model_matches_transformers(tmp_path):
    """An OLMo 3 with sliding (window 40 < seq 150) and global layers and GQA, converted from a random
    `transformers` Olmo3, gives transformers' logits with splash attention."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from olmo3eqx.tools.convert import save_tiny_hf_model

    save_tiny_hf_model(tmp_path, seed=0, num_hidden_layers=4, sliding_window=40)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    model, cfg = hf.load_hf(tmp_path)
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    model = dataclasses.replace(model, cfg=dataclasses.replace(cfg, attention_impl="splash", attention_block_q=BLOCK,
                                                               attention_block_kv=BLOCK))
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 150))
    with torch.no_grad():
        want = ref(input_ids=torch.from_numpy(tokens)).logits.numpy()
    got = np.asarray(jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens, jnp.int32)))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5 * scale)
