"""The "flash" attention backend: the flash-attention algorithm in plain JAX, memory linear in the sequence on every
platform (attention.py's module doc says where "auto" picks it).

Queries go in blocks of Bq positions, keys in blocks of Bk. For each query block a loop visits only the key blocks
that can hold a visible key, keeping a running max `m`, a running sum `l` and an output accumulator in float32 (the
online softmax); the forward pass saves the output and each query's log-sum-exp (LSE), nothing of size [T, T]. A
custom VJP recomputes the scores block by block from the LSE (FlashAttention-2's backward): for each key block a loop
over the query blocks that can see it accumulates dK and dV, and adds its share of dQ into a [T]-sized float32
accumulator. So forward and backward keep O(T) memory per head, and the work is O(visited blocks):

- a global layer visits key blocks 0 .. the query block's last key (the masked upper triangle is skipped);
- a sliding layer with window W visits only the blocks that reach into the query block's band: O(T x (W + Bk));
- with segment ids (packed documents), a query block starts at the key block holding the first token of the
  earliest document any of its queries (in any batch row) belongs to, and a key block's backward loop stops at the
  query block holding the last token of its latest document: blocks that share no document with the other side are
  skipped, not masked. That is exact for any ids; for packed rows (each document one run) it is tight.

Inside a visited block the mask is causal AND window AND same segment, built from iotas; masked scores are MASKED
(finite), so a block whose rows are all masked for now adds weight that the next real score scales away to 0
(exp(MASKED - m) = 0), and no row is ever all masked (a query sees itself). Statistics, scores and accumulators are
float32; probabilities and dS are cast to the inputs' dtype for the matmuls (as "blocked" and cuDNN do).

The loops are `lax.scan` (outer, over blocks) and `lax.fori_loop` with bounds computed from the data (inner), so
the number of blocks visited follows the mask, and the program is the same for any sequence: its size does not
grow with T. Leading batch axes are flattened into one; the batch and heads go in every matmul (heads-major
[batch, kv_heads, groups, block, dim] layout, as "blocked" has), so the matmuls are large even at small blocks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

MASKED = -0.7 * float(np.finfo(np.float32).max)
"""Score of a masked key, for every backend that masks scores itself (attention.py imports it): finite (a row is
never all -inf, so no NaN) and far below any real score."""
BLOCK_PAD_SEGMENT = -1
"""Segment id of the positions a backend pads the sequence with, for every backend (attention.py imports it): a
segment of its own, so a padded query still sees itself (no all-masked row) and no real query sees padding."""
DEFAULT_BLOCK = 256
"""Query and key block when none is given (model.attention_block_q/_kv override it): the fastest of 128, 256 and 512
on this 2-core CPU (bench/bench_attention.py --lengths 2048 8192 --window 4096 --block B: fwd+bwd of 4 heads x 64
with 4 documents, global layer 53/45/72 ms at 2048 and 615/431/442 ms at 8192). Not measured on a GPU or TPU."""


def blocks_for(seq: int, block_q: int | None, block_kv: int | None) -> tuple[int, int, int]:
    """(padded sequence, query block, key block): the given blocks (else DEFAULT_BLOCK), none longer than the
    sequence rounded up to a multiple of 8, and the sequence padded to a multiple of both."""
    rounded = -(-seq // 8) * 8
    bq, bk = (min(b or DEFAULT_BLOCK, rounded) for b in (block_q, block_kv))
    step = math.lcm(bq, bk)
    return -(-seq // step) * step, bq, bk


def first_and_last(segment_ids: Int[Array, "batch seq"]) -> tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]]:
    """For each position, the first and the last position of the same row that carries the same segment id (for any
    ids: a stable sort groups equal ids in position order)."""
    seq = segment_ids.shape[-1]
    order = jnp.argsort(segment_ids, axis=-1, stable=True)
    ids = jnp.take_along_axis(segment_ids, order, axis=-1)
    pos = jnp.arange(seq, dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=-1)
    ends = jnp.concatenate([ids[:, 1:] != ids[:, :-1], jnp.ones_like(ids[:, :1], bool)], axis=-1)
    # index (in sorted order) of each group's first / last member, spread over the group
    group_first = jax.lax.cummax(jnp.where(starts, pos, 0), axis=1)
    group_last = jax.lax.cummin(jnp.where(ends, pos, seq - 1), axis=1, reverse=True)
    first_sorted = jnp.take_along_axis(order, group_first, axis=-1)
    last_sorted = jnp.take_along_axis(order, group_last, axis=-1)
    rows = jnp.arange(segment_ids.shape[0])[:, None]
    first = jnp.zeros_like(order).at[rows, order].set(first_sorted)
    last = jnp.zeros_like(order).at[rows, order].set(last_sorted)
    return first.astype(jnp.int32), last.astype(jnp.int32)


def block_bounds(seq: int, bq: int, bk: int, window: int | None, segment_ids: Int[Array, "batch seq"] | None):
    """Loop bounds, int32 arrays: (first, last) key block each query block visits [nq], and (first, last) query
    block each key block's backward visits [nk], inclusive. Causality and the window are static; documents narrow
    them with the data (module doc)."""
    nq, nk = seq // bq, seq // bk
    qb = np.arange(nq)
    kb = np.arange(nk)
    k_hi = np.minimum(((qb + 1) * bq - 1) // bk, nk - 1)
    q_lo = (kb * bk) // bq
    if window is None:
        k_lo, q_hi = np.zeros(nq, np.int64), np.full(nk, nq - 1)
    else:
        k_lo = np.maximum(qb * bq - (window - 1), 0) // bk
        q_hi = np.minimum(((kb + 1) * bk - 1 + window - 1) // bq, nq - 1)
    k_lo, k_hi, q_lo, q_hi = (jnp.asarray(x, jnp.int32) for x in (k_lo, k_hi, q_lo, q_hi))
    if segment_ids is not None:
        first, last = first_and_last(segment_ids)
        earliest = first.reshape(-1, nq, bq).min(axis=(0, 2))  # earliest document start seen by each query block
        latest = last.reshape(-1, nk, bk).max(axis=(0, 2))  # latest document end reached from each key block
        k_lo = jnp.maximum(k_lo, earliest // bk)
        q_hi = jnp.minimum(q_hi, latest // bq)
    return k_lo, k_hi, q_lo, q_hi


def offset_bounds(nq: int, nk: int, bq: int, bk: int, offset: Int[Array, ""], window: int | None,
                  q_first: Int[Array, "batch sq"] | None, kv_last: Int[Array, "batch s"] | None):
    """block_bounds for queries at positions offset .. offset + nq*bq - 1 against keys at 0 .. nk*bk - 1 (a context
    rank's chunk against the gathered sequence), from the data: a key block no query can see gets an empty backward
    loop (first > last). `q_first`: the first position of each query's document, `kv_last`: the last of each key's
    (first_and_last over the gathered segment ids), or None."""
    qb, kb = jnp.arange(nq, dtype=jnp.int32), jnp.arange(nk, dtype=jnp.int32)
    k_hi = jnp.minimum((offset + (qb + 1) * bq - 1) // bk, nk - 1)
    q_lo = jnp.clip((kb * bk - offset) // bq, 0, nq)
    if window is None:
        k_lo, q_hi = jnp.zeros(nq, jnp.int32), jnp.full(nk, nq - 1, jnp.int32)
    else:
        k_lo = jnp.maximum(offset + qb * bq - (window - 1), 0) // bk
        q_hi = jnp.minimum(((kb + 1) * bk - 1 + window - 1 - offset) // bq, nq - 1)
    if q_first is not None:
        k_lo = jnp.maximum(k_lo, q_first.reshape(-1, nq, bq).min(axis=(0, 2)) // bk)
        q_hi = jnp.minimum(q_hi, (kv_last.reshape(-1, nk, bk).max(axis=(0, 2)) - offset) // bq)
    return k_lo, k_hi, q_lo, q_hi


def _mask(i, j, bq: int, bk: int, window: int | None, seg_q, seg_k, offset=None):
    """[batch, 1, 1, Bq, Bk] (or [Bq, Bk]) visible pairs of query block i against key block j; `offset`: the
    position of the first query (None: 0, queries and keys the same positions)."""
    qpos = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
    if offset is not None:
        qpos = qpos + offset
    kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
    mask = kpos <= qpos
    if window is not None:
        mask = mask & (qpos - kpos < window)
    if seg_q is not None:  # [batch, Bq], [batch, Bk]
        mask = mask & (seg_q[:, None, None, :, None] == seg_k[:, None, None, None, :])
    return mask


def _scores(q_blk, k_blk, scale: float):
    """[b, K, G, Bq, D] x [b, K, Bk, D] -> float32 [b, K, G, Bq, Bk], scaled."""
    return jnp.einsum("bkgqd,bksd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale


def _forward(q, k, v, seg_q, seg_k, k_lo, k_hi, offset, *, window, scale):
    """q [nq, b, K, G, Bq, D]; k, v [nk, b, K, Bk, D]; seg_q [nq, b, Bq] / seg_k [nk, b, Bk] or None. Returns the
    output in q's dtype and the LSE [nq, b, K, G, Bq] (float32)."""
    bq, bk = q.shape[-2], k.shape[-2]
    stats = q.shape[1:-1]

    def query_block(_, xs):
        i, q_i, s_i, lo, hi = xs

        def key_block(j, carry):
            m, l, acc = carry
            s = _scores(q_i, k[j], scale)
            segs = (None, None) if seg_q is None else (s_i, seg_k[j])
            s = jnp.where(_mask(i, j, bq, bk, window, *segs, offset), s, MASKED)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), v[j], preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

        init = (jnp.full(stats, MASKED, jnp.float32), jnp.zeros(stats, jnp.float32),
                jnp.zeros(q_i.shape, jnp.float32))
        m, l, acc = jax.lax.fori_loop(lo, hi + 1, key_block, init)
        return None, ((acc / l[..., None]).astype(q.dtype), m + jnp.log(l))

    nq = q.shape[0]
    seg = seg_q if seg_q is not None else jnp.zeros((nq, 0), jnp.int32)  # scanned along, unused
    _, (out, lse) = jax.lax.scan(query_block, None, (jnp.arange(nq), q, seg, k_lo, k_hi))
    return out, lse


def _backward(q, k, v, seg_q, seg_k, q_lo, q_hi, offset, out, lse, dout, *, window, scale):
    """dq, dk, dv (the inputs' dtypes) by FlashAttention-2's recomputation, one key block at a time (module doc)."""
    bq, bk = q.shape[-2], k.shape[-2]
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [nq, b, K, G, Bq]

    def key_block(dq, xs):
        j, k_j, v_j, sk_j, lo, hi = xs

        def query_block(i, carry):
            dq, dk, dv = carry
            q_i, do_i = q[i], dout[i]
            s = _scores(q_i, k_j, scale)
            segs = (None, None) if seg_q is None else (seg_q[i], sk_j)
            mask = _mask(i, j, bq, bk, window, *segs, offset)
            p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(do_i.dtype), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", do_i, v_j, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta[i][..., None])).astype(q.dtype)
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, q_i, preferred_element_type=jnp.float32) * scale
            dq_i = jnp.einsum("bkgqs,bksd->bkgqd", ds, k_j, preferred_element_type=jnp.float32) * scale
            return dq.at[i].add(dq_i), dk, dv

        zeros = jnp.zeros(k_j.shape, jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(lo, hi + 1, query_block, (dq, zeros, zeros))
        return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

    nk = k.shape[0]
    seg = seg_k if seg_k is not None else jnp.zeros((nk, 0), jnp.int32)  # scanned along, unused
    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), (jnp.arange(nk), k, v, seg, q_lo, q_hi))
    return dq.astype(q.dtype), dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(window, scale, has_segments, q, k, v, seg_q, seg_k, k_lo, k_hi, q_lo, q_hi, offset):
    segs = (seg_q, seg_k) if has_segments else (None, None)
    return _forward(q, k, v, *segs, k_lo, k_hi, offset, window=window, scale=scale)[0]


def _flash_fwd(window, scale, has_segments, q, k, v, seg_q, seg_k, k_lo, k_hi, q_lo, q_hi, offset):
    segs = (seg_q, seg_k) if has_segments else (None, None)
    out, lse = _forward(q, k, v, *segs, k_lo, k_hi, offset, window=window, scale=scale)
    return out, (q, k, v, seg_q, seg_k, k_lo, k_hi, q_lo, q_hi, offset, out, lse)


def _flash_bwd(window, scale, has_segments, res, dout):
    q, k, v, seg_q, seg_k, k_lo, k_hi, q_lo, q_hi, offset, out, lse = res
    segs = (seg_q, seg_k) if has_segments else (None, None)
    dq, dk, dv = _backward(q, k, v, *segs, q_lo, q_hi, offset, out, lse, dout, window=window, scale=scale)
    return dq, dk, dv, None, None, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: Float[Array, "*batch seq heads dim"], k: Float[Array, "*batch kv_seq kv_heads dim"],
    v: Float[Array, "*batch kv_seq kv_heads dim"], *, window: int | None,
    segment_ids: Int[Array, "*batch seq"] | None = None, block_q: int | None = None, block_kv: int | None = None,
    q_offset: Int[Array, ""] | None = None, kv_segment_ids: Int[Array, "*batch kv_seq"] | None = None,
) -> Float[Array, "*batch seq heads dim"]:
    """The "flash" backend (module doc): causal attention, `window` W keys including the query (None: global),
    grouped-query heads, `segment_ids` masking documents (None: none), blocks of `block_q` queries and `block_kv`
    keys (None: DEFAULT_BLOCK). Output in q's dtype. With `q_offset` (a context rank's chunk, olmo3eqx.context): q
    [batch, seq] holds the positions q_offset.. of k and v's [batch, kv_seq], `segment_ids` are the queries' and
    `kv_segment_ids` the keys'."""
    *lead, seq, heads, dim = q.shape
    kv_heads = k.shape[-2]
    groups = heads // kv_heads
    if q_offset is not None:
        return _offset_flash(q, k, v, window, segment_ids, kv_segment_ids, block_q, block_kv, q_offset)
    if window is not None and window >= seq:
        window = None
    padded, bq, bk = blocks_for(seq, block_q, block_kv)
    q, k, v = (x.reshape(-1, *x.shape[-3:]) for x in (q, k, v))
    batch = q.shape[0]
    seg = None if segment_ids is None else segment_ids.reshape(batch, seq).astype(jnp.int32)
    if padded != seq:  # padding at the end: never seen by a real query (causality; its own segment)
        pad = [(0, 0), (0, padded - seq), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
        if seg is not None:
            seg = jnp.pad(seg, pad[:2], constant_values=BLOCK_PAD_SEGMENT)
    nq, nk = padded // bq, padded // bk
    # q: [b, nq*Bq, K*G, D] -> [nq, b, K, G, Bq, D]; k, v: [b, nk*Bk, K, D] -> [nk, b, K, Bk, D]
    qb = q.reshape(batch, nq, bq, kv_heads, groups, dim).transpose(1, 0, 3, 4, 2, 5)
    kb, vb = (x.reshape(batch, nk, bk, kv_heads, dim).transpose(1, 0, 3, 2, 4) for x in (k, v))
    k_lo, k_hi, q_lo, q_hi = block_bounds(padded, bq, bk, window, seg)
    if seg is None:
        seg_q = seg_k = jnp.zeros((0,), jnp.int32)
    else:
        seg_q = seg.reshape(batch, nq, bq).transpose(1, 0, 2)
        seg_k = seg.reshape(batch, nk, bk).transpose(1, 0, 2)
    out = _flash(window, 1.0 / math.sqrt(dim), seg is not None, qb, kb, vb, seg_q, seg_k, k_lo, k_hi, q_lo, q_hi,
                 None)
    # [nq, b, K, G, Bq, D] -> [b, nq*Bq, K*G, D]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, padded, heads, dim)[:, :seq]
    return out.reshape(*lead, seq, heads, dim)


def _offset_flash(q, k, v, window, q_segment_ids, kv_segment_ids, block_q, block_kv, offset):
    """flash_attention of [b, sq] queries at positions offset.. against [b, s] keys at 0.. (module doc of
    olmo3eqx.context): each side padded at its end to its blocks (padded queries' outputs are dropped, padded keys
    are past every real query), the bounds from the data (offset_bounds)."""
    batch, seq_q, heads, dim = q.shape
    seq_kv, kv_heads = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    _, bq, bk = blocks_for(seq_q, block_q, block_kv)
    pq, pk = -(-seq_q // bq) * bq, -(-seq_kv // bk) * bk
    q = jnp.pad(q, [(0, 0), (0, pq - seq_q), (0, 0), (0, 0)])
    k, v = (jnp.pad(x, [(0, 0), (0, pk - seq_kv), (0, 0), (0, 0)]) for x in (k, v))
    nq, nk = pq // bq, pk // bk
    qb = q.reshape(batch, nq, bq, kv_heads, groups, dim).transpose(1, 0, 3, 4, 2, 5)
    kb, vb = (x.reshape(batch, nk, bk, kv_heads, dim).transpose(1, 0, 3, 2, 4) for x in (k, v))
    if q_segment_ids is None:
        seg_q = seg_k = jnp.zeros((0,), jnp.int32)
        bounds = offset_bounds(nq, nk, bq, bk, offset, window, None, None)
    else:
        sq = jnp.pad(q_segment_ids.astype(jnp.int32), [(0, 0), (0, pq - seq_q)], constant_values=BLOCK_PAD_SEGMENT)
        sk = jnp.pad(kv_segment_ids.astype(jnp.int32), [(0, 0), (0, pk - seq_kv)], constant_values=BLOCK_PAD_SEGMENT)
        first, last = first_and_last(sk)
        q_first = jnp.pad(jax.lax.dynamic_slice_in_dim(first, offset, seq_q, axis=1), [(0, 0), (0, pq - seq_q)],
                          constant_values=pk)  # padded queries narrow nothing
        bounds = offset_bounds(nq, nk, bq, bk, offset, window, q_first, last)
        seg_q, seg_k = sq.reshape(batch, nq, bq).transpose(1, 0, 2), sk.reshape(batch, nk, bk).transpose(1, 0, 2)
    out = _flash(window, 1.0 / math.sqrt(dim), q_segment_ids is not None, qb, kb, vb, seg_q, seg_k, *bounds, offset)
    return out.transpose(1, 0, 4, 2, 3, 5).reshape(batch, pq, heads, dim)[:, :seq_q]


PALLAS_GPU_BLOCKS = (128, 64)
"""(query block, key block) of the Pallas GPU kernel's forward pass, and 64 x 64 for its backward kernels: the
kernel's own defaults for the forward (128 x 128) fit no 256-wide head in a GPU's shared memory, these do."""


def pallas_gpu_attention(
    q: Float[Array, "*batch seq heads dim"], k: Float[Array, "*batch seq kv_heads dim"],
    v: Float[Array, "*batch seq kv_heads dim"], *, segment_ids: Int[Array, "*batch seq"] | None = None,
    interpret: bool = False,
) -> Float[Array, "*batch seq heads dim"]:
    """Causal (global) attention by JAX's Pallas GPU flash-attention kernel (`jax.experimental.pallas.ops.gpu.
    attention.mha`: Triton on GPUs; `interpret` runs it as plain JAX, for tests on CPU). It masks documents by segment
    ids and skips the blocks above the diagonal, but has no sliding window (attention.py routes sliding layers to
    flash) and no grouped-query heads (k and v are repeated to q's heads: O(T) more memory). The sequence is padded
    to the blocks with a segment of its own."""
    from jax.experimental.pallas.ops.gpu import attention as pallas

    *lead, seq, heads, dim = q.shape
    kv_heads = k.shape[-2]
    q, k, v = (x.reshape(-1, *x.shape[-3:]) for x in (q, k, v))
    k, v = (jnp.repeat(x, heads // kv_heads, axis=-2) for x in (k, v))
    batch = q.shape[0]
    bq, bk = (min(b, -(-seq // 16) * 16) for b in PALLAS_GPU_BLOCKS)
    step = math.lcm(bq, bk, 64)
    padded = -(-seq // step) * step
    seg = None if segment_ids is None else segment_ids.reshape(batch, seq).astype(jnp.int32)
    if padded != seq:
        q, k, v = (jnp.pad(x, [(0, 0), (0, padded - seq), (0, 0), (0, 0)]) for x in (q, k, v))
        seg = jnp.pad(jnp.zeros((batch, seq), jnp.int32) if seg is None else seg, [(0, 0), (0, padded - seq)],
                      constant_values=BLOCK_PAD_SEGMENT)
    small = min(64, bq, bk)
    blocks = pallas.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=small, block_kv_dkv=small, block_q_dq=small,
                               block_kv_dq=small)
    out = pallas.mha(q, k, v, seg, sm_scale=1.0 / math.sqrt(dim), causal=True, block_sizes=blocks,
                     interpret=interpret)
    return out[:, :seq].reshape(*lead, seq, heads, dim)
