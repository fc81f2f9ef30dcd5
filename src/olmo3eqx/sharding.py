"""The device mesh and the run's Layout; the rule that maps a parameter path to a PartitionSpec lives in specs.py.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with parameters and optimizer state sharded),
`tensor` (Megatron-style column/row split of the projections), and with mesh.context > 1 `context` (each
sequence split into chunks; parameters sharded over fsdp x context). The batch is split over (data, fsdp), its
sequence over context.
The same rule shards parameters and optimizer state: it looks only at the module names in a leaf's path
and its shape, so `opt_state[...].mu.blocks.mlp.up_proj.weight` lands where `blocks.mlp.up_proj.weight` does.
GSPMD style throughout (AxisType.Auto). `build_layout(cfg)` puts it together for a run: mesh, batch plan,
optimizer, abstract train state and its shardings, which the loop, the dry run, bench/ and the tests start from.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from olmo3eqx import optim
from olmo3eqx.config import MeshConfig, TrainConfig
from olmo3eqx.errors import ConfigError
from olmo3eqx.specs import (  # noqa: F401 (the rule, re-exported)
    AXES, BATCH_AXES, COLUMN, CONTEXT, CONTEXT_AXES, ROW, context_size, partition_spec)
from olmo3eqx.state import TrainState, abstract_state, init_state


def mesh_axes(cfg: MeshConfig) -> tuple[str, ...]:
    """The mesh's axis names: (data, fsdp, tensor), with `context` before tensor when mesh.context > 1."""
    return CONTEXT_AXES if cfg.context > 1 else AXES


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, ...]:
    """(data, fsdp, tensor) for `num_devices` devices, (data, fsdp, context, tensor) with a context axis; MeshConfig
    has checked the sizes themselves."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
    if cfg.context > 1:  # the sizes the messages below name are data, fsdp and tensor; context divides first
        if num_devices % cfg.context:
            raise ConfigError(f"mesh.context={cfg.context} does not divide the {num_devices} devices; choose a "
                              f"context size that does.")
        sizes = list(mesh_shape(dataclasses.replace(cfg, context=1), num_devices // cfg.context))
        return sizes[0], sizes[1], cfg.context, sizes[2]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(f"{num_devices} devices cannot be split into mesh data={cfg.data} fsdp={cfg.fsdp} "
                              f"tensor={cfg.tensor}; make the fixed sizes divide the device count.")
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ConfigError(f"Mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} needs {math.prod(sizes)} "
                          f"devices but {num_devices} are available; set one axis to -1.")
    return tuple(sizes)


def granule_ids(devices, node_devices: int = 0) -> np.ndarray:
    """The granule (TPU slice, or node: a GPU/CPU host) of each of `devices`, as ints 0.. in the given order.
    `node_devices` > 0: consecutive blocks of that many devices in (process, id) order. Else TPU devices by their
    `slice_index` (absent or all equal on one slice: the hosts of a slice share its ICI), other devices by the node
    each process published at startup (olmo3eqx.distributed.node_of; one process: one node)."""
    devices = list(devices)
    if node_devices > 0:
        if len(devices) % node_devices:
            raise ConfigError(f"mesh.node_devices={node_devices} does not divide the {len(devices)} devices; set it to "
                              f"the devices of one node or slice.")
        rank = {id(d): r for r, d in enumerate(sorted(devices, key=lambda d: (d.process_index, d.id)))}
        keys = [rank[id(d)] // node_devices for d in devices]
    elif devices and devices[0].platform == "tpu":
        keys = [getattr(d, "slice_index", 0) for d in devices]
    else:
        from olmo3eqx.distributed import node_of

        keys = [node_of(d.process_index) for d in devices]
    first = {}  # granules numbered in the order they first appear in (process, id) order
    for key, _ in sorted(zip(keys, devices), key=lambda kd: (kd[1].process_index, kd[1].id)):
        first.setdefault(key, len(first))
    return np.array([first[k] for k in keys], dtype=np.int32)


def granules_of(mesh: Mesh, node_devices: int = 0) -> np.ndarray:
    """granule_ids of the mesh's devices, shaped like mesh.devices."""
    return granule_ids(mesh.devices.flat, node_devices).reshape(mesh.devices.shape)


def device_grid(shape: tuple[int, ...], devices) -> np.ndarray:
    """`devices` as an array of `shape`, laid out by JAX's topology-aware mesh_utils where it can, else in order."""
    try:
        from jax.experimental import mesh_utils

        return mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        return np.asarray(devices).reshape(shape)


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """The (data, fsdp, tensor) mesh. On several granules (TPU slices, nodes: granule_ids) `data` runs across them
    and fsdp and tensor within, each granule's (data/G, fsdp, tensor) grid stacked granule-major along `data` (as
    mesh_utils.create_hybrid_device_mesh with dcn_mesh_shape (G, 1, 1)); a mesh whose fsdp x tensor groups would
    span granules is refused, or with mesh.cross_nodes built granule-major with a warning. One granule: JAX's
    topology-aware grid of all devices."""
    devices = list(jax.devices() if devices is None else devices)
    shape, axes = mesh_shape(cfg, len(devices)), mesh_axes(cfg)
    ids = granule_ids(devices, cfg.node_devices)
    count = int(ids.max()) + 1
    if count == 1:
        return Mesh(device_grid(shape, devices), axes, axis_types=(AxisType.Auto,) * len(axes))
    sizes = np.bincount(ids)
    what = "slices" if devices[0].platform == "tpu" and cfg.node_devices == 0 else "nodes"
    if len(set(sizes.tolist())) > 1:
        raise ConfigError(f"The {len(devices)} devices fall into {count} {what} of unequal sizes "
                          f"({', '.join(map(str, sizes))} devices); run on equal {what} or set mesh.node_devices.")
    per = int(sizes[0])
    data, fsdp, tensor = shape[0], shape[1] * cfg.context, shape[-1]  # context within a granule, as fsdp
    groups = [[d for d, i in zip(devices, ids) if i == g] for g in range(count)]
    if per % (fsdp * tensor) == 0 and data % count == 0:
        grid = np.concatenate([device_grid((data // count, *shape[1:]), g) for g in groups], axis=0)
        return Mesh(grid, axes, axis_types=(AxisType.Auto,) * len(axes))
    axis = f"mesh.fsdp={shape[1]}" + (f" x context={cfg.context}" if cfg.context > 1 else "") + \
        ("" if tensor == 1 else f" x tensor={tensor}")
    span = -(-fsdp * tensor // per)
    if fsdp * tensor > per:
        where = f"would span {span} {what} of {per} devices"
    else:
        where = f"with mesh.data={data} would not fill the {count} {what} of {per} devices evenly"
    if not cfg.cross_nodes:
        raise ConfigError(f"{axis} {where} (every layer's all-gather and reduce-scatter over the network); run HSDP "
                          f"as OLMo-core does with --mesh.data {count} (fsdp -1 then takes the {per} devices of a "
                          f"{what[:-1]}), or allow it with --mesh.cross-nodes.")
    print(f"warning: {axis} {where}: its all-gathers and reduce-scatters cross the network (mesh.cross_nodes).",
          file=sys.stderr, flush=True)
    ordered = [d for g in groups for d in g]
    return Mesh(np.asarray(ordered).reshape(shape), axes, axis_types=(AxisType.Auto,) * len(axes))


def node_mesh(devices=None) -> Mesh:
    """Every device, fsdp over the devices of each node or slice and data across them: what the evaluation and
    generation tools shard a model over (one node or slice: make_mesh(MeshConfig()))."""
    devices = list(jax.devices() if devices is None else devices)
    return make_mesh(MeshConfig(data=int(granule_ids(devices).max()) + 1), devices)


def on_mesh(mesh: Mesh, fn):
    """`fn` traced with `mesh` as the abstract mesh in context: what it calls can then read the platform the program
    compiles for and split work by hand over the mesh (the splash attention kernel, olmo3eqx.attention). Every
    jitted function that runs the model is wrapped in it."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def tree_shardings(tree, mesh: Mesh):
    """NamedSharding for every array-like leaf of `tree` (params, optimizer state, a whole train state)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, partition_spec(path, tuple(x.shape), mesh)), tree)


def model_shardings(model, mesh: Mesh):
    """The training rule applied to a model's arrays, or to its abstract twin's (to restore or place a checkpoint for
    evaluation where training would put it)."""
    return tree_shardings(eqx.filter(model, is_leaf_like), mesh)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over (data, fsdp), the rest whole (evaluation and generation batches, whatever the mesh)."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def sequence_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """A training batch's: rows over (data, fsdp) and, with a context axis, a [rows, seq] array's sequence over
    context (batch_sharding without one)."""
    if ndim >= 2 and context_size(mesh) > 1:
        return NamedSharding(mesh, P(BATCH_AXES, CONTEXT, *([None] * (ndim - 2))))
    return batch_sharding(mesh, ndim)


def data_parallel_size(mesh: Mesh) -> int:
    """Devices the batch is split over: data x fsdp."""
    return mesh.shape["data"] * mesh.shape["fsdp"]


def is_leaf_like(x) -> bool:
    """An array or its abstract stand-in (`eqx.is_array` is False for a ShapeDtypeStruct)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def with_shardings(abstract, shardings):
    """The array leaves of `abstract` as ShapeDtypeStructs carrying `shardings`: what an orbax restore (landing
    resharded: a run saved on 4 devices resumes on 2 or 8) and an ahead-of-time lowering take."""
    params, _ = eqx.partition(abstract, is_leaf_like)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)


@dataclass(frozen=True)
class BatchPlan:
    """How the fixed global batch maps onto the devices."""

    global_batch: int
    batch_devices: int  # data_parallel_size(mesh)
    per_device_batch: int  # micro-batch per device
    accum_steps: int

    @property
    def micro_batch(self) -> int:
        return self.per_device_batch * self.batch_devices


def plan_batch(global_batch: int, mesh: Mesh, max_per_device_batch: int) -> BatchPlan:
    dp = data_parallel_size(mesh)
    if global_batch % dp:
        raise ConfigError(f"data.global_batch={global_batch} is not divisible by the {dp} data-parallel devices "
                          f"(mesh data x fsdp); change the batch or the mesh.")
    per_device = global_batch // dp
    accum = next(a for a in range(max(1, -(-per_device // max(1, max_per_device_batch))), per_device + 1)
                 if per_device % a == 0)
    return BatchPlan(global_batch, dp, per_device // accum, accum)


@dataclass(frozen=True)
class Layout:
    """Where a run's state and batches live on the devices; built once by `build_layout`."""

    mesh: Mesh
    plan: BatchPlan
    optimizer: optax.GradientTransformationExtraArgs
    abstract: TrainState
    """The train state's shapes and dtypes (ShapeDtypeStruct leaves)."""
    shardings: TrainState
    """A NamedSharding per array leaf of the train state."""
    packed: bool = False
    """Batches of packed documents (data.packing): they carry segment ids and a label mask."""

    @property
    def data_parallel(self) -> int:
        return self.plan.batch_devices

    def tokens_per_device(self, seq_len: int) -> int:
        """Tokens of a step per device, the global batch's over all devices: a row's tensor-parallel devices share
        its tokens (and its model FLOPs)."""
        return self.plan.global_batch * seq_len // self.mesh.devices.size

    def init_state(self, cfg: TrainConfig) -> TrainState:
        """A fresh state from cfg.run.seed, every leaf created already sharded, never whole on one device."""
        init = jax.jit(lambda k: init_state(cfg, self.optimizer, k), out_shardings=self.shardings)
        return init(jax.random.PRNGKey(cfg.run.seed))

    def state_target(self) -> TrainState:
        """The state's arrays as sharded ShapeDtypeStructs (see with_shardings)."""
        return with_shardings(self.abstract, self.shardings)

    def batch_target(self, seq_len: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """(tokens, mask[, segment_ids, label_mask]) of one global batch as sharded ShapeDtypeStructs."""
        b, rows = self.plan.global_batch, sequence_sharding(self.mesh, 2)
        target = (jax.ShapeDtypeStruct((b, seq_len), jnp.int32, sharding=rows),
                  jax.ShapeDtypeStruct((b,), jnp.float32, sharding=batch_sharding(self.mesh, 1)))
        if self.packed:
            target += (jax.ShapeDtypeStruct((b, seq_len), jnp.int32, sharding=rows),
                       jax.ShapeDtypeStruct((b, seq_len), jnp.bool_, sharding=rows))
        return target

    def put_batch(self, batch: dict[str, np.ndarray]) -> tuple[jax.Array, ...]:
        """This process's rows of a global batch (the data pipeline's {"tokens", "mask"}, packed: and
        {"segment_ids", "label_mask"}) -> the global arrays the train step takes, in batch_target's order."""
        tokens, mask = batch["tokens"], batch["mask"]
        shape = (self.plan.global_batch, tokens.shape[1])
        rows = sequence_sharding(self.mesh, 2)
        out = (jax.make_array_from_process_local_data(rows, tokens, shape),
               jax.make_array_from_process_local_data(batch_sharding(self.mesh, 1), mask, shape[:1]))
        if self.packed:
            out += tuple(jax.make_array_from_process_local_data(rows, batch[k], shape)
                         for k in ("segment_ids", "label_mask"))
        return out

    def describe(self) -> str:
        p = self.plan
        return (f"mesh {dict(self.mesh.shape)}; per-device batch {p.per_device_batch} x {p.accum_steps} accumulation "
                f"steps = global batch {p.global_batch}")


def build_layout(cfg: TrainConfig, devices=None) -> Layout:
    """The Layout of `cfg` on `devices` (default: every device)."""
    if cfg.data.seq_len % cfg.mesh.context:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} does not split into mesh.context={cfg.mesh.context} equal "
                          f"chunks; choose a context size that divides it.")
    if cfg.mesh.context > 1 and cfg.mesh.context_balance and cfg.data.seq_len % (2 * cfg.mesh.context):
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} does not split into the {2 * cfg.mesh.context} equal "
                          f"chunks of mesh.context={cfg.mesh.context} balanced; choose a sequence length they divide "
                          f"or set --mesh.no-context-balance.")
    mesh = make_mesh(cfg.mesh, devices)
    plan = plan_batch(cfg.data.global_batch, mesh, cfg.mesh.max_per_device_batch)
    optimizer = optim.make_optimizer(cfg.optim, cfg.steps)
    abstract = abstract_state(cfg, optimizer)
    return Layout(mesh, plan, optimizer, abstract, tree_shardings(abstract, mesh), packed=cfg.data.packing)
