"""What JAX is told before it starts, decided from the host: which platforms to initialise, and on NVIDIA GPU hosts
XLA's GPU performance flags. train.py calls `prepare` before anything imports jax (standard library only here).

- A host without accelerator device files gets JAX_PLATFORMS=cpu (unless set): with libtpu installed (the `tpu`
  extra, for ahead-of-time TPU compiles) JAX would otherwise start a TPU client at backend start, print warnings
  about the missing TPU and take libtpu's lockfile from every other process.
- An NVIDIA GPU host gets GPU_XLA_FLAGS in XLA_FLAGS, unless the user set XLA_FLAGS (then theirs are used as given).
"""

from __future__ import annotations

import glob
from collections.abc import Mapping, MutableMapping

ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
"""Device files of NVIDIA GPUs, AMD GPUs and TPUs (accel on v4/v5e, vfio on v5p/v6e)."""

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

IRONWOOD_XLA_FLAGS = (
    "--xla_tpu_scoped_vmem_limit_kib=65536",  # 64 MiB of VMEM per op (default 32): larger splash blocks fit
    "--xla_tpu_bf16_emission_mode=NATIVE_EMISSION",
    "--xla_tpu_dvfs_p_state=7",  # the chip's highest power state
    # FSDP's collectives on the SparseCores, off the TensorCores: all-gather (1-D and 2-D), reduce-scatter, all-reduce
    "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
    "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
    "--xla_tpu_use_tc_device_shape_on_sc=true",
    "--xla_sc_disable_megacore_partitioning=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false",  # the all-gathers go to the SparseCores
)
"""XLA:TPU flags of the MaxText reproduction's Ironwood stage-1 launcher (run_olmo3_7b_stage1.sh, credited there with
27% -> 44.5% MFU together with its remat and splash blocks): SparseCore collective offload, 64 MiB scoped VMEM."""
V5P_XLA_FLAGS = (
    "--xla_tpu_scoped_vmem_limit_kib=98304",  # MaxText's dense-model VMEM limit (xla_flags_library)
    # Continuation fusion: FSDP's all-gathers overlapped with the compute of the layer before (MaxText's
    # CF_FOR_ALL_GATHER), and the data-parallel collectives pipelined across iterations (DATA_PARALLEL_OVERLAP).
    "--xla_tpu_enable_async_collective_fusion=true",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
    "--xla_tpu_overlap_compute_collective_tc=true",
    "--xla_enable_async_all_gather=true",
    "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
    "--xla_tpu_data_parallel_opt_different_sized_ops=true",
)
"""XLA:TPU flags for v5p from MaxText's flag library (benchmarks/xla_flags_library.py) as its dense-model recipes
combine them: the VMEM limit, continuation fusion for all-gathers, data-parallel overlap."""
TPU_XLA_FLAGS = (("tpu7", IRONWOOD_XLA_FLAGS), ("tpu v5 lite", ()), ("tpu v5", V5P_XLA_FLAGS))
"""mesh.tpu_flags "auto": the flags by substring of the lower-cased device kind (first match wins; v5e, v6e and v4
get none). The train step compiles with them as compiler options (olmo3eqx.step), unless the user set LIBTPU_INIT_ARGS:
then libtpu's own flags are the user's, and ours are not added."""
JAX_LIBTPU_FLAGS = ("--xla_tpu_use_enhanced_launch_barrier=true",)
"""What `import jax` appends to LIBTPU_INIT_ARGS on a Cloud TPU VM (jax/_src/cloud_tpu_init.py): jax's flags, not the
user's. Told apart by value rather than by a snapshot taken before jax starts, so that every caller (the trainer, the
cost model, a benchmark or a notebook that imported jax first) decides alike; tests/test_tpu_flags.py runs jax's own
setup to keep this list true. A user's own `--xla_tpu_use_enhanced_launch_barrier=true` counts as jax's (the same
flag at the same value)."""


SPEAKING_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)
"""XLA flags of the processes that evaluate and generate. XLA:CPU copies a layer's weights out of the stacked blocks
before its matmuls, and its default scheduler, ordering a program for concurrency, starts every such copy ahead of
the first matmul: a second copy of the layers as temporaries (a decode step of a 7B-wide model of 2 layers: 0.33x
its weights). The memory-minimising scheduler copies each weight just before its matmul (0.04x;
bench/bench_speak_memory.py). XLA:CPU reads this one from XLA_FLAGS only (a compile option is ignored)."""



def has_accelerator(env: Mapping[str, str]) -> bool:
    """Whether JAX will run on an accelerator here: JAX_PLATFORMS when set, else the device files present."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return any(p != "cpu" for p in platforms)
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def prepare_speaking(env: MutableMapping[str, str]) -> None:
    """Add SPEAKING_XLA_FLAGS to `env`'s XLA_FLAGS, each unless the user set that flag. XLA reads XLA_FLAGS once, when
    JAX starts its first backend: call this first thing in a command (the eval and generate commands do, when JAX is
    not yet imported)."""
    flags = env.get("XLA_FLAGS", "").split()
    names = {f.split("=")[0] for f in flags}
    env["XLA_FLAGS"] = " ".join(flags + [f for f in SPEAKING_XLA_FLAGS if f.split("=")[0] not in names])


def parse_tpu_flags(text: str) -> dict[str, str]:
    """"--name=value --other=value" -> {name: value}; ValueError naming the first token that is not --name=value."""
    flags = {}
    for token in text.split():
        name, eq, value = token.removeprefix("--").partition("=")
        if not token.startswith("--") or not eq or not name or not value:
            raise ValueError(f"{token!r} is not --name=value")
        flags[name] = value
    return flags


def libtpu_args(env: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """LIBTPU_INIT_ARGS as (the user's flags, those jax's Cloud TPU setup added: JAX_LIBTPU_FLAGS)."""
    tokens = env.get("LIBTPU_INIT_ARGS", "").split()
    return [t for t in tokens if t not in JAX_LIBTPU_FLAGS], [t for t in tokens if t in JAX_LIBTPU_FLAGS]


def step_tpu_flags(setting: str, device_kind: str, env: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """(the XLA:TPU flags the train step compiles with for mesh.tpu_flags `setting` on TPUs of `device_kind`, where
    they come from): the chip's preset for "auto" unless the user set LIBTPU_INIT_ARGS, the user's own flags always,
    none for "none"."""
    if setting == "none":
        return {}, "mesh.tpu_flags none"
    if setting != "auto":
        return parse_tpu_flags(setting), "--mesh.tpu-flags"
    if libtpu_args(env)[0]:
        return {}, f"your LIBTPU_INIT_ARGS replaces the {device_kind} preset; --mesh.tpu-flags adds to it"
    flags = next((f for key, f in TPU_XLA_FLAGS if key in device_kind.lower()), ())
    if not flags:
        return {}, f"the {device_kind} preset has none"
    return parse_tpu_flags(" ".join(flags)), f"the {device_kind} preset, mesh.tpu_flags auto"


def tpu_flags(setting: str, device_kind: str, env: Mapping[str, str]) -> dict[str, str]:
    """The XLA:TPU flags the train step compiles with for mesh.tpu_flags `setting` ("auto", "none" or flags) on
    devices of `device_kind`: none off TPUs (step_tpu_flags says which on TPUs)."""
    return step_tpu_flags(setting, device_kind, env)[0] if "tpu" in device_kind.lower() else {}


def describe_tpu_flags(setting: str, device_kind: str, env: Mapping[str, str]) -> str | None:
    """The startup line on the XLA:TPU flags: those the train step compiles with and those libtpu starts with
    (LIBTPU_INIT_ARGS), each with its source; None off TPUs."""
    if "tpu" not in device_kind.lower():
        return None
    flags, source = step_tpu_flags(setting, device_kind, env)
    compiled = " ".join(f"--{name}={value}" for name, value in flags.items()) if flags else "no added flags"
    line = f"the train step compiles with {compiled} ({source})"
    users, jaxs = libtpu_args(env)
    started = [f"{' '.join(users)} (yours)"] * bool(users) + [f"{' '.join(jaxs)} (set by jax)"] * bool(jaxs)
    return line + (f"; libtpu starts with LIBTPU_INIT_ARGS {', '.join(started)}" if started else "")


def nvidia_gpu_host(env: MutableMapping[str, str]) -> bool:
    """Whether JAX will run on NVIDIA GPUs: JAX_PLATFORMS names cuda/gpu, or it is unset and the device files exist."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return any(p in ("cuda", "gpu") for p in platforms)
    return bool(glob.glob(NVIDIA_NODES))


def float32_matmuls(env: MutableMapping[str, str], compute_dtype: str) -> str | None:
    """For a float32 model on an accelerator, JAX_DEFAULT_MATMUL_PRECISION=highest in `env` (unless set; call after
    `prepare`): JAX's default lets a GPU multiply float32 in TF32 (relative error 3e-4 on an H200, against 1e-6;
    TPUs use bfloat16 passes), which moved the default run's held-out loss by 0.03 nats against the CPU's. A CPU
    computes float32 exactly either way. Returns the log line, None when not applied."""
    if compute_dtype != "float32" or env.get("JAX_DEFAULT_MATMUL_PRECISION") or env.get("JAX_PLATFORMS") == "cpu":
        return None
    env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    return ("float32 model: float32 matmuls at full precision on this accelerator (JAX_DEFAULT_MATMUL_PRECISION="
            "highest; set it to 'default' for the GPU's faster TF32)")


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
