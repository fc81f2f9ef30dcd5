"""Weights cross the mesh in the compute dtype, gradients in float32 (mesh.gather_dtype "compute").

OLMo-core's FSDP2 `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` all-gathers each parameter in
bfloat16 and reduces its gradient in float32, over float32 master weights. Left to the compiler (mesh.gather_dtype
"xla"), the default run's step (configs/tiny.yaml) with bfloat16 compute, compiled for XLA:TPU (v5p:2x2x1, fsdp 4), gathers its weights in
bfloat16 but all-reduces 29 of its weight gradients in bfloat16: XLA's SPMD partitioner sums a matmul's partial
products right after the matmul, in the matmul's output dtype, before the cast to float32 that the program writes
after it. (Compiled for CPU devices every collective reads float32: after partitioning, XLA:CPU's
all-reduce-promotion and float-normalization-bf16 passes widen the bfloat16 collectives its runtime cannot run; as
partitioned, the CPU program has the same 29 bfloat16 all-reduces.)

Here the policy is written into the program, weight by weight where the model uses it (model.for_compute), with the
parameter's own PartitionSpec (sharding.partition_spec) on the abstract mesh in context:
- `gathered`: the float32 shard cast to the compute dtype while still sharded (a sharding constraint to the
  parameter's spec on both sides of the cast), then constrained to the gathered spec (the spec without "fsdp"; a
  tensor split stays), so the all-gather carries the compute dtype.
- `dense` (every projection) and `take_rows` (the embedding): the forward pass uses the gathered weight, outside the
  gradient; the weight's gradient comes from a second path whose backward computes it with a float32 result (the
  matmul's partial products accumulate into float32; the embedding's rows are added in float32) and constrains it to
  the parameter's spec, so the partial sums are reduced (all-reduce or reduce-scatter) in float32 and never rounded
  to bfloat16 on the way. The forward matmul stays an ordinary one, so the remat policies that keep matmul outputs
  ("dots") still see it; a custom VJP around it would hide it from them.
- `gather_for_compute` (norm weights, LM head): a custom VJP, `gathered` forward, the cotangent cast to float32 before
  its constraint back to the parameter's spec. Their gradients already reduce in float32 (the norm's product and the
  unembedding's logits are float32).
The layer-stacked block weights are gathered one layer at a time inside the layer scan, inside the layer's remat, so a
checkpointed layer gathers its weights again for the backward pass, as FSDP's reshard-after-forward does.

Outside a mesh with an fsdp axis > 1 (generation, evaluation on one device, convert's parity check), with float32
compute, or with mesh.gather_dtype "xla", the model casts as it always has. The step chooses with `traced_gathering`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from olmo3eqx import fp8
from olmo3eqx.specs import CONTEXT, context_size

_GATHER: contextvars.ContextVar[str] = contextvars.ContextVar("gather_dtype", default="compute")


@contextlib.contextmanager
def gathering(gather_dtype: str):
    """Trace with mesh.gather_dtype `gather_dtype` ("compute" unless told)."""
    token = _GATHER.set(gather_dtype)
    try:
        yield
    finally:
        _GATHER.reset(token)


def traced_gathering(gather_dtype: str, fn):
    """`fn` traced under `gathering(gather_dtype)` (the train step, as sharding.on_mesh wraps it in its mesh)."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with gathering(gather_dtype):
            return fn(*args, **kwargs)

    return traced


def compute_mode() -> bool:
    """Whether this trace runs in mesh.gather_dtype "compute" (the train step's default)."""
    return _GATHER.get() == "compute"


def explicit() -> bool:
    """Whether this trace gathers weights explicitly: mesh.gather_dtype "compute" under an abstract mesh
    (sharding.on_mesh) with an fsdp axis > 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if _GATHER.get() != "compute" or mesh.empty or not {"fsdp", "tensor"} <= set(mesh.axis_names):
        return False
    return mesh.shape["fsdp"] * context_size(mesh) > 1


def context_split(mesh) -> bool:
    """Whether `mesh` has a context axis (mesh.context > 1): its sequences are split too, which the per-device paths
    here (`hierarchical`, loss.per_device: each device's rows) do not handle; the partitioner reduces there."""
    return context_size(mesh) > 1


def param_spec(names: tuple[str, ...], shape: tuple[int, ...], *, layer: bool = False) -> P:
    """The PartitionSpec of the parameter at `names` (e.g. ("blocks", "attn", "q_proj", "weight")) on the abstract mesh
    in context (sharding.partition_spec, the one rule); `layer`: of one layer's slice of a stacked block leaf, i.e.
    the stacked leaf's spec without its leading entry."""
    from olmo3eqx.specs import partition_spec

    path = tuple(jax.tree_util.GetAttrKey(n) for n in names)
    mesh = jax.sharding.get_abstract_mesh()
    if layer:
        return P(*partition_spec(path, (1, *shape), mesh)[1:])
    return partition_spec(path, shape, mesh)


def without_fsdp(spec: P) -> P:
    """`spec` with the fsdp axis (and context, which shards the weights with it) dropped from every entry (the weight
    gathered over fsdp x context, other splits kept)."""

    def drop(entry):
        if isinstance(entry, tuple):
            kept = tuple(a for a in entry if a not in ("fsdp", CONTEXT))
            return kept if len(kept) > 1 else (kept[0] if kept else None)
        return None if entry in ("fsdp", CONTEXT) else entry

    return P(*(drop(e) for e in spec))


def gathered(w: Array, dtype, spec: P) -> Array:
    """`w` (sharded as `spec`) cast to `dtype` while sharded, then all-gathered over fsdp in `dtype`."""
    constrain = jax.lax.with_sharding_constraint
    return constrain(constrain(constrain(w, spec).astype(dtype), spec), without_fsdp(spec))


def gather_for_compute(w: Array, dtype, spec: P) -> Array:
    """`gathered`, whose cotangent is cast back to w's dtype before it is reduced to `spec`."""

    @jax.custom_vjp
    def gather(x):
        return gathered(x, dtype, spec)

    def backward(_, cotangent):
        return (jax.lax.with_sharding_constraint(cotangent.astype(w.dtype), spec),)

    gather.defvjp(lambda x: (gather(x), None), backward)
    return gather(w)


def weight_gradient_path(forward_shape: tuple[int, ...], dtype, inputs: Array, w: Array, spec: P, gradient):
    """Zeros of `forward_shape` whose only effect is w's gradient: gradient(inputs, cotangent) with w's dtype,
    constrained to `spec` (so its partial sums are reduced in that dtype). Added to an output computed from the
    gathered weight outside the gradient."""

    @jax.custom_vjp
    def path(x, weight):
        return jnp.zeros(forward_shape, dtype)

    def backward(x, cotangent):
        return None, jax.lax.with_sharding_constraint(gradient(x, cotangent).astype(w.dtype), spec)

    path.defvjp(lambda x, weight: (path(x, weight), x), backward)
    return path(inputs, w)


def dense(x: Float[Array, "n din"], w: Float[Array, "din dout"], spec: P, fp8_recipe: str = "none"
          ) -> Float[Array, "n dout"]:
    """x @ w in x's dtype, w (a float32 master weight sharded as `spec`) gathered in x's dtype; w's gradient x^T g
    accumulated and reduced in float32. `fp8_recipe` (model.fp8) other than "none": the three GEMMs in FP8
    (olmo3eqx.fp8), the gathered weight cast after the gather."""
    w_compute = jax.lax.stop_gradient(gathered(w, x.dtype, spec))
    y = x @ w_compute if fp8_recipe == "none" else fp8.matmul(x, w_compute, fp8_recipe)

    def gradient(inputs, cotangent):
        if fp8_recipe != "none":
            return fp8.grad_weight(inputs, cotangent, fp8_recipe, jnp.float32)
        return jax.lax.dot_general(inputs, cotangent, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    return y + weight_gradient_path(y.shape, y.dtype, x, w, spec, gradient)


def take_rows(table: Float[Array, "vocab d"], rows: Int[Array, "*batch"], dtype, spec: P) -> Float[Array, "*batch d"]:
    """table[rows] in `dtype`, the table (a float32 master sharded as `spec`) gathered in `dtype`; its gradient (the
    cotangent's rows added into a zero table) in float32, each device's rows added on the device and reduced as HSDP
    does (`hierarchical`): left to the partitioner, the whole table's gradient was all-reduced over every device at
    once, across nodes."""
    y = jax.lax.stop_gradient(gathered(table, dtype, spec))[rows]

    def partial(ids, cotangent):
        return jnp.zeros(table.shape, jnp.float32).at[ids].add(cotangent.astype(jnp.float32))

    def gradient(ids, cotangent):
        if hierarchical_ok(spec, ids.shape[0]):
            return hierarchical(partial, spec, ids, cotangent)
        zeros = jax.lax.with_sharding_constraint(jnp.zeros(table.shape, jnp.float32), without_fsdp(spec))
        return zeros.at[ids].add(cotangent.astype(jnp.float32))  # laid out as the gathered table: see embed_rows

    return y + weight_gradient_path(y.shape, y.dtype, rows, table, spec, gradient)


def embed_rows(table: Float[Array, "vocab d"], rows: Int[Array, "*batch"]) -> Float[Array, "*batch d"]:
    """table[rows] for the embedding table as the parameters shard it (take_rows without the cast). Under a tensor
    split the table is first gathered over fsdp, its tensor split kept, as take_rows gathers it: left to choose, XLA's
    SPMD partitioner (jax 0.10.2) fails a check (ExpandDeviceGroupsWithIota) regrouping the gather's operand inside
    the step's per-replica region (step.per_replica, `data` manual); the gradient's scatter gets the same layout."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and dict(mesh.shape).get("tensor", 1) > 1:
        table = jax.lax.with_sharding_constraint(table, without_fsdp(param_spec(("embed",), table.shape)))
    return table[rows]


def fsdp_dim(spec: P) -> int | None:
    """The dimension `spec` shards over fsdp (None: replicated over it)."""
    return next((i for i, e in enumerate(spec) if e == "fsdp" or (isinstance(e, tuple) and "fsdp" in e)), None)


def row_axes() -> tuple[str, ...]:
    """The batch axes (data, fsdp) of the mesh in context that still split the traced rows: those not already manual.
    Inside the step's per-replica region (step.per_replica, `data` manual) the rows are one data replica's, split
    over fsdp alone, and a shard_map nested there names no manual axis."""
    from olmo3eqx.specs import BATCH_AXES

    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names and a not in mesh.manual_axes)


def auto_axes() -> frozenset[str]:
    """The axes of the mesh in context that a nested shard_map may make manual (those not manual already)."""
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset(mesh.axis_names) - frozenset(mesh.manual_axes)


def rows_split(rows: int) -> bool:
    """Whether the mesh in context splits `rows` over its batch axes (`row_axes`, more than one device) with no
    tensor split: then each device's rows can be worked on the device (`hierarchical`, loss.per_device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not {"data", "fsdp", "tensor"} <= set(mesh.axis_names) or mesh.shape["tensor"] != 1 \
            or context_split(mesh):
        return False
    shards = math.prod(mesh.shape[a] for a in row_axes())
    return shards > 1 and rows % shards == 0


def hierarchical_ok(spec: P, rows: int) -> bool:
    """Whether `hierarchical` applies: `rows_split(rows)`, and `spec` naming no axis but fsdp."""
    return rows_split(rows) and all(e in (None, "fsdp") for e in spec)


def hierarchical(partial, spec: P, *args: Array) -> Array:
    """A weight's float32 gradient from each device's own rows: partial(*local rows of args) is this device's
    contribution (the weight's full shape), reduce-scattered over fsdp (within a node or slice) and then all-reduced
    over data (across them, on the shard), the order OLMo-core's HSDP reduces in; laid out as `spec`. `args` are
    split over the batch axes on their first dimension."""
    dim = fsdp_dim(spec)
    sizes = jax.sharding.get_abstract_mesh().shape
    axes = row_axes()

    def local(*xs):
        g = partial(*xs)
        if sizes["fsdp"] > 1:
            g = jax.lax.psum(g, "fsdp") if dim is None else jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dim,
                                                                                  tiled=True)
        # data manual already (step.per_replica): the replica's sum, reduced over data once a step there
        return jax.lax.psum(g, "data") if "data" in axes and sizes["data"] > 1 else g

    return jax.shard_map(local, in_specs=tuple(P(axes) for _ in args), out_specs=spec, axis_names=auto_axes(),
                         check_vma=False)(*args)
