"""The language-model loss and per-token log-probabilities, shared by the train step and the evaluators.

Labels are the inputs shifted left by one (`next_token_labels`); the last position of every instance has no
label. Hidden states are unembedded a chunk of positions at a time (`map_logits`), so full-vocabulary float32
logits for a whole batch never exist at once. Everything takes the batch as leading axes of `model.hidden` (not
`jax.vmap`): every projection then runs as one 2-D matmul (model.py says why that matters).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from olmo3eqx.context import context_ranks
from olmo3eqx.model import OLMo3

LOGITS_BUDGET = 1 << 26
"""Float32 logits materialised at once by the chunked unembedding (256 MiB)."""


def next_token_labels(tokens: Int[Array, "b s"]) -> Int[Array, "b s"]:
    """labels[b, t] = tokens[b, t + 1]; the last position gets 0 and must be weighted out."""
    return jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)


def label_weights(tokens: Int[Array, "b s"], mask: Float[Array, " b"],
                  label_mask: Bool[Array, "b s"] | None = None) -> Float[Array, "b s"]:
    """1 where a position has a label (all but the last) in an unmasked instance; with a packed batch's
    `label_mask` (False on padding), also only where the token it predicts is not padding: OLMo-core's get_labels,
    which ignores a label whose target is masked (so an EOS predicting the next document's first token is kept)."""
    has_label = jnp.arange(tokens.shape[1]) < tokens.shape[1] - 1
    weights = mask[:, None] * has_label[None, :].astype(jnp.float32)
    if label_mask is None:
        return weights
    return weights * next_token_labels(label_mask.astype(jnp.int32)).astype(jnp.float32)


def per_rank_scale(weights: Float[Array, "b s"], ranks: int) -> Float[Array, " b"]:
    """Per-row factors that turn the global token mean into OLMo-core's mean of per-rank token means: rank r holds
    rows r, r + ranks, ... (its data loader's split of a global batch), and a row of rank r scales its weights by
    total / (ranks * count_r), so that sum(loss * weights * scale) / total = mean_r(sum_r(loss) / count_r). A rank
    without a labelled token contributes 0 (OLMo-core would divide 0 by 0)."""
    counts = jnp.sum(weights, axis=1).reshape(-1, ranks).sum(axis=0)  # [ranks]: row i is at [i // ranks, i % ranks]
    total = jnp.maximum(jnp.sum(counts), 1.0)
    scale = total / (ranks * jnp.maximum(counts, 1.0))
    return jnp.broadcast_to(scale[None, :], (weights.shape[0] // ranks, ranks)).reshape(-1)


def loss_chunk(batch: int, seq: int, vocab: int) -> int:
    """Largest divisor of seq whose [batch, chunk, vocab] float32 logits fit LOGITS_BUDGET."""
    limit = max(1, LOGITS_BUDGET // max(1, batch * vocab))
    return max(c for c in range(1, seq + 1) if seq % c == 0 and c <= limit)


def local_rows(batch: int) -> int:
    """Rows of a [batch, ...] array on each device when traced under a mesh (olmo3eqx.sharding.on_mesh), whose
    batch axes (data x fsdp, those not manual: precision.row_axes) split it; `batch` itself outside a mesh or when
    they do not divide it."""
    from olmo3eqx import precision

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return batch
    shards = math.prod(mesh.shape[axis] for axis in precision.row_axes())
    return batch // shards if batch % shards == 0 else batch


def chunk_plan(batch: int, seq: int, vocab: int) -> tuple[int, int]:
    """(positions per chunk, chunks) of map_logits for [batch, seq] inputs traced here: the logits budget is per
    device (a 7B global batch of 512 rows on 128 devices unembeds 4 rows x 128 positions at a time, not 1 position)."""
    chunk = loss_chunk(local_rows(batch), seq // context_ranks(), vocab)  # a chunk never spans two context ranks
    return chunk, seq // chunk


def unembed_then(fn: Callable, lm_head: Float[Array, "d v"]) -> Callable:
    """(hidden [b, c, d], ys [b, c]) -> fn(float32 logits, ys): one chunk of map_logits."""

    def unembed_then_fn(h, y):
        logits = jnp.einsum("bcd,dv->bcv", h, lm_head.astype(h.dtype), preferred_element_type=jnp.float32)
        return fn(logits, y)

    return unembed_then_fn


def map_logits(fn: Callable, hidden: Float[Array, "b s d"], lm_head: Float[Array, "d v"], ys: Int[Array, "b s"], *,
               remat: bool, master: Float[Array, "d v"] | None = None) -> tuple[Array, ...]:
    """fn(float32 logits [b, c, v], ys [b, c]) -> per-position outputs [b, c], applied over the sequence `chunk`
    positions at a time (lax.map: one chunk of logits alive at once) and reassembled as [b, s] each.

    With `remat` and several chunks the chunk function is rematerialised, so a backward pass never holds more
    than one chunk of logits; when the whole sequence is one chunk its logits are kept instead of computed twice.
    Over a mesh whose batch axes split the rows (and no tensor axis), in the train step's mesh.gather_dtype
    "compute", each device maps its own rows (rows_per_device); `master` (the float32 LM head as the parameters hold
    it, for a loss to differentiate) is then gathered there, its gradient reduced as HSDP does (per_device)."""
    b, s, _ = hidden.shape
    chunk, _ = chunk_plan(b, s, lm_head.shape[1])
    if chunk != s and rows_per_device(b):
        return per_device(fn, hidden, lm_head if master is None else master, ys, chunk, remat,
                          gather=master is not None)
    return map_chunks(fn, hidden, lm_head, ys, chunk, remat)


def map_chunks(fn: Callable, hidden, lm_head, ys, chunk: int, remat: bool) -> tuple[Array, ...]:
    b, s, _ = hidden.shape
    unembed_then_fn = unembed_then(fn, lm_head)
    if chunk == s:
        return unembed_then_fn(hidden, ys)
    chunk_fn = jax.checkpoint(unembed_then_fn) if remat else unembed_then_fn
    ranks = context_ranks()
    if ranks > 1:
        return rank_chunks(chunk_fn, hidden, ys, chunk, ranks)
    hs = hidden.reshape(b, s // chunk, chunk, -1).swapaxes(0, 1)
    yc = ys.reshape(b, s // chunk, chunk).swapaxes(0, 1)
    outs = jax.lax.map(lambda args: chunk_fn(*args), (hs, yc))
    return tuple(o.swapaxes(0, 1).reshape(b, s) for o in outs)


def rank_chunks(chunk_fn: Callable, hidden, ys, chunk: int, ranks: int) -> tuple[Array, ...]:
    """map_chunks' loop with the sequence split over `ranks` context ranks: step i unembeds the i-th chunk of every
    rank's part of the sequence, so each rank works on its own positions in every step (a loop over chunks of the
    whole sequence would hand each step to one rank)."""
    b, s, d = hidden.shape
    per = s // ranks // chunk
    hs = hidden.reshape(b, ranks, per, chunk, d).transpose(2, 0, 1, 3, 4).reshape(per, b * ranks, chunk, d)
    yc = ys.reshape(b, ranks, per, chunk).transpose(2, 0, 1, 3).reshape(per, b * ranks, chunk)
    outs = jax.lax.map(lambda args: chunk_fn(*args), (hs, yc))
    return tuple(o.reshape(per, b, ranks, chunk).transpose(1, 2, 0, 3).reshape(b, s) for o in outs)


def rows_per_device(batch: int) -> bool:
    """Whether the loss maps each device's rows on their own (per_device): traced in the train step's
    mesh.gather_dtype "compute" (olmo3eqx.precision) under a mesh whose batch axes (data x fsdp) split `batch` over
    more than one device, with no tensor axis (a tensor split shards the logits' vocabulary: the old path)."""
    from olmo3eqx import precision

    return precision.compute_mode() and precision.rows_split(batch)


def per_device(fn: Callable, hidden, lm_head, ys, chunk: int, remat: bool, gather: bool) -> tuple[Array, ...]:
    """map_chunks on each device's rows (shard_map over the batch axes).

    Left to the partitioner, the chunk loop's backward reduces the LM head's gradient over the batch axes in every
    chunk (the loop carries it replicated): for the 7B stage-1 step on 16 nodes of 8 GPUs, 64 all-reduces of a
    [100352, 4096] float32 gradient a step, 171 GiB sent per device (bench/bench_collectives.py). Here, with
    `gather`, `lm_head` is the float32 master as the parameters shard it: each device gathers it over fsdp in the
    compute dtype once, before the loop, and holds it as float32, so each chunk's contribution to its gradient adds
    into a float32 sum on the device; after the loop that sum is reduce-scattered over fsdp (within a node or slice)
    and, as the transpose of the shard_map over a weight replicated across data, all-reduced over data on the shard
    (across them): once a step, in float32, in HSDP's order; inside the step's per-replica region (step.per_replica,
    `data` already manual) the rows are the replica's, split over fsdp, and that all-reduce is the region's, once
    after the micro-batches. Without `gather` (evaluation: no gradient) `lm_head` is
    the gathered weight, replicated."""
    from jax.sharding import PartitionSpec as P

    from olmo3eqx import precision

    rows = P(precision.row_axes())
    spec = precision.param_spec(("lm_head", "weight"), lm_head.shape) if gather else P()
    dim = precision.fsdp_dim(spec)
    dtype = hidden.dtype

    @jax.custom_vjp
    def gathered(w):
        return jax.lax.all_gather(w.astype(dtype), "fsdp", axis=dim, tiled=True).astype(jnp.float32)

    def backward(_, cotangent):
        return (jax.lax.psum_scatter(cotangent, "fsdp", scatter_dimension=dim, tiled=True),)

    gathered.defvjp(lambda w: (gathered(w), None), backward)

    def local(h, w, y):
        return map_chunks(fn, h, w if dim is None else gathered(w), y, chunk, remat)

    return jax.shard_map(local, in_specs=(rows, spec, rows), out_specs=rows, axis_names=precision.auto_axes(),
                         check_vma=False)(hidden, lm_head, ys)


def token_losses(
    hidden: Float[Array, "b s d"], lm_head: Float[Array, "d v"], labels: Int[Array, "b s"], z_loss: float,
    master: Float[Array, "d v"] | None = None,
) -> tuple[Float[Array, "b s"], Float[Array, "b s"]]:
    """Per-token cross-entropy and z-loss (`z_loss * logsumexp(logits)^2`) in float32 (`master`: map_logits)."""
    return map_logits(ce_and_z(z_loss), hidden, lm_head, labels, remat=True, master=master)


def ce_and_z(z_loss: float) -> Callable:
    """fn(float32 logits [b, c, v], labels [b, c]) -> (cross-entropy, z-loss) per position."""

    def fn(logits, y):
        lse = jax.nn.logsumexp(logits, axis=-1)
        return lse - label_logits(logits, y), z_loss * jnp.square(lse)

    return fn


def label_logits(logits: Float[Array, "b c v"], y: Int[Array, "b c"]) -> Float[Array, "b c"]:
    """logits[b, c, y[b, c]]. Where the mesh splits the vocabulary over tensor (the LM head's columns), a select and a
    sum over the vocabulary (exact: one term is not zero), which the partitioner reduces as one value per position
    over tensor: a gather would have the split regrouped, and XLA's SPMD partitioner (jax 0.10.2) fails a check
    (ExpandDeviceGroupsWithIota) doing that inside the step's per-replica region (step.per_replica)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or dict(mesh.shape).get("tensor", 1) == 1:
        return jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
    vocab = jax.lax.broadcasted_iota(y.dtype, logits.shape, logits.ndim - 1)
    return jnp.sum(jnp.where(vocab == y[..., None], logits, 0.0), axis=-1)


def loss_sums(model: OLMo3, tokens: Int[Array, "b s"], weights: Float[Array, "b s"], z_loss: float,
              segment_ids: Int[Array, "b s"] | None = None, labels: Int[Array, "b s"] | None = None,
              positions: Int[Array, "b s"] | None = None) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(sum of CE, sum of z-loss) over positions, weights[b, t] scoring the prediction of `labels`[b, t] (default
    tokens[b, t + 1]); `segment_ids` (packed batches) keep attention within each document; `positions`: the tokens'
    RoPE positions (OLMo3.hidden). Labels and positions are given where the sequence is not in its natural order
    (the train step's balanced context chunks)."""
    hidden = model.hidden(tokens, segment_ids=segment_ids, positions=positions)
    labels = next_token_labels(tokens) if labels is None else labels
    ce, z = token_losses(hidden, model.head_weight(hidden.dtype), labels, z_loss, master=model.lm_head.weight)
    return jnp.sum(ce * weights), jnp.sum(z * weights)


def token_logprobs(model: OLMo3, tokens: Int[Array, "b s"],
                   targets: Int[Array, "b s"]) -> tuple[Float[Array, "b s"], Bool[Array, "b s"]]:
    """log p(targets[b, t] | tokens[b, :t+1]) in float32 and whether it is the argmax."""

    def logprob_and_greedy(logits, y):
        picked = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == y

    hidden = model.hidden(tokens)
    return map_logits(logprob_and_greedy, hidden, model.head_weight(hidden.dtype), targets, remat=False)


def candidate_logprobs(model: OLMo3, tokens: Int[Array, "b s"], positions: Int[Array, " b"],
                       candidates: Int[Array, "b k"]) -> Float[Array, "b k"]:
    """log p(candidates[b, j] | tokens[b, :positions[b]+1]) in float32: one position per row, unembedded alone."""
    hidden = model.hidden(tokens)
    h = jnp.take_along_axis(hidden, positions[:, None, None], axis=1)[:, 0]
    logits = jnp.einsum("bd,dv->bv", h, model.head_weight(h.dtype), preferred_element_type=jnp.float32)
    return jnp.take_along_axis(logits, candidates, axis=1) - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
