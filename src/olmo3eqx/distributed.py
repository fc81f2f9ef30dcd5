"""`jax.distributed` initialisation: which launcher started this process, which of its host's devices it drives,
and a refusal when the devices the run got are not the ones the launcher announced. Runs before anything touches
a device.

Which launcher: explicit `dist.*` flags or JAX_COORDINATOR_ADDRESS (+ JAX_NUM_PROCESSES, JAX_PROCESS_ID, or Open
MPI's OMPI_COMM_WORLD_SIZE/RANK); else Open MPI when mpirun started the process (OMPI_COMM_WORLD_*: its coordinator
at mpirun's host through Open MPI 4's OMPI_MCA_orte_hnp_uri; Open MPI 5 names none, refused unless
JAX_COORDINATOR_ADDRESS does). mpirun's ranks inside a SLURM allocation inherit the SLURM_* of the batch script or of
the srun step that started Open MPI's daemon; those describe other tasks, so Open MPI's variables win. Else the first
cluster JAX's own detection finds (jax._src.clusters, in JAX's order: a SLURM step, a gcloud TPU VM through the
metadata server, a GKE TPU pod, an indexed Kubernetes Job); else one process, refused when it runs outside any
srun step of a SLURM allocation of several nodes (a batch script's `python train.py` would train on the first node
alone). A cluster of one process runs as one process (no coordination service, no port taken). Off a TPU VM JAX's
TPU detection asks no metadata server (it looks first at whether libtpu found TPU chips), so on a laptop or a CI
runner deciding costs a few environment look-ups.

Which devices: JAX's detection gives each SLURM or Open MPI process one GPU (`[local rank]`), right for one task
per GPU and wrong for one task per node, where a process would drive one of its node's 8 GPUs. Here the GPUs a
process sees (CUDA_VISIBLE_DEVICES, else SLURM_STEP_GPUS, else SLURM_GPUS_ON_NODE, else the node's NVIDIA device
files) are split evenly among the tasks of its node; a process bound to its own GPUs (it sees fewer than
SLURM_GPUS_ON_NODE, or, where nothing counts the node's, fewer than its node has tasks) drives every one it sees. A
TPU host drives all its chips (JAX's rule); JAX_LOCAL_DEVICE_IDS overrides. CPU collectives between processes use
gloo (JAX's default).

Which count: once JAX started, the GPUs a node's tasks drive together must be the node's as the launcher or the
node says (SLURM_GPUS_ON_NODE, else, where CUDA_VISIBLE_DEVICES does not narrow them, its device files): a wrong
count is refused in one sentence (`check_devices`).

Which node: once joined, each process publishes its node's name (OLMO3EQX_NODE_NAME, else its host name) through
JAX's coordination key-value store and reads every other's, so the mesh (olmo3eqx.sharding.granule_ids) can keep
fsdp and tensor within a node of GPUs.
"""

from __future__ import annotations

import glob
import os
import re
import socket
from dataclasses import dataclass

from olmo3eqx import jaxenv, peers
from olmo3eqx.config import DistConfig
from olmo3eqx.errors import ConfigError

EXPLICIT = "explicit coordinator address"
LAUNCHERS = {"OmpiCluster": "Open MPI", "SlurmCluster": "SLURM", "GkeTpuCluster": "GKE TPU",
             "GceTpuCluster": "gcloud TPU VM", "K8sCluster": "Kubernetes Job"}
"""JAX's cluster classes (jax._src.clusters) by the name the startup line gives them."""


@dataclass(frozen=True)
class Launch:
    """How this process joins the run: what `jax.distributed.initialize` receives, and what the launcher
    announced that the devices the run gets can be checked against."""

    launcher: str = "one process"
    num_processes: int = 1
    process_id: int = 0
    coordinator_address: str | None = None
    local_device_ids: tuple[int, ...] | None = None
    """The GPUs (ordinals among those the process sees) it drives; None: every device it sees."""
    node_tasks: int | None = None
    """The processes the launcher started on this process's node; None where it does not say."""
    node_gpus: int | None = None
    """The GPUs of this node the run is to use, as the launcher or the node says (node_gpus); None: nothing says."""
    gpus_by: str = ""
    """Where `node_gpus` comes from, for the refusal's sentence."""


launched = Launch()
"""This process's Launch, once `initialize` ran (describe and check_devices read it)."""
NODE_NAME = "OLMO3EQX_NODE_NAME"
"""The node name this process publishes instead of its host name (two processes on one host stand for two nodes)."""
NODE_KEY = "olmo3eqx/node/"
nodes: tuple[str, ...] = ()
"""The node name of every process, by process index, once `initialize` joined several; () for one process."""


def node_of(process_index: int) -> str:
    """The node the process runs on (every process on one node when this process runs alone)."""
    return nodes[process_index] if nodes else "this node"


def publish_nodes(process_id: int, num_processes: int, timeout_s: float) -> tuple[str, ...]:
    """Publish this process's node name in JAX's key-value store and read every process's (waiting up to
    `timeout_s` for each)."""
    from jax._src.distributed import global_state

    client = global_state.client
    client.key_value_set(f"{NODE_KEY}{process_id}", os.environ.get(NODE_NAME) or socket.gethostname())
    names = []
    for p in range(num_processes):
        try:
            names.append(client.blocking_key_value_get(f"{NODE_KEY}{p}", int(timeout_s * 1000)))
        except Exception as e:  # jax.errors.JaxRuntimeError: DEADLINE_EXCEEDED and the like
            raise RuntimeError(f"Process {p} did not publish its node name within {timeout_s:g} s "
                               f"({str(e).splitlines()[0]}); every process of the run must start.") from None
    return tuple(names)


def ints(value: str | None) -> int | None:
    return int(value) if value not in (None, "") else None


def device_files() -> int:
    """This node's NVIDIA GPUs by their device files (jaxenv.NVIDIA_NODES): what CUDA finds where no variable
    narrows it."""
    return len(glob.glob(jaxenv.NVIDIA_NODES))


def visible_gpus() -> int | None:
    """How many GPUs this process sees, as the launcher or the node says (None: nothing says)."""
    for var in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS"):
        value = os.environ.get(var)
        if value is not None:
            return 0 if value.strip() in ("", "NoDevFiles") else len([v for v in value.split(",") if v.strip()])
    on_node = ints(os.environ.get("SLURM_GPUS_ON_NODE"))
    return on_node if on_node is not None else device_files() or None


def node_gpus() -> tuple[int | None, str]:
    """(the GPUs of this node the run is to use, where that comes from): SLURM_GPUS_ON_NODE (a SLURM step's GPUs on
    the node; for mpirun's ranks, those of the batch step or the daemon's step: the job's), else, where
    CUDA_VISIBLE_DEVICES does not narrow what CUDA finds, the node's device files; (None, "") where only the user's
    CUDA_VISIBLE_DEVICES says or nothing does."""
    on_node = ints(os.environ.get("SLURM_GPUS_ON_NODE"))
    if on_node is not None:
        return on_node, f"SLURM_GPUS_ON_NODE={on_node}"
    files = device_files() if "CUDA_VISIBLE_DEVICES" not in os.environ else 0
    return (files, f"its {files} device files {jaxenv.NVIDIA_NODES}") if files else (None, "")


def slurm_tasks_here() -> int | None:
    """The tasks of this SLURM step on this node, from SLURM_STEP_TASKS_PER_NODE ('2(x3),1': two tasks on each
    of the first three nodes, one on the fourth) and SLURM_NODEID."""
    spec = os.environ.get("SLURM_STEP_TASKS_PER_NODE")
    if not spec:
        return None
    per_node = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE={spec!r} is not SLURM's 'tasks(xnodes),...' form.")
        per_node += [int(m.group(1))] * int(m.group(2) or 1)
    node = ints(os.environ.get("SLURM_NODEID")) or 0
    return per_node[node] if node < len(per_node) else None


def open_mpi() -> bool:
    """Whether mpirun started this process (its ranks carry OMPI_COMM_WORLD_*, whatever SLURM_* they inherit)."""
    return "OMPI_COMM_WORLD_SIZE" in os.environ


def slurm_step() -> bool:
    """Whether srun started this process as a task of a SLURM step (a batch script or salloc's shell has no
    SLURM_STEP_NODELIST; JAX's SLURM detection needs it too)."""
    return "SLURM_STEP_NODELIST" in os.environ and "SLURM_LOCALID" in os.environ


def node_tasks() -> tuple[int | None, int] | None:
    """(tasks on this node, this task's rank among them) from the launcher that started this process: Open MPI's
    variables for mpirun's ranks, a SLURM step's for srun's tasks; None when neither started it."""
    if open_mpi() and "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:
        return ints(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")), int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    if not open_mpi() and slurm_step():
        return slurm_tasks_here(), int(os.environ["SLURM_LOCALID"])
    return None


def gpu_share(tasks_here: int | None, local_rank: int, visible: int | None,
              on_node: int | None) -> tuple[int, ...] | None:
    """The GPUs a process drives, as ordinals among the `visible` it sees, when `tasks_here` tasks share its node
    (`on_node`: the node's GPUs for this step, when the launcher says); None: every device it sees."""
    if tasks_here is None or (visible is None and tasks_here > 1):
        return (local_rank,)  # JAX's own choice: one GPU per task
    if not visible:
        return None  # nothing says how many GPUs (or none: a CPU run): the process drives what it sees
    # Bound by the launcher to its own GPUs: it sees fewer than the step has on the node (SLURM_GPUS_ON_NODE counts
    # the step's GPUs there, CUDA_VISIBLE_DEVICES this task's), or, where nothing counts the node's, fewer than
    # the node has tasks.
    bound = visible < on_node if on_node is not None else visible < tasks_here
    if tasks_here == 1 or bound:
        return tuple(range(visible))
    if visible % tasks_here:
        raise ConfigError(f"The {visible} GPUs of this node cannot be split evenly among its {tasks_here} tasks; "
                          "launch one task per node or one task per GPU.")
    share = visible // tasks_here
    return tuple(range(local_rank * share, (local_rank + 1) * share))


def local_devices() -> tuple[int, ...] | None:
    """The devices this process drives: JAX_LOCAL_DEVICE_IDS, else its share of its node's GPUs when SLURM or
    Open MPI started it, else None (every device it sees)."""
    if os.environ.get("JAX_LOCAL_DEVICE_IDS"):
        return tuple(int(i) for i in os.environ["JAX_LOCAL_DEVICE_IDS"].split(","))
    tasks = node_tasks()
    if tasks is None:
        return None
    return gpu_share(*tasks, visible_gpus(), ints(os.environ.get("SLURM_GPUS_ON_NODE")))


def node_view() -> dict:
    """Launch's fields on this node: the devices this process drives, and the tasks and GPUs its node has as the
    launcher says (an unknown count of tasks leaves the GPUs unchecked)."""
    tasks = node_tasks()
    here = tasks[0] if tasks is not None else None
    gpus, by = node_gpus() if here is not None else (None, "")
    return dict(local_device_ids=local_devices(), node_tasks=here, node_gpus=gpus, gpus_by=by)


def allocation_nodes() -> int | None:
    """The nodes of the SLURM allocation this process runs in outside any srun step (a batch script, salloc's
    shell), None inside a step or outside SLURM."""
    if "SLURM_JOB_ID" not in os.environ or slurm_step():
        return None
    return ints(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES"))


def cluster():
    """The first cluster JAX's detection finds (a jax._src.clusters.ClusterEnv subclass), or None. An opt-in
    method (mpi4py) is left out, as JAX leaves it out; a Kubernetes pod counts only as an indexed Job
    (JOB_COMPLETION_INDEX, which JAX needs), so a pod that merely runs in Kubernetes (a CI runner) stays one
    process without asking the Kubernetes API."""
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method or (env is clusters.K8sCluster and "JOB_COMPLETION_INDEX" not in os.environ):
            continue
        if env.is_env_present():
            return env
    return None


def detect(cfg: DistConfig) -> Launch:
    """What `jax.distributed.initialize` is to receive, from the config, the environment or JAX's cluster
    detection; touches no device."""
    address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        num = cfg.num_processes if cfg.num_processes is not None else (
            os.environ.get("JAX_NUM_PROCESSES") or os.environ.get("OMPI_COMM_WORLD_SIZE"))
        pid = cfg.process_id if cfg.process_id is not None else (
            os.environ.get("JAX_PROCESS_ID") or os.environ.get("OMPI_COMM_WORLD_RANK"))
        if num is None or pid is None:
            raise ConfigError("A coordinator address is set but the process count or id is not; set "
                              "JAX_NUM_PROCESSES and JAX_PROCESS_ID (or --dist.num-processes/--dist.process-id) "
                              "for every process.")
        return Launch(EXPLICIT, int(num), int(pid), address, **node_view())
    if open_mpi():
        from jax._src import clusters

        env = clusters.OmpiCluster if clusters.OmpiCluster.is_env_present() else None
        if env is None and int(os.environ["OMPI_COMM_WORLD_SIZE"]) > 1:
            raise ConfigError(f"Open MPI started {os.environ['OMPI_COMM_WORLD_SIZE']} processes but says nothing "
                              "JAX can find their coordinator by (Open MPI 5 sets no OMPI_MCA_orte_hnp_uri); pass "
                              "-x JAX_COORDINATOR_ADDRESS=<first host>:<port> to mpirun.")
    else:
        env = cluster()
    if env is None:
        nodes = allocation_nodes()
        if nodes is not None and nodes > 1:
            raise ConfigError(f"This process runs in the batch script of a {nodes}-node SLURM allocation, outside "
                              "any srun step, and would train alone on its first node; start it with srun (srun "
                              "python train.py ...) so that every node trains.")
        if nodes is not None:  # a one-node allocation's script: the node's one process
            gpus, by = node_gpus()
            return Launch("SLURM allocation", node_tasks=1, node_gpus=gpus, gpus_by=by)
        return Launch()
    name = LAUNCHERS.get(env.__name__, env.__name__)
    num = env.get_process_count()
    if num == 1:
        return Launch(name, **node_view())
    address = env.get_coordinator_address(timeout_secs=cfg.initialization_timeout,
                                          override_coordinator_port=os.environ.get("JAX_COORDINATOR_PORT"))
    return Launch(name, num, env.get_process_id(), address, **node_view())


def initialize(cfg: DistConfig) -> Launch:
    """Initialise multi-process JAX when the config or a launcher asks for it (`jax.distributed.initialize` with
    every argument resolved here, JAX's own detection switched off so it cannot narrow the devices again)."""
    global launched, nodes
    import jax

    launch = detect(cfg)
    if launch.num_processes > 1 or launch.launcher == EXPLICIT:
        ids = list(launch.local_device_ids) if launch.local_device_ids is not None else None
        jax.distributed.initialize(coordinator_address=launch.coordinator_address,
                                   num_processes=launch.num_processes,
                                   process_id=launch.process_id, local_device_ids=ids,
                                   cluster_detection_method="deactivate",
                                   initialization_timeout=cfg.initialization_timeout,
                                   heartbeat_timeout_seconds=cfg.heartbeat_timeout)
        nodes = publish_nodes(launch.process_id, launch.num_processes, cfg.initialization_timeout)
        peers.watch(launch.process_id, launch.num_processes)  # an error on one process stops them all
    launched = launch
    return launch


def device_mismatch(launch: Launch, processes: int, local: int, total: int, platform: str) -> str | None:
    """Why the devices the run got are not the ones its launcher meant it to have (one sentence), or None."""
    if processes != launch.num_processes:
        return (f"The launcher ({launch.launcher}) started {launch.num_processes} processes but JAX counts "
                f"{processes}; every process must join the same run.")
    if total != processes * local:
        return (f"This process drives {local} devices but the run has {total} over {processes} processes, not "
                f"{processes * local}: each process must drive as many devices as every other.")
    tasks, gpus = launch.node_tasks, launch.node_gpus
    if tasks is not None and gpus is not None and platform == "gpu" and tasks * local != gpus:
        driven = f"its process drives {local}" if tasks == 1 else f"its {tasks} processes drive {local} each"
        return (f"This node has {gpus} GPUs ({launch.gpus_by}) but {driven} ({launch.launcher}); launch one task per "
                "node or one per GPU so that every GPU is used once.")
    return None


def check_devices(launch: Launch | None = None) -> None:
    """Refuse (ConfigError, exit 2) a run whose devices are not the ones its launcher announced."""
    import jax

    problem = device_mismatch(launch or launched, jax.process_count(), jax.local_device_count(),
                              jax.device_count(), jax.devices()[0].platform)
    if problem:
        raise ConfigError(problem)


def describe() -> str:
    """The startup line: processes, local and global devices (and, with several processes, the launcher, the
    devices this process drives and, on several nodes, its node)."""
    import jax

    line = (f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local / "
            f"{jax.device_count()} global devices ({jax.devices()[0].device_kind})")
    if jax.process_count() > 1:
        ids = launched.local_device_ids
        line += f"; {launched.launcher}" + (f", GPUs {','.join(map(str, ids))} of this host" if ids else "")
        if len(set(nodes)) > 1:
            line += f"; node {node_of(jax.process_index())} of {len(set(nodes))}"
    return line
