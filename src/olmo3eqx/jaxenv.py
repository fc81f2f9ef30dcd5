"""What JAX is told before it starts, decided from the host: which platforms to initialise, and on NVIDIA GPU hosts
XLA's GPU performance flags. train.py calls `prepare` before anything imports jax (standard library only here).

- A host without accelerator device files gets JAX_PLATFORMS=cpu (unless set): with libtpu installed (the `tpu`
  extra, for ahead-of-time TPU compiles) JAX would otherwise start a TPU client at backend start, print warnings
  about the missing TPU and take libtpu's lockfile from every other process.
- An NVIDIA GPU host gets GPU_XLA_FLAGS in XLA_FLAGS, unless the user set XLA_FLAGS (then theirs are used as given).
"""

from __future__ import annotations

import glob
from collections.abc import MutableMapping

from olmo3eqx.tools.hostmem import has_accelerator

GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",  # overlap collectives with compute
    "--xla_gpu_enable_highest_priority_async_stream=true",  # collectives ahead of compute on the async stream
    # Combine small collectives into large ones (MaxText's GPU recipe for one 8-GPU host: 1 GiB / 8 for
    # all-gather, half that for reduce-scatter); FSDP all-gathers each layer's parameters and reduce-scatters its
    # gradients, so these are the collectives of the train step.
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=67108864",
    # Pipeline the layer scan's collectives: the next layer's all-gather runs during this layer's compute.
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)
"""XLA flags for training on NVIDIA GPUs, from JAX's GPU performance tips and MaxText's GPU recipes; every one is
known to the installed jaxlib (tests/test_aot.py starts XLA with them: an unknown flag aborts XLA)."""
NVIDIA_NODES = "/dev/nvidia[0-9]*"


def nvidia_gpu_host(env: MutableMapping[str, str]) -> bool:
    """Whether JAX will run on NVIDIA GPUs: JAX_PLATFORMS names cuda/gpu, or it is unset and the device files exist."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return any(p in ("cuda", "gpu") for p in platforms)
    return bool(glob.glob(NVIDIA_NODES))


def prepare(env: MutableMapping[str, str]) -> str | None:
    """Set JAX_PLATFORMS and XLA_FLAGS in `env` for this host (see the module doc); returns the log line that says
    which XLA flags a GPU run uses, None elsewhere."""
    if not env.get("JAX_PLATFORMS") and not has_accelerator(env):
        env["JAX_PLATFORMS"] = "cpu"
    if not nvidia_gpu_host(env):
        return None
    if env.get("XLA_FLAGS", "").strip():
        return f"XLA_FLAGS set by the user ({env['XLA_FLAGS'].strip()}): olmo3eqx's GPU flags not applied"
    env["XLA_FLAGS"] = " ".join(GPU_XLA_FLAGS)
    return (f"XLA GPU flags (olmo3eqx.jaxenv.GPU_XLA_FLAGS; set XLA_FLAGS to replace them): {env['XLA_FLAGS']}")
