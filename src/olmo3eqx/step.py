"""The train step with in-step gradient accumulation.

The loss (olmo3eqx.loss) is the mean over the labelled tokens of unmasked instances of the *global* batch: each
micro-batch adds sum(loss) / (labelled tokens in the global batch), so the result is the same whatever the
sharding or accumulation (up to floating-point reassociation). Packed batches (data.packing) add segment ids
(attention within documents) and a label mask (no loss on padding). With loss.normalize per_rank each row's weights
are scaled first (loss.per_rank_scale) so that the same sum is OLMo-core's mean of per-rank token means, for the
loss.ranks ranks of its data loader's split, again whatever our own sharding or accumulation.
Over a data axis (across nodes or slices) the gradients are summed per data replica and reduced over data once a
step, whatever the accumulation (`per_replica`).
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from olmo3eqx import optim
from olmo3eqx.config import OptimConfig, TrainConfig
from olmo3eqx.context import context_chunks, splitting_sequences, to_layout
from olmo3eqx.loss import label_weights, loss_sums, next_token_labels, per_rank_scale
from olmo3eqx.model import DTYPE, cast_floating, document_positions
from olmo3eqx.precision import traced_gathering
from olmo3eqx.sharding import Layout, batch_sharding, on_mesh, sequence_sharding
from olmo3eqx.state import TrainState


def split_micro(x: Array, accum: int) -> Array:
    """[global, ...] -> [accum, global/accum, ...] such that every micro-batch holds an equal share of every
    device's rows (row i*accum + a goes to micro-batch a), so no micro-batch needs rows from another device."""
    return x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)


def micro_batch_loss(params, tokens: Int[Array, "m s"], mask: Float[Array, " m"], z_loss: float,
                     total: Float[Array, ""], segment_ids: Int[Array, "m s"] | None = None,
                     label_mask: Bool[Array, "m s"] | None = None, labels: Int[Array, "m s"] | None = None,
                     weights: Float[Array, "m s"] | None = None, positions: Int[Array, "m s"] | None = None
                     ) -> tuple[Float[Array, ""], tuple[Float[Array, ""], Float[Array, ""]]]:
    """(what a micro-batch backpropagates, (its CE sum, its z-loss sum)). Its sums are divided by `total`, the labelled
    tokens of the whole global batch (OLMo-core's loss_div_factor), not by its own count, so the accumulated gradient
    is the gradient of the global token mean whatever the accumulation. A sequence in the balanced context layout
    comes with what needs the natural order already computed (`gradients`): its `labels`, label `weights` (mask and
    label_mask in them) and RoPE `positions`."""
    if weights is None:
        weights = label_weights(tokens, mask, label_mask)
    ce, z = loss_sums(params, tokens, weights, z_loss, segment_ids, labels, positions)
    return (ce + z) / total, (ce, z)


def per_replica(layout: Layout) -> bool:
    """Whether the step sums its gradients per data replica and reduces them over `data` once (`gradients`): on a
    mesh with data > 1, with or without a tensor axis. Left to the partitioner, each micro-batch's constraint to the
    parameter shardings all-reduces over data (across nodes) every micro-batch, and the gradients no hand-written path
    reduces (the replicated norm weights, float32 compute's; with a tensor split the embedding's and the LM head's)
    are reduced over data and fsdp at once. With a tensor split the region compiles because the embedding lookup and
    the label logit keep the tensor split as it is (precision.embed_rows, loss.label_logits): XLA's SPMD partitioner
    (jax 0.10.2) fails a check (ExpandDeviceGroupsWithIota) regrouping a gather's or scatter's tensor-split operand
    while `data` is manual."""
    return dict(layout.mesh.shape).get("data", 1) > 1


def loss_ranks(cfg: TrainConfig, layout: Layout) -> int:
    """The ranks whose token means loss.normalize per_rank averages: loss.ranks, else the mesh's data x fsdp devices
    (OLMo-core's data-parallel ranks: HSDP's replicas times shards; context and tensor ranks share a rank's batch);
    0 for the global rule."""
    if cfg.loss.normalize != "per_rank":
        return 0
    from olmo3eqx.errors import ConfigError

    sizes = dict(layout.mesh.shape)
    ranks = cfg.loss.ranks or sizes.get("data", 1) * sizes.get("fsdp", 1)
    if cfg.data.global_batch % ranks:
        raise ConfigError(f"loss.normalize per_rank over the mesh's {ranks} data x fsdp devices needs "
                          f"data.global_batch {cfg.data.global_batch} to be a multiple of them; set loss.ranks.")
    return ranks


def make_gradients(cfg: TrainConfig, layout: Layout) -> Callable:
    """gradients(params, tokens, mask, segment_ids, label_mask) -> (grads, CE sum, z-loss sum, labelled tokens) of
    a global batch in float32 params, grads laid out like the parameters, traced under layout's mesh (on_mesh); the
    sums weighted as loss.normalize says, so that each divided by the labelled tokens is the step's loss.

    Per micro-batch the gradient is reduced to the parameter shardings (over fsdp and tensor, within a node) and
    added into the accumulator. With `per_replica` the micro-batch loop runs in a shard_map that makes only `data`
    manual: each data replica sums its own micro-batches, and one float32 psum over data after the loop reduces
    them (as OLMo-core's set_requires_all_reduce on the last micro-batch, and MaxText's gradients unreduced on
    data), so the bytes that cross nodes a step are those of one micro-batch."""
    ocfg: OptimConfig = cfg.optim
    plan, mesh = layout.plan, layout.mesh
    micro_sharding = NamedSharding(mesh, P(None, *sequence_sharding(mesh, 2).spec))
    param_specs = jax.tree.map(lambda s: s.spec, layout.shardings.model)
    grad_fn = eqx.filter_value_and_grad(micro_batch_loss, has_aux=True)
    ranks = loss_ranks(cfg, layout)

    def accumulated(params, total, micro_tokens, micro_mask, micro_packed):
        def micro_grads(t, m, packed):
            """(grads laid out like the parameters, CE sum, z-loss sum) of one micro-batch."""
            (_, (ce, z)), g = grad_fn(params, t, m, ocfg.z_loss, total, *packed)
            return jax.lax.with_sharding_constraint(eqx.filter(g, eqx.is_array), param_specs), ce, z

        def accumulate(carry, xs):
            grads, ce_sum, z_sum = carry
            g, ce, z = micro_grads(*xs)
            grads = jax.lax.with_sharding_constraint(jax.tree.map(jnp.add, grads, g), param_specs)
            return (grads, ce_sum + ce, z_sum + z), None

        if plan.accum_steps == 1:  # no accumulator to zero and add into
            first = tuple(None if x is None else x[0] for x in micro_packed)
            return micro_grads(micro_tokens[0], micro_mask[0], first)
        zeros = jax.tree.map(jnp.zeros_like, eqx.filter(params, eqx.is_array))
        return jax.lax.scan(accumulate, (zeros, jnp.zeros(()), jnp.zeros(())),
                            (micro_tokens, micro_mask, micro_packed))[0]

    def gradients(params, tokens: Int[Array, "b s"], mask: Float[Array, " b"],
                  segment_ids: Int[Array, "b s"] | None = None, label_mask: Bool[Array, "b s"] | None = None):
        weights = label_weights(tokens, mask, label_mask)
        total = jnp.maximum(jnp.sum(weights), 1.0)
        if ranks:
            scale = per_rank_scale(weights, ranks)
            mask, weights = mask * scale, weights * scale[:, None]
        packed = (segment_ids, label_mask)
        chunks = context_chunks()
        if chunks.balanced:  # once a step: what needs the natural order first, then every [rows, seq] array reordered
            positions = None if segment_ids is None else document_positions(segment_ids)
            natural = (tokens, segment_ids, None, next_token_labels(tokens), weights, positions)
            tokens, *packed = (None if x is None else to_layout(x, chunks) for x in natural)
        micro_tokens = jax.lax.with_sharding_constraint(split_micro(tokens, plan.accum_steps), micro_sharding)
        micro_mask = split_micro(mask, plan.accum_steps)
        micro_packed = tuple(None if x is None else jax.lax.with_sharding_constraint(
            split_micro(x, plan.accum_steps), micro_sharding) for x in packed)
        if not per_replica(layout):
            return (*accumulated(params, total, micro_tokens, micro_mask, micro_packed), total)
        arrays, static = eqx.partition(params, eqx.is_array)

        def replica(arrays, total, *micro):
            sums = accumulated(eqx.combine(arrays, static), total, *micro)
            return jax.lax.psum(sums, "data")  # float32: the parameters are

        rows = P(None, "data")  # the micro-batches' rows: this replica's, still split over fsdp inside
        sums = jax.shard_map(replica, in_specs=(P(), P(), rows, rows, rows), out_specs=P(), axis_names={"data"},
                             check_vma=False)(arrays, total, micro_tokens, micro_mask, micro_packed)
        return (jax.lax.with_sharding_constraint(sums[0], param_specs), *sums[1:], total)

    return splitting_sequences(gradients, balanced=cfg.mesh.context_balance)


def make_train_step(cfg: TrainConfig, layout: Layout) -> Callable:
    """jit(train_step(state, tokens, mask[, segment_ids, label_mask]) -> (state, metrics)), state donated,
    shardings explicit; the packed arguments exactly when layout.packed (layout.put_batch gives them)."""
    ocfg: OptimConfig = cfg.optim
    optimizer, mesh, shardings = layout.optimizer, layout.mesh, layout.shardings
    check_blocked_memory(cfg, layout)
    schedule = optim.lr_schedule(ocfg, cfg.steps)
    gradients = make_gradients(cfg, layout)

    def train_step(state: TrainState, tokens: Int[Array, "b s"], mask: Float[Array, " b"],
                   segment_ids: Int[Array, "b s"] | None = None, label_mask: Bool[Array, "b s"] | None = None):
        params = cast_floating(state.model, jnp.float32)  # differentiate w.r.t. float32: fp32 grads
        grads, ce_sum, z_sum, total = gradients(params, tokens, mask, segment_ids, label_mask)
        ce_mean, z_mean = ce_sum / total, z_sum / total
        grad_norm = optim.global_norm(grads)
        step = state.step + 1

        model_arrays = eqx.filter(state.model, eqx.is_array)
        updates, new_opt_state = optimizer.update(grads, state.opt_state, model_arrays, step=step)
        new_arrays = optax.apply_updates(model_arrays, updates)
        new_model = eqx.combine(new_arrays, eqx.filter(state.model, eqx.is_array, inverse=True))

        # The guard judges the CE without the z-loss and the grad norm before clipping, as OLMo-core's does.
        skip, spike, (new_model, new_opt_state) = optim.guard_update(
            ocfg, state.spike, ce_mean, grad_norm, (new_model, new_opt_state), (state.model, state.opt_state))
        metrics = {
            "train/loss": ce_mean,
            "train/z_loss": z_mean,
            "train/grad_norm": grad_norm,
            "train/lr": schedule(step),
            "train/skipped": skip.astype(jnp.float32),
            "train/masked_instances": jnp.sum(mask == 0).astype(jnp.float32),
        }
        return TrainState(new_model, new_opt_state, step, spike), metrics

    bsh = sequence_sharding(mesh, 2)
    batch_shardings = (bsh, batch_sharding(mesh, 1)) + ((bsh, bsh) if layout.packed else ())
    return jax.jit(on_mesh(mesh, traced_gathering(cfg.mesh.gather_dtype, train_step)), in_shardings=(shardings, *batch_shardings),
                   out_shardings=(shardings, None), donate_argnums=0,
                   compiler_options=tpu_compiler_options(cfg, mesh) or None)


def check_blocked_memory(cfg: TrainConfig, layout: Layout) -> None:
    """Refuse, before anything compiles, a "blocked" attention whose scores alone cannot fit the device's memory
    (attention.blocked_score_bytes against what the device reports; hosts that report none, CPUs, are not checked):
    XLA would otherwise compile it and fail allocating (one 268 GiB buffer for a 1B at 8,192 tokens on an H200)."""
    from olmo3eqx.attention import blocked_score_bytes, resolve
    from olmo3eqx.errors import ConfigError

    m = cfg.model
    with jax.sharding.use_abstract_mesh(layout.mesh.abstract_mesh):  # "auto" as the step resolves it (on_mesh)
        impl = resolve(m.attention_impl, DTYPE[m.compute_dtype], cfg.data.packing, cfg.data.seq_len)
    if impl != "blocked":
        return
    device = layout.mesh.local_devices[0]  # memory_stats answers for this process's own devices only
    limit = device_memory(device)
    if not limit:
        return
    tensor = dict(layout.mesh.shape).get("tensor", 1)
    need = blocked_score_bytes(m, cfg.data.seq_len, layout.plan.per_device_batch, m.num_attention_heads // tensor)
    if need > limit:
        raise ConfigError(
            f"model.attention_impl 'blocked' needs at least {need / 2**30:,.1f} GiB per device for its attention "
            f"scores (seq_len {cfg.data.seq_len}, {layout.plan.per_device_batch} rows per device, remat "
            f"{m.remat}) but {device.device_kind} has {limit / 2**30:,.1f} GiB; use 'flash' or 'cudnn' (memory "
            f"linear in the sequence), or 'auto'.")


def device_memory(device) -> int | None:
    """Bytes the device lets XLA allocate (its memory_stats' bytes_limit); None where it reports none (CPU) or
    cannot be asked: the devices of a compile-only topology (jax.experimental.topologies, the dry run for a TPU
    slice from a CPU host) are not addressable, and their memory is what the compile itself then reports."""
    try:
        stats = device.memory_stats()
    except jax.errors.JaxRuntimeError:  # "MemoryStats is only supported for addressable PjRt devices"
        return None
    return (stats or {}).get("bytes_limit")


def tpu_compiler_options(cfg: TrainConfig, mesh) -> dict[str, str]:
    """The XLA:TPU flags of mesh.tpu_flags for `mesh`'s devices (olmo3eqx.jaxenv.tpu_flags; none off TPUs), checked
    once against libtpu by compiling a one-op program with them: a flag it does not know, or a value it cannot
    parse, is a ConfigError in one sentence, before the step is traced."""
    import os

    from olmo3eqx.jaxenv import tpu_flags

    device = mesh.devices.flat[0]
    flags = tpu_flags(cfg.mesh.tpu_flags, device.device_kind, os.environ)
    if flags:
        check_tpu_flags(tuple(sorted(flags.items())), device)
    return flags


_CHECKED: set = set()


def check_tpu_flags(flags: tuple[tuple[str, str], ...], device) -> None:
    from olmo3eqx.errors import ConfigError

    if (flags, device.device_kind) in _CHECKED:
        return
    mesh = jax.sharding.Mesh([device], ("x",))
    probe = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(mesh, P()))
    try:
        jax.jit(lambda x: x + 1).lower(probe).compile(compiler_options=dict(flags))
    except jax.errors.JaxRuntimeError as e:
        said = str(e).splitlines()[0].removeprefix("INVALID_ARGUMENT: ")
        raise ConfigError(f"mesh.tpu_flags: XLA:TPU on {device.device_kind} refuses them ({said}); fix or drop that "
                          f"flag, or set mesh.tpu_flags to 'none'.") from None
    _CHECKED.add((flags, device.device_kind))
