"""cuDNN's fused attention for a chunk of queries that continues a document begun on an earlier context rank: the
"cudnn-cp-compiled-only" backend with the sequence split over mesh.context (olmo3eqx.context). Compiled by XLA:GPU
to cuDNN's kernels (tests/test_cudnn_context.py reads them from the compiled H100 program), checked on CPU with the
same calls' mask semantics in XLA's math, never yet run on a GPU: opt-in until a GPU has run it equal to flash.

cuDNN, as XLA calls it, has four masks (MaskType: NO_MASK, PADDING, CAUSAL, PADDING_CAUSAL; jaxlib's backend-config
proto has no bottom-right alignment), and its causal mask and sliding window align top-left in each query/key run
pair: query t of a run sees keys 0..t of its paired run (jax's own reference, tril(T, S)). Queries at positions
o..o+C-1 need keys from their document's start, before o: an offset top-left cannot give. So each chunk's attention
is cut where top-left is exact, as ring attention cuts it, and the parts merged by their softmax statistics:

- own: the chunk's queries against its own keys, square, so top-left is the causal diagonal. The chunk's first
  document run (the one that may continue from before o) is a padded call of its own (`len0` queries and keys,
  PADDING_CAUSAL, the window); the other runs start in the chunk and need nothing else: cuDNN's packed layout
  (cudnn_packed.document_runs without the first run), its output taken as it is.
- history: the first run's queries against the keys before o of the same document, reversed (key o-1 first), so
  that the document's keys are a prefix (`kv_seqlen`, the padding mask). A global layer sees all of them: PADDING,
  no causality. A sliding layer of W keys sees, from query t, the keys o+t-W+1..o-1: with the first W-1 queries
  reversed too (query W-2 first), that is exactly top-left causal (PADDING_CAUSAL, no window).

The first run's two parts merge as flash merges blocks: lse = logaddexp(lse_own, lse_history), out = the outputs
weighted by exp(lse_part - lse). jax's cuDNN call drops the cotangent of its softmax statistics, so the merge has
its own VJP: each part's backward kernel runs with the merged output and statistics (ring attention's backward),
with zero cotangent on the rows a part does not serve. `Executor`: cuDNN's kernels (jax._src.cudnn's forward call
and backward primitive), or the same parts in XLA's math from the runs' masks (`run_mask`: the semantics above,
written out), which the CPU tests compare with the existing context-parallel attention.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from olmo3eqx import cudnn_packed

UNSEEN = 1e30
"""Softmax statistic given to a backward kernel for rows a part does not serve: exp(score - UNSEEN) is 0."""


@dataclass(frozen=True)
class Runs:
    """Query and key runs of one cuDNN call: lengths [b] (padded layout, each run at 0) or [b, M] with offsets
    [b, M + 1] (packed layout, -1 past a row's last run), as jax's cuDNN call takes them."""

    q_len: Int[Array, "b *m"]
    kv_len: Int[Array, "b *m"]
    q_off: Int[Array, "b m1"] | None = None
    kv_off: Int[Array, "b m1"] | None = None


def run_mask(runs: Runs, t: int, s: int, causal: bool, window: int | None) -> Bool[Array, "b t s"]:
    """Which (query, key) pairs a cuDNN call with these runs computes: same run pair, and with `causal` key index <=
    query index within the pair (top-left), and with `window` query index - key index < window."""
    q_len, kv_len = runs.q_len, runs.kv_len
    if runs.q_off is None:
        q_len, kv_len = q_len[:, None], kv_len[:, None]
        q_off = kv_off = jnp.zeros_like(q_len)
    else:
        q_off, kv_off = runs.q_off[:, :-1], runs.kv_off[:, :-1]
    qi = jnp.arange(t)[None, None, :] - q_off[..., None]  # [b, runs, t]: index within each run
    kj = jnp.arange(s)[None, None, :] - kv_off[..., None]
    in_q = (q_off[..., None] >= 0) & (qi >= 0) & (qi < q_len[..., None])
    in_k = (kv_off[..., None] >= 0) & (kj >= 0) & (kj < kv_len[..., None])
    pair = in_q[..., :, None] & in_k[..., None, :]
    if causal:
        pair &= kj[..., None, :] <= qi[..., :, None]
    if window is not None:
        pair &= qi[..., :, None] - kj[..., None, :] < window
    return pair.any(axis=1)


def _grouped(q, kv_heads):
    b, t, h, d = q.shape
    return q.reshape(b, t, kv_heads, h // kv_heads, d).astype(jnp.float32)


def _probabilities(q, k, mask, lse, scale):
    """exp(scores - lse) where `mask`, 0 elsewhere: [b, kv_heads, groups, t, s] (lse [b, heads, t])."""
    s = jnp.einsum("btkgd,bskd->bkgts", _grouped(q, k.shape[2]), k.astype(jnp.float32)) * scale
    lse = lse.reshape(s.shape[:-1])
    return jnp.where(mask[:, None, None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)


@dataclass(frozen=True)
class Executor:
    """One cuDNN call's forward (output, softmax statistics [b, heads, t]) and backward given the merged output and
    statistics: `name` "cudnn" cuDNN's kernels, "xla" the same in XLA's math."""

    name: str

    def forward(self, q, k, v, runs: Runs, causal: bool, window: int | None):
        scale = 1.0 / math.sqrt(q.shape[-1])
        if self.name == "cudnn":
            from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

            out, lse = cudnn_attention(q, k, v, q_seqlen=runs.q_len, kv_seqlen=runs.kv_len, q_offsets=runs.q_off,
                                       kv_offsets=runs.kv_off, scale=scale, mask_type=_mask_type(causal),
                                       qkv_layout="BTNH", sliding_window_length=window, return_residual=True)
            return out, lse
        mask = run_mask(runs, q.shape[1], k.shape[1], causal, window)
        s = jnp.einsum("btkgd,bskd->bkgts", _grouped(q, k.shape[2]), k.astype(jnp.float32)) * scale
        lse = jax.nn.logsumexp(jnp.where(mask[:, None, None], s, -jnp.inf), axis=-1)  # -inf on empty rows
        p = _probabilities(q, k, mask, lse, scale)
        out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32)).reshape(q.shape).astype(q.dtype)
        return out, lse.reshape(q.shape[0], q.shape[2], q.shape[1])

    def backward(self, q, k, v, runs: Runs, causal: bool, window: int | None, out, lse, d_out):
        scale = 1.0 / math.sqrt(q.shape[-1])
        if self.name == "cudnn":
            from jax._src.cudnn.fused_attention_stablehlo import _dot_product_attention_bwd_p_wrapper

            unused = jnp.zeros(0, q.dtype)
            grads = _dot_product_attention_bwd_p_wrapper.bind(
                q, k, v, unused, runs.q_len, runs.kv_len, unused, unused, unused, unused, lse, out, d_out,
                scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=_mask_type(causal),
                layout=0, sliding_window_length=window)  # layout 0: BTNH
            return grads[0], grads[1], grads[2]
        mask = run_mask(runs, q.shape[1], k.shape[1], causal, window)
        p = _probabilities(q, k, mask, lse, scale)
        kv_heads = k.shape[2]
        do, o = _grouped(d_out, kv_heads), _grouped(out, kv_heads)
        dv = jnp.einsum("bkgts,btkgd->bskd", p, do)
        dp = jnp.einsum("btkgd,bskd->bkgts", do, v.astype(jnp.float32))
        ds = p * (dp - jnp.einsum("btkgd,btkgd->bkgt", do, o)[..., None]) * scale
        dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(jnp.float32)).reshape(q.shape)
        dk = jnp.einsum("bkgts,btkgd->bskd", ds, _grouped(q, kv_heads))
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _mask_type(causal: bool):
    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    return MaskType.PADDING_CAUSAL if causal else MaskType.PADDING


@dataclass(frozen=True)
class History:
    """How the history call's rows relate to the chunk's queries: a global layer's are the chunk's (`reach` None);
    a sliding layer's are its first `reach` = W - 1 queries reversed, zeros where the chunk is shorter."""

    chunk: int
    reach: int | None

    def rows(self, x: Array) -> Array:
        """[b, reach, ...] -> [b, chunk, ...] (zeros past reach); the identity for a global layer."""
        if self.reach is None:
            return x
        x = jnp.flip(x, axis=1)[:, :self.chunk]
        return _pad_to(x, self.chunk)

    def calls(self, x: Array) -> Array:
        """[b, chunk, ...] -> the history call's rows; rows(calls(x)) is x on the first `reach` rows."""
        if self.reach is None:
            return x
        return jnp.flip(_pad_to(x[:, :self.reach], self.reach), axis=1)


def _pad_to(x: Array, n: int) -> Array:
    return jnp.pad(x, [(0, 0), (0, n - x.shape[1])] + [(0, 0)] * (x.ndim - 2)) if x.shape[1] < n else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def first_run(executor: Executor, history: History, window: int | None, q, k, v, k_hist, v_hist, len0, hist_len):
    """The chunk's first document run: its own part (keys of the chunk) and its history part (k_hist: earlier keys
    of its document, reversed, `hist_len` of them) merged; rows past `len0` are the caller's to replace."""
    return _first_run(executor, history, window, q, k, v, k_hist, v_hist, len0, hist_len)[0]


def _first_run(executor, history, window, q, k, v, k_hist, v_hist, len0, hist_len):
    rows = jnp.arange(q.shape[1])
    own_rows = rows[None, :] < len0[:, None]
    seen = own_rows & (hist_len[:, None] > 0)
    if history.reach is not None:
        seen &= rows[None, :] < history.reach
    out_a, lse_a = executor.forward(q, k, v, Runs(len0, len0), True, window)
    q_len_b = len0 if history.reach is None else jnp.full_like(len0, history.reach)
    out_b, lse_b = executor.forward(history.calls(q), k_hist, v_hist, Runs(q_len_b, hist_len),
                                    history.reach is not None, None)
    lse_a = jnp.where(own_rows[:, None, :], lse_a, 0.0)  # rows past len0: any finite number (replaced outside)
    lse_b = jnp.where(seen[:, None, :], jnp.swapaxes(history.rows(jnp.swapaxes(lse_b, 1, 2)), 1, 2), -jnp.inf)
    lse = jnp.logaddexp(lse_a, lse_b)
    weight = lambda part: jnp.swapaxes(jnp.exp(part - lse), 1, 2)[..., None]  # noqa: E731 - [b, t, heads, 1]
    out_b = jnp.where(seen[..., None, None], history.rows(out_b).astype(jnp.float32), 0.0)
    out = (weight(lse_a) * out_a.astype(jnp.float32) + weight(lse_b) * out_b).astype(q.dtype)
    return out, (q, k, v, k_hist, v_hist, len0, hist_len, q_len_b, own_rows, seen, out, lse)


def _first_run_bwd(executor, history, window, res, d_out):
    q, k, v, k_hist, v_hist, len0, hist_len, q_len_b, own_rows, seen, out, lse = res

    def only(rows, x, fill):
        return jnp.where(rows[..., None, None], x, fill)

    def lse_only(rows):
        return jnp.where(rows[:, None, :], lse, UNSEEN)

    dq_a, dk, dv = executor.backward(q, k, v, Runs(len0, len0), True, window, out, lse_only(own_rows),
                                     only(own_rows, d_out, 0))
    lse_b = jnp.swapaxes(history.calls(jnp.swapaxes(lse_only(seen), 1, 2)), 1, 2)
    if history.reach is not None and history.reach > history.chunk:  # the reversed calls' rows past the chunk
        lse_b = lse_b.at[:, :, :history.reach - history.chunk].set(UNSEEN)
    dq_b, dk_hist, dv_hist = executor.backward(
        history.calls(q), k_hist, v_hist, Runs(q_len_b, hist_len), history.reach is not None, None,
        history.calls(out), lse_b, history.calls(only(seen, d_out, 0)))
    return dq_a + history.rows(dq_b), dk, dv, dk_hist, dv_hist, None, None


first_run.defvjp(_first_run, _first_run_bwd)


def leading_run(ids: Int[Array, "b n"], valid: Bool[Array, "b n"]) -> Int[Array, " b"]:
    """Per row, how many positions from the first on are valid and of the first position's segment."""
    same = valid & (ids == ids[:, :1])
    return jnp.cumprod(same, axis=1).sum(axis=1, dtype=jnp.int32)


def chunk_attention(executor: Executor, q: Float[Array, "b c h d"], k: Float[Array, "b s kh d"],
                    v: Float[Array, "b s kh d"], q_seg: Int[Array, "b c"] | None, kv_seg: Int[Array, "b s"] | None,
                    offset: Int[Array, ""], window: int | None) -> Float[Array, "b c h d"]:
    """Causal attention of queries at positions offset..offset+C-1 of the keys (split_attention's `local`), in the
    parts of the module doc; `window`: W keys including the query, None for a global layer; segment ids None: one
    document. With documents the chunk's runs after the first are at most cudnn_packed.MAX_RUNS a row (`fits`: the
    caller's to check)."""
    b, c = q.shape[:2]
    s = k.shape[1]
    own = [jax.lax.dynamic_slice_in_dim(x, offset, c, axis=1) for x in (k, v)]
    # k_hist[u] = k[offset - 1 - u]: the keys before the chunk, nearest first (wrapped past u = offset: never seen)
    back = [jnp.flip(jnp.roll(x, s - offset, axis=1), axis=1) for x in (k, v)]
    reach_ = None if window is None else window - 1
    if reach_ is not None:
        back = [_pad_to(x[:, :reach_], reach_) for x in back]
    before = jnp.arange(back[0].shape[1])[None, :] < offset
    if q_seg is None:
        len0 = jnp.full((b,), c, jnp.int32)
        hist_len = jnp.broadcast_to(before.sum(axis=1, dtype=jnp.int32), (b,))
    else:
        len0 = leading_run(q_seg, jnp.ones_like(q_seg, bool))
        seg_back = jnp.flip(jnp.roll(kv_seg, s - offset, axis=1), axis=1)[:, :back[0].shape[1]]
        hist_len = leading_run(jnp.concatenate([q_seg[:, :1], _pad_to(seg_back, back[0].shape[1])], axis=1),
                               jnp.concatenate([jnp.ones((b, 1), bool), jnp.broadcast_to(before, seg_back.shape)],
                                               axis=1)) - 1
    first = first_run(executor, History(c, reach_), window, q, *own, *back, len0, hist_len)
    if q_seg is None:
        return first

    def rest(q, k, v, q_seg):  # the runs that start in the chunk, without the first: packed layout
        seqlens, offsets, _ = cudnn_packed.document_runs(q_seg, cudnn_packed.MAX_RUNS + 1)
        runs = Runs(seqlens[:, 1:], seqlens[:, 1:], offsets[:, 1:], offsets[:, 1:])
        if executor.name == "cudnn":
            from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

            return cudnn_attention(q, k, v, q_seqlen=runs.q_len, kv_seqlen=runs.kv_len, q_offsets=runs.q_off,
                                   kv_offsets=runs.kv_off, scale=1.0 / math.sqrt(q.shape[-1]),
                                   mask_type=_mask_type(True), qkv_layout="BTNH", sliding_window_length=window)
        return executor.forward(q, k, v, runs, True, window)[0]

    runs_count = (q_seg[:, 1:] != q_seg[:, :-1]).sum(axis=1) + 1
    others = jax.lax.cond(jnp.any(runs_count > 1), rest, lambda q, *_: jnp.zeros_like(q), q, *own, q_seg)
    return jnp.where((jnp.arange(c)[None, :] < len0[:, None])[..., None, None], first, others)


def fits(q_seg: Int[Array, "b c"]) -> Bool[Array, ""]:
    """Whether every row of the chunk has at most cudnn_packed.MAX_RUNS runs after its first."""
    return cudnn_packed.document_runs(q_seg, cudnn_packed.MAX_RUNS + 1)[2]
