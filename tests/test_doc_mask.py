"""Intra-document attention masking (packed instances, `segment_ids`): every backend against a float64 numpy
reference with an explicit mask (causal AND window AND same document), exact zero influence across a document
boundary by gradients (including a sliding window that reaches over the boundary), and the whole model: a packed
document gives the logits it gives alone (masking plus RoPE positions restarting per document, as OLMo-core's
RotaryEmbedding does with cu_doc_lens), and segment ids of one document reproduce the unmasked model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx.attention import attention
from olmo3eqx.config import ModelConfig
from olmo3eqx.model import document_positions, init_model
from test_attention import inputs, reference


def segments(lengths: list[int]) -> np.ndarray:
    """Segment ids of documents of `lengths` packed in order: 0, 0, 1, 1, 1, 2, ..."""
    return np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)


# (heads, kv_heads, dim, window, document lengths): the last "document" plays the padding (an id of its own)
CASES = [
    (4, 4, 16, None, [20, 13, 31]),  # global, 3 documents over the 4 query blocks
    (8, 2, 16, 5, [9, 1, 17, 10]),  # sliding, GQA, a one-token document, 37 = padded blocks
    (4, 1, 8, 9, [3, 25, 12]),  # sliding, multi-query, windows reaching across both boundaries
    (4, 2, 8, 100, [11, 13]),  # window longer than the sequence: global
]


@pytest.mark.parametrize("impl", ["blocked", "xla"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_numpy_reference_with_explicit_mask(impl, case):
    heads, kv_heads, dim, window, lengths = case
    seg = segments(lengths)
    q, k, v = inputs(len(seg), heads, kv_heads, dim)
    out = attention(q, k, v, window=window, impl=impl, segment_ids=jnp.asarray(seg))
    want = reference(q, k, v, window, seg)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6, rtol=2e-5)
    # The mask matters here: without it the outputs differ (the comparison can fail).
    assert np.abs(np.asarray(attention(q, k, v, window=window, impl=impl)) - want).max() > 1e-2


@pytest.mark.parametrize("impl", ["blocked", "xla"])
def test_batch_rows_with_different_packings(impl):
    """Leading batch axes: each row its own documents, as the per-row reference."""
    lengths = ([10, 27], [30, 7], [37])
    seg = np.stack([segments(x) for x in lengths])
    q, k, v = (jnp.stack([x * (1 + r) for r in range(3)]) for x in inputs(37, 8, 2, 16))
    out = np.asarray(attention(q, k, v, window=6, impl=impl, segment_ids=jnp.asarray(seg)))
    for r in range(3):  # row r's inputs are scaled by 1 + r, its scores by (1 + r)^2: float32 error grows with them
        np.testing.assert_allclose(out[r], reference(q[r], k[r], v[r], 6, seg[r]), atol=2e-6 * (1 + r) ** 2,
                                   rtol=2e-5)


@pytest.mark.parametrize("impl", ["blocked", "xla"])
@pytest.mark.parametrize("window", [None, 8])
def test_no_gradient_crosses_a_document_boundary(impl, window):
    """d out[doc 2] / d (q, k, v)[doc 1] is exactly zero, also where the window reaches over the boundary; and
    inside a document the gradient is not (the check is not vacuous)."""
    seg = jnp.asarray(segments([12, 14, 14]))
    q, k, v = inputs(40, 4, 2, 8)
    cot = jax.random.normal(jax.random.key(3), q.shape).at[:12].set(0).at[26:].set(0)  # out[doc 1] only

    def f(q, k, v):
        return jnp.sum(attention(q, k, v, window=window, impl=impl, segment_ids=seg) * cot)

    for name, g in zip("qkv", jax.grad(f, argnums=(0, 1, 2))(q, k, v)):
        g = np.asarray(g)
        assert np.all(g[:12] == 0) and np.all(g[26:] == 0), name
        first = 13 if name == "q" else 12  # a document's first query sees one key: no gradient to itself
        assert np.all(np.abs(g[first:26]).sum(axis=(-2, -1)) > 0), name


def test_document_positions_restart_at_each_document():
    seg = jnp.asarray(np.stack([segments([3, 1, 4]), segments([8]), np.array([0, 0, 1, 1, 1, 1, 7, 7])]))
    want = [[0, 1, 2, 0, 0, 1, 2, 3], list(range(8)), [0, 1, 0, 1, 2, 3, 0, 1]]
    np.testing.assert_array_equal(np.asarray(document_positions(seg)), want)


def logits(model, tokens, segment_ids=None):
    return jax.jit(lambda m, t, s: m(t, s))(model, tokens, segment_ids)


MODEL = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, sliding_window=6, eos_token_id=1, pad_token_id=2,
                    compute_dtype="float32")


@pytest.mark.parametrize("impl", ["blocked", "flash", "xla"])
def test_packed_documents_give_their_logits_alone(impl):
    """Documents A (11 tokens) and B (15) and padding (6) packed as A B pad in row 0 and B A pad in row 1: each
    document's logits are the same in either place, so equal to the model on that document alone (a row's prefix is
    the document alone: causality); this needs both the mask and per-document RoPE positions. Row 2 (row 0's tokens,
    one segment) equals the model without segment ids, and differs from row 0 where B would see A."""
    model = init_model(dataclasses.replace(MODEL, attention_impl=impl), jax.random.key(0))
    doc_a, doc_b = (jax.random.randint(jax.random.key(i), (n,), 3, MODEL.vocab_size) for i, n in ((1, 11), (2, 15)))
    pad = jnp.full((6,), MODEL.pad_token_id)
    tokens = jnp.stack([jnp.concatenate(x) for x in ((doc_a, doc_b, pad), (doc_b, doc_a, pad), (doc_a, doc_b, pad))])
    seg = jnp.asarray(np.stack([segments([11, 15, 6]), segments([15, 11, 6]), segments([32])]))
    out = np.asarray(logits(model, tokens, seg))
    np.testing.assert_allclose(out[0, 11:26], out[1, :15], atol=2e-5, rtol=1e-5)  # B second == B alone
    np.testing.assert_allclose(out[1, 15:26], out[0, :11], atol=2e-5, rtol=1e-5)  # A second == A alone
    unmasked = np.asarray(logits(model, tokens))
    np.testing.assert_allclose(out[2], unmasked[2], atol=2e-5, rtol=1e-5)
    assert np.abs(unmasked[0, 11:26] - out[0, 11:26]).max() > 1e-3  # without segments B sees A


# Splash (Pallas, interpret mode on CPU: slow, so the smallest shapes with several 128-blocks).
SPLASH_CASES = [
    (8, 2, 32, 37, [90, 70, 40]),  # sliding, GQA, 200 padded to 256; a boundary inside a block, the window over it
    (4, 4, 32, None, [130, 126]),  # global, the boundary just past the first block
]


def splash(window, seg):
    return jax.jit(lambda q, k, v: attention(q, k, v, window=window, impl="splash", block_q=128, block_kv=128,
                                             segment_ids=seg))


@pytest.mark.parametrize("case", SPLASH_CASES, ids=str)
def test_splash_segments_match_the_reference_and_block_gradients(case):
    heads, kv_heads, dim, window, lengths = case
    seg = segments(lengths)
    q, k, v = inputs(len(seg), heads, kv_heads, dim)
    np.testing.assert_allclose(np.asarray(splash(window, jnp.asarray(seg))(q, k, v)),
                               reference(q, k, v, window, seg), atol=2e-6, rtol=2e-5)
    a, b = lengths[0], lengths[0] + lengths[1]
    cot = jax.random.normal(jax.random.key(7), q.shape).at[:a].set(0).at[b:].set(0)  # out[document 1] only

    def grads(impl):
        fn = lambda q, k, v: jnp.sum(attention(q, k, v, window=window, impl=impl, block_q=128, block_kv=128,  # noqa: E731
                                               segment_ids=jnp.asarray(seg)) * cot)
        return jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v)

    for ours, theirs in zip(grads("splash"), grads("xla")):
        ours = np.asarray(ours)
        assert np.all(ours[:a] == 0) and np.all(ours[b:] == 0)
        np.testing.assert_allclose(ours, np.asarray(theirs), atol=2e-5, rtol=1e-4)


def test_splash_segments_under_a_mesh():
    """The segment ids are split over the batch axes with q, k, v in splash's shard_map."""
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

    from olmo3eqx.sharding import AXES, BATCH_AXES, on_mesh

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), AXES, axis_types=(AxisType.Auto,) * 3)
    seg = jnp.asarray(np.stack([segments(x) for x in ([60, 140], [200], [1, 199], [100, 50, 50])]))
    q, k, v = (jnp.stack([x, x * 0.5 + 1, -x, x * 2]) for x in inputs(200, 8, 2, 32))
    batch = NamedSharding(mesh, P(BATCH_AXES))
    q, k, v, seg = (jax.device_put(x, batch) for x in (q, k, v, seg))
    out = jax.jit(on_mesh(mesh, lambda q, k, v, s: attention(q, k, v, window=37, impl="splash", block_q=128,
                                                            block_kv=128, segment_ids=s)))(q, k, v, seg)
    want = attention(q, k, v, window=37, impl="xla", segment_ids=seg)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=2e-5)


@pytest.mark.parametrize(("impl", "lengths"), [
    pytest.param("blocked", ([20, 33, 27], [50, 30]), marks=pytest.mark.slow),  # 11 s; auto packs with flash now
    ("flash", ([150, 97, 53], [200, 100]))], ids=["blocked", "flash"])
def test_packed_model_matches_transformers_packed_by_position_ids(tmp_path, impl, lengths):
    """transformers packs by position_ids that restart at 0 (masking_utils.find_packed_sequence_indices: a
    block-diagonal mask, and those positions for RoPE): a random `transformers` Olmo3 (sliding window 12 < the
    documents, GQA) converted to ours gives its logits on packed rows with segment ids. flash with blocks of 128
    over 300 tokens: documents across block borders, padding to 384."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from olmo3eqx import hf
    from olmo3eqx.tools.convert import save_tiny_hf_model

    save_tiny_hf_model(tmp_path, seed=0, num_hidden_layers=4, sliding_window=12)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
    model, cfg = hf.load_hf(tmp_path)
    blocks = {"attention_block_q": 128, "attention_block_kv": 128} if impl == "flash" else {}
    model = dataclasses.replace(model, cfg=dataclasses.replace(cfg, attention_impl=impl, **blocks))
    seg = np.stack([segments(x) for x in lengths])
    positions = np.array(document_positions(jnp.asarray(seg)))  # a writable copy for torch.from_numpy
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, seg.shape)
    with torch.no_grad():
        want = ref(input_ids=torch.from_numpy(tokens), position_ids=torch.from_numpy(positions).long(),
                   use_cache=False).logits.numpy()  # no cache: the packed mask needs none
    got = np.asarray(logits(model, jnp.asarray(tokens, jnp.int32), jnp.asarray(seg)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5 * np.abs(want).max())
