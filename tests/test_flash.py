"""The "flash" backend (olmo3eqx.flash): forward and gradients against the float64 numpy reference and the `xla`
backend, with blocks small enough that every case crosses several query and key blocks (and blocks of different
sizes for queries and keys); documents, padding, rows with different packings; the blocks it skips against a
brute-force count of the blocks that hold a visible pair; memory that grows linearly with the sequence (XLA's
memory analysis of the compiled forward+backward at 16K and 64K tokens, against `blocked`'s quadratic growth)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx import attention as attn
from olmo3eqx.attention import attention, resolve
from olmo3eqx.flash import block_bounds, first_and_last, flash_attention
from test_attention import CASES, inputs, reference
from test_doc_mask import CASES as DOC_CASES
from test_doc_mask import segments

BLOCKS = [(8, 16), (16, 8)]
"""(block_q, block_kv): several blocks per case, keys and queries blocked differently both ways."""


def flash(window, block, segment_ids=None):
    return lambda q, k, v: flash_attention(q, k, v, window=window, segment_ids=segment_ids, block_q=block[0],
                                           block_kv=block[1])


@pytest.mark.parametrize(("case", "block"), [(c, BLOCKS[i % 2]) for i, c in enumerate(CASES)], ids=str)
def test_forward_and_gradients_match_reference_and_xla(case, block):
    seq, heads, kv_heads, dim, window = case
    q, k, v = inputs(seq, heads, kv_heads, dim)
    out = jax.jit(flash(window, block))(q, k, v)
    assert out.shape == q.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), reference(q, k, v, window), atol=2e-6, rtol=2e-5)
    cot = jax.random.normal(jax.random.key(7), q.shape)
    ours = jax.jit(jax.grad(lambda *x: jnp.sum(flash(window, block)(*x) * cot), argnums=(0, 1, 2)))(q, k, v)
    theirs = jax.grad(lambda *x: jnp.sum(attention(*x, window=window, impl="xla") * cot), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


def test_wrong_window_is_detected():
    """The comparison can fail: one key more in the window differs from the reference."""
    q, k, v = inputs(37, 8, 2, 16)
    out = np.asarray(flash(6, (8, 8))(q, k, v))
    assert np.abs(out - reference(q, k, v, 5)).max() > 1e-2
    np.testing.assert_allclose(out, reference(q, k, v, 6), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_bfloat16_close_to_reference_and_xla(window):
    q, k, v = inputs(64, 8, 2, 16, jnp.bfloat16)
    ours = jax.jit(flash(window, (16, 16)))(q, k, v)
    assert ours.dtype == jnp.bfloat16
    ref = reference(*(x.astype(jnp.float32) for x in (q, k, v)), window)
    np.testing.assert_allclose(np.asarray(ours, np.float32), ref, atol=3e-2, rtol=3e-2)
    theirs = attention(q, k, v, window=window, impl="xla")
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), atol=2e-2, rtol=2e-2)
    loss = [lambda *x: jnp.sum(flash(window, (16, 16))(*x).astype(jnp.float32) ** 2),
            lambda *x: jnp.sum(attention(*x, window=window, impl="xla").astype(jnp.float32) ** 2)]
    for a, b in zip(*(jax.grad(f, argnums=(0, 1, 2))(q, k, v) for f in loss)):
        assert a.dtype == jnp.bfloat16
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, atol=0.1 * np.abs(b).max(), rtol=5e-2)


@pytest.mark.parametrize(("case", "block"), [(c, BLOCKS[i % 2]) for i, c in enumerate(DOC_CASES)], ids=str)
def test_documents_match_reference_and_xla(case, block):
    """Several documents per row, one spanning block borders, a one-token document, padding (an id of its own)."""
    heads, kv_heads, dim, window, lengths = case
    seg = segments(lengths)
    q, k, v = inputs(len(seg), heads, kv_heads, dim)
    fn = flash(window, block, jnp.asarray(seg))
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v)), reference(q, k, v, window, seg), atol=2e-6,
                               rtol=2e-5)
    cot = jax.random.normal(jax.random.key(7), q.shape)
    ours = jax.grad(lambda *x: jnp.sum(fn(*x) * cot), argnums=(0, 1, 2))(q, k, v)
    theirs = jax.grad(lambda *x: jnp.sum(attention(*x, window=window, impl="xla", segment_ids=jnp.asarray(seg))
                                         * cot), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 6])
def test_rows_with_different_packings(window):
    lengths = ([10, 27], [30, 7], [37], [1, 1, 35])
    seg = jnp.asarray(np.stack([segments(x) for x in lengths]))
    q, k, v = (jnp.stack([x * (1 + r / 2) for r in range(4)]) for x in inputs(37, 8, 2, 16))
    fn = flash(window, (8, 16), seg)
    out = np.asarray(jax.jit(fn)(q, k, v))
    for r in range(4):
        np.testing.assert_allclose(out[r], reference(q[r], k[r], v[r], window, np.asarray(seg[r])),
                                   atol=2e-6 * (1 + r), rtol=2e-5)
    ours = jax.grad(lambda *x: jnp.sum(fn(*x) ** 2), argnums=(0, 1, 2))(q, k, v)
    theirs = jax.grad(lambda *x: jnp.sum(attention(*x, window=window, impl="xla", segment_ids=seg) ** 2),
                      argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, theirs):  # row r's scores are scaled by (1 + r/2)^2: sharper softmax, larger float32 error
        for r in range(4):
            b_r = np.asarray(b[r])
            np.testing.assert_allclose(np.asarray(a[r]), b_r, atol=2e-5 * np.abs(b_r).max(), rtol=1e-4)


@pytest.mark.parametrize("window", [None, 8])
def test_no_gradient_crosses_a_document_boundary(window):
    """d out[document 1] / d (q, k, v) outside document 1 is exactly zero (the boundaries inside blocks)."""
    seg = jnp.asarray(segments([12, 14, 14]))
    q, k, v = inputs(40, 4, 2, 8)
    cot = jax.random.normal(jax.random.key(3), q.shape).at[:12].set(0).at[26:].set(0)
    grads = jax.grad(lambda *x: jnp.sum(flash(window, (8, 8), seg)(*x) * cot), argnums=(0, 1, 2))(q, k, v)
    for name, g in zip("qkv", grads):
        g = np.asarray(g)
        assert np.all(g[:12] == 0) and np.all(g[26:] == 0), name
        first = 13 if name == "q" else 12  # a document's first query sees only itself: no gradient to q
        assert np.all(np.abs(g[first:26]).sum(axis=(-2, -1)) > 0), name


def test_leading_batch_axes_and_attention_dispatch():
    q, k, v = (jnp.stack([jnp.stack([x, x * 0.5 + 1]), jnp.stack([-x, x * 2])]) for x in inputs(37, 8, 2, 16))
    out = attention(q, k, v, window=5, impl="flash", block_q=8, block_kv=8)
    want = jax.vmap(jax.vmap(lambda a, b, c: attention(a, b, c, window=5, impl="xla")))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6, rtol=2e-5)


def test_first_and_last_positions_of_each_id():
    rng = np.random.default_rng(0)
    ids = rng.integers(-1, 4, (3, 50)).astype(np.int32)  # any ids, not contiguous
    first, last = (np.asarray(x) for x in first_and_last(jnp.asarray(ids)))
    for r in range(3):
        for t in range(50):
            same = np.flatnonzero(ids[r] == ids[r, t])
            assert first[r, t] == same[0] and last[r, t] == same[-1]


def needed(seq, bq, bk, window, seg):
    """Brute force: the (query block, key block) pairs holding at least one visible pair in any row."""
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    ok = (j <= i) & ((i - j < window) if window else True)
    if seg is not None:
        ok = np.stack([ok & (s[:, None] == s[None, :]) for s in seg]).any(0)
    return {(a, b) for a, b in zip(*np.nonzero(ok.reshape(seq // bq, bq, seq // bk, bk).any((1, 3))))}


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("rows", [[[30, 2, 40, 24]], [[30, 2, 40, 24], [96]], [[50, 46], [10, 86]]], ids=str)
def test_visited_blocks(rows, window):
    """Forward (key blocks per query block) and backward (query blocks per key block) visit every block pair that
    holds a visible pair; for one packed row exactly those (everything else is skipped, not masked)."""
    seg = np.stack([segments(r) for r in rows])
    bq, bk = 8, 16
    k_lo, k_hi, q_lo, q_hi = (np.asarray(x) for x in block_bounds(96, bq, bk, window, jnp.asarray(seg)))
    forward = {(a, b) for a in range(96 // bq) for b in range(k_lo[a], k_hi[a] + 1)}
    backward = {(a, b) for b in range(96 // bk) for a in range(q_lo[b], q_hi[b] + 1)}
    want = needed(96, bq, bk, window, seg)
    assert want <= forward and want <= backward
    if len(rows) == 1:
        assert forward == want == backward
        assert len(forward) < len(needed(96, bq, bk, window, None))  # documents skip blocks causality would visit


def temp_bytes(impl, seq, window=None, block=512):
    """XLA's temporary memory for the compiled forward+backward at `seq` tokens, 2 heads sharing one kv head."""
    x = jax.ShapeDtypeStruct((1, seq, 2, 32), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, 1, 32), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)
    fn = jax.grad(lambda q, k, v, s: jnp.sum(attention(q, k, v, window=window, impl=impl, segment_ids=s,
                                                       block_q=block, block_kv=block) ** 2), argnums=(0, 1, 2))
    return jax.jit(fn).lower(x, kv, kv, seg).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("window", [None, 4096])
def test_memory_grows_linearly_with_the_sequence(window):
    """4x the tokens: flash's temporaries about 4x (linear, plus a few MiB of block workspace that does not grow:
    measured 2.97x), blocked's (global layer: the score blocks) about 16x (measured 15.96x)."""
    flash16, flash64 = temp_bytes("flash", 16384, window), temp_bytes("flash", 65536, window)
    assert 2.5 < flash64 / flash16 < 4.5
    if window is None:
        blocked16, blocked64 = temp_bytes("blocked", 16384), temp_bytes("blocked", 65536)
        assert blocked64 / blocked16 > 12
        assert flash64 < blocked64 / 100
    else:  # a sliding layer's blocked scores are T x 1.5 W: linear too, but W / Bk times flash's
        assert flash64 < temp_bytes("blocked", 65536, window) / 4


def test_auto_backend_per_platform_dtype_and_documents(monkeypatch):
    assert resolve("auto", jnp.float32, documents=True) == "flash"
    assert resolve("auto", jnp.float32, documents=False, seq=attn.LONG_SEQUENCE) == "blocked"
    assert resolve("auto", jnp.float32, documents=False, seq=attn.LONG_SEQUENCE + 1) == "flash"
    monkeypatch.setattr(attn, "target_device", lambda: ("gpu", "NVIDIA H100 80GB HBM3"))
    assert resolve("auto", jnp.bfloat16, documents=True) == "cudnn"  # its packed layout (olmo3eqx.cudnn_packed)
    assert resolve("auto", jnp.float32, documents=True) == "flash"
    assert resolve("auto", jnp.bfloat16, documents=False) == "cudnn"
    assert resolve("auto", jnp.float32, documents=False) == "flash"
    monkeypatch.setattr(attn, "target_device", lambda: ("tpu", "TPU v5p"))
    assert resolve("auto", jnp.bfloat16, documents=True) == "splash"
    assert resolve("pallas", jnp.bfloat16, documents=True) == "pallas"  # by name only (44% of unmasked cuDNN on an H200)


def test_under_a_mesh_with_the_batch_split():
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from olmo3eqx.sharding import AXES, BATCH_AXES, on_mesh

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), AXES, axis_types=(AxisType.Auto,) * 3)
    seg = jnp.asarray(np.stack([segments(x) for x in ([60, 140], [200], [1, 199], [100, 50, 50])]))
    q, k, v = (jnp.stack([x, x * 0.5 + 1, -x, x * 2]) for x in inputs(200, 8, 2, 32))
    batch = NamedSharding(mesh, P(BATCH_AXES))
    q, k, v, seg = (jax.device_put(x, batch) for x in (q, k, v, seg))
    fn = on_mesh(mesh, lambda q, k, v, s: jnp.sum(attention(q, k, v, window=37, impl="flash", block_q=64,
                                                            block_kv=32, segment_ids=s) ** 2))
    ours = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2)))(q, k, v, seg)
    theirs = jax.value_and_grad(lambda q, k, v: jnp.sum(attention(q, k, v, window=37, impl="xla",
                                                                  segment_ids=seg) ** 2), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=1e-4)


@pytest.mark.slow  # 10-16 s in Pallas interpret mode; -m slow
def test_pallas_gpu_kernel_in_interpret_mode():
    """JAX's Pallas GPU flash kernel ("pallas"), run as plain JAX on CPU: documents across its blocks, GQA (k, v
    repeated), 100 tokens padded to its blocks; forward against the reference, gradients against xla. A sliding layer
    goes to flash (the kernel has no window)."""
    seg = jnp.asarray(segments([50, 30, 20]))
    q, k, v = inputs(100, 4, 2, 16)
    np.testing.assert_allclose(np.asarray(attention(q, k, v, window=None, impl="pallas", segment_ids=seg)),
                               reference(q, k, v, None, np.asarray(seg)), atol=2e-6, rtol=2e-5)
    cot = jax.random.normal(jax.random.key(7), q.shape)
    grads = [jax.grad(lambda *x, i=impl: jnp.sum(attention(*x, window=None, impl=i, segment_ids=seg) * cot),
                      argnums=(0, 1, 2))(q, k, v) for impl in ("pallas", "xla")]
    for a, b in zip(*grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    sliding = attention(q, k, v, window=7, impl="pallas", segment_ids=seg)
    np.testing.assert_array_equal(np.asarray(sliding), np.asarray(attention(q, k, v, window=7, impl="flash",
                                                                             segment_ids=seg)))


@pytest.mark.parametrize("impl", ["flash", "blocked"])
def test_train_step_memory_at_16k_and_64k(impl):
    """The whole train step (configs/tiny.yaml's model, one packed instance, remat full) compiled at 16,384 and
    65,536 tokens: flash's temporaries grow about 4x (linear), blocked's about 16x (its global layer's scores)."""
    import dataclasses

    from olmo3eqx import aot
    from olmo3eqx.config import load_yaml
    from olmo3eqx.sharding import build_layout

    base = load_yaml(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    temps = []
    for seq in (16384, 65536):
        cfg = dataclasses.replace(
            base, model=dataclasses.replace(base.model, attention_impl=impl, remat="full"),
            data=dataclasses.replace(base.data, seq_len=seq, global_batch=1, packing=True))
        temps.append(aot.compile_step(cfg, build_layout(cfg, jax.devices()[:1])).memory["temp"])
    ratio = temps[1] / temps[0]
    assert (2.5 < ratio < 5) if impl == "flash" else ratio > 12, (impl, temps)
