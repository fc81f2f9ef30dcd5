"""The "cudnn" backend with documents (olmo3eqx.cudnn_packed) on a host without cuDNN: the runs handed to cuDNN's
packed layout against a numpy reading of the segment ids, attention restricted to those runs against the float64
reference with the segment mask, and the dispatch (packed kernel for rows within MAX_RUNS documents, flash for a
batch with more) with a stand-in for the kernel that computes what cuDNN is documented to compute from the runs.
The kernel itself is checked against "xla" on a GPU by bench/gpu.py before it is timed (docs/tpu-gpu.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx import attention as attn
from olmo3eqx import cudnn_packed
from test_attention import inputs, reference


def runs_numpy(ids: np.ndarray, max_runs: int):
    """Each row's runs of equal ids: lengths and starts, -1 padded, as cuDNN's packed call takes them."""
    seqlens = -np.ones((len(ids), max_runs), np.int32)
    offsets = -np.ones((len(ids), max_runs + 1), np.int32)
    fits = True
    for r, row in enumerate(ids):
        starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]]
        ends = starts[1:] + [len(row)]
        fits &= len(starts) <= max_runs
        for i, (a, b) in enumerate(zip(starts[:max_runs], ends[:max_runs])):
            seqlens[r, i], offsets[r, i] = b - a, a
    return seqlens, offsets, fits


ROWS = np.array([[0] * 5 + [1] * 3 + [2] * 8,  # three documents
                 [0] * 16,  # one
                 [0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 5, 5, 6, 6, 6, 6],  # one-token documents first
                 [3] * 4 + [0] * 4 + [3] * 8], np.int32)  # an id again after another: two runs, not one document


@pytest.mark.parametrize("max_runs", [4, 7, 8])
def test_document_runs_match_numpy(max_runs):
    seqlens, offsets, fits = cudnn_packed.document_runs(jnp.asarray(ROWS), max_runs)
    want = runs_numpy(ROWS, max_runs)
    valid = want[1] >= 0
    np.testing.assert_array_equal(np.asarray(seqlens), want[0])
    np.testing.assert_array_equal(np.asarray(offsets)[valid], want[1][valid])
    assert bool(fits) == want[2] == (max_runs >= 7)
    if max_runs >= 7:  # the whole row is described: lengths sum to the sequence
        np.testing.assert_array_equal(np.where(np.asarray(seqlens) > 0, np.asarray(seqlens), 0).sum(1), 16)
        np.testing.assert_array_equal(np.asarray(offsets)[~valid], -1)


def ragged_attention(q, k, v, seqlens, offsets, window):
    """What cuDNN's packed layout computes, written from its contract: the tokens [offset, offset + len) of each run
    attend causally (and within the window) to their own run only."""
    seq = q.shape[1]
    t = jnp.arange(seq)
    starts = jnp.where(offsets[:, :-1] >= 0, offsets[:, :-1], seq + 1)
    run = jnp.sum((t[None, None, :] >= starts[:, :, None]) & (seqlens[:, :, None] > 0), axis=1)  # [batch, seq]
    mask = (run[:, :, None] == run[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                        local_window_size=None if window is None else (window - 1, 0))


@pytest.mark.parametrize("window", [None, 5])
def test_runs_reproduce_segment_masking(window):
    """Attention over the runs equals the segment-masked float64 reference on packed rows (rows 0-2: each id one
    run, as packing writes them)."""
    ids = ROWS[:3]
    q, k, v = (jnp.stack([x] * 3) for x in inputs(16, 4, 2, 8))
    seqlens, offsets, _ = cudnn_packed.document_runs(jnp.asarray(ids), 8)
    out = np.asarray(ragged_attention(q, k, v, seqlens, offsets, window))
    for r in range(3):
        np.testing.assert_allclose(out[r], reference(q[r], k[r], v[r], window, ids[r]), atol=2e-6, rtol=2e-5)


def test_dispatch_packed_within_max_runs_else_flash(monkeypatch):
    """Under jit, a batch whose rows have at most MAX_RUNS documents goes to the packed kernel, one with more to
    flash; both give the segment-masked reference, values and gradients."""
    calls = []

    def stand_in(q, k, v, segment_ids, *, window, max_runs):
        seqlens, offsets, _ = cudnn_packed.document_runs(segment_ids, max_runs)
        jax.debug.callback(lambda: calls.append("packed"))
        return ragged_attention(q, k, v, seqlens, offsets, window)

    monkeypatch.setattr(cudnn_packed, "packed_attention", stand_in)
    monkeypatch.setattr(cudnn_packed, "MAX_RUNS", 3)
    q, k, v = (jnp.stack([x] * 2) for x in inputs(16, 4, 2, 8))
    f = jax.jit(lambda q, k, v, s: attn.attention(q, k, v, window=5, impl="cudnn", segment_ids=s))
    for ids, path in ((ROWS[:2], "packed"), (ROWS[1:3], "flash")):  # 3 and 1 runs; then 1 and 7
        calls.clear()
        out = np.asarray(f(q, k, v, jnp.asarray(ids)))
        jax.effects_barrier()
        assert calls == (["packed"] if path == "packed" else []), path
        for r in range(2):
            np.testing.assert_allclose(out[r], reference(q[r], k[r], v[r], 5, ids[r]), atol=3e-6, rtol=3e-5)
    cot = jax.random.normal(jax.random.key(5), q.shape)
    ids = jnp.asarray(ROWS[:2])
    grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, ids) * cot), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda q, k, v: jnp.sum(attn.attention(q, k, v, window=5, impl="xla", segment_ids=ids) * cot),
                    argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("backend,used", [("cudnn", "flash"), ("blocked", "flash"), ("pallas", "flash"),
                                          ("flash", "flash"), ("xla", "xla"), ("splash", "splash")])
def test_split_sequences_run_a_backend_that_takes_the_queries_offset(backend, used):
    """With the sequence split over context ranks each backend's work runs where the mask can be shifted by the
    chunk's offset: cuDNN as jax calls it aligns it top-left (cudnn_packed.SPLIT_SEQUENCES), so flash."""
    got, why = attn.split_backend(backend)
    assert got == used
    assert (why is None) == (used == backend)
    if backend == "cudnn":
        assert "top-left" in why and "offset" in why


def test_cudnn_on_split_sequences_runs_flash_and_says_why_once(monkeypatch, capsys):
    """"cudnn" on a mesh with context 2: each rank's queries against the gathered keys give the unsplit segment-masked
    attention (flash with the queries' offset), and one line on stderr, the first time only, names flash, cudnn and
    the reason, for a sliding and a global layer traced in two programs."""
    from olmo3eqx.config import MeshConfig
    from olmo3eqx.context import splitting_sequences
    from olmo3eqx.sharding import make_mesh, on_mesh

    monkeypatch.setattr(attn, "SAID", set())
    mesh = make_mesh(MeshConfig(context=2), jax.devices()[:2])
    q, k, v = (jnp.stack([x] * 2) for x in inputs(16, 4, 2, 8))
    ids = jnp.asarray(ROWS[:2])  # row 0's second document crosses the chunk boundary at 8

    def split(window):
        return jax.jit(on_mesh(mesh, splitting_sequences(  # contiguous chunks: the inputs are in natural order
            lambda q, k, v, s: attn.attention(q, k, v, window=window, impl="cudnn", segment_ids=s), balanced=False)),
            in_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

    for window in (5, None):
        out = np.asarray(split(window)(q, k, v, ids))
        for r in range(2):
            np.testing.assert_allclose(out[r], reference(q[r], k[r], v[r], window, ROWS[r]), atol=3e-6, rtol=3e-5)
    lines = capsys.readouterr().err.splitlines()
    said = [line for line in lines if line.startswith("attention:")]
    assert said == [f"attention: flash in place of cudnn with the sequence split over mesh.context=2: "
                    f"{cudnn_packed.SPLIT_SEQUENCES}."], lines
