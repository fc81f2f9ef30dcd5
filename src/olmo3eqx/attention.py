"""Causal attention backends behind one call, each checked against `jax.nn.dot_product_attention` and a numpy
reference in tests/test_attention.py.

Window semantics for every backend: a sliding layer with window W lets query i see keys j with
i - W + 1 <= j <= i (W keys including itself, as `transformers`' `sliding_window`); a global layer is causal.

- "xla": `jax.nn.dot_product_attention`'s XLA implementation: [heads, T, T] scores for every layer, the window a
  mask over them.
- "cudnn": the same call with cuDNN's fused flash attention (GPU only; the window is passed to the kernel).
- "blocked": window-aware blocks in plain einsums (XLA differentiates them). Queries go in blocks of C positions.
  A sliding layer's block sees only the key blocks that can reach it, T x (W + C) scores instead of T x T;
  a global layer's query block i sees key blocks 0..i, so the masked upper triangle is mostly never computed.
  Heads-major layout, so every matmul is a canonical batched matmul. It computes a fraction of the scores "xla"
  computes, so it is the faster one wherever the window is shorter than the sequence (bench/bench_attention.py
  times both; README "Performance"). The same algorithm accelerators want.
- "auto": cudnn on GPU, blocked elsewhere.
"""

from __future__ import annotations

import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from olmo3eqx.config import AttentionImpl

IMPLEMENTATIONS = typing.get_args(AttentionImpl)
GLOBAL_BLOCKS = 4
"""Query blocks of a global layer: block i attends to key blocks 0..i, so (n+1)/2n = 5/8 of T x T is computed."""
MASKED = -0.7 * float(np.finfo(np.float32).max)
"""Score of a masked key: finite (a row is never all -inf, so no NaN) and far below any real score."""


def resolve(impl: str) -> str:
    """The backend `impl` names on the current default backend ("auto" decided here)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"model.attention_impl must be one of {IMPLEMENTATIONS}, got {impl!r}.")
    if impl == "auto":
        return "cudnn" if jax.default_backend() == "gpu" else "blocked"
    return impl


def attention(
    q: Float[Array, "*batch seq heads dim"], k: Float[Array, "*batch seq kv_heads dim"],
    v: Float[Array, "*batch seq kv_heads dim"], *, window: int | None, impl: str = "auto",
) -> Float[Array, "*batch seq heads dim"]:
    """Causal attention; `window` is W keys including the query itself, None for a global layer. Query head h uses
    kv head h // (heads // kv_heads) (grouped-query attention). Leading batch axes are optional. Output in q's
    dtype."""
    backend = resolve(impl)
    if backend != "blocked" and q.ndim > 4:
        return jax.vmap(lambda a, b, c: attention(a, b, c, window=window, impl=impl))(q, k, v)
    seq = q.shape[-3]
    if window is not None and window >= seq:
        window = None  # a window covering the whole sequence is plain causal attention
    if backend == "blocked":
        return blocked_attention(q, k, v, window=window)
    # jax.nn's local_window_size=(L, R) allows i - L <= j <= i + R: W keys including self is (W - 1, 0).
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=None if window is None else (window - 1, 0),
        implementation=None if backend == "xla" else backend)


def sliding_block(seq: int, window: int) -> int:
    """Query block of a sliding layer: about W/2, so each block reads 1.5 W keys (W/4 would read 1.25 W in smaller,
    slower matmuls); never longer than the sequence."""
    return max(1, min(seq, (window + 1) // 2))


def blocked_attention(
    q: Float[Array, "*batch seq heads dim"], k: Float[Array, "*batch seq kv_heads dim"],
    v: Float[Array, "*batch seq kv_heads dim"], *, window: int | None,
) -> Float[Array, "*batch seq heads dim"]:
    """The "blocked" backend (see the module doc). Leading batch axes are handled natively (no vmap). Scores and
    softmax in float32, probabilities cast to v's dtype for the PV matmul (as `jax.nn.dot_product_attention` does).

    Layout: q is transposed once to [*batch, kv_heads, blocks, groups * C, dim] and k, v to [*batch, kv_heads, seq,
    dim], so both matmuls are canonical batched matmuls (batch axes leading, the contraction last or second to
    last) that XLA's CPU backend runs without per-matmul transposed copies; one transpose back at the end."""
    *lead, seq, heads, dim = q.shape
    kv_heads = k.shape[-2]
    groups = heads // kv_heads
    if window is None or window >= seq:
        block = -(-seq // GLOBAL_BLOCKS)
    else:
        block = sliding_block(seq, window)
    n = -(-seq // block)
    padded = n * block
    nb = len(lead)
    if padded != seq:  # padding at the end is never seen by a real query (causality)
        pad = [(0, 0)] * nb + [(0, padded - seq), (0, 0), (0, 0)]
        q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    # q: [*b, n*C, K*G, D] -> [*b, K, n, G*C, D]; k, v: [*b, T, K, D] -> [*b, K, T, D]
    b_axes = tuple(range(nb))
    qb = q.reshape(*lead, n, block, kv_heads, groups, dim).transpose(*b_axes, nb + 2, nb, nb + 3, nb + 1, nb + 4)
    qb = qb.reshape(*lead, kv_heads, n, groups * block, dim)
    kh, vh = (x.transpose(*b_axes, nb + 1, nb, nb + 2) for x in (k, v))
    scale = 1.0 / math.sqrt(dim)
    if window is None or window >= seq:
        out = _triangle(qb, kh, vh, block, groups, scale)
    else:
        out = _band(qb, kh, vh, block, groups, window, scale)
    # [*b, K, n, G*C, D] -> [*b, n*C, K*G, D]
    out = out.reshape(*lead, kv_heads, n, groups, block, dim).transpose(*b_axes, nb + 1, nb + 3, nb, nb + 2, nb + 4)
    return out.reshape(*lead, padded, heads, dim)[..., :seq, :, :]


def _softmax_pv(scores: Float[Array, "*b q s"], mask: np.ndarray, v_dtype, scale: float):
    scores = jnp.where(mask, scores * scale, MASKED)
    return jax.nn.softmax(scores, axis=-1).astype(v_dtype)


def _band(qb, k, v, block: int, groups: int, window: int, scale: float):
    """Sliding layer: query block b sees key blocks b-P..b, P = ceil((W-1)/C), as one batched matmul over
    (batch, kv head, block)."""
    n = qb.shape[-3]
    prev = min(n - 1, -(-(window - 1) // block))

    def key_blocks(x):  # [*b, K, n*C, D] -> [*b, K, n, (P+1)*C, D]: block b holds positions (b-P)*C .. (b+1)*C - 1
        pad = [(0, 0)] * (x.ndim - 2) + [(prev * block, 0), (0, 0)]
        xp = jnp.pad(x, pad).reshape(*x.shape[:-2], n + prev, block, x.shape[-1])
        return jnp.concatenate([xp[..., p:p + n, :, :] for p in range(prev + 1)], axis=-2)

    i = np.arange(n)[:, None, None] * block + np.arange(block)[None, :, None]
    j = (np.arange(n)[:, None, None] - prev) * block + np.arange((prev + 1) * block)[None, None, :]
    mask = (j >= 0) & (j <= i) & (i - j < window)  # [n, C, (P+1)C]; j < 0 is the front padding
    mask = np.tile(mask, (1, groups, 1))  # rows are (group, position) pairs, group-major
    s = jnp.einsum("...nmd,...nsd->...nms", qb, key_blocks(k), preferred_element_type=jnp.float32)
    p = _softmax_pv(s, mask, v.dtype, scale)
    return jnp.einsum("...nms,...nsd->...nmd", p, key_blocks(v))


def _triangle(qb, k, v, block: int, groups: int, scale: float):
    """Global layer: query block b sees keys 0..(b+1)*C - 1 (a static Python loop over the few blocks)."""
    n = qb.shape[-3]
    outs = []
    for b in range(n):
        keys = (b + 1) * block
        mask = np.tile(np.arange(block)[:, None] + b * block >= np.arange(keys)[None, :], (groups, 1))
        s = jnp.einsum("...md,...sd->...ms", qb[..., b, :, :], k[..., :keys, :], preferred_element_type=jnp.float32)
        p = _softmax_pv(s, mask, v.dtype, scale)
        outs.append(jnp.einsum("...ms,...sd->...md", p, v[..., :keys, :]))
    return jnp.stack(outs, axis=-3)
