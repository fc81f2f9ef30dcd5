"""Context parallelism's attention: on a mesh with a `context` axis (mesh.context > 1) each rank holds one chunk of
every sequence. Queries stay on their rank; keys, values and the keys' segment ids are all-gathered over `context`
(a shard_map that splits the rows over data x fsdp, the heads over tensor and the sequence over context), and
the backend runs on (local queries, gathered keys) with the queries' positions offset by the chunk's start. Every
mask is then computed from explicit query and key positions (`masked_attention`, flash's `q_offset`), never from the
assumption that queries and keys are the same positions.

Everything else that sees the sequence is left to the partitioner, which keeps its semantics: the next-token label of
a chunk's last token (a shift over the sharded sequence: one collective permute), the per-document RoPE positions,
the loss and its normaliser (olmo3eqx.loss splits its chunks per rank).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from olmo3eqx.specs import CONTEXT


_SPLIT: contextvars.ContextVar[bool] = contextvars.ContextVar("splitting_sequences", default=False)


def splitting_sequences(fn: Callable) -> Callable:
    """`fn` traced as the train step's gradients are: its [rows, seq] inputs split along the sequence over the
    mesh's context axis (Layout.put_batch). Evaluation and generation on the same mesh keep whole sequences."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        token = _SPLIT.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _SPLIT.reset(token)

    return traced


def context_ranks() -> int:
    """Chunks the traced sequences are split into: the context axis of the abstract mesh in context inside
    `splitting_sequences`, else 1 (also inside a region where the axis is manual already)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not _SPLIT.get() or mesh.empty or CONTEXT not in mesh.axis_names or CONTEXT in mesh.manual_axes:
        return 1
    return mesh.shape[CONTEXT]


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


def split_attention(local: Callable, q: Float[Array, "b sq h d"], k: Float[Array, "b s kh d"],
                    v: Float[Array, "b s kh d"], segment_ids: Int[Array, "b s"] | None, spec: P
                    ) -> Float[Array, "b s h d"]:
    """local(q, k, v, q_segment_ids, kv_segment_ids, q_offset) -> out on each context rank: q its chunk, k, v and
    kv_segment_ids all-gathered over context (segment ids None when `segment_ids` is), q_offset the chunk's first
    position (int32 scalar). `spec`: how q, k and v are split, the sequence over context (every axis not manual
    already is made manual: left to the partitioner inside, the rows were gathered over fsdp)."""
    mesh = jax.sharding.get_abstract_mesh()
    seq = spec

    def per_rank(q, k, v, *segments):
        k, v = gather_sequence(k), gather_sequence(v)
        q_seg = segments[0] if segments else None
        kv_seg = jax.lax.all_gather(q_seg, CONTEXT, axis=1, tiled=True) if segments else None
        offset = (jax.lax.axis_index(CONTEXT) * q.shape[1]).astype(jnp.int32)
        return local(q, k, v, q_seg, kv_seg, offset)

    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids.astype(jnp.int32))
    specs = (seq,) * 3 + ((P(*seq[:2]),) if segment_ids is not None else ())
    auto = frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)  # nested in the step's per-replica region
    return jax.shard_map(per_rank, mesh=mesh, in_specs=specs, out_specs=seq, axis_names=auto,
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


def attention_balance(layer_windows: list[int | None], seq: int, ranks: int) -> float:
    """Attention work of the busiest context rank over the mean rank's: the (query, key) pairs each rank's chunk of
    `seq` positions attends, summed over layers (`layer_windows`: each layer's window, None for a global one), one
    document a row (documents only shrink it). The chunks are contiguous, so a causal layer's last rank does
    (2N - 1)/N times the mean; a sliding layer is near even."""
    import numpy as np

    position = np.arange(seq, dtype=np.float64)
    per_rank = np.zeros(ranks)
    for window in layer_windows:
        keys = position + 1 if window is None else np.minimum(position + 1, window)
        per_rank += keys.reshape(ranks, seq // ranks).sum(axis=1)
    return float(per_rank.max() / per_rank.mean())

