"""Attention backends against a float64 numpy reference and against `jax.nn.dot_product_attention`: causal global,
windows shorter than, equal to and longer than the sequence (W keys including the query), sequence lengths the
blocks do not divide, grouped- and multi-query heads, float32 and bfloat16, forward and gradients."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx.attention import IMPLEMENTATIONS, attention, blocked_attention, resolve
from olmo3eqx.config import ModelConfig
from olmo3eqx.model import init_model

REPO = Path(__file__).resolve().parents[1]


def reference(q, k, v, window, seg=None):
    """float64 numpy: query i sees keys j with i - W + 1 <= j <= i (all j <= i when window is None), and with
    `seg` (each position's document) only keys of its own document."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    seq, heads, dim = q.shape
    k = np.repeat(k, heads // k.shape[1], axis=1)
    v = np.repeat(v, heads // v.shape[1], axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dim)
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = (j <= i) & ((i - j < window) if window is not None else True)
    if seg is not None:
        allowed &= seg[:, None] == seg[None, :]
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


# (seq, heads, kv_heads, dim, window)
CASES = [
    (64, 4, 4, 16, None),  # causal global, blocks divide the sequence
    (37, 4, 4, 16, None),  # global, padded to the blocks
    (64, 4, 4, 16, 16),  # sliding, W < T, P = 2 previous blocks
    (37, 8, 2, 16, 5),  # sliding, GQA, padded, odd window
    (40, 4, 1, 8, 9),  # sliding, multi-query
    (33, 4, 2, 8, 1),  # a window of one key: the query itself
    (32, 4, 2, 8, 32),  # window equal to the sequence: global
    (24, 4, 2, 8, 100),  # window longer than the sequence: global
]


def inputs(seq, heads, kv_heads, dim, dtype=jnp.float32, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (seq, heads, dim), dtype), jax.random.normal(kk, (seq, kv_heads, dim), dtype),
            jax.random.normal(kv, (seq, kv_heads, dim), dtype))


@pytest.mark.parametrize("impl", ["blocked", "xla"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_numpy_reference(impl, case):
    seq, heads, kv_heads, dim, window = case
    q, k, v = inputs(seq, heads, kv_heads, dim)
    out = attention(q, k, v, window=window, impl=impl)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), reference(q, k, v, window), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_blocked_gradients_match_dot_product_attention(case):
    seq, heads, kv_heads, dim, window = case
    q, k, v = inputs(seq, heads, kv_heads, dim)
    cot = jax.random.normal(jax.random.key(7), q.shape)

    def loss(impl):
        return lambda q, k, v: jnp.sum(attention(q, k, v, window=window, impl=impl) * cot)

    ours = jax.grad(loss("blocked"), argnums=(0, 1, 2))(q, k, v)
    theirs = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]], ids=str)
def test_bfloat16_close_to_reference_and_to_dot_product_attention(case):
    seq, heads, kv_heads, dim, window = case
    q, k, v = inputs(seq, heads, kv_heads, dim, jnp.bfloat16)
    ours = attention(q, k, v, window=window, impl="blocked")
    theirs = attention(q, k, v, window=window, impl="xla")
    assert ours.dtype == jnp.bfloat16
    ref = reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), window)
    # bf16 probabilities and values: ~3 significant digits; both backends round the same way.
    np.testing.assert_allclose(np.asarray(ours, np.float32), ref, atol=3e-2, rtol=3e-2)
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), atol=2e-2, rtol=2e-2)
    g = [jax.grad(lambda q, k, v, i=i: jnp.sum(attention(q, k, v, window=window, impl=i).astype(jnp.float32) ** 2),
                  argnums=(0, 1, 2))(q, k, v) for i in ("blocked", "xla")]
    for a, b in zip(*g):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, atol=0.1 * np.abs(b).max(), rtol=5e-2)


def test_off_by_one_window_is_detected():
    """The comparison can fail: a window one key wider differs from the reference."""
    q, k, v = inputs(37, 8, 2, 16)
    out = np.asarray(attention(q, k, v, window=6, impl="blocked"))
    assert np.abs(out - reference(q, k, v, 5)).max() > 1e-2
    np.testing.assert_allclose(out, reference(q, k, v, 6), atol=2e-6, rtol=2e-5)


def test_future_keys_have_no_influence():
    q, k, v = inputs(40, 4, 2, 8)
    for window in (None, 7):
        jac = jax.jacobian(lambda k, w=window: blocked_attention(q, k, v, window=w)[10].sum())(k)
        assert np.all(np.asarray(jac)[11:] == 0)
        if window is not None:
            assert np.all(np.asarray(jac)[:10 - window + 1] == 0) and np.any(np.asarray(jac)[10 - window + 1] != 0)


@pytest.mark.parametrize("window", [None, 4096])
@pytest.mark.parametrize("documents", [False, True])
def test_blocked_masks_are_built_in_the_graph(window, documents):
    """The static causal/window masks are iotas in the graph, not numpy constants: at 8192 tokens those would be
    ~50 MB of literals in the lowered step (at stage 3's 65,536, ~4 GB, which no compile survives)."""
    seq = 8192
    x = jax.ShapeDtypeStruct((seq, 2, 16), jnp.float32)
    ids = jax.ShapeDtypeStruct((seq,), jnp.int32) if documents else None
    lowered = jax.jit(lambda q, k, v, s: blocked_attention(q, k, v, window=window, segment_ids=s)).lower(x, x, x, ids)
    assert len(lowered.as_text()) < 200_000


@pytest.mark.parametrize("impl", ["blocked", "xla"])
def test_leading_batch_axes_equal_vmap(impl):
    q, k, v = (jnp.stack([x, x * 0.5 + 1]) for x in inputs(37, 8, 2, 16))
    batched = attention(q, k, v, window=5, impl=impl)
    mapped = jax.vmap(lambda a, b, c: attention(a, b, c, window=5, impl=impl))(q, k, v)
    np.testing.assert_allclose(np.asarray(batched), np.asarray(mapped), atol=1e-6)


def test_backend_names():
    on_gpu = jax.default_backend() == "gpu"
    assert resolve("auto", jnp.bfloat16) == ("cudnn" if on_gpu else "blocked")
    assert resolve("auto", jnp.float32) == ("flash" if on_gpu else "blocked")  # cuDNN has no float32 flash kernel
    assert resolve("splash", jnp.float32) == "splash"
    assert {"blocked", "xla", "cudnn", "flash", "splash"} <= set(IMPLEMENTATIONS)
    with pytest.raises(ValueError, match="attention_impl"):
        resolve("flash2", jnp.float32)


MODEL = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, sliding_window=6, eos_token_id=1, pad_token_id=2,
                    compute_dtype="float32")


@pytest.mark.slow  # 28 s; the backends stay compared layer by layer in the default suite
def test_model_logits_and_gradients_same_with_blocked_and_xla():
    tokens = jax.random.randint(jax.random.key(1), (2, 29), 0, MODEL.vocab_size)
    models = {impl: init_model(dataclasses.replace(MODEL, attention_impl=impl), jax.random.key(0))
              for impl in ("blocked", "xla")}

    def loss(m):
        return jnp.mean(jax.nn.logsumexp(m(tokens), axis=-1))

    logits = {i: np.asarray(m(tokens)) for i, m in models.items()}
    np.testing.assert_allclose(logits["blocked"], logits["xla"], atol=2e-5, rtol=1e-5)
    grads = {i: jax.tree.leaves(eqx.filter_grad(loss)(m)) for i, m in models.items()}
    for a, b in zip(grads["blocked"], grads["xla"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)


@pytest.mark.slow  # ~15 s: a .ci/run share (.ci/share.py)
def test_model_on_a_batch_equals_model_vmapped_over_examples():
    """The train step feeds the batch as a leading axis (2-D matmuls); it must equal the per-example model."""
    model = init_model(MODEL, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 29), 0, MODEL.vocab_size)
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(jax.vmap(model)(tokens)), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model.hidden(tokens)), np.asarray(jax.vmap(model.hidden)(tokens)),
                               atol=2e-5, rtol=1e-5)


def score_elements(seq: int, window: int | None, heads: int = 2) -> int:
    """float32 elements of the score matmuls in the blocked forward pass, read off its jaxpr (independent of the
    formula in attention.blocked_score_bytes). bfloat16 inputs, so the PV matmul's output is not float32."""
    q, k, v = inputs(seq, heads, heads, 8, dtype=jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda q, k, v: blocked_attention(q, k, v, window=window))(q, k, v)
    return sum(int(np.prod(e.outvars[0].aval.shape)) for e in jaxpr.jaxpr.eqns
               if e.primitive.name == "dot_general" and e.outvars[0].aval.dtype == jnp.float32
               and e.params["preferred_element_type"] == jnp.float32)


@pytest.mark.parametrize("seq,window", [(64, None), (70, None), (64, 16), (64, 9), (40, 100)])
def test_blocked_score_bytes_counts_the_programs_scores(seq, window):
    from olmo3eqx.attention import blocked_score_bytes

    kinds = ("sliding_attention", "full_attention")
    for remat, layers in (("dots", kinds), ("full", kinds)):
        m = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=2, head_dim=8, sliding_window=window or seq, layer_types=layers,
                        remat=remat, eos_token_id=1, pad_token_id=2)
        per_layer = [4 * 3 * score_elements(seq, window), 4 * 3 * score_elements(seq, None)]
        want = sum(per_layer) if remat == "dots" else max(per_layer)
        assert blocked_score_bytes(m, seq, batch=3) == want, (remat, seq, window)


def test_blocked_refused_before_compiling_when_its_scores_cannot_fit(monkeypatch):
    """The 1B at 8,192 tokens, 4 rows per device, remat dots: 184 GiB of scores at least (hand count: 4 global layers
    of 16 heads x 2048^2 x 10 scores, 12 sliding of 16 x 4 x 2048 x 3 x 2048, 4 rows, 4 bytes) against an H200's
    ~139 GiB: refused in one sentence naming flash and cudnn; remat full (one layer's 12.9 GB) passes."""
    from olmo3eqx import step as step_mod
    from olmo3eqx.attention import blocked_score_bytes
    from olmo3eqx.config import ConfigError, DataConfig, MeshConfig, TrainConfig, load_yaml
    from olmo3eqx.sharding import build_layout

    one_b = dataclasses.replace(load_yaml(REPO / "configs" / "olmo3-1b.yaml").model, attention_impl="blocked")
    assert blocked_score_bytes(one_b, 8192, 4) == 4 * 16 * 4 * (4 * 2048**2 * 10 + 12 * 4 * 2048 * 3 * 2048)
    monkeypatch.setattr(step_mod, "device_memory", lambda device: 139 * 2**30)
    cfg = TrainConfig(model=one_b, data=DataConfig(seq_len=8192, global_batch=4),
                      mesh=MeshConfig(max_per_device_batch=4))
    layout = build_layout(cfg, jax.devices()[:1])
    with pytest.raises(ConfigError, match=r"'blocked' needs at least 18\d\.\d GiB .* use 'flash' or 'cudnn'"):
        step_mod.check_blocked_memory(cfg, layout)
    full = dataclasses.replace(cfg, model=dataclasses.replace(one_b, remat="full"))
    step_mod.check_blocked_memory(full, layout)
