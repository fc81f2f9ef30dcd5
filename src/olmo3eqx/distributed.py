"""`jax.distributed` initialisation from the environment; must run before anything touches devices.

Order: explicit `JAX_COORDINATOR_ADDRESS` + `JAX_NUM_PROCESSES` + `JAX_PROCESS_ID`; otherwise JAX's own
cluster auto-detection (SLURM, TPU pods, GKE, Open MPI) when such a cluster is visible; otherwise a single
process.
"""

from __future__ import annotations

import os

CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
               "JOBSET_NAME")


def initialize(timeout_s: int = 300) -> bool:
    """Initialise multi-process JAX if the environment asks for it; True when it did."""
    import jax

    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        try:
            num, pid = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
        except KeyError as e:
            raise SystemExit(f"JAX_COORDINATOR_ADDRESS is set but {e.args[0]} is not; set JAX_NUM_PROCESSES and "
                             f"JAX_PROCESS_ID for every process.") from None
        jax.distributed.initialize(address, num_processes=num, process_id=pid,
                                   initialization_timeout=timeout_s)
        return True
    if any(v in os.environ for v in CLUSTER_ENV) and os.environ.get("OLMO3EQX_NO_AUTO_DISTRIBUTED") != "1":
        jax.distributed.initialize(initialization_timeout=timeout_s)
        return True
    return False


def describe() -> str:
    import jax

    return (f"process {jax.process_index()}/{jax.process_count()}, {jax.local_device_count()} local / "
            f"{jax.device_count()} global devices ({jax.devices()[0].device_kind})")
