"""Every launcher gets all its chips, exactly once (olmo3eqx.distributed).

Each launcher's environment is simulated (the variables SLURM and Open MPI set, a metadata server on loopback
answering as a gcloud TPU VM's does, a GKE TPU multislice JobSet's variables, explicit variables) and what
`jax.distributed.initialize` receives is recorded; its address, process count and id are compared with JAX's own
detection (`ClusterEnv.auto_detect_unset_distributed_params`), which differs only in the devices a SLURM or Open
MPI process drives. The recipes of docs/multi-host.md are read from the page and simulated: every GPU of a node
is driven by exactly one process. The device-count refusal is checked on numbers and, with two CPU processes
joined over loopback under a simulated two-node SLURM step, end to end (nothing here ran on a real cluster)."""

from __future__ import annotations

import http.server
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from jax._src import clusters
from jax._src.clusters import cloud_tpu_cluster

from olmo3eqx import distributed, jaxenv
from olmo3eqx.config import DistConfig
from olmo3eqx.distributed import Launch
from olmo3eqx.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("SLURM_", "OMPI_", "PMI_", "TPU_", "MEGASCALE_", "KUBERNETES_", "JOB_COMPLETION_INDEX", "JOBSET_",
               "CUDA_VISIBLE_DEVICES", "GCE_METADATA_IP", "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT",
               "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS")
EIGHT = ",".join(map(str, range(8)))


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}


@pytest.fixture
def env(monkeypatch, tmp_path):
    """This process's environment without any launcher's variables, on a node whose NVIDIA device files are those
    the test puts in `tmp_path` (none unless it does: `gpu_files`); returns a setter for a launcher's variables."""
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    monkeypatch.setattr(distributed, "launched", Launch())
    monkeypatch.setattr(jaxenv, "NVIDIA_NODES", str(tmp_path / "nvidia[0-9]*"))

    def set_vars(clear=False, **values):
        """Set a launcher's variables (`clear`: first remove those an earlier call set)."""
        for k in list(os.environ) if clear else ():
            if k.startswith(LAUNCH_VARS):
                monkeypatch.delenv(k)
        for k, v in values.items():
            monkeypatch.setenv(k, str(v))

    set_vars(clear=True)
    return set_vars


@pytest.fixture
def calls(monkeypatch):
    """What jax.distributed.initialize receives (it is not run: this process's backend is the suite's, and no
    coordination service is there for the node names)."""
    got = []
    monkeypatch.setattr("jax.distributed.initialize", lambda **kw: got.append(kw))
    monkeypatch.setattr(distributed, "publish_nodes", lambda *a: ())
    monkeypatch.setattr(distributed, "nodes", ())
    monkeypatch.setattr("olmo3eqx.peers.watch", lambda *a: None)  # no watcher thread, no exits.ending left behind
    return got


class Metadata(http.server.BaseHTTPRequestHandler):
    """A GCE metadata server's instance attributes (what JAX's GceTpuCluster asks for), on loopback."""

    attributes: dict[str, str] = {}
    asked: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        key = self.path.rsplit("/", 1)[-1]
        Metadata.asked.append(key)
        ok = self.path.startswith("/computeMetadata/v1/instance/attributes/") and key in self.attributes
        body = self.attributes.get(key, "").encode() if ok else b"not found"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def tpu_vm(monkeypatch, env):
    """This host as a TPU VM (libtpu found chips: JAX's running_in_cloud_tpu_vm) whose metadata server answers
    with the attributes the test sets."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    monkeypatch.setattr(cloud_tpu_cluster, "running_in_cloud_tpu_vm", True)
    env(GCE_METADATA_IP=f"127.0.0.1:{server.server_address[1]}")
    Metadata.asked = []

    def answer(attributes: dict[str, str]):
        Metadata.attributes = {"tpu-env": "ACCELERATOR_TYPE: 'v5p-32'\n", **attributes}

    yield answer
    server.shutdown()
    server.server_close()


def jax_own(timeout=300):
    """(address, processes, id, local device ids) as JAX's own detection would pass them."""
    return clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, timeout)


SLURM_STEP = dict(SLURM_JOB_ID=4242, SLURM_STEP_NODELIST="gpu[001-016]", SLURM_JOB_NODELIST="gpu[001-016]",
                  SLURM_STEP_NUM_NODES=16, SLURM_GPUS_ON_NODE=8)
CASES = {  # name: (environment, received by jax.distributed.initialize (None: not called), JAX's own device ids)
    "SLURM one task per node": (
        dict(SLURM_STEP, SLURM_NTASKS=16, SLURM_PROCID=5, SLURM_LOCALID=0, SLURM_NODEID=5,
             SLURM_STEP_TASKS_PER_NODE="1(x16)", CUDA_VISIBLE_DEVICES=EIGHT, SLURM_STEP_GPUS=EIGHT),
        dict(coordinator_address="gpu001:61586", num_processes=16, process_id=5, local_device_ids=list(range(8))),
        [0]),
    "SLURM one task per GPU": (
        dict(SLURM_STEP, SLURM_NTASKS=128, SLURM_PROCID=43, SLURM_LOCALID=3, SLURM_NODEID=5,
             SLURM_STEP_TASKS_PER_NODE="8(x16)", CUDA_VISIBLE_DEVICES=EIGHT),
        dict(coordinator_address="gpu001:61586", num_processes=128, process_id=43, local_device_ids=[3]), [3]),
    "SLURM one task per GPU, bound (--gpus-per-task=1)": (
        dict(SLURM_STEP, SLURM_NTASKS=128, SLURM_PROCID=43, SLURM_LOCALID=3, SLURM_NODEID=5,
             SLURM_STEP_TASKS_PER_NODE="8(x16)", CUDA_VISIBLE_DEVICES="3", SLURM_STEP_GPUS="3"),
        dict(coordinator_address="gpu001:61586", num_processes=128, process_id=43, local_device_ids=[0]), [3]),
    "SLURM two tasks per node": (
        dict(SLURM_STEP, SLURM_NTASKS=32, SLURM_PROCID=11, SLURM_LOCALID=1, SLURM_NODEID=5,
             SLURM_STEP_TASKS_PER_NODE="2(x16)", CUDA_VISIBLE_DEVICES=EIGHT),
        dict(coordinator_address="gpu001:61586", num_processes=32, process_id=11, local_device_ids=[4, 5, 6, 7]),
        [1]),
    "SLURM single task": (
        dict(SLURM_STEP, SLURM_NTASKS=1, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_NODEID=0,
             SLURM_STEP_NUM_NODES=1, SLURM_STEP_TASKS_PER_NODE="1", CUDA_VISIBLE_DEVICES=EIGHT),
        None, [0]),
    "Open MPI 4 mpirun, one rank per node": (
        dict(OMPI_MCA_orte_hnp_uri="1531576320.0;tcp://10.96.0.1,10.148.0.1:34911", OMPI_COMM_WORLD_SIZE=4,
             OMPI_COMM_WORLD_RANK=2, OMPI_COMM_WORLD_LOCAL_RANK=0, OMPI_COMM_WORLD_LOCAL_SIZE=1),
        dict(coordinator_address="10.96.0.1:62624", num_processes=4, process_id=2, local_device_ids=None), [0]),
    "Open MPI 5 mpirun -x JAX_COORDINATOR_ADDRESS": (
        dict(JAX_COORDINATOR_ADDRESS="node001:61234", OMPI_COMM_WORLD_SIZE=16, OMPI_COMM_WORLD_RANK=9,
             OMPI_COMM_WORLD_LOCAL_RANK=0, OMPI_COMM_WORLD_LOCAL_SIZE=1, CUDA_VISIBLE_DEVICES=EIGHT),
        dict(coordinator_address="node001:61234", num_processes=16, process_id=9, local_device_ids=list(range(8))),
        None),
    "explicit variables": (
        dict(JAX_COORDINATOR_ADDRESS="10.0.0.1:1234", JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=1,
             JAX_LOCAL_DEVICE_IDS="2,3"),
        dict(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1, local_device_ids=[2, 3]), None),
    "a Kubernetes pod that is no indexed Job (a CI runner)": (
        dict(KUBERNETES_SERVICE_HOST="10.0.0.1", KUBERNETES_SERVICE_PORT=443), None, None),
    "a laptop": ({}, None, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_what_each_launcher_passes_to_jax(name, env, calls):
    values, want, jax_ids = CASES[name]
    env(**values)
    launch = distributed.initialize(DistConfig(initialization_timeout=7, heartbeat_timeout=9))
    if want is None:
        assert calls == [] and launch.num_processes == 1
        return
    assert calls == [dict(want, cluster_detection_method="deactivate", initialization_timeout=7,
                          heartbeat_timeout_seconds=9)]
    assert distributed.launched == launch
    if jax_ids is not None:  # JAX's own detection: the same address, count and id; its device choice
        assert jax_own() == (want["coordinator_address"], want["num_processes"], want["process_id"], jax_ids)


def test_a_host_without_tpu_chips_asks_no_metadata_server(env, calls, monkeypatch):
    """On a laptop or CI runner JAX's TPU detection is skipped before any request (running_in_cloud_tpu_vm is
    False without libtpu chips): deciding that there is no cluster asks nothing of the network."""
    def ask(key):
        raise AssertionError(f"asked the metadata server for {key}")

    monkeypatch.setattr(cloud_tpu_cluster, "get_metadata", ask)
    assert distributed.detect(DistConfig()) == Launch() and calls == []


ENDPOINTS = "0:w0:10.130.0.1,1:w1:10.130.0.2,2:w2:10.130.0.3,3:w3:10.130.0.4"  # the old name:id:ip form


@pytest.mark.parametrize("tpu_env,want", [
    ("ACCELERATOR_TYPE: 'v5p-32'\n", dict(coordinator_address="10.130.0.1:8482", num_processes=4, process_id=3)),
    ("MEGASCALE_NUM_SLICES: '2'\nMEGASCALE_SLICE_ID: '1'\nMEGASCALE_COORDINATOR_ADDRESS: '10.130.0.9'\n",
     dict(coordinator_address="10.130.0.9:8482", num_processes=8, process_id=7)),
], ids=["slice", "multislice"])
def test_a_gcloud_tpu_vm_is_found_through_its_metadata_server(tpu_vm, calls, tpu_env, want):
    """`gcloud compute tpus tpu-vm create` sets no variable JAX reads; worker 3's metadata server says who it is."""
    tpu_vm({"agent-worker-number": "3", "worker-network-endpoints": ENDPOINTS, "tpu-env": tpu_env})
    launch = distributed.initialize(DistConfig(initialization_timeout=7))
    assert launch.launcher == "gcloud TPU VM"
    assert calls == [dict(want, local_device_ids=None, cluster_detection_method="deactivate",
                          initialization_timeout=7, heartbeat_timeout_seconds=100)]
    assert jax_own(7) == (want["coordinator_address"], want["num_processes"], want["process_id"], None)
    assert "agent-worker-number" in Metadata.asked


def test_a_gke_tpu_multislice_jobset_is_found_through_its_variables(tpu_vm, env, calls):
    """JAX asks the metadata server first (its GceTpuCluster is defined before GkeTpuCluster); without a worker
    number there (JAX's 6 tries, 3 s), the pod's variables decide."""
    tpu_vm({})
    env(TPU_WORKER_HOSTNAMES="10.8.0.1,10.8.0.2", TPU_WORKER_ID=1, MEGASCALE_NUM_SLICES=2, MEGASCALE_SLICE_ID=1,
        MEGASCALE_COORDINATOR_ADDRESS="10.8.0.1", JOBSET_NAME="olmo3", KUBERNETES_SERVICE_HOST="10.0.0.1",
        JOB_COMPLETION_INDEX=1)
    launch = distributed.initialize(DistConfig())
    assert launch.launcher == "GKE TPU" and set(Metadata.asked) == {"agent-worker-number"}
    assert calls[0]["local_device_ids"] is None
    assert (calls[0]["coordinator_address"], calls[0]["num_processes"], calls[0]["process_id"]) == (
        "10.8.0.1:8482", 4, 3)


@pytest.mark.parametrize("values,match", [
    (dict(SLURM_STEP, SLURM_NTASKS=48, SLURM_PROCID=4, SLURM_LOCALID=1, SLURM_NODEID=1,
          SLURM_STEP_TASKS_PER_NODE="3(x16)", CUDA_VISIBLE_DEVICES=EIGHT), "cannot be split evenly among its 3"),
    (dict(SLURM_STEP, SLURM_NTASKS=128, SLURM_PROCID=4, SLURM_LOCALID=4, SLURM_NODEID=0, SLURM_GPUS_ON_NODE=6,
          SLURM_STEP_TASKS_PER_NODE="8(x16)", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5"), "The 6 GPUs of this node"),
    (dict(OMPI_COMM_WORLD_SIZE=16, OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_LOCAL_RANK=0),
     "Open MPI started 16 processes"),
    (dict(SLURM_STEP, SLURM_NTASKS=2, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_STEP_TASKS_PER_NODE="1,x"),
     "SLURM's"),
])
def test_a_launch_that_cannot_use_every_gpu_once_is_refused(env, calls, values, match):
    env(**values)
    with pytest.raises(ConfigError, match=match):
        distributed.initialize(DistConfig())
    assert calls == []


SLURM_16 = Launch("SLURM", 16, 5, "gpu001:61586", tuple(range(8)), node_tasks=1, node_gpus=8,
                  gpus_by="SLURM_GPUS_ON_NODE=8")
OMPI_16x8 = Launch("Open MPI", 128, 9, "10.10.0.1:64640", (1,), node_tasks=8, node_gpus=8,
                   gpus_by="SLURM_GPUS_ON_NODE=8")


@pytest.mark.parametrize("launch,counts,problem", [
    (SLURM_16, (16, 8, 128, "gpu"), None),
    (SLURM_16, (16, 1, 16, "gpu"), "This node has 8 GPUs (SLURM_GPUS_ON_NODE=8) but its process drives 1 (SLURM); "
                                   "launch one task per node or one per GPU"),
    (SLURM_16, (16, 8, 121, "gpu"), "This process drives 8 devices but the run has 121 over 16 processes, not 128"),
    (SLURM_16, (1, 8, 8, "gpu"), "The launcher (SLURM) started 16 processes but JAX counts 1"),
    (SLURM_16, (16, 2, 32, "cpu"), None),  # a CPU run inside a GPU allocation: SLURM's GPU count says nothing of it
    (OMPI_16x8, (128, 1, 128, "gpu"), None),
    # mpirun's 8 ranks per node each driving the node's 8 GPUs (the SLURM_* of Open MPI's daemon's step read first)
    (OMPI_16x8, (128, 8, 1024, "gpu"), "This node has 8 GPUs (SLURM_GPUS_ON_NODE=8) but its 8 processes drive 8 each "
                                       "(Open MPI)"),
    (Launch("Open MPI", 4, 1, "node001:61234", (1,), node_tasks=4, node_gpus=8, gpus_by="its 8 device files"),
     (4, 1, 4, "gpu"), "This node has 8 GPUs (its 8 device files) but its 4 processes drive 1 each (Open MPI)"),
    (Launch("SLURM allocation", node_tasks=1, node_gpus=8, gpus_by="SLURM_GPUS_ON_NODE=8"), (1, 1, 1, "gpu"),
     "This node has 8 GPUs (SLURM_GPUS_ON_NODE=8) but its process drives 1 (SLURM allocation)"),
    (Launch("explicit coordinator address", 2, 1, "10.0.0.1:1234"), (2, 3, 6, "gpu"), None),  # nothing counts its node
])
def test_the_device_count_is_checked_against_the_launcher(launch, counts, problem):
    got = distributed.device_mismatch(launch, *counts)
    assert got == problem if problem is None else got.startswith(problem)


def test_check_devices_reads_this_process():
    import jax

    distributed.check_devices(Launch())
    with pytest.raises(ConfigError, match=f"started 2 processes but JAX counts {jax.process_count()}"):
        distributed.check_devices(Launch("SLURM", 2))


# --- the recipes of docs/multi-host.md ------------------------------------------------------------------------

DOC = ROOT / "docs" / "multi-host.md"


def doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), re.S | re.M)


def options(words: list[str]) -> dict[str, str]:
    """--name=value / --name value / -x value options (repeated ones joined by newlines)."""
    out, i = {}, 0
    while i < len(words):
        w = words[i]
        if w.startswith("-") and "=" in w and w.startswith("--"):
            k, v = w.split("=", 1)
        elif w.startswith("-") and i + 1 < len(words) and not words[i + 1].startswith("-"):
            k, v, i = w, words[i + 1], i + 1
        else:
            k, v = w, ""
        out[k.lstrip("-")] = (out[k.lstrip("-")] + "\n" + v) if k.lstrip("-") in out else v
        i += 1
    return out


def sbatch_recipes() -> list[tuple[dict[str, str], list[str]]]:
    """(#SBATCH and srun options, the srun payload) of every sbatch script on the page."""
    recipes = []
    for block in doc_blocks("bash"):
        if "#SBATCH" not in block:
            continue
        opts = options([w for line in block.splitlines() if line.startswith("#SBATCH")
                        for w in shlex.split(line)[1:]])
        srun = shlex.split(next(line for line in block.splitlines() if line.startswith("srun ")))
        start = srun.index("python")
        recipes.append(({**opts, **options(srun[1:start])}, srun[start:]))
    return recipes


def slurm_task_env(opts: dict[str, str], node: int, local: int) -> dict:
    """A task's environment as SLURM documents it for `srun` in an allocation made with `opts`: every task of a
    node sees the node's GPUs, unless --gpus-per-task binds it to its own."""
    nodes, tasks, gpus = int(opts["nodes"]), int(opts["ntasks-per-node"]), int(opts["gpus-per-node"])
    per_task = int(opts.get("gpus-per-task", 0))
    mine = list(range(local * per_task, (local + 1) * per_task)) if per_task else list(range(gpus))
    return dict(SLURM_JOB_ID=777, SLURM_STEP_NODELIST=f"gpu[001-{nodes:03d}]", SLURM_NTASKS=nodes * tasks,
                SLURM_PROCID=node * tasks + local, SLURM_LOCALID=local, SLURM_NODEID=node,
                SLURM_STEP_NUM_NODES=nodes, SLURM_STEP_TASKS_PER_NODE=f"{tasks}(x{nodes})", SLURM_GPUS_ON_NODE=gpus,
                SLURM_STEP_GPUS=",".join(map(str, mine)), CUDA_VISIBLE_DEVICES=",".join(map(str, mine)))


def driven(launch: Launch, visible: str) -> list[str]:
    """The physical GPUs a process drives: its local device ids index the GPUs it sees."""
    seen = visible.split(",")
    return seen if launch.local_device_ids is None else [seen[i] for i in launch.local_device_ids]


def every_gpu_once(env, task_env, nodes: int, tasks: int, gpus: int) -> None:
    for node in (0, nodes - 1):
        used = []
        for local in range(tasks):
            values = task_env(node, local)
            env(clear=True, **values)
            launch = distributed.detect(DistConfig())
            assert (launch.num_processes, launch.process_id) == (nodes * tasks, node * tasks + local)
            used += driven(launch, values.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))))
        assert sorted(used, key=int) == [str(g) for g in range(gpus)], f"node {node}: {used}"


def test_the_sbatch_recipes_use_every_gpu_once(env, calls):
    """Both sbatch scripts on the page, and the one-task-per-GPU script with --gpus-per-task=1 as the page says:
    each node's GPUs driven by exactly one of its tasks each, and the run as many GPUs as SLURM announces."""
    recipes = sbatch_recipes()
    assert [int(o["ntasks-per-node"]) for o, _ in recipes] == [1, 8], "the page's two sbatch scripts"
    recipes.append(({**recipes[1][0], "gpus-per-task": "1"}, recipes[1][1]))
    for opts, payload in recipes:
        assert payload[:2] == ["python", "train.py"]
        nodes, tasks, gpus = (int(opts[k]) for k in ("nodes", "ntasks-per-node", "gpus-per-node"))
        every_gpu_once(env, lambda n, t: slurm_task_env(opts, n, t), nodes, tasks, gpus)
        launch = distributed.detect(DistConfig())
        assert (launch.node_tasks, launch.node_gpus, launch.gpus_by) == (tasks, gpus, f"SLURM_GPUS_ON_NODE={gpus}")
    assert calls == []


def test_the_mpirun_recipes_use_every_gpu_once(env, calls):
    """Open MPI 4 (found by JAX through OMPI_MCA_orte_hnp_uri) and 5 (-x JAX_COORDINATOR_ADDRESS)."""
    lines = [b.replace("\\\n", " ") for b in doc_blocks("bash") if b.startswith("mpirun")]
    assert len(lines) == 2
    for line in lines:
        words = shlex.split(line)
        opts = options(words[1:words.index("python")])
        nodes, per_node = int(opts["np"]), int(opts["npernode"])
        exported = dict(x.split("=", 1) for x in opts["x"].split("\n") if "=" in x)

        def task_env(node, local):
            rank = node * per_node + local
            ompi = dict(OMPI_COMM_WORLD_SIZE=nodes * per_node, OMPI_COMM_WORLD_RANK=rank,
                        OMPI_COMM_WORLD_LOCAL_RANK=local, OMPI_COMM_WORLD_LOCAL_SIZE=per_node, **exported)
            if "JAX_COORDINATOR_ADDRESS" not in exported:  # Open MPI 4's ORTE
                ompi["OMPI_MCA_orte_hnp_uri"] = "1531576320.0;tcp://10.96.0.1:34911"
            return ompi

        every_gpu_once(env, task_env, nodes, per_node, 8)
        launch = distributed.detect(DistConfig())
        assert launch.coordinator_address == exported.get("JAX_COORDINATOR_ADDRESS", "10.96.0.1:62624")


def test_the_tpu_vm_recipe_runs_one_process_per_worker(tpu_vm, calls):
    """The page's gcloud command runs train.py on every worker; each worker's metadata names it."""
    cmd = next(shlex.split(b.replace("\\\n", " ")) for b in doc_blocks("bash") if b.startswith("gcloud compute tpus"))
    assert "--worker=all" in cmd and "train.py" in cmd[cmd.index("--command") + 1]
    for worker in (0, 3):
        tpu_vm({"agent-worker-number": str(worker), "worker-network-endpoints": ENDPOINTS})
        launch = distributed.detect(DistConfig())
        assert (launch.launcher, launch.num_processes, launch.process_id, launch.coordinator_address,
                launch.local_device_ids) == ("gcloud TPU VM", 4, worker, "10.130.0.1:8482", None)


def test_the_jobset_recipe_gives_each_pod_its_process(env, calls):
    (doc,) = [yaml.safe_load(b) for b in doc_blocks("yaml") if "kind: JobSet" in b]
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    assert job["completionMode"] == "Indexed" and container["resources"]["limits"]["nvidia.com/gpu"] == 8
    for index in (0, job["parallelism"] - 1):
        values = {}
        for var in container["env"]:  # the completion-index annotation as Kubernetes fills it
            assert "value" in var or "job-completion-index" in var["valueFrom"]["fieldRef"]["fieldPath"]
            values[var["name"]] = var.get("value", index)
        env(clear=True, **values, KUBERNETES_SERVICE_HOST="10.0.0.1", JOB_COMPLETION_INDEX=index)
        launch = distributed.detect(DistConfig())
        assert (launch.num_processes, launch.process_id, launch.local_device_ids) == (job["parallelism"], index, None)
        assert launch.coordinator_address == values["JAX_COORDINATOR_ADDRESS"]


JOBSET_POLICY = {"maxRestarts", "restartStrategy", "rules"}
JOBSET_RULE = {"name", "action", "onJobFailureReasons", "onJobFailureMessagePatterns", "targetReplicatedJobs"}
"""JobSet v1alpha2's FailurePolicy and FailurePolicyRule fields (kubernetes-sigs/jobset api/jobset/v1alpha2/
jobset_types.go)."""


def jobset_outcome(doc: dict, code: int, conditions: tuple[str, ...] = ()) -> tuple[str, bool]:
    """What the recipe's JobSet does once a trainer pod fails with exit `code` (and pod `conditions`): ("fails",
    False) or ("relaunches", whether it counts toward maxRestarts). The Job controller matches its podFailurePolicy's
    rules in order (kubernetes pkg/controller/job/pod_failure_policy.go: FailJob fails the Job with reason
    PodFailurePolicy, Ignore replaces the pod uncounted, no match counts toward backoffLimit, past which the Job fails
    with reason BackoffLimitExceeded); JobSet then matches its failurePolicy's rules in order by that reason (jobset
    pkg/controllers/failure_policy.go; none matching: RestartJobSet, counted)."""
    spec = doc["spec"]
    (replicated,) = spec["replicatedJobs"]
    job = replicated["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    action = "Count"
    for rule in job.get("podFailurePolicy", {}).get("rules", ()):
        assert set(rule) <= {"action", "onExitCodes", "onPodConditions"}, rule  # batch/v1 PodFailurePolicyRule
        if "onExitCodes" in rule:
            codes = rule["onExitCodes"]
            assert codes["containerName"] == container["name"] and codes["operator"] in ("In", "NotIn"), rule
            matched = code != 0 and (code in codes["values"]) == (codes["operator"] == "In")
        else:
            matched = any(c["type"] in conditions and c.get("status", "True") == "True"
                          for c in rule["onPodConditions"])
        if matched:
            action = rule["action"]
            break
    if action == "Ignore":
        return "relaunches", False
    assert action in ("FailJob", "Count"), action
    if action == "Count" and job.get("backoffLimit", 6) > 0:
        return "relaunches", True  # the Job controller replaces the pod, counted toward backoffLimit
    reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
    if "failurePolicy" not in spec:
        return "fails", False  # JobSet without a failure policy fails with its first failed Job
    policy = spec["failurePolicy"]
    assert set(policy) <= JOBSET_POLICY and all(set(rule) <= JOBSET_RULE for rule in policy.get("rules", ())), policy
    chosen = next((rule["action"] for rule in policy.get("rules", ())
                   if reason in rule.get("onJobFailureReasons", [reason])
                   and replicated["name"] in rule.get("targetReplicatedJobs", [replicated["name"]])), "RestartJobSet")
    return {"FailJobSet": ("fails", False), "RestartJobSet": ("relaunches", True),
            "RestartJobSetAndIgnoreMaxRestarts": ("relaunches", False)}[chosen]


def test_the_jobset_recipe_relaunches_as_until_done_does():
    """After a crash, a storage failure (74) and a preemption (75), never after bad input (2) or a non-finite run (3),
    with preemptions not counted: the exit codes as exits.py defines them and --until-done treats them."""
    import signal

    from olmo3eqx import exits
    from olmo3eqx.tools.supervise import FINAL

    (doc,) = [yaml.safe_load(b) for b in doc_blocks("yaml") if "kind: JobSet" in b]
    crashes = (exits.PARITY_FAILED, 128 + signal.SIGKILL, 128 + signal.SIGABRT)  # a traceback, OOM killer, JAX abort
    for code in (exits.BAD_INPUT, exits.NONFINITE, exits.STORAGE, exits.PREEMPTED, *crashes):
        expected = ("fails", False) if code in FINAL else ("relaunches", code != exits.PREEMPTED)
        assert jobset_outcome(doc, code) == expected, f"exit {code}"
    # killed with its node before it could write its checkpoint and exit 75: a preemption too
    assert jobset_outcome(doc, 128 + signal.SIGKILL, ("DisruptionTarget",)) == ("relaunches", False)
    policy = doc["spec"]["failurePolicy"]
    assert policy["maxRestarts"] > 0
    assert policy["restartStrategy"] == "BlockingRecreate"  # no old trainer holds the run when a new one starts
    pod = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # a podFailurePolicy requires it
    assert pod["terminationGracePeriodSeconds"] > 30  # Kubernetes' default: too short for the preemption checkpoint


def test_the_explicit_recipe_gives_each_process_its_id(env, calls):
    (block,) = [b for b in doc_blocks("bash") if b.startswith("for i in 0 1")]
    words = shlex.split(block.replace("\\\n", " ").splitlines()[1])
    for i in (0, 1):
        env(clear=True, **dict(w.replace("$i", str(i)).split("=", 1) for w in words if w.startswith("JAX_")))
        launch = distributed.detect(DistConfig())
        assert (launch.launcher, launch.num_processes, launch.process_id, launch.coordinator_address,
                launch.local_device_ids) == (distributed.EXPLICIT, 2, i, "127.0.0.1:12345", None)


# --- mpirun and plain processes inside an sbatch allocation; ranks sharing a node's GPUs ------------------------

def hosts(first: int, last: int) -> str:
    return f"gpu[{first:03d}-{last:03d}]" if last > first else f"gpu{first:03d}"


def batch_script(nodes: int, tasks_per_node: int, gpus: int) -> dict:
    """What the script of `sbatch --nodes N --ntasks-per-node T --gpus-per-node G` sees on the first node of its
    allocation, as Slurm builds it: sbatch's options (SLURM_NTASKS_PER_NODE, SLURM_GPUS_PER_NODE), the controller's
    (SLURM_TASKS_PER_NODE: job_scheduler.c), the batch job's (env_array_for_batch_job: SLURM_JOB_ID,
    SLURM_JOB_NUM_NODES, SLURM_NNODES, SLURM_JOB_NODELIST, SLURM_NTASKS), the batch step's one task's (setup_env:
    SLURM_NODEID, SLURM_PROCID and SLURM_LOCALID all 0) and its node's GPUs (gres_common.c: SLURM_GPUS_ON_NODE,
    SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES). No SLURM_STEP_NODELIST or SLURM_STEP_NUM_NODES: only srun's steps get
    them (env_array_for_step)."""
    gpu_list = ",".join(map(str, range(gpus)))
    return dict(SLURM_JOB_ID=4242, SLURM_JOBID=4242, SLURM_JOB_NAME="olmo3-7b", SLURM_JOB_NUM_NODES=nodes,
                SLURM_NNODES=nodes, SLURM_JOB_NODELIST=hosts(1, nodes), SLURM_NODELIST=hosts(1, nodes),
                SLURM_JOB_CPUS_PER_NODE=f"96(x{nodes})", SLURM_NTASKS=nodes * tasks_per_node,
                SLURM_NPROCS=nodes * tasks_per_node, SLURM_NTASKS_PER_NODE=tasks_per_node,
                SLURM_TASKS_PER_NODE=f"{tasks_per_node}(x{nodes})", SLURM_GPUS_PER_NODE=gpus, SLURM_CPUS_ON_NODE=96,
                SLURM_NODEID=0, SLURM_PROCID=0, SLURM_LOCALID=0, SLURM_TASK_PID=5151, SLURMD_NODENAME="gpu001",
                ENVIRONMENT="BATCH", SLURM_GPUS_ON_NODE=gpus, SLURM_JOB_GPUS=gpu_list, CUDA_VISIBLE_DEVICES=gpu_list)


def daemon_task(batch: dict, node: int) -> dict:
    """The environment of Open MPI's daemon on node `node` (> 0) of the batch script's allocation: mpirun starts one
    on each other node with `srun --ntasks-per-node=1 --kill-on-bad-exit --mpi=none --nodes=N-1 --nodelist=...
    --ntasks=N-1` (plm_slurm of Open MPI 4's ORTE and of 5's PRRTE), a step with the batch script's environment
    and its own variables over it (env_array_for_step, setup_env) and, as a step has by default, the job's GPUs on
    its node."""
    others = int(batch["SLURM_JOB_NUM_NODES"]) - 1
    gpu_list = batch["SLURM_JOB_GPUS"]
    return {**batch, **dict(
        SLURM_STEP_ID=0, SLURM_STEPID=0, SLURM_STEP_NODELIST=hosts(2, others + 1), SLURM_STEP_NUM_NODES=others,
        SLURM_STEP_NUM_TASKS=others, SLURM_STEP_TASKS_PER_NODE=f"1(x{others})", SLURM_NNODES=others,
        SLURM_NTASKS=others, SLURM_NPROCS=others, SLURM_NTASKS_PER_NODE=1, SLURM_TASKS_PER_NODE=f"1(x{others})",
        SLURM_NODELIST=hosts(2, others + 1), SLURM_NODEID=node - 1, SLURM_PROCID=node - 1, SLURM_LOCALID=0,
        SLURM_CPU_BIND="quiet,none", SLURMD_NODENAME=f"gpu{node + 1:03d}", SLURM_STEP_GPUS=gpu_list,
        CUDA_VISIBLE_DEVICES=gpu_list)}


def ompi_rank(version: int, nodes: int, per_node: int, node: int, local: int, coordinator: str | None) -> dict:
    """Open MPI's variables of rank `local` on node `node` of `mpirun --npernode per_node` over `nodes` nodes: Open
    MPI 4's OMPI_MCA_orte_hnp_uri names mpirun's host; Open MPI 5 has none (`coordinator`: what -x
    JAX_COORDINATOR_ADDRESS exports)."""
    rank = node * per_node + local
    ompi = dict(OMPI_COMM_WORLD_SIZE=nodes * per_node, OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_LOCAL_RANK=local,
                OMPI_COMM_WORLD_LOCAL_SIZE=per_node, OMPI_COMM_WORLD_NODE_RANK=local,
                OMPI_UNIVERSE_SIZE=nodes * per_node)
    if version == 4:
        ompi["OMPI_MCA_orte_hnp_uri"] = "2781347840.0;tcp://10.10.0.1,172.17.0.1:39113"
    else:
        ompi.update(PMIX_RANK=rank, PMIX_NAMESPACE="prterun-gpu001-51517@1")
    return {**ompi, **({"JAX_COORDINATOR_ADDRESS": coordinator} if coordinator else {})}


def mpirun_in_sbatch(version: int, nodes: int, per_node: int, gpus: int, node: int, local: int,
                     coordinator: str | None = None) -> dict:
    """A rank of `mpirun --npernode per_node python train.py` run by the batch script of a `--nodes nodes
    --ntasks-per-node per_node --gpus-per-node gpus` allocation: on the script's node mpirun starts it with its own
    environment (the batch step's), elsewhere the node's daemon with the daemon's (its launch environment under
    the application's, schizo_ompi.c); Open MPI's variables over either."""
    batch = batch_script(nodes, per_node, gpus)
    inherited = batch if node == 0 else daemon_task(batch, node)
    return {**inherited, **ompi_rank(version, nodes, per_node, node, local, coordinator)}


def gpu_files(directory: Path, count: int) -> None:
    """A node's NVIDIA device files: one per GPU, and the control and UVM files that are none."""
    for name in [f"nvidia{i}" for i in range(count)] + ["nvidiactl", "nvidia-uvm"]:
        (directory / name).touch()


@pytest.mark.parametrize("version,per_node", [(4, 8), (4, 1), (5, 8), (5, 1)])
def test_mpirun_inside_an_sbatch_allocation_uses_every_gpu_once(env, calls, version, per_node):
    """Open MPI's variables, not the SLURM_* its ranks inherit from the batch step (SLURM_LOCALID 0 for every rank of
    the script's node) or from the srun step of Open MPI's daemon (one task per node), say which process a rank is
    and which GPUs it drives; JAX is told Open MPI's process count and id."""
    coordinator = "gpu001:61234" if version == 5 else None
    every_gpu_once(env, lambda n, t: mpirun_in_sbatch(version, 16, per_node, 8, n, t, coordinator), 16, per_node, 8)
    launch = distributed.initialize(DistConfig())  # the last rank of the last node
    assert (launch.num_processes, launch.process_id) == (16 * per_node, 16 * per_node - 1)
    assert launch.coordinator_address == (coordinator or "10.10.0.1:64640")  # Open MPI 4: JAX's port for the job
    assert (launch.node_tasks, launch.node_gpus) == (per_node, 8)
    assert calls[0]["num_processes"] == 16 * per_node


def test_open_mpi_5_without_a_coordinator_is_refused_on_every_node(env, calls):
    """Its ranks on the daemons' nodes see the daemons' srun step (SLURM_STEP_NODELIST, 15 tasks), which JAX's own
    detection would take for a SLURM step of 15 processes; they are refused as the script's node's ranks are."""
    for node in (0, 15):
        env(clear=True, **mpirun_in_sbatch(5, 16, 8, 8, node, 3))
        with pytest.raises(ConfigError, match=r"Open MPI started 128 processes .* -x JAX_COORDINATOR_ADDRESS"):
            distributed.initialize(DistConfig())
    assert calls == []


@pytest.mark.parametrize("version", [4, 5])
def test_ranks_on_a_node_without_cuda_visible_devices_share_its_gpus(env, calls, tmp_path, version):
    """`mpirun -np 4` on a host of 8 GPUs that no variable counts: the device files do, two GPUs per rank; three
    ranks cannot share them evenly and are refused."""
    gpu_files(tmp_path, 8)
    every_gpu_once(env, lambda n, t: ompi_rank(version, 1, 4, n, t, "node001:61234"), 1, 4, 8)
    launch = distributed.initialize(DistConfig())  # the last rank
    assert (launch.node_tasks, launch.node_gpus, calls[0]["local_device_ids"]) == (4, 8, [6, 7])
    env(clear=True, **ompi_rank(version, 1, 3, 0, 1, "node001:61234"))
    with pytest.raises(ConfigError, match="The 8 GPUs of this node cannot be split evenly among its 3 tasks"):
        distributed.initialize(DistConfig())


def test_a_process_the_batch_script_starts_without_srun(env, calls):
    """`python train.py` in the script of a 16-node allocation would train alone on the first node: refused, naming
    srun; in a one-node allocation it is the node's one process and drives its GPUs."""
    env(**batch_script(16, 1, 8))
    with pytest.raises(ConfigError, match=r"^This process runs in the batch script of a 16-node SLURM allocation.*srun"):
        distributed.initialize(DistConfig())
    env(clear=True, **batch_script(1, 8, 8))
    launch = distributed.initialize(DistConfig())
    assert (launch.num_processes, launch.local_device_ids, launch.node_tasks, launch.node_gpus) == (1, None, 1, 8)
    assert calls == []


def test_the_batch_scripts_refusal_is_one_sentence_and_exit_2():
    e = clean_env()
    e.update({k: str(v) for k, v in batch_script(16, 1, 8).items()}, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=e, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    assert "16-node SLURM allocation" in done.stderr and "srun" in done.stderr


# --- two processes under a simulated SLURM step -------------------------------------------------------------

SCRIPT = """
import sys
from jax._src import xla_bridge
from olmo3eqx import distributed, exits
from olmo3eqx.config import DistConfig

@exits.command
def main():
    distributed.check_devices(distributed.initialize(DistConfig(initialization_timeout=60, heartbeat_timeout=10)))
    print(distributed.describe(), flush=True)
    print("CUDA devices JAX may use:", xla_bridge.CUDA_VISIBLE_DEVICES.value, flush=True)

sys.exit(main())
"""


def free_slurm_job_id() -> int:
    """A job id whose SLURM port (JAX: 61440 + id % 4096) is free on loopback."""
    for port in range(61440 + os.getpid() % 4000, 65536):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port - 61440
    raise RuntimeError("no free port in SLURM's range")


def slurm_step(devices: list[int]) -> list[tuple[int, str, str]]:
    """A two-node SLURM step (one task per node, both on this host) whose tasks have `devices[i]` CPU devices
    and see two 'GPUs' each; (exit code, stdout, stderr) of each."""
    job = free_slurm_job_id()
    procs = []
    for i, n in enumerate(devices):
        e = clean_env()
        e.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={n}", JAX_PLATFORMS="cpu",
                 SLURM_JOB_ID=str(job), SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost",
                 SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_PROCID=str(i), SLURM_LOCALID="0",
                 SLURM_NODEID=str(i), SLURM_STEP_NUM_NODES="2", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                 SLURM_GPUS_ON_NODE="2", CUDA_VISIBLE_DEVICES="0,1")
        procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        results.append((p.returncode, out, err))
    return results


def test_two_processes_under_a_simulated_slurm_step():
    """Each process finds the step through JAX's SLURM detection and the run has 4 devices; JAX is told both
    'GPUs' each process sees (its own detection would tell it '0': on a GPU node one of the two); with 2 devices
    on one node and 1 on the other, both refuse (exit 2)."""
    results = slurm_step([2, 2])
    for i, (rc, out, err) in enumerate(results):
        assert rc == 0, err[-2000:]
        assert out.splitlines() == [f"process {i} of 2: 2 local / 4 global devices (cpu); SLURM, GPUs 0,1 of this host",
                                    "CUDA devices JAX may use: 0,1"]
    results = slurm_step([2, 1])
    assert [rc for rc, _, _ in results] == [2, 2], [err[-2000:] for _, _, err in results]
    assert "This process drives 2 devices but the run has 3 over 2 processes, not 4" in results[0][2]
    assert "This process drives 1 devices but the run has 3 over 2 processes, not 2" in results[1][2]


# --- two processes naming two nodes -----------------------------------------------------------------------------

NODES_SCRIPT = """
import sys
import jax
import numpy as np
from olmo3eqx import distributed, exits
from olmo3eqx.config import DistConfig, MeshConfig
from olmo3eqx.errors import ConfigError
from olmo3eqx.sharding import batch_sharding, granule_ids, granules_of, make_mesh, node_mesh

@exits.command
def main():
    distributed.initialize(DistConfig(initialization_timeout=60, heartbeat_timeout=10))
    print("nodes", *distributed.nodes)
    print("granules", *granule_ids(jax.devices()))
    try:
        make_mesh(MeshConfig())
    except ConfigError as e:
        print("refused", e)
    mesh = make_mesh(MeshConfig(data=2))
    print("mesh", dict(mesh.shape), granules_of(mesh).ravel().tolist(),
          [d.process_index for d in mesh.devices.flat])
    print("tools' mesh", dict(node_mesh().shape))
    # This process's block of rows of a global batch of 8 (what the data pipeline gives process p) lands on the
    # rows of the global array where the other processes' blocks do not.
    p = jax.process_index()
    rows = np.arange(8, dtype=np.int32)
    batch = jax.make_array_from_process_local_data(batch_sharding(mesh, 1), rows[4 * p:4 * p + 4], (8,))
    print("rows", all(np.array_equal(np.asarray(s.data), rows[s.index]) for s in batch.addressable_shards))
    print("sum", int(jax.jit(lambda x: x.sum())(batch)))
    print(distributed.describe())

sys.exit(main())
"""


def two_nodes(names: list[str]) -> list[tuple[int, str, str]]:
    """Two processes of 2 CPU devices each joined over loopback, process i publishing node name names[i]."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i, name in enumerate(names):
        e = clean_env()
        e.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
                 JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i),
                 OLMO3EQX_NODE_NAME=name)
        procs.append(subprocess.Popen([sys.executable, "-c", NODES_SCRIPT], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=180) for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outs)]


def test_two_processes_on_two_nodes_agree_on_the_mesh():
    """Each process learns both node names through the coordination service; both give every device the same
    granule, refuse fsdp over both nodes in the same sentence, and build the mesh with data across the nodes, each
    process's batch rows where the data pipeline put them."""
    results = two_nodes(["node-a", "node-b"])
    outs = []
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
        outs.append([line for line in out.splitlines() if not line.startswith("[Gloo]")])
    assert outs[0][:5] == outs[1][:5]  # the same node names, granules, refusal and meshes
    nodes, granules, refused, mesh, tools = outs[0][:5]
    assert nodes == "nodes node-a node-b" and granules == "granules 0 0 1 1"
    assert refused.startswith("refused mesh.fsdp=4 would span 2 nodes of 2 devices") and "--mesh.data 2" in refused
    assert mesh == "mesh {'data': 2, 'fsdp': 2, 'tensor': 1} [0, 0, 1, 1] [0, 0, 1, 1]"
    assert tools == "tools' mesh {'data': 2, 'fsdp': 2, 'tensor': 1}"  # eval and generate: HSDP too
    for i, name in enumerate(["node-a", "node-b"]):
        assert outs[i][5:] == ["rows True", "sum 28", f"process {i} of 2: 2 local / 4 global devices (cpu); "
                               f"explicit coordinator address; node {name} of 2"]
