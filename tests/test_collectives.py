"""olmo3eqx.collectives: every collective of a compiled program, against hand computations. Small jitted programs on
the suite's 8 simulated CPU devices whose collectives are known by construction (a psum over one named axis, loops
of known length, a ppermute), the tiny train step's gradient reduction against the parameters' shapes, and (with
libtpu) a TPU compile's async collective fusions against the layer weights it gathers."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from olmo3eqx import aot
from olmo3eqx.collectives import HloParseError, account
from olmo3eqx.config import for_chip, load_yaml
from olmo3eqx.sharding import build_layout
from olmo3eqx.step import make_train_step

REPO = Path(__file__).resolve().parents[1]
X = jnp.zeros((8, 16), jnp.float32)  # over a 2 x 4 mesh each device holds a [4, 4] float32 block: 64 bytes


def permuted_mesh() -> Mesh:
    """data=2 x fsdp=4 over the devices in an order unlike their ids: replica groups name positions in
    mesh.devices.flat, and reading them as device ids would name the wrong axes."""
    devices = np.asarray(jax.devices()[:8])[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 4)
    return Mesh(devices, ("data", "fsdp"))


def compiled_text(fn, mesh, *args, out_specs=P("data", "fsdp")) -> str:
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P("data", "fsdp"), out_specs=out_specs, check_vma=False)
    return jax.jit(mapped).lower(*args).compile().as_text()


def only(traffic, kind):
    found = [c for c in traffic.collectives if c.kind == kind]
    assert len(found) == 1, traffic.lines()
    return found[0]


def test_one_axis_psum_and_gather_name_that_axis_its_group_and_bytes():
    mesh = permuted_mesh()
    psum = only(account(compiled_text(lambda x: jax.lax.psum(x, "fsdp"), mesh, X), mesh), "all-reduce")
    assert (psum.axes, psum.group_size, psum.raw, psum.count, psum.across) == (("fsdp",), 4, {"f32": 64}, 1, False)
    assert psum.bytes_per_device == 2 * 3 / 4 * 64  # ring all-reduce: 2 (n-1)/n of the buffer
    gather = only(account(compiled_text(lambda x: jax.lax.all_gather(x, "data", tiled=True), mesh, X,
                                        out_specs=P(None, "fsdp")), mesh), "all-gather")
    assert (gather.axes, gather.group_size, gather.raw) == (("data",), 2, {"f32": 128})  # output [8, 4]
    assert gather.bytes_per_device == 1 / 2 * 128
    # the partitioner's own collectives (mesh-axes replica groups): a sum over the data axis of a sharded array
    sharded = jax.sharding.NamedSharding(mesh, P("data", "fsdp"))
    summed = jax.jit(lambda x: x.sum(0), in_shardings=sharded, out_shardings=sharded.update(spec=P("fsdp")))
    reduce = only(account(summed.lower(X).compile().as_text(), mesh), "all-reduce")
    assert (reduce.axes, reduce.group_size, reduce.raw) == (("data",), 2, {"f32": 16})


def test_partitioner_groups_over_reordered_devices_and_sub_axes():
    """XLA's mesh-axes replica groups with a device order (device_ids=([2,2,2]T(0,2,1))) and a sub-axis ('axis_1':(2)2,
    the minor half of a 4-wide axis): sums over one and over two axes of a 2 x 2 x 2 mesh whose rows are split over
    (d, t), and a transpose whose all-to-all runs over t alone."""
    devices = np.asarray(jax.devices()[:8])[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 2, 2)
    mesh = Mesh(devices, ("d", "f", "t"))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P(("d", "t"), "f")))

    def axes(fn, out):
        compiled = jax.jit(fn, out_shardings=jax.sharding.NamedSharding(mesh, out)).lower(x).compile()
        return [(c.kind, c.axes, c.group_size) for c in account(compiled.as_text(), mesh).collectives]

    assert axes(lambda v: v.sum(1), P(("d", "t"))) == [("all-reduce", ("f",), 2)]
    assert axes(lambda v: v.sum(0), P("f")) == [("all-reduce", ("d", "t"), 4)]
    assert axes(lambda v: v.reshape(2, 4, 16).sum(1), P("d", "f")) == [("all-reduce", ("t",), 2)]
    assert ("all-to-all", ("t",), 2) in axes(lambda v: v.T, P(("d", "t"), "f"))


def loops(x):
    def layer(c, _):
        c = jax.lax.psum(c, "fsdp") * 0.5
        return jax.lax.fori_loop(0, 3, lambda i, d: jax.lax.psum(d, "data") * 0.5, c), None

    return jax.lax.scan(layer, x, None, length=5)[0]


def test_counts_multiply_by_trip_counts_of_nested_loops():
    mesh = permuted_mesh()
    text = compiled_text(loops, mesh, X)
    assert text.count(" while(") == 2 and "known_trip_count" in text  # two loops, not unrolled
    counts = {c.axes: (c.count, c.exact) for c in account(text, mesh).collectives}
    assert counts == {("fsdp",): (5, "exact"), ("data",): (15, "exact")}
    # XLA:TPU states no trip count: the loop's condition (i < N from a constant start, step 1) gives the same
    stated = re.sub(r',?"known_trip_count":\{"n":"\d+"\}', "", text)
    assert "known_trip_count" not in stated
    assert {c.axes: (c.count, c.exact) for c in account(stated, mesh).collectives} == counts


def test_a_loop_of_unknown_length_is_marked_not_guessed():
    mesh = permuted_mesh()
    text = compiled_text(lambda x: jax.lax.while_loop(lambda c: c.sum() < 100.0,
                                                      lambda c: jax.lax.psum(c, "fsdp") + 1.0, x), mesh, X)
    traffic = account(text, mesh)
    reduce = only(traffic, "all-reduce")
    assert (reduce.count, reduce.exact) == (1, "unknown")
    printed = "\n".join(traffic.lines())
    assert ">=1" in printed and "counted as one trip" in printed
    assert traffic.to_json()["not_exact"] == [{"name": reduce.name, "kind": "all-reduce", "count_is": "unknown"}]


def test_granules_split_within_and_across():
    """Two granules along the data axis (as two slices or nodes): data-axis collectives cross them, fsdp-axis ones
    stay within; a permute along each axis likewise."""
    mesh = permuted_mesh()
    granules = np.array([[0] * 4, [1] * 4])

    def program(x):
        x = jax.lax.psum(x, "data") + jax.lax.psum(x * 2, "fsdp")
        return jax.lax.ppermute(x, "data", [(0, 1), (1, 0)]) + jax.lax.ppermute(x, "fsdp", [(i, (i + 1) % 4)
                                                                                            for i in range(4)])

    traffic = account(compiled_text(program, mesh, X), mesh, granules)
    links = {(c.kind, c.axes): c.across for c in traffic.collectives}
    assert links == {("all-reduce", ("data",)): True, ("all-reduce", ("fsdp",)): False,
                     ("collective-permute", ("data",)): True, ("collective-permute", ("fsdp",)): False}
    permute = [c for c in traffic.collectives if c.kind == "collective-permute"][0]
    assert permute.bytes_per_device == 64  # a permute sends its whole [4, 4] block
    assert traffic.total(True) == 2 * 1 / 2 * 64 + 64 and traffic.total(False) == 2 * 3 / 4 * 64 + 64
    assert account(compiled_text(program, mesh, X), mesh).total(True) == 0  # one granule: nothing across
    with pytest.raises(ValueError, match="granules has 4 entries for a mesh of 8 devices"):
        account(compiled_text(program, mesh, X), mesh, np.zeros(4))


def test_tiny_step_reduces_every_gradient_in_float32_over_fsdp():
    """The tiny config on 8 devices, fsdp=8, no accumulation: each gradient leaf is reduced in float32 over fsdp,
    so the float32 reduced bytes are 4 x the parameters, counted from the model's shapes, plus the loss's few
    scalars. The leaves fsdp shards (their PartitionSpec names it) are reduce-scattered, each device keeping its
    part (as partitioned: an all-reduce each device slices, which XLA:GPU's reduce-scatter creator turns into one),
    per device 7/8 of their bytes; the replicated rest (norm weights) all-reduced, 2 x 7/8. The dry run prints it."""
    cfg = load_yaml(REPO / "configs" / "tiny.yaml")
    layout = build_layout(cfg)
    assert dict(layout.mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1} and layout.plan.accum_steps == 1
    report = aot.compile_step(cfg, layout)
    traffic = report.collectives
    leaves = jax.tree.leaves(layout.abstract.model)  # ShapeDtypeStructs
    specs = jax.tree.leaves(layout.shardings.model)
    params = sum(leaf.size for leaf in leaves)
    sharded = sum(leaf.size for leaf, s in zip(leaves, specs) if "fsdp" in jax.tree.leaves(tuple(s.spec)))
    reductions = [c for c in traffic.collectives if c.kind in ("all-reduce", "reduce-scatter") and "f32" in c.raw]
    raw = sum(c.count * c.raw["f32"] for c in reductions)
    assert 4 * params <= raw <= 4 * params + 1024, (raw, 4 * params)
    scattered = sum(c.count * c.raw["f32"] for c in reductions if c.kind == "reduce-scatter")
    assert scattered == 4 * sharded, (scattered, 4 * sharded)
    sent = sum(c.count * c.factor * c.raw["f32"] for c in reductions)
    assert sent == pytest.approx(7 / 8 * scattered + 2 * 7 / 8 * (raw - scattered))
    assert {c.axes for c in traffic.collectives} == {("fsdp",)} and traffic.total(True) == 0
    assert all(c.exact == "exact" for c in traffic.collectives)
    printed = report.lines()
    assert any(line.startswith("collectives per step:") for line in printed)
    row = next(r for r in traffic.rows if r.kind == "reduce-scatter" and r.dtype == "f32")
    assert re.search(rf"reduce-scatter +f32 +fsdp +within node/slice +{row.count} +"
                     rf"{row.bytes_per_device / 2**20:,.2f}\n", "\n".join(printed))
    assert json.loads(json.dumps(traffic.to_json()))["within_bytes_per_device"] == traffic.total(False)


def test_context_axis_bytes_per_link_on_two_nodes():
    """The tiny packed step with context parallelism on two simulated nodes of 4 (data 2 across them, fsdp 2 x
    context 2 within each): the context axis's collectives (keys' and values' gathers, their gradients'
    reduce-scatters, the label shift) stay within a node, and the dry run's table sums each set of mesh axes per
    link: what the context axis alone sends, the weights over fsdp x context, the gradients' reduction over data
    across the nodes."""
    from test_context import config

    cfg = config(2, "flash")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, compute_dtype="bfloat16"),
                              mesh=dataclasses.replace(cfg.mesh, data=2, fsdp=-1, node_devices=4))
    layout = build_layout(cfg)
    assert dict(layout.mesh.shape) == {"data": 2, "fsdp": 2, "context": 2, "tensor": 1}
    report = aot.compile_step(cfg, layout, predict_time=False)
    traffic = report.collectives
    assert traffic.granules == 2
    by_axes = traffic.by_axes()
    context = [r for r in traffic.rows if r.axes == ("context",)]
    assert {r.kind for r in context} >= {"all-gather", "reduce-scatter", "collective-permute"}
    assert not any(r.across for r in traffic.rows if "context" in r.axes)
    assert by_axes[("context",)] == (pytest.approx(sum(r.bytes_per_device for r in context)), 0.0)
    assert by_axes[("context",)][0] > 0 and by_axes[("fsdp", "context")][0] > 0
    within, across = by_axes[("data",)]
    assert within == 0 and across > 0  # the gradients; the loss's scalars over data x fsdp beside them
    assert all("data" in axes for axes, (_, a) in by_axes.items() if a)
    assert sum(w + a for w, a in by_axes.values()) == pytest.approx(traffic.total(False) + traffic.total(True))
    printed = "\n".join(report.lines())
    assert re.search(rf"\n  context +{by_axes[('context',)][0] / 2**20:,.2f} +0\.00\n", printed), printed
    assert re.search(rf"\n  data +0\.00 +{across / 2**20:,.2f}\n", printed), printed
    stored = json.loads(json.dumps(traffic.to_json()))["by_axes"]
    assert {tuple(e["axes"]): (e["within_bytes_per_device"], e["across_bytes_per_device"]) for e in stored} == by_axes


GPU_ASYNC = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%scatter (p: f32[64]) -> f32[16] {
  %p = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(f32[64]{0} %p), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
}

%body (t: (s32[], bf16[8,4])) -> (s32[], bf16[8,4]) {
  %t = (s32[], bf16[8,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[8,4]{1,0} get-tuple-element(%t), index=1
  %f = f32[] constant(1)
  %y = f32[16]{0} broadcast(%f), dimensions={}
  %z = f32[64]{0} broadcast(%f), dimensions={}
  %ag-start = ((bf16[2,4]{1,0}, bf16[2,4]{1,0}), (bf16[8,4]{1,0}, bf16[8,4]{1,0})) all-gather-start(%x, %x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}, use_global_device_ids=true
  %ag-done = (bf16[8,4]{1,0}, bf16[8,4]{1,0}) all-gather-done(%ag-start)
  %ar-start = f32[16]{0} all-reduce-start(%y), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %ar-done = f32[16]{0} all-reduce-done(%ar-start)
  %cp-start = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(%y), channel_id=3, source_target_pairs={{0,4},{4,0}}
  %cp-done = f32[16]{0} collective-permute-done(%cp-start)
  %rs-start = ((f32[64]{0}), f32[16]{0}) async-start(%z), calls=%scatter
  %rs-done = f32[16]{0} async-done(%rs-start), calls=%scatter
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %r = (s32[], bf16[8,4]{1,0}) tuple(%next, %x)
}

%cond (c: (s32[], bf16[8,4])) -> pred[] {
  %c = (s32[], bf16[8,4]{1,0}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (x: bf16[8,4]) -> bf16[8,4] {
  %x0 = bf16[8,4]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,4]{1,0}) tuple(%zero, %x0)
  %loop = (s32[], bf16[8,4]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[8,4]{1,0} get-tuple-element(%loop), index=1
}
"""
"""XLA:GPU's async forms as XLA's own tests write them (all-gather-start / -done with combined operands,
all-reduce-start, collective-permute-start with its context, a reduce-scatter wrapped in async-start), in a loop of
6 whose trip count only the condition states, on a 2 x 4 mesh."""


def test_gpu_async_pairs_count_once_with_their_results():
    mesh = permuted_mesh()
    found = account(GPU_ASYNC, mesh).collectives
    got = {c.kind: c for c in found}
    assert len(found) == 4  # each start counted, each done not
    assert {k: (c.count, c.exact, c.group_size, c.axes) for k, c in got.items()} == {
        "all-gather": (6, "exact", 4, ("fsdp",)), "all-reduce": (6, "exact", 2, ("data",)),
        "collective-permute": (6, "exact", 2, ("data",)), "reduce-scatter": (6, "exact", 4, ("fsdp",))}
    assert got["all-gather"].raw == {"bf16": 2 * 8 * 4 * 2}  # the two gathered outputs, not the start's operands
    assert got["all-reduce"].raw == {"f32": 64} and got["collective-permute"].raw == {"f32": 64}
    assert got["reduce-scatter"].raw == {"f32": 256} and got["reduce-scatter"].bytes_per_device == 3 / 4 * 256


def test_replica_group_forms_it_cannot_read_are_one_sentence():
    text = "ENTRY %main () -> f32[] {\n  ROOT %a = f32[4]{0} all-reduce(%x), replica_groups=weird[0], to_apply=%r\n}\n"
    with pytest.raises(HloParseError, match="cannot read the replica groups"):
        account(text, permuted_mesh())
    with pytest.raises(HloParseError, match="no ENTRY computation"):
        account("%x = f32[] constant(0)", permuted_mesh())


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
@pytest.mark.tpu
@pytest.mark.tpu_small
def test_tpu_async_collective_fusions_are_counted_once_per_run():
    """XLA:TPU prints no trip counts and splits each async all-gather into start, continuation and done fusions, each
    holding a copy of it. The tiny model with 8 layers (two scan steps of 4) and 2 accumulation steps on v5p:2x2x1:
    every count exact, and the layer weights (bfloat16: XLA:TPU gathers them after the cast) gathered once in the
    forward scan and once in the backward scan of each micro-batch; the embedding and the lm_head once per
    micro-batch."""
    base = load_yaml(REPO / "configs" / "tiny.yaml")
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, num_hidden_layers=8,
                                                              compute_dtype="bfloat16"),
                              mesh=dataclasses.replace(base.mesh, max_per_device_batch=2))
    devices = aot.topology_devices("v5p:2x2x1")
    cfg = for_chip(cfg, devices[0].device_kind)
    layout = build_layout(cfg, devices)  # compiled here rather than by aot.compile_for: no cost-model compiles
    compiled = make_train_step(cfg, layout).lower(layout.state_target(), *layout.batch_target(cfg.data.seq_len))
    traffic = account(compiled.compile().as_text(), layout.mesh)
    assert traffic.collectives and all(c.exact == "exact" and c.count >= 1 for c in traffic.collectives)
    model = layout.abstract.model
    stacked = sum(x.size for x in jax.tree.leaves(model.blocks) if x.ndim >= 3)  # the layers' matrices
    ends = model.embed.size + model.lm_head.weight.size
    gathers = [c for c in traffic.collectives if c.kind == "all-gather"]
    assert {d for c in gathers for d in c.raw} == {"bf16"}
    accum = 2
    assert sum(c.count * c.raw["bf16"] for c in gathers) == 2 * (2 * accum * stacked + accum * ends)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu]')")
def test_two_tpu_slices_count_what_crosses_the_data_centre_network():
    """Over two v5p:2x2x1 slices, meshed data=2 (the slices) x fsdp=4 as make_mesh lays them out, XLA:TPU compiles each
    slice's program: a sum over the data axis crosses slices and goes out as Megascale sends (dcn-send, across, on
    the data axis, the [8, 256] float32 block each device holds, a whole number of the TPU's (8, 128) tiles, so no
    padding), a sum over fsdp stays on the slice's ICI."""
    from olmo3eqx.config import MeshConfig
    from olmo3eqx.sharding import granules_of, make_mesh

    devices = aot.topology_devices("v5p:2x2x1", slices=2)
    mesh = make_mesh(MeshConfig(data=2, fsdp=4), devices)
    granules = granules_of(mesh)
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P(("data", "fsdp"))))

    def traffic(axis):
        fn = jax.shard_map(lambda b: jax.lax.psum(b, axis), mesh=mesh, in_specs=P(("data", "fsdp")),
                           out_specs=P(("data", "fsdp")), check_vma=False)
        return account(jax.jit(fn).lower(x).compile().as_text(), mesh, granules)

    across = traffic("data")
    sends = [c for c in across.collectives if c.kind == "dcn-send"]
    assert sends and all(c.across and c.axes == ("data",) for c in sends), across.lines()
    assert sum(sum(c.raw.values()) * c.count for c in sends) == 8 * 256 * 4, across.lines()
    assert across.total(True) > 0
    within = traffic("fsdp")
    assert within.total(True) == 0 and not [c for c in within.collectives if c.kind == "dcn-send"], within.lines()
    assert {c.axes for c in within.collectives} == {("fsdp",)}, within.lines()


PADDED_GATHER = """HloModule m, is_scheduled=true

%add (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %s = bf16[] add(%a, %b)
}

%padded (p: bf16[2,4], i: s32[]) -> bf16[8,4] {
  %p = bf16[2,4]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %zero = bf16[] constant(0)
  %zeros = bf16[8,4]{1,0} broadcast(%zero), dimensions={}
  %j = s32[] constant(0)
  ROOT %dus = bf16[8,4]{1,0} dynamic-update-slice(%zeros, %p, %i, %j)
}

%into (z2: bf16[8,4], p2: bf16[2,4], i2: s32[]) -> bf16[8,4] {
  %z2 = bf16[8,4]{1,0} parameter(0)
  %p2 = bf16[2,4]{1,0} parameter(1)
  %i2 = s32[] parameter(2)
  %j2 = s32[] constant(0)
  ROOT %dus2 = bf16[8,4]{1,0} dynamic-update-slice(%z2, %p2, %i2, %j2)
}

ENTRY %main (x: bf16[2,4], y: bf16[8,4], k: s32[]) -> (bf16[8,4], bf16[8,4], bf16[8,4]) {
  %x = bf16[2,4]{1,0} parameter(0)
  %y = bf16[8,4]{1,0} parameter(1)
  %k = s32[] parameter(2)
  %part = bf16[8,4]{1,0} fusion(%x, %k), kind=kLoop, calls=%padded
  %gathered = bf16[8,4]{1,0} all-reduce(%part), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %summed = bf16[8,4]{1,0} all-reduce(%y), channel_id=2, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %zero3 = bf16[] constant(0)
  %zeros3 = bf16[8,4]{1,0} broadcast(%zero3), dimensions={}
  %part2 = bf16[8,4]{1,0} fusion(%zeros3, %x, %k), kind=kLoop, calls=%into
  %gathered2 = bf16[8,4]{1,0} all-reduce(%part2), channel_id=3, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  ROOT %out = (bf16[8,4]{1,0}, bf16[8,4]{1,0}, bf16[8,4]{1,0}) tuple(%gathered, %summed, %gathered2)
}
"""
"""XLA:TPU's all-gather run as an all-reduce: each device's [2, 4] part written into a zero [8, 4] (a fused
dynamic-update-slice into a broadcast), summed over a group of 4, once with the zeros made inside the fusion and once
passed in as its parameter; beside them a plain all-reduce."""


def test_an_all_reduce_of_zero_padded_parts_is_the_all_gather_it_runs():
    traffic = account(PADDED_GATHER, permuted_mesh())
    gathers, plain = [c for c in traffic.collectives if c.kind == "all-gather"], only(traffic, "all-reduce")
    assert [g.name for g in gathers] == ["gathered", "gathered2"] and plain.name == "summed"
    for gather in gathers:
        assert gather.raw == plain.raw == {"bf16": 8 * 4 * 2}
        assert gather.bytes_per_device == plain.bytes_per_device == 2 * 3 / 4 * 64  # run as the all-reduce it is


GPU_LOOP = """
%fused_compare (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %limit = s32[] constant(63)
  ROOT %lt = pred[] compare(%p, %limit), direction=LT
}

%fused_add (q: s32[]) -> s32[] {
  %q = s32[] parameter(0)
  %one = s32[] constant(1)
  ROOT %inc = s32[] add(%q, %one)
}

%sum (l: f32[], r: f32[]) -> f32[] {
  %l = f32[] parameter(0)
  %r = f32[] parameter(1)
  ROOT %s = f32[] add(%l, %r)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  ROOT %cmp = pred[] fusion(%ci), kind=kLoop, calls=%fused_compare
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %bi = s32[] get-tuple-element(%b), index=0
  %bx = f32[8]{0} get-tuple-element(%b), index=1
  %next = s32[] fusion(%bi), kind=kLoop, calls=%fused_add
  %ar = f32[8]{0} all-reduce(%bx), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  ROOT %out = (s32[], f32[8]{0}) tuple(%next, %ar)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[8]{0}) tuple(%start, %x)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %y = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_trip_count_read_through_a_compare_fused_with_its_limit():
    """XLA:GPU states no trip count for the gradient-accumulation loop it peels, and fuses the condition's limit
    constant into the compare (loop_compare_fusion): the count is read from that fusion (0 to 63 by 1)."""
    mesh = Mesh(np.asarray(jax.devices()[:8]), ("fsdp",))
    reduce = only(account(GPU_LOOP, mesh), "all-reduce")
    assert (reduce.count, reduce.exact) == (63, "exact")
