"""Nodes and slices in the mesh (olmo3eqx.sharding.make_mesh): `data` runs across granules (TPU slices, nodes), fsdp
and tensor within, and each process's devices stay one contiguous block of the batch rows, in process order (the
data pipeline gives process p the p-th block). Two TPU v5p slices as libtpu describes them for compiling
(jax.experimental.topologies, slice_index 0 and 1) and two nodes of 4 simulated CPU devices (mesh.node_devices);
two real processes naming two nodes are in test_distributed.py."""

from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest

from olmo3eqx import aot
from olmo3eqx.config import ConfigError, MeshConfig
from olmo3eqx.sharding import AXES, granule_ids, granules_of, make_mesh, node_mesh

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")


def assert_hybrid(mesh, granules: np.ndarray) -> None:
    """Every data index lies in one granule (so every fsdp x tensor group does), the granules follow one another
    along data, and each process's devices are one contiguous run of batch rows, processes in order."""
    assert granules.shape == mesh.devices.shape and mesh.axis_names == AXES
    per_data = [set(granules[i].flat) for i in range(mesh.shape["data"])]
    assert all(len(s) == 1 for s in per_data), per_data
    along = [s.pop() for s in per_data]
    assert along == sorted(along) and set(along) == set(granules.flat), along
    assert_rows_by_process(mesh)


def assert_rows_by_process(mesh) -> None:
    """The batch is split over (data, fsdp), row-major: each row block's devices (its tensor group) belong to one
    process, and the processes come in order."""
    rows = mesh.devices.reshape(mesh.shape["data"] * mesh.shape["fsdp"], mesh.shape["tensor"])
    procs = [{d.process_index for d in row} for row in rows]
    assert all(len(p) == 1 for p in procs), procs
    order = [p.pop() for p in procs]
    assert order == sorted(order), order


@pytest.fixture(scope="module")
def two_slices():
    """The 8 abstract devices of two v5p:2x2x1 slices (4 chips each, one host each)."""
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install -e '.[tpu]')")
    return aot.topology_devices("v5p:2x2x1", slices=2)


@needs_libtpu
def test_two_tpu_slices(two_slices, capsys):
    devices = two_slices
    assert [d.slice_index for d in devices] == [0] * 4 + [1] * 4
    assert [d.slice_index for d in aot.topology_devices("2xv5p:2x2x1")] == [0] * 4 + [1] * 4  # --target's name
    assert list(granule_ids(devices)) == [0] * 4 + [1] * 4
    mesh = make_mesh(MeshConfig(data=2), devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert_hybrid(mesh, granules_of(mesh))
    assert node_mesh(devices).devices.tolist() == mesh.devices.tolist()  # the tools' mesh: the same HSDP
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2), devices)
    assert_hybrid(mesh, granules_of(mesh))
    mesh = make_mesh(MeshConfig(data=4, fsdp=2), devices)  # two data replicas in each slice
    assert [int(granules_of(mesh)[i, 0, 0]) for i in range(4)] == [0, 0, 1, 1]
    assert_hybrid(mesh, granules_of(mesh))
    with pytest.raises(ConfigError, match=r"mesh.fsdp=8 would span 2 slices of 4 devices .*--mesh.data 2 .*"
                                          r"--mesh.cross-nodes"):
        make_mesh(MeshConfig(), devices)
    with pytest.raises(ConfigError, match=r"fsdp=2 x tensor=4 would span 2 slices"):
        make_mesh(MeshConfig(fsdp=2, tensor=4, data=1), devices)
    with pytest.raises(ConfigError, match=r"unequal sizes \(4, 2 devices\)"):
        make_mesh(MeshConfig(), devices[:6])
    assert capsys.readouterr().err == ""
    crossed = make_mesh(MeshConfig(cross_nodes=True), devices)  # allowed, granule-major, with one warning line
    assert dict(crossed.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
    assert list(granules_of(crossed).flat) == [0] * 4 + [1] * 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: mesh.fsdp=8 would span 2 slices"), err
    one = aot.topology_devices("v5p:2x2x1")  # one slice: one granule, the mesh as before
    assert set(granule_ids(one)) == {0}
    assert make_mesh(MeshConfig(), one).devices.shape == (1, 4, 1) and node_mesh(one).devices.shape == (1, 4, 1)


def test_two_simulated_nodes(capsys):
    """node_devices=4 on the suite's 8 CPU devices: two nodes; node_devices=8 (one node) leaves the mesh as it was."""
    devices = jax.devices()[:8]
    assert list(granule_ids(devices, 4)) == [0] * 4 + [1] * 4
    assert list(granule_ids(devices[::-1], 4)) == [1] * 4 + [0] * 4  # by (process, id), whatever the given order
    for cfg in (MeshConfig(data=2, node_devices=4), MeshConfig(data=2, fsdp=2, tensor=2, node_devices=4),
                MeshConfig(data=4, fsdp=-1, node_devices=4)):
        mesh = make_mesh(cfg, devices)
        assert_hybrid(mesh, granules_of(mesh, 4))
    assert make_mesh(MeshConfig(node_devices=8), devices).devices.tolist() == make_mesh(MeshConfig(),
                                                                                          devices).devices.tolist()
    with pytest.raises(ConfigError, match=r"^mesh.fsdp=8 would span 2 nodes of 4 devices \(every layer's all-gather "
                                          r"and reduce-scatter over the network\); run HSDP as OLMo-core does with "
                                          r"--mesh.data 2 \(fsdp -1 then takes the 4 devices of a node\)"):
        make_mesh(MeshConfig(node_devices=4), devices)
    with pytest.raises(ConfigError, match="mesh.node_devices=3 does not divide the 8 devices"):
        make_mesh(MeshConfig(node_devices=3), devices)
    with pytest.raises(ConfigError, match="mesh.node_devices must be non-negative"):
        MeshConfig(node_devices=-1)
    assert capsys.readouterr().err == ""
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2, node_devices=4, cross_nodes=True), devices)
    assert "warning: mesh.fsdp=4 x tensor=2 would span 2 nodes" in capsys.readouterr().err
    assert list(granules_of(mesh, 4).flat) == [0] * 4 + [1] * 4
