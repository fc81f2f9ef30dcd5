"""Context parallelism's attention: on a mesh with a `context` axis (mesh.context > 1) each rank holds chunks of
every sequence. Queries stay on their rank; keys, values and the keys' segment ids come to them over `context` (a
shard_map that splits the rows over data x fsdp, the heads over tensor and the sequence over context), and the
backend runs on (local queries, those keys) with the queries' positions offset by their chunk's start. Every mask is
then computed from explicit query and key positions (`masked_attention`, flash's `q_offset`), never from the
assumption that queries and keys are the same positions.

Which chunks a rank holds (`Chunks`): contiguous, rank r the r-th of N; or balanced (mesh.context_balance, on by
default, as MaxText's and OLMo-core's causal load balancing): the sequence cut into 2N chunks, rank r holding chunks
r and 2N - 1 - r, so each rank's queries see about as many causal keys as every other's. The train step reorders its
batch once, at its start (`to_layout`: one collective permute of the token-level int arrays), after computing what
needs the natural order: next-token labels, label weights and per-document RoPE positions (olmo3eqx.step).

Which keys a rank receives: all of them (all-gathered, then put back in the natural order on each rank); or, for a
sliding layer whose window reaches fewer chunks than the all-gather would bring (`reach`), only the previous chunks
its window reaches, by collective permutes (`neighbour_spans`): each query chunk then attends its own span of
(reach + 1) chunks, a missing chunk before the sequence's start masked by a segment id of its own.

Everything else that sees the sequence is left to the partitioner: the contiguous layout's next-token shift (one
collective permute), RoPE positions, the loss and its normaliser (olmo3eqx.loss splits its chunks per rank).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, Shaped

from olmo3eqx.flash import BLOCK_PAD_SEGMENT
from olmo3eqx.specs import CONTEXT


_SPLIT: contextvars.ContextVar[bool | None] = contextvars.ContextVar("splitting_sequences", default=None)
"""None outside the train step's gradients; inside, whether the split sequences' chunks are balanced."""


@dataclass(frozen=True)
class Chunks:
    """Which chunks of a split sequence each of `ranks` context ranks holds, in its `slots` (module doc)."""

    ranks: int
    balanced: bool

    @property
    def slots(self) -> int:
        return 2 if self.balanced else 1

    @property
    def count(self) -> int:
        return self.ranks * self.slots

    def chunk(self, rank, slot: int):
        """The natural index of the chunk in `rank`'s `slot` (`rank` an int or a traced axis index)."""
        return rank if slot == 0 else 2 * self.ranks - 1 - rank

    def holder(self, chunk: int) -> tuple[int, int]:
        """(rank, slot) holding natural chunk `chunk`."""
        return (chunk, 0) if chunk < self.ranks else (2 * self.ranks - 1 - chunk, 1)

    def order(self) -> list[int]:
        """The natural chunks in the layout's order (rank by rank, slot by slot)."""
        return [self.chunk(r, t) for r in range(self.ranks) for t in range(self.slots)]

    def positions(self, seq: int) -> np.ndarray:
        """int32 [seq]: the natural position of each position of the layout."""
        c = seq // self.count
        return np.concatenate([np.arange(c * i, c * (i + 1)) for i in self.order()]).astype(np.int32)


def splitting_sequences(fn: Callable, balanced: bool) -> Callable:
    """`fn` traced as the train step's gradients are: its [rows, seq] inputs split along the sequence over the
    mesh's context axis (Layout.put_batch), in the balanced layout when `balanced` (`fn` reorders them, `to_layout`).
    Evaluation and generation on the same mesh keep whole sequences."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        token = _SPLIT.set(balanced)
        try:
            return fn(*args, **kwargs)
        finally:
            _SPLIT.reset(token)

    return traced


def context_chunks() -> Chunks:
    """How the traced sequences are split: over the context axis of the abstract mesh in context inside
    `splitting_sequences`, else one rank holding everything (also inside a region where the axis is manual)."""
    balanced = _SPLIT.get()
    mesh = jax.sharding.get_abstract_mesh()
    if balanced is None or mesh.empty or CONTEXT not in mesh.axis_names or CONTEXT in mesh.manual_axes:
        return Chunks(1, False)
    ranks = mesh.shape[CONTEXT]
    return Chunks(ranks, balanced and ranks > 1)


def context_ranks() -> int:
    """Ranks the traced sequences are split over (context_chunks)."""
    return context_chunks().ranks


def layout_positions(seq: int) -> np.ndarray | None:
    """The natural position of each position of the traced sequences' layout, None where that is the identity."""
    chunks = context_chunks()
    return chunks.positions(seq) if chunks.balanced else None


def fetch(parts: list[Array], source: Callable[[int], tuple[int, int] | None], ranks: int, fill=0) -> Array:
    """Inside a shard_map where context is manual: on each rank r, parts[u] of rank s where source(r) = (s, u), or
    `fill` where source(r) is None. One collective permute per part some rank takes from another; what a rank takes
    from itself is a local select."""
    sources = [source(r) for r in range(ranks)]
    rank = jax.lax.axis_index(CONTEXT)

    def on(ranks_: list[int]) -> Array:
        return jnp.asarray(np.isin(np.arange(ranks), ranks_))[rank]

    out = jnp.zeros_like(parts[0])
    for u, part in enumerate(parts):
        pairs = [(s[0], r) for r, s in enumerate(sources) if s is not None and s[1] == u and s[0] != r]
        if pairs:  # ranks outside the pairs receive zeros: each rank takes exactly one part
            out = out + jax.lax.ppermute(part, CONTEXT, pairs)
        own = [r for r, s in enumerate(sources) if s == (r, u)]
        if own:
            out = out + jnp.where(on(own), part, jnp.zeros_like(part))
    missing = [r for r, s in enumerate(sources) if s is None]
    return jnp.where(on(missing), jnp.full_like(out, fill), out) if missing else out


def to_layout(x: Shaped[Array, "b s"], chunks: Chunks) -> Shaped[Array, "b s"]:
    """A [rows, seq] array in the natural order, split contiguously over context, in `chunks`' layout (under the
    train step's mesh; the identity when not balanced): each rank's two natural chunks permuted to where they go."""
    if not chunks.balanced:
        return x
    slots = chunks.slots

    def per_rank(x):
        c = x.shape[1] // slots
        parts = [x[:, i * c:(i + 1) * c] for i in range(slots)]  # natural chunks slots * rank + i
        return jnp.concatenate([fetch(parts, lambda r, t=t: divmod(chunks.chunk(r, t), slots), chunks.ranks)
                                for t in range(slots)], axis=1)

    return jax.shard_map(per_rank, mesh=jax.sharding.get_abstract_mesh(), in_specs=P(None, CONTEXT),
                         out_specs=P(None, CONTEXT), axis_names={CONTEXT}, check_vma=False)(x)


@jax.custom_vjp
def gather_sequence(x: Float[Array, "b sq *rest"]) -> Float[Array, "b s *rest"]:
    """x's chunks of the sequence (axis 1) all-gathered over the context ranks in x's dtype, inside a shard_map where
    context is manual. Its transpose, each rank's gradient of the whole sequence reduce-scattered back to the chunks,
    sums in float32 (as every gradient reduction of the step: olmo3eqx.precision); XLA:CPU also fails a check
    (AllReducePromotion, "Invalid binary instruction opcode copy") compiling the bfloat16 one."""
    return jax.lax.all_gather(x, CONTEXT, axis=1, tiled=True)


def _scatter_sum(_, cotangent):
    summed = jax.lax.psum_scatter(cotangent.astype(jnp.float32), CONTEXT, scatter_dimension=1, tiled=True)
    return (summed.astype(cotangent.dtype),)


gather_sequence.defvjp(lambda x: (gather_sequence(x), None), _scatter_sum)


def gather_natural(x: Array, chunks: Chunks, gather: Callable = gather_sequence) -> Array:
    """x [b, slots * chunk, ...] of each rank gathered (`gather`) into the whole sequence in the natural order
    (a local permutation of the chunks after the all-gather when balanced)."""
    full = gather(x)
    if not chunks.balanced:
        return full
    c = full.shape[1] // chunks.count
    at = {chunk: i for i, chunk in enumerate(chunks.order())}
    return jnp.concatenate([full[:, at[n] * c:(at[n] + 1) * c] for n in range(chunks.count)], axis=1)


def reach(window: int | None, chunk: int, chunks: Chunks) -> int | None:
    """The previous chunks (of `chunk` positions) a sliding window of `window` keys reaches, ceil((W - 1) / C), when
    fetching only those moves fewer chunks to a rank than the all-gather ((N - 1) x slots); else None (global layers
    too): all-gather."""
    if window is None or chunks.ranks == 1:
        return None
    back = -(-(window - 1) // chunk)
    sent = max(sum(1 for t in range(chunks.slots) for d in range(1, back + 1)
                   if chunks.chunk(r, t) - d >= 0 and chunks.holder(chunks.chunk(r, t) - d)[0] != r)
               for r in range(chunks.ranks))
    return back if sent < (chunks.ranks - 1) * chunks.slots else None


def neighbour_spans(x: Array, chunks: Chunks, back: int, fill=0) -> Array:
    """Inside a shard_map where context is manual: x [b, slots * C, ...] -> [slots * b, (back + 1) * C, ...], each
    slot's chunk preceded by the `back` chunks before it in the natural order (collective permutes; `fill` where they
    lie before the sequence's start), the slots stacked along the rows (`stack_slots`)."""
    c = x.shape[1] // chunks.slots
    parts = [x[:, t * c:(t + 1) * c] for t in range(chunks.slots)]

    def source(r: int, t: int, d: int) -> tuple[int, int] | None:
        n = chunks.chunk(r, t) - d
        return chunks.holder(n) if n >= 0 else None

    spans = [jnp.concatenate([fetch(parts, functools.partial(source, t=t, d=d), chunks.ranks, fill)
                              for d in range(back, 0, -1)] + [parts[t]], axis=1) for t in range(chunks.slots)]
    return jnp.concatenate(spans, axis=0)


def neighbour_keys(x: Float[Array, "b sq kh d"], chunks: Chunks, back: int) -> Float[Array, "b2 s kh d"]:
    """neighbour_spans of keys or values, its transpose (each chunk's gradient sent back and added to its own)
    summing in float32, as gather_sequence's does."""

    @jax.custom_vjp
    def spans(x):
        return neighbour_spans(x, chunks, back)

    def transpose(_, cotangent):
        linear = jax.linear_transpose(functools.partial(neighbour_spans, chunks=chunks, back=back),
                                      jax.ShapeDtypeStruct(x.shape, jnp.float32))
        return (linear(cotangent.astype(jnp.float32))[0].astype(cotangent.dtype),)

    spans.defvjp(lambda x: (spans(x), None), transpose)
    return spans(x)


def stack_slots(x: Array, slots: int) -> Array:
    """[b, slots * C, ...] -> [slots * b, C, ...]: a rank's chunks as rows (neighbour_spans' order)."""
    c = x.shape[1] // slots
    return jnp.concatenate([x[:, t * c:(t + 1) * c] for t in range(slots)], axis=0) if slots > 1 else x


def unstack_slots(x: Array, slots: int) -> Array:
    """stack_slots undone."""
    b = x.shape[0] // slots
    return jnp.concatenate([x[t * b:(t + 1) * b] for t in range(slots)], axis=1) if slots > 1 else x


def keys_for_rank(k: Float[Array, "b sq kh d"], v: Float[Array, "b sq kh d"], q_seg: Int[Array, "b sq"] | None,
                  chunks: Chunks, back: int | None):
    """Inside a shard_map where context is manual: (k, v, q_seg, kv_seg) a rank's queries attend. With the all-gather
    (`back` None) the whole sequence's keys, values and segment ids in the natural order (kv_seg None when q_seg
    is); with neighbour spans, each chunk's span of `back` + 1 chunks stacked as rows, and the queries' segment ids
    too (zeros where none: the missing chunks' BLOCK_PAD_SEGMENT is what masks them)."""
    if back is None:
        kv_seg = None if q_seg is None else gather_natural(
            q_seg, chunks, lambda s: jax.lax.all_gather(s, CONTEXT, axis=1, tiled=True))
        return gather_natural(k, chunks), gather_natural(v, chunks), q_seg, kv_seg
    if q_seg is None:
        q_seg = jnp.zeros(k.shape[:2], jnp.int32)
    return (neighbour_keys(k, chunks, back), neighbour_keys(v, chunks, back), stack_slots(q_seg, chunks.slots),
            neighbour_spans(q_seg, chunks, back, fill=BLOCK_PAD_SEGMENT))


def split_attention(local: Callable, q: Float[Array, "b sq h d"], k: Float[Array, "b s kh d"],
                    v: Float[Array, "b s kh d"], segment_ids: Int[Array, "b s"] | None, spec: P,
                    window: int | None) -> Float[Array, "b s h d"]:
    """local(q, k, v, q_segment_ids, kv_segment_ids, q_offset) -> out on each context rank, q [b', C'] contiguous
    queries at positions q_offset.. (int32 scalar) of keys [b', S'] at 0..: with the all-gather, once per slot with
    the whole sequence's keys in the natural order (segment ids None when `segment_ids` is); with neighbour spans
    (`reach`), once for the rank's chunks stacked as rows, each against its span (segment ids always given: the
    missing chunks' are BLOCK_PAD_SEGMENT). `spec`: how q, k and v are split, the sequence over context (every axis not
    manual already is made manual: left to the partitioner inside, the rows were gathered over fsdp)."""
    mesh = jax.sharding.get_abstract_mesh()
    chunks = context_chunks()
    slots, c = chunks.slots, q.shape[1] // chunks.count
    back = reach(window, c, chunks)

    def per_rank(q, k, v, *segments):
        k, v, q_seg, kv_seg = keys_for_rank(k, v, segments[0] if segments else None, chunks, back)
        if back is not None:
            return unstack_slots(local(stack_slots(q, slots), k, v, q_seg, kv_seg, jnp.int32(back * c)), slots)
        rank = jax.lax.axis_index(CONTEXT)
        return jnp.concatenate([
            local(q[:, t * c:(t + 1) * c], k, v, None if q_seg is None else q_seg[:, t * c:(t + 1) * c], kv_seg,
                  (chunks.chunk(rank, t) * c).astype(jnp.int32)) for t in range(slots)], axis=1)

    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids.astype(jnp.int32))
    specs = (spec,) * 3 + ((P(*spec[:2]),) if segment_ids is not None else ())
    auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)  # nested in the step's per-replica region
    return jax.shard_map(per_rank, mesh=mesh, in_specs=specs, out_specs=spec, axis_names=auto,
                         check_vma=False)(*args)


def split_rows(x: Array, rows_axes: tuple[str, ...]) -> Array:
    """x [rows x seq flattened, ...] (a projection's 2-D input or output) constrained to rows over `rows_axes` and
    then the sequence over context, as [rows, seq] is: left alone the partitioner gathers the sequence around the
    flattening reshape."""
    return jax.lax.with_sharding_constraint(x, P((*rows_axes, CONTEXT), *([None] * (x.ndim - 1))))


def masked_attention(q: Float[Array, "b sq h d"], k: Float[Array, "b s kh d"], v: Float[Array, "b s kh d"],
                     q_positions: Int[Array, " sq"], kv_positions: Int[Array, " s"], window: int | None,
                     q_segment_ids: Int[Array, "b sq"] | None, kv_segment_ids: Int[Array, "b s"] | None
                     ) -> Float[Array, "b sq h d"]:
    """The "xla" backend on queries and keys at explicit positions: query i sees key j when kv_positions[j] <=
    q_positions[i], within the window (W keys including itself) on a sliding layer, and of the same segment."""
    qp, kp = q_positions[:, None], kv_positions[None, :]
    mask = kp <= qp
    if window is not None:
        mask = mask & (qp - kp < window)
    mask = jnp.broadcast_to(mask, (q.shape[0], 1, *mask.shape))
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def attention_balance(layer_windows: list[int | None], seq: int, ranks: int, balanced: bool) -> float:
    """Attention work of the busiest context rank over the mean rank's: the (query, key) pairs each rank's chunks of
    `seq` positions attend, summed over layers (`layer_windows`: each layer's window, None for a global one), one
    document a row (documents only shrink it). Contiguous chunks give a causal layer's last rank (2N - 1)/N times the
    mean; balanced ones (Chunks) even it out; a sliding layer is near even either way."""
    position = np.arange(seq, dtype=np.float64)
    chunks = Chunks(ranks, balanced and ranks > 1)
    per_chunk = np.zeros(chunks.count)
    for window in layer_windows:
        keys = position + 1 if window is None else np.minimum(position + 1, window)
        per_chunk += keys.reshape(chunks.count, -1).sum(axis=1)
    per_rank = per_chunk[chunks.order()].reshape(ranks, chunks.slots).sum(axis=1)
    return float(per_rank.max() / per_rank.mean())
