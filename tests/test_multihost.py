"""Multi-process training through jax.distributed on localhost (gloo CPU collectives): 2 processes x 2 devices
against 1 process x 4 devices; checkpoints cross process counts both ways; a dead process stops the other."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from test_train import CONFIG, ROOT, losses, wait_for, logged_step

STEPS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(devices: int) -> dict:
    e = dict(os.environ)
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    e["JAX_PLATFORMS"] = "cpu"
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        e.pop(k, None)
    return e


def cmd(cfg, run_dir, *extra):
    return [sys.executable, str(ROOT / "train.py"), "--config", str(cfg), "--run.dir", str(run_dir),
            "--steps", str(STEPS), "--log.indices", "--dist.heartbeat-timeout", "10", *extra]


HYBRID = ("--mesh.data", "2")
"""With each process on its own node (OLMO3EQX_NODE_NAME): the batch over data across the nodes x fsdp within."""


def launch(cfg, run_dir, processes: int, *extra, nodes: bool = False):
    """`processes` processes with 4 / processes devices each (4 devices in all); `nodes`: each names its own node."""
    if processes == 1:
        return [subprocess.Popen(cmd(cfg, run_dir, *extra), env=base_env(4), stderr=subprocess.PIPE, text=True)]
    port = free_port()
    procs = []
    for i in range(processes):
        e = base_env(4 // processes)
        e.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes), JAX_PROCESS_ID=str(i))
        if nodes:
            e["OLMO3EQX_NODE_NAME"] = f"node-{i}"
        procs.append(subprocess.Popen(cmd(cfg, run_dir, *extra), env=e, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs, timeout=300):
    out = []
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        out.append((p.returncode, err))
    return out


def indices(run_dir) -> dict[int, list[int]]:
    """Global instance ids per step: the union over processes (a resumed step's later line wins per process)."""
    per_proc = {}
    for path in sorted((run_dir / "e2e" / "indices").glob("process_*.jsonl")):
        rows = {}
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            rows[rec["step"]] = rec["index"]
        per_proc[path.name] = rows
    steps = sorted(set().union(*per_proc.values()))
    return {s: sorted(i for rows in per_proc.values() for i in rows.get(s, [])) for s in steps}


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory):
    base = tmp_path_factory.mktemp("multihost")
    path = base / "e2e.yaml"
    path.write_text(CONFIG.replace("CACHE", str(base / "cache")))
    return path


@pytest.fixture(scope="module")
def single(cfg_path):
    run_dir = cfg_path.parent / "single"
    (rc, err), = finish(launch(cfg_path, run_dir, 1))
    assert rc == 0, err[-3000:]
    return run_dir


def assert_close(run_dir, reference):
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert got[s] == pytest.approx(want[s], rel=2e-5), f"step {s}: {got[s]} vs {want[s]}"


@pytest.mark.parametrize("nodes", [False, pytest.param(True, marks=pytest.mark.slow)],  # 34 s; the 2 -> 1 resume
                         ids=["one-node", "two-nodes"])  # below keeps two nodes in the default suite
def test_two_processes_match_one_process(cfg_path, single, nodes):
    """Two processes, on one node (fsdp over all 4 devices) or on two (data across the nodes, fsdp within: the
    hybrid mesh), train as one process does on the same global batches, each reading its own half."""
    run_dir = cfg_path.parent / f"two-{nodes}"
    results = finish(launch(cfg_path, run_dir, 2, *(HYBRID if nodes else ()), nodes=nodes))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert_close(run_dir, single)
    two, one = indices(run_dir), indices(single)
    assert two == one and sorted(two) == list(range(1, STEPS + 1))
    # Each process read only its own half of every global batch.
    halves = [json.loads(line)["index"] for line in
              (run_dir / "e2e" / "indices" / "process_0.jsonl").read_text().splitlines()]
    assert all(len(h) == 4 for h in halves)
    assert "process 0 of 2" in results[0][1]
    assert f"mesh {{'data': {2 if nodes else 1}, 'fsdp': {2 if nodes else 4}, 'tensor': 1}}" in results[0][1]
    assert ("; node node-0 of 2" in results[0][1]) == nodes


@pytest.mark.parametrize("before,after", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])  # 1 -> 2: -m slow
def test_checkpoint_crosses_process_counts(cfg_path, single, before, after):
    """Preempted and resumed on another process count: the same losses and global batches as one uninterrupted
    process. The two processes name two nodes when they start (the hybrid mesh: data across nodes, fsdp within)."""
    run_dir = cfg_path.parent / f"cross-{before}-{after}"
    procs = launch(cfg_path, run_dir, before, *(HYBRID if before == 2 else ()), nodes=before == 2)
    wait_for(lambda: logged_step(run_dir) >= 4, procs[0])
    for p in procs:
        p.send_signal(signal.SIGTERM)  # as a scheduler preempts every task of a job
    results = finish(procs)
    assert all(rc == 75 for rc, _ in results), [err[-2000:] for _, err in results]
    if before == 2:
        assert "; node node-0 of 2" in results[0][1] and "mesh {'data': 2, 'fsdp': 2, 'tensor': 1}" in results[0][1]
    saved = sorted(int(p.name) for p in (run_dir / "e2e" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] < STEPS
    results = finish(launch(cfg_path, run_dir, after))
    assert all(rc == 0 for rc, _ in results), [err[-2000:] for _, err in results]
    assert "resumed from" in results[0][1]
    assert_close(run_dir, single)
    assert indices(run_dir) == indices(single)


@pytest.mark.slow  # 31 s; test_faults keeps a multi-process stop (process 0 refused) in the default suite
def test_a_dead_process_stops_the_other(cfg_path):
    run_dir = cfg_path.parent / "dead"
    procs = launch(cfg_path, run_dir, 2, "--steps", "100000", "--checkpoint.every", "100000")
    wait_for(lambda: logged_step(run_dir) >= 2, procs[0])
    procs[1].send_signal(signal.SIGKILL)
    t = time.time()
    try:
        procs[0].wait(timeout=120)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("the surviving process hung for 120 s after its peer died")
    assert procs[0].returncode != 0
    assert time.time() - t < 120



TORN_FOR_ONE = """
import json, os, sys
from pathlib import Path

import jax

jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], num_processes=2,
                           process_id=int(os.environ["JAX_PROCESS_ID"]))
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from olmo3eqx.checkpoint.checkpointer import Checkpointer
from olmo3eqx.config import ModelConfig, to_dict

sharding = NamedSharding(jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Auto,)), PartitionSpec("fsdp"))


def values(step):  # 4 MiB that compress little: stored in each process's own data files, not inline in the index
    return np.random.default_rng(step).standard_normal(1 << 20, dtype=np.float32)


def state(step):
    return {"w": jax.make_array_from_callback((1 << 20,), sharding, lambda i: values(step)[i])}


root, cfg = Path(sys.argv[1]), ModelConfig()
ck = Checkpointer(root, keep=5, async_save=False)
for step in (2, 4):
    ck.save(step, state(step), {"batches_consumed": step}, {"model": to_dict(cfg)})
ck.close()
multihost_utils.sync_global_devices("saved")
if jax.process_index() == 0:  # tear checkpoint 4's data files of process 1: the shards only process 1 reads back
    torn = [f for f in (root / "4" / "state" / "ocdbt.process_1").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert torn
    for f in torn:
        f.write_bytes(b"")
multihost_utils.sync_global_devices("torn")
ck = Checkpointer(root, keep=5, async_save=False)
target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state(0))
step, restored, data = ck.restore_latest(target, cfg, warn=lambda m: print(m, file=sys.stderr, flush=True))
intact = all(np.array_equal(np.asarray(s.data), values(step)[s.index]) for s in restored["w"].addressable_shards)
print(json.dumps({"step": step, "intact": intact, "data": data}), flush=True)
ck.close()
"""
"""Two processes (2 devices each) save checkpoints 2 and 4 of a state sharded over all 4 devices, tear checkpoint 4
for process 1 alone, and resume the newest checkpoint that restores."""


def test_a_step_torn_for_one_process_is_skipped_by_every_process(tmp_path):
    """Checkpoint 4's data files of process 1 torn: only process 1 sees the damage, yet both processes skip 4 and
    restore 2 intact (process 0's list of steps, one verdict from everyone's outcome), and 4 is set aside once."""
    root = tmp_path / "checkpoints"
    port, procs = free_port(), []
    for i in range(2):
        e = base_env(2)
        e.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, "-c", TORN_FOR_ONE, str(root)], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        (out0, err0), (out1, err1) = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()  # one left waiting in a collective for the other must not outlive the test
    assert [p.returncode for p in procs] == [0, 0], err0[-3000:] + err1[-3000:]
    for out in (out0, out1):
        assert json.loads(out.strip().splitlines()[-1]) == {"step": 2, "intact": True,
                                                            "data": {"batches_consumed": 2}}
    assert f"checkpoint {root / '4'} is incomplete or damaged on process 1 (" in err0, err0[-3000:]
    assert f"warning (process 1): checkpoint {root / '4'} is incomplete or damaged (" in err1, err1[-3000:]
    assert sorted(p.name.split("-")[0] for p in root.iterdir()) == ["2", "4.unreadable"]


@pytest.mark.slow  # 150 s: two launches of two trainers; the test above checks the same through the Checkpointer
def test_a_run_whose_step_is_torn_for_one_process_resumes_on_both_from_the_previous(cfg_path):
    """End to end through train.py: two processes wrote checkpoints 2 and 4; checkpoint 4's data of process 1 torn;
    both processes skip it, resume from 2 and replay steps 3-4 bit-identically."""
    run_dir = cfg_path.parent / "torn-for-one"
    flags = ("--steps", "4", "--checkpoint.every", "2", "--eval.every", "0")
    results = finish(launch(cfg_path, run_dir, 2, *flags))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    first = losses(run_dir)
    ckpt = run_dir / "e2e" / "checkpoints"
    torn = [f for f in (ckpt / "4" / "state" / "ocdbt.process_1").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert torn
    for f in torn:
        f.write_bytes(b"")
    metrics = run_dir / "e2e" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if json.loads(line)["step"] <= 2))
    results = finish(launch(cfg_path, run_dir, 2, *flags))
    assert [rc for rc, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    (_, err0), (_, err1) = results
    assert f"checkpoint {ckpt / '4'} is incomplete or damaged on process 1 (" in err0, err0[-3000:]
    assert f"resumed from {ckpt / '2'}" in err0
    assert f"warning (process 1): checkpoint {ckpt / '4'} is incomplete or damaged" in err1, err1[-3000:]
    assert losses(run_dir) == first
    assert len([p for p in ckpt.iterdir() if p.name.startswith("4.unreadable-")]) == 1
