"""The device mesh and the one rule that maps a parameter path to a PartitionSpec.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with parameters and optimizer state sharded),
`tensor` (Megatron-style column/row split of the projections). The batch is split over (data, fsdp).
The same rule shards parameters and optimizer state: it looks only at the module names in a leaf's path
and its shape, so `opt_state[...].mu.blocks.mlp.up_proj.weight` lands where `blocks.mlp.up_proj.weight` does.
GSPMD style throughout (AxisType.Auto).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from olmo3eqx.config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
# Column-parallel (output dim split over `tensor`) and row-parallel (input dim split) projections.
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROW = ("o_proj", "down_proj")


def mesh_shape(cfg: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) for `num_devices` devices; MeshConfig has checked the sizes themselves."""
    sizes = [cfg.data, cfg.fsdp, cfg.tensor]
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


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    shape = mesh_shape(cfg, len(devices))
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _names(path) -> list[str]:
    out = []
    for k in path:
        name = getattr(k, "name", None) or getattr(k, "key", None)
        if isinstance(name, str):
            out.append(name)
    return out


def partition_spec(path, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The rule. Layer-stacked leaves (under `blocks`) keep their leading layer axis unsharded; the tensor axis
    splits the output of column-parallel and the input of row-parallel projections; fsdp then takes the largest
    remaining dimension it divides. Scalars and anything fsdp divides nowhere are replicated."""
    names = _names(path)
    spec: list = [None] * len(shape)
    first = 1 if "blocks" in names and len(shape) >= 1 else 0
    dims = list(range(first, len(shape)))
    if len(dims) == 0:
        return P(*spec)
    tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
    if tensor > 1 and len(dims) == 2:
        tdim = None
        if any(n in names for n in COLUMN):
            tdim = dims[1]
        elif any(n in names for n in ROW):
            tdim = dims[0]
        elif "embed" in names:
            tdim = dims[1]
        if tdim is not None:
            if shape[tdim] % tensor:
                raise ConfigError(f"Parameter {'.'.join(names)} dim {shape[tdim]} is not divisible by "
                                  f"mesh.tensor={tensor}; choose a tensor size that divides it.")
            spec[tdim] = "tensor"
    if fsdp > 1 and len(dims) >= 2:
        free = sorted((d for d in dims if spec[d] is None and shape[d] % fsdp == 0), key=lambda d: -shape[d])
        if free:
            spec[free[0]] = "fsdp"
    return P(*spec)


def tree_shardings(tree, mesh: Mesh):
    """NamedSharding for every array-like leaf of `tree` (params, optimizer state, a whole train state)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, partition_spec(path, tuple(x.shape), mesh)), tree)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


@dataclass(frozen=True)
class BatchPlan:
    """How the fixed global batch maps onto the devices."""

    global_batch: int
    batch_devices: int  # data x fsdp
    per_device_batch: int  # micro-batch per device
    accum_steps: int

    @property
    def micro_batch(self) -> int:
        return self.per_device_batch * self.batch_devices


def plan_batch(global_batch: int, mesh: Mesh, max_per_device_batch: int) -> BatchPlan:
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if global_batch % dp:
        raise ConfigError(f"data.global_batch={global_batch} is not divisible by the {dp} data-parallel devices "
                          f"(mesh data x fsdp); change the batch or the mesh.")
    per_device = global_batch // dp
    accum = next(a for a in range(max(1, -(-per_device // max(1, max_per_device_batch))), per_device + 1)
                 if per_device % a == 0)
    return BatchPlan(global_batch, dp, per_device // accum, accum)
