"""`jax.distributed` initialisation from the config or the environment; must run before anything touches devices.

Order: explicit `dist.*` flags or `JAX_COORDINATOR_ADDRESS` + `JAX_NUM_PROCESSES` + `JAX_PROCESS_ID`; otherwise
JAX's own cluster auto-detection (SLURM, TPU pods, GKE, Open MPI) when such a cluster is visible; otherwise one
process. CPU collectives between processes use gloo (JAX's default).
"""

from __future__ import annotations

import os

from olmo3eqx.config import DistConfig
from olmo3eqx.errors import ConfigError

# Variables whose presence means a cluster JAX can auto-detect (a multi-task SLURM step, an Open MPI launch,
# a TPU pod worker, a Kubernetes JobSet).
CLUSTER_ENV = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
               "JOBSET_NAME")


def initialize(cfg: DistConfig) -> bool:
    """Initialise multi-process JAX if the config or environment asks for it; True when it did."""
    import jax

    address = cfg.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    timeouts = dict(initialization_timeout=cfg.initialization_timeout, heartbeat_timeout_seconds=cfg.heartbeat_timeout)
    if address:
        num = cfg.num_processes if cfg.num_processes is not None else os.environ.get("JAX_NUM_PROCESSES")
        pid = cfg.process_id if cfg.process_id is not None else os.environ.get("JAX_PROCESS_ID")
        if num is None or pid is None:
            raise ConfigError("A coordinator address is set but the process count or id is not; set "
                              "JAX_NUM_PROCESSES and JAX_PROCESS_ID (or --dist.num-processes/--dist.process-id) "
                              "for every process.")
        jax.distributed.initialize(address, num_processes=int(num), process_id=int(pid), **timeouts)
        return True
    if any(os.environ.get(v) not in (None, "", "1") for v in CLUSTER_ENV[:2]) or any(v in os.environ for v in CLUSTER_ENV[2:]):
        jax.distributed.initialize(**timeouts)
        return True
    return False


def describe() -> str:
    import jax

    return (f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local / "
            f"{jax.device_count()} global devices ({jax.devices()[0].device_kind})")
