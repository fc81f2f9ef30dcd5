"""The mesh's axis names and the one rule that maps a parameter path to its PartitionSpec (sharding.py builds the mesh
and the run's Layout on it). A module of its own, below the model: precision.py and loss.py read the rule while the
model is traced, and sharding.py imports the model (through state.py)."""

from __future__ import annotations

from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P

from olmo3eqx.errors import ConfigError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
CONTEXT = "context"
"""The context-parallel axis (mesh.context > 1 only: a mesh without it is the plain (data, fsdp, tensor) one). It
splits each instance's sequence, and shards the parameters together with fsdp."""
CONTEXT_AXES = ("data", "fsdp", CONTEXT, "tensor")


def context_size(mesh: Mesh | AbstractMesh) -> int:
    """Chunks each sequence is split into on `mesh` (1 without a context axis)."""
    return dict(mesh.shape).get(CONTEXT, 1)
# Column-parallel (output dim split over `tensor`) and row-parallel (input dim split) projections.
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
ROW = ("o_proj", "down_proj")


def _names(path) -> list[str]:
    out = []
    for k in path:
        name = getattr(k, "name", None) or getattr(k, "key", None)
        if isinstance(name, str):
            out.append(name)
    return out


def partition_spec(path, shape: tuple[int, ...], mesh: Mesh | AbstractMesh) -> P:
    """The rule. Layer-stacked leaves (under `blocks`) keep their leading layer axis unsharded; the tensor axis
    splits the output of column-parallel and the input of row-parallel projections; fsdp then takes the largest
    remaining dimension it divides (fsdp x context jointly on a mesh with a context axis, as OLMo-core's FSDP shards
    over its data and context ranks). Scalars and anything fsdp divides nowhere are replicated."""
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
    shard = tuple(a for a, n in (("fsdp", fsdp), (CONTEXT, context_size(mesh))) if n > 1)
    size = fsdp * context_size(mesh)
    if size > 1 and len(dims) >= 2:
        free = sorted((d for d in dims if spec[d] is None and shape[d] % size == 0), key=lambda d: -shape[d])
        if free:
            spec[free[0]] = shard[0] if len(shard) == 1 else shard
    return P(*spec)
