"""Document-masked attention on cuDNN's packed ("THD") layout: the "cudnn" backend with segment ids.

cuDNN's fused flash attention takes packed rows as ragged sequences: for each row, where each document starts
(`offsets`) and how long it is (`seqlens`); causality and the sliding window then hold within each document, and
no block that spans two documents is computed. `jax.nn.dot_product_attention` exposes only padding
(`query_seq_lengths`), so this calls the function under it (`jax._src.cudnn.fused_attention_stablehlo`, the packed
layout on Hopper GPUs and later, since JAX 0.4.36); tests/test_cudnn_packed.py checks the conversion on any host and
bench/gpu.py checks the kernel against "xla" on a GPU before timing it.

Each contiguous run of one segment id is a document (packed instances are; the trailing padding is one run, a
document of its own). The number of runs per row is static for the kernel (MAX_RUNS): a batch with a row of more
runs takes the "flash" backend instead, decided on the device (`lax.cond`), so every batch is computed exactly.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

SPLIT_SEQUENCES = ("cuDNN's fused attention, as jax 0.10.2 calls it, aligns its causal mask and sliding window "
                   "top-left in each query/key segment pair and takes no query offset, so the queries of a chunk that "
                   "continues a document begun on an earlier context rank cannot be masked (the opt-in "
                   "--model.attention-impl cudnn-cp-compiled-only cuts the chunks where top-left is exact: compiled, "
                   "not yet run on a GPU)")
"""Why the "cudnn" backend runs as flash on sequences split over the context axis (attention.split_backend). The
packed layout does take separate query and key runs (q_offsets/kv_offsets, q_seqlen/kv_seqlen), but the mask is
chosen only by MaskType (CAUSAL, PADDING_CAUSAL: no alignment, no offset) and jax's own reference for it is
tril(T, S), top-left: query t of a run sees keys 0..t of its paired run. A rank's queries at positions o..o+C-1
need keys from their document's start, o - d before them: a bottom-right alignment (keys 0..t + S - T) would give
that, top-left does not. Exact only where every row of the chunk begins a document, i.e. where the chunk needs no
other rank's keys at all."""

MAX_RUNS = 16
"""Documents per row the packed kernel is compiled for; more in any row of a batch: flash for that batch. cuDNN sizes
the backward pass's float32 workspace for rows x MAX_RUNS full-length sequences (B x M x heads x T x head_dim x 4
bytes: 4.3 GB for the 1B's 4 x 8192 at 16; 256 asked 256 GiB for the 7B's 65,536), and its time grows with it too
(bench/gpu_attention.py on an H200, the 1B's layer with 8 documents a row: 3.2 ms at 16, 5.7 at 64, 14.0 at 256;
7.5 ms without documents)."""


@contextlib.contextmanager
def compute_capability_of(device):
    """Trace jax's cuDNN calls for GPU `device` (a compile-only topology's: no GPU here). jax checks the packed layout
    and head widths over 128 against the default backend's first GPU (`check_compute_capability`), which a host
    without one fails ("Packed layout requires a GPU with at least Hopper architecture"); inside, it checks
    `device.compute_capability` instead."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    have = tuple(int(x) for x in device.compute_capability.split("."))
    checks = fa.check_compute_capability, fa.is_cuda_compute_capability_equal
    fa.check_compute_capability = lambda c: have >= tuple(int(x) for x in c.split("."))
    fa.is_cuda_compute_capability_equal = lambda c: have == tuple(int(x) for x in c.split("."))
    try:
        yield
    finally:
        fa.check_compute_capability, fa.is_cuda_compute_capability_equal = checks


def document_runs(segment_ids: Int[Array, "batch seq"], max_runs: int
                  ) -> tuple[Int[Array, "batch runs"], Int[Array, "batch runs_plus_1"], Bool[Array, ""]]:
    """(seqlens [batch, max_runs], offsets [batch, max_runs + 1], fits) in the layout cuDNN's packed call takes:
    each row's runs of equal ids, their lengths and start positions, -1 past the row's last run; `fits` is False if
    a row has more than `max_runs` runs (the arrays then describe only its first ones)."""
    batch, seq = segment_ids.shape
    starts = jnp.concatenate([jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    count = starts.sum(axis=1, dtype=jnp.int32)
    begin = jax.vmap(lambda s: jnp.nonzero(s, size=max_runs + 1, fill_value=seq)[0])(starts).astype(jnp.int32)
    run = jnp.arange(max_runs + 1, dtype=jnp.int32)
    offsets = jnp.where(run < count[:, None], begin, -1)
    seqlens = jnp.where(run[:-1] < count[:, None], begin[:, 1:] - begin[:, :-1], -1)
    return seqlens, offsets, jnp.all(count <= max_runs)


def packed_attention(
    q: Float[Array, "batch seq heads dim"], k: Float[Array, "batch seq kv_heads dim"],
    v: Float[Array, "batch seq kv_heads dim"], segment_ids: Int[Array, "batch seq"], *, window: int | None,
    max_runs: int = MAX_RUNS,
) -> Float[Array, "batch seq heads dim"]:
    """cuDNN's fused attention over each row's documents (causal, `window` keys including the query on sliding
    layers, None for global ones); rows of more than `max_runs` documents are the caller's to route elsewhere."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

    seqlens, offsets, _ = document_runs(segment_ids, max_runs)
    return cudnn_attention(q, k, v, bias=None, mask=None, q_seqlen=seqlens, kv_seqlen=seqlens, q_offsets=offsets,
                           kv_offsets=offsets, scale=1.0 / q.shape[-1] ** 0.5, mask_type=MaskType.PADDING_CAUSAL,
                           qkv_layout="BTNH", sliding_window_length=window)


def attention_or(fallback, q, k, v, segment_ids, *, window: int | None):
    """packed_attention where every row has at most MAX_RUNS documents, else `fallback(q, k, v, segment_ids)`
    (decided per batch on the device; both are compiled)."""
    max_runs = MAX_RUNS
    fits = document_runs(segment_ids, max_runs)[2]
    return jax.lax.cond(fits, lambda *a: packed_attention(*a, window=window, max_runs=max_runs), fallback,
                        q, k, v, segment_ids)
