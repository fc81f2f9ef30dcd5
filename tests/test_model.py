"""The OLMo3 model on its own (no torch): shapes, causality and the window by gradients, scan vs unrolled,
remat, abstract init of the 7B config, init statistics, mixed precision."""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx.config import FULL, SLIDING, ModelConfig
from olmo3eqx.model import MAX_UNROLLED_GROUPS, OLMo3, abstract_model, init_model, num_params

TINY = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=64, eos_token_id=0,
                   pad_token_id=1, param_dtype="float32", compute_dtype="float32")
SEQ = 16


@eqx.filter_jit
def fwd(model: OLMo3, tokens):
    return model(tokens)


def tiny(**changes) -> ModelConfig:
    return dataclasses.replace(TINY, **changes)


def make(cfg: ModelConfig, seed: int = 0) -> OLMo3:
    """A random model with OLMo3.init's structure, filled from numpy (norm weights around 1).

    `init_model` itself costs ~10 s per new config on a 2-core CPU (its truncated normals compile op by
    op, or slowly under jit); only test_init_statistics needs it.
    """
    rng = np.random.default_rng(seed)
    std = cfg.initializer_range

    def fill(path, x):
        if "norm" in jax.tree_util.keystr(path):
            return jnp.asarray(1 + 0.1 * rng.standard_normal(x.shape), x.dtype)
        return jnp.asarray(std * rng.standard_normal(x.shape), x.dtype)

    params, static = eqx.partition(abstract_model(cfg), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return eqx.combine(jax.tree_util.tree_map_with_path(fill, params), static)


@functools.cache
def influence(layer_types: tuple[str, ...]) -> np.ndarray:
    """influence[i, j] = |d (logits[i] . r) / d (input embedding at position j)| for a TINY model, tokens distinct.

    With distinct tokens, the embedding row of token j is the input of position j alone, so differentiating
    through the embedding table measures exactly how position j's input reaches position i's output.
    """
    model = make(tiny(num_hidden_layers=len(layer_types), layer_types=layer_types))
    tokens = jnp.arange(SEQ, dtype=jnp.int32)
    r = jax.random.normal(jax.random.key(1), (model.cfg.vocab_size,))

    def out(embed):
        return dataclasses.replace(model, embed=embed)(tokens) @ r

    jac = jax.jit(jax.jacrev(out))(model.embed)  # [seq_i, vocab, hidden]
    return np.asarray(jnp.linalg.norm(jac[:, tokens, :], axis=-1))  # [seq_i, seq_j]


def test_output_shape_and_dtype():
    tokens = jnp.arange(SEQ, dtype=jnp.int32) % TINY.vocab_size
    for compute in ("float32", "bfloat16"):
        logits = fwd(make(tiny(compute_dtype=compute)), tokens)
        assert logits.shape == (SEQ, TINY.vocab_size) and logits.dtype == jnp.float32
        assert np.isfinite(np.asarray(logits)).all()
    batched = jax.vmap(fwd, in_axes=(None, 0))(make(TINY), jnp.stack([tokens, tokens[::-1]]))
    assert batched.shape == (2, SEQ, TINY.vocab_size)


def test_causal_by_gradients():
    inf = influence((SLIDING, FULL))
    future = np.triu(np.ones((SEQ, SEQ), bool), k=1)
    assert (inf[future] == 0).all(), "a later token changed an earlier position's logits"
    assert (inf[~future] > 0).all(), "every earlier token (and the token itself) should matter"


def test_sliding_window_by_gradients():
    """All-sliding layers: the last position sees back exactly layers * (W - 1) tokens; a global layer sees all.

    W keys include the query itself, so each sliding layer reaches W - 1 positions back; a window off by one
    (W instead of W - 1) moves the boundary by one per layer and fails here.
    """
    layers = 2
    last = influence((SLIDING,) * layers)[SEQ - 1]
    reach = SEQ - 1 - layers * (TINY.sliding_window - 1)  # oldest position that can still reach the last one
    assert (last[:reach] == 0).all(), f"tokens older than the window reached the last position: {last}"
    assert (last[reach:] > 0).all(), f"tokens inside the window should matter: {last}"
    with_global = influence((SLIDING, FULL))[SEQ - 1]
    assert (with_global > 0).all(), "a global layer should let every earlier token reach the last position"


def uses_scan(model, tokens) -> bool:
    return "scan" in str(jax.make_jaxpr(lambda m, t: m.hidden(t))(model, tokens))


def test_scan_when_the_period_repeats_often_enough_for_the_remat_policy():
    tokens = jnp.zeros((SEQ,), jnp.int32)
    assert MAX_UNROLLED_GROUPS == {"none": 2}
    assert not uses_scan(make(tiny(num_hidden_layers=4, layer_types=None), 0), tokens)  # 1 period: unrolled
    assert uses_scan(make(tiny(num_hidden_layers=8, layer_types=None), 0), tokens)  # 2 periods, dots: scanned
    assert uses_scan(make(tiny(num_hidden_layers=8, layer_types=None, remat="full"), 0), tokens)
    assert not uses_scan(make(tiny(num_hidden_layers=8, layer_types=None, remat="none"), 0), tokens)
    assert uses_scan(make(tiny(num_hidden_layers=12, layer_types=None, remat="none"), 0), tokens)  # 3 periods
    assert not uses_scan(make(tiny(num_hidden_layers=12, layer_types=None, scan_layers=False), 0), tokens)


def test_scan_matches_unrolled():
    # OLMo's 3:1 pattern over 12 layers: scan over 3 groups of period 4.
    cfg = tiny(num_hidden_layers=12, layer_types=None)
    tokens = jax.random.randint(jax.random.key(2), (SEQ,), 0, cfg.vocab_size)
    scanned = make(cfg, 3)
    assert uses_scan(scanned, tokens)
    unrolled = dataclasses.replace(scanned, cfg=dataclasses.replace(cfg, scan_layers=False))
    a, b = fwd(scanned, tokens), fwd(unrolled, tokens)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    # ... and the layer order matters (the comparison can fail): reversing the stack changes the logits.
    flipped = jax.tree.map(lambda x: x[::-1], scanned.blocks)
    c = fwd(dataclasses.replace(scanned, blocks=flipped), tokens)
    assert np.abs(np.asarray(c) - np.asarray(a)).max() > 1e-3


@eqx.filter_jit
@eqx.filter_value_and_grad
def loss_and_grads(model: OLMo3, tokens):
    logp = jax.nn.log_softmax(model(tokens[:-1]))
    return -jnp.take_along_axis(logp, tokens[1:, None], axis=-1).mean()


@pytest.mark.parametrize("policy", ["full", "dots", "dots_no_batch"])
def test_remat_same_logits_and_gradients(policy):
    # 3 layers of period 1: a scan even with the baseline's remat none (MAX_UNROLLED_GROUPS), so remat acts
    # inside the scan body
    cfg = tiny(num_hidden_layers=3, layer_types=(SLIDING,) * 3, remat="none")
    model = make(cfg, 4)
    tokens = jax.random.randint(jax.random.key(5), (SEQ + 1,), 0, cfg.vocab_size)
    remat = dataclasses.replace(model, cfg=dataclasses.replace(cfg, remat=policy))
    (l0, g0), (l1, g1) = loss_and_grads(model, tokens), loss_and_grads(remat, tokens)
    assert float(l1) == pytest.approx(float(l0), rel=1e-6)  # the forward (through every logit) agrees
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    assert min(float(jnp.abs(x).max()) for x in jax.tree.leaves(g0)) > 0  # every leaf gets a gradient


@pytest.mark.parametrize("heads", [dict(), dict(num_attention_heads=16, num_key_value_heads=16, head_dim=256)],
                         ids=["32x128", "16x256"])
def test_abstract_7b_has_the_published_count_and_allocates_nothing(heads):
    before = len(jax.live_arrays())
    model = abstract_model(ModelConfig(**heads))
    arrays = jax.tree.leaves(eqx.filter(model, lambda x: isinstance(x, (jax.Array, jax.ShapeDtypeStruct))))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in arrays)
    assert num_params(model) == 7_298_617_344
    assert len(jax.live_arrays()) == before
    assert model.blocks.attn.q_proj.weight.shape == (32, 4096, 4096)


def test_init_statistics():
    cfg = tiny(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=32)
    model = init_model(cfg, jax.random.key(6))
    # A normal truncated at +-3 std keeps 98.66% of the std.
    want = cfg.initializer_range * 0.98659
    for name, w in [("embed", model.embed), ("mlp.up_proj", model.blocks.mlp.up_proj.weight),
                    ("attn.q_proj", model.blocks.attn.q_proj.weight), ("lm_head", model.lm_head.weight)]:
        w = np.asarray(w)
        assert abs(w.mean()) < 1e-3, name
        assert w.std() == pytest.approx(want, rel=0.02), name
        assert np.abs(w).max() <= 3 * cfg.initializer_range, name
        assert np.abs(w).max() > 2.9 * cfg.initializer_range, name  # the tails reach the cut
    for norm in (model.norm, model.blocks.post_attention_norm, model.blocks.post_feedforward_norm,
                 model.blocks.attn.q_norm, model.blocks.attn.k_norm):
        assert (np.asarray(norm.weight) == 1).all()


def test_bf16_compute_with_fp32_params_is_close_to_fp32():
    cfg = tiny(num_hidden_layers=4, layer_types=None, initializer_range=0.2)
    f32 = make(cfg, 7)
    bf16 = dataclasses.replace(f32, cfg=dataclasses.replace(cfg, compute_dtype="bfloat16"))
    assert f32.embed.dtype == bf16.embed.dtype == jnp.float32
    tokens = jax.random.randint(jax.random.key(8), (SEQ,), 0, cfg.vocab_size)
    a, b = np.asarray(fwd(f32, tokens)), np.asarray(fwd(bf16, tokens))
    assert b.dtype == np.float32
    scale = np.abs(a).max()
    assert scale > 1
    assert np.abs(a - b).max() < 0.05 * scale
    assert np.abs(a - b).max() > 0  # bf16 really was used
    pa, pb = jax.nn.log_softmax(a), jax.nn.log_softmax(b)
    kl = float((jnp.exp(pa) * (pa - pb)).sum(-1).mean())
    assert kl < 1e-3
