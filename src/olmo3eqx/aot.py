"""The real train step compiled ahead of time, for the devices here or for a TPU topology that is not present.

`compile_for(cfg, "tpu7x:4x4x4")` builds the run's Layout over the abstract devices of that topology (JAX's
`jax.experimental.topologies`, backed by libtpu: the `tpu` extra, `pip install -e ".[tpu]"`), lowers the train step
over sharded ShapeDtypeStructs and compiles it with XLA:TPU on this host, as MaxText's train_compile does. Nothing
is allocated or run. The report holds XLA's memory per device against the chip's HBM, XLA's count of the compiled
FLOPs per device and step (StepReport.flops says what it leaves out), every collective of the step with its bytes
(olmo3eqx.collectives) and the compile time; when XLA:TPU refuses the program for lack of HBM, its own message. `compile_step(cfg, layout)` does the same for any Layout (the dry run on this host's
devices). Config in, report out: the dry run (`train.py --dry-run --target T`) and bench/bench_tpu_memory.py use it.

Topology names are libtpu's: `v5p:8x8x2` (chips in x, y, z), `tpu7x:4x4x4` (Ironwood: each chip shows as two
devices), `v5e:16x16`, `v6e:8x8`, `v4:4x4x4`. A host without a TPU runs the compile with JAX_PLATFORMS=cpu.

GPU nodes (`h100x8`, `16xh100x8`, `h200x8`, `b200x8`: gpu_node) compile the same way with XLA:GPU for compile-only
devices of jax's CUDA plugin (`gpu_devices`: the `gpu-compile` extra; no GPU or driver needed), described by XLA's
own GPU descriptions (package data, olmo3eqx/gpu_specs/); the report then also holds what the program runs
(olmo3eqx.gpu_program: each attention's kernel, the GEMMs). Without the plugin a GPU node is planned on simulated CPU
devices (XLA:CPU's memory against the GPU's).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import tempfile
import time
from dataclasses import dataclass

from olmo3eqx import collectives
from olmo3eqx.compile_cache import compile_only, uncached
from olmo3eqx.config import TrainConfig
from olmo3eqx.errors import ConfigError

GIB = 1024**3
HBM_GIB = (("tpu7", 94.75), ("v6 lite", 31.25), ("v5 lite", 15.75), ("tpu v5", 95.74), ("tpu v4", 15.25))
"""HBM per device in GiB, by substring of the lower-cased device kind (first match wins: "v5 lite" before "tpu v5"),
as XLA:TPU (libtpu 0.0.42.1) states it when a program does not fit ("exceeds available HBM"); tests check the table
against the compiler."""
LIBTPU_QUIET = {"TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
"""Set (unless set already) while libtpu starts on a host without a TPU, and removed again (TPU_WORKER_HOSTNAMES would
make olmo3eqx.distributed take later processes for TPU pod workers): without the first two libtpu warns that it
cannot find this host's TPU; the third lets it start while another process holds its lockfile (/tmp/libtpu_lockfile,
taken by any JAX process that initialised a TPU client). None changes what is compiled: the topology is named."""
OUT_OF_HBM = re.compile(r"RESOURCE_EXHAUSTED: .*(?:HBM|hbm|vmem|VMEM).*")
OUT_OF_VMEM = re.compile(r"RESOURCE_EXHAUSTED: [^\n]*VmemOom.*?(Scoped allocation with size \S+ and limit \S+ "
                         r"exceeded scoped vmem limit by [0-9.]+[KMG]?)", re.S)
"""A kernel's scoped VMEM overflow (a splash block too large for the chip); its message spans lines."""


GPU_SPECS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb", "b200": "b200.txtpb"}
"""GPU node targets `h100xM` / `h200xM` / `b200xM` (one node of M GPUs) and `Nxh100xM` (N such nodes): each GPU's
description, XLA's own (package data under olmo3eqx/gpu_specs/, each file naming its source in openxla/xla), which
jax's CUDA plugin compiles for (GPU_INSTALL) and which gives the device kind and memory."""
MULTISLICE = re.compile(r"^([0-9]+)x([a-z][a-z0-9]*:.+)$")
"""A TPU target of several slices: `2xv5p:8x8x1` is two v5p:8x8x1 slices joined over the data-centre network."""
GPU_TARGET = re.compile(r"^(?:([0-9]+)x)?(h100|h200|b200)x([0-9]+)$")
GPU_LINKS = ("NVLink (node)", "network (nodes)")
"""The collectives table's links on GPU nodes: within a node and across nodes."""
GPU_LIKE = re.compile(r"^(?:[0-9]+x)?[a-z]+[0-9]+x[0-9]+$")
"""A target written as a GPU node (`a100x8`): TPU topologies name their chip with a colon (`v5p:2x2x1`)."""
CUDA_PLUGIN = "jax_plugins.xla_cuda12"
GPU_INSTALL = 'pip install -e ".[gpu-compile]"'
"""The `gpu-compile` extra: jax's CUDA plugin for the installed jax and the NVIDIA wheels its compiles need
(docs/tpu-gpu.md); a GPU host's `gpu` extra (jax[cuda12], every NVIDIA wheel) has them too."""
GPU_QUIET = {"JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}
"""Set (unless set) before the CUDA plugin starts on a host without a GPU: its version check calls cuInit, which
fails without a driver ("Unknown CUDA error 303"); a compile for named GPUs needs neither."""


@dataclass(frozen=True)
class GpuNode:
    """GPU nodes: `count` GPUs in `nodes` nodes of count / nodes each, compiled for by XLA:GPU (jax's CUDA plugin,
    compile-only devices of `spec`'s GPU) or, without the plugin, planned on simulated CPU devices (the CPU
    compiler's memory analysis standing in for XLA:GPU's, attention resolved as on a GPU)."""

    name: str
    count: int
    device_kind: str
    hbm: float
    """Bytes of memory per GPU: the description's device_memory_size."""
    nodes: int = 1
    spec: str = GPU_SPECS["h100"]

    @property
    def per_node(self) -> int:
        return self.count // self.nodes

    def description(self) -> str:
        """The GPU's description (a GpuTargetConfigProto in text form), as the CUDA plugin takes it."""
        return gpu_spec(self.spec)


def gpu_spec(name: str) -> str:
    """The text of package data file olmo3eqx/gpu_specs/`name`."""
    from importlib import resources

    return resources.files("olmo3eqx").joinpath("gpu_specs", name).read_text()


def gpu_node(target: str | None) -> GpuNode | None:
    """The GPU nodes `target` names (`h100x8`, `h200x8`, `b200x8`, `16xh100x8`: 16 nodes of 8), None for anything
    else (a TPU topology)."""
    found = GPU_TARGET.match(target or "")
    if found is None:
        if GPU_LIKE.match(target or ""):
            raise ConfigError(f"--target {target} names no GPU described here; name one of {', '.join(GPU_SPECS)} as "
                              f"GPUSxCOUNT or NODESxGPUxCOUNT, e.g. h100x8 or 16xh100x8.")
        return None
    nodes, per_node = int(found.group(1) or 1), int(found.group(3))
    if nodes < 1 or per_node < 1:
        raise ConfigError(f"--target {target} names no GPU; write NODESx{found.group(2)}xGPUS with both counts "
                          f"positive, e.g. 16x{found.group(2)}x8.")
    spec = GPU_SPECS[found.group(2)]
    text = gpu_spec(spec)
    kind = re.search(r'^\s*name: "([^"]+)"', text, re.M).group(1)
    memory = int(re.search(r"device_memory_size: ([0-9]+)", text).group(1))
    return GpuNode(target, nodes * per_node, kind, float(memory), nodes, spec)


def cuda_plugin() -> bool:
    """Whether jax's CUDA plugin is installed (the `gpu` extra): GPU targets then compile with XLA:GPU."""
    return importlib.util.find_spec(CUDA_PLUGIN) is not None


def gpu_devices(node: GpuNode) -> list:
    """Compile-only devices for `node`: the CUDA plugin's topology of node.nodes hosts of node.per_node GPUs each
    (each device's process_index is its node), of the described GPU; no GPU or driver is needed."""
    import jax
    from jax.experimental import topologies

    for key, value in GPU_QUIET.items():
        os.environ.setdefault(key, value)
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=node.description(),
                                                topology=f"{node.nodes}x1x{node.per_node}")
    except (jax.errors.JaxRuntimeError, RuntimeError) as e:
        raise ConfigError(f"jax's CUDA plugin gave no devices for --target {node.name} ({str(e).splitlines()[0]}); "
                          f"install the plugin of the installed jax: {GPU_INSTALL}.") from None
    return list(topology.devices)


def hbm_bytes(device_kind: str) -> float | None:
    """HBM per device of a TPU of this kind (HBM_GIB), None for other devices."""
    kind = device_kind.lower()
    return next((gib * GIB for key, gib in HBM_GIB if key in kind), None)


def topology_devices(name: str, slices: int = 1) -> list:
    """The abstract devices of TPU topology `name` (`slices` of them joined over the data-centre network: each
    device's slice_index says which; `2xv5p:8x8x1` in the name says the same as slices=2); ConfigError naming the fix
    when libtpu is missing or the name is unknown."""
    found = MULTISLICE.match(name)
    if found is not None:
        slices, name = slices * int(found.group(1)), found.group(2)
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError(f"--target {name} compiles with XLA:TPU, which needs libtpu: pip install -e \".[tpu]\" "
                          f"(the jax[tpu] that matches the installed jax).")
    import jax
    from jax.experimental import topologies

    added = [key for key in LIBTPU_QUIET if key not in os.environ]
    os.environ.update({key: LIBTPU_QUIET[key] for key in added})
    try:
        more = {"num_slices": slices} if slices > 1 else {}  # one slice: the devices as libtpu gives them
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **more).devices)
    except jax.errors.JaxRuntimeError as e:
        raise ConfigError(f"Unknown TPU topology {name!r} ({str(e).splitlines()[0]}); name one as libtpu does, "
                          f"e.g. v5p:2x2x1, v5p:8x8x2, tpu7x:4x4x4, v5e:16x16, v6e:8x8.") from None
    finally:
        for key in added:
            del os.environ[key]


@dataclass(frozen=True)
class StepReport:
    """One compiled train step, per device."""

    devices: int
    device_kind: str
    compile_s: float
    hbm: float | None
    """Bytes of HBM per device (known TPUs), else None."""
    memory: dict[str, int] | None = None
    """XLA's memory analysis: argument, output, alias, temp bytes, and total = argument + output - alias + temp."""
    flops: float | None = None
    """XLA's cost analysis: FLOPs per device and step, recomputation (remat) included, but a loop body (the layer
    scan, gradient accumulation, the chunked loss) counted once whatever its trip count, and a Pallas kernel (splash
    attention) as 0. On a program without loops and with XLA's attention it is the whole step (tests/test_aot.py)."""
    out_of_memory: str | None = None
    """XLA:TPU's own message when it refused the program for lack of memory."""
    prediction: object | None = None
    """XLA:TPU's predicted step time, every loop counted (olmo3eqx.costmodel.Prediction); TPU targets only."""
    prediction_error: str | None = None
    """Why a TPU step has no prediction (the cost model gave no usable figure)."""
    collectives: object | None = None
    """Every collective of one step: kind, dtype, count, bytes per device, mesh axes, within or across a node or
    slice (olmo3eqx.collectives.Traffic; `.to_json()` is the form bench/ stores)."""
    program: object | None = None
    """A GPU program's attention kernels and GEMMs (olmo3eqx.gpu_program.Program); GPU targets only."""
    estimate: object | None = None
    """The step time estimated from the GPU program, kernel by kernel at its roofline (olmo3eqx.gpu_estimate.Estimate);
    GPU targets only."""
    compiler: str | None = None
    """Whose memory analysis it is, where the dry run says so ("XLA:GPU")."""

    @property
    def fits(self) -> bool | None:
        if self.out_of_memory is not None:
            return False
        if self.memory is None or self.hbm is None:
            return None
        return self.memory["total"] <= self.hbm

    def lines(self) -> list[str]:
        """What the dry run prints."""
        if self.out_of_memory is not None:
            return [f"compiled step memory per device: does not fit; XLA says: {self.out_of_memory}",
                    f"compile time:          {self.compile_s:.1f} s"]
        out = []
        if self.memory is not None:
            m = self.memory
            by = f" ({self.compiler})" if self.compiler else ""
            line = (f"compiled step memory per device{by}: {m['total'] / GIB:.2f} GiB (arguments {m['argument'] / GIB:.2f}, "
                    f"outputs {m['output'] / GIB:.2f}, aliased {m['alias'] / GIB:.2f}, temporaries "
                    f"{m['temp'] / GIB:.2f})")
            if self.hbm is not None:
                margin = (self.hbm - m["total"]) / GIB
                what = "GPU memory" if self.program is not None else "HBM"
                line += (f"; {what} {self.hbm / GIB:.2f} GiB: fits with {margin:.2f} GiB to spare" if margin >= 0 else
                         f"; {what} {self.hbm / GIB:.2f} GiB: does not fit, {-margin:.2f} GiB over")
            out.append(line)
        else:
            out.append("compiled step memory per device: this backend reports no memory analysis")
        if self.flops is not None:
            out.append(f"compiled FLOPs:        {self.flops / 1e12:,.4g} TFLOP per device-step as XLA counts them: "
                       f"recomputation included, each loop body once (layer scan, micro-batches, loss chunks), "
                       f"Pallas kernels (splash) as 0")
        if self.prediction is not None:
            out.extend(self.prediction.lines())
        elif self.prediction_error is not None:
            out.append(f"predicted step time:   none ({self.prediction_error})")
        if self.program is not None:
            out.extend(self.program.lines())
        if self.estimate is not None:
            out.extend(self.estimate.lines())
        if self.collectives is not None:
            out.extend(self.collectives.lines(GPU_LINKS) if self.program is not None else self.collectives.lines())
        out.append(f"compile time:          {self.compile_s:.1f} s")
        return out


def compile_step(cfg: TrainConfig, layout, gpu: GpuNode | None = None, predict_time: bool = True) -> StepReport:
    """Lower and compile `cfg`'s train step over `layout` (abstract inputs: nothing allocated) and measure it; `gpu`:
    the GPU node the layout's devices are (compile-only GPUs: XLA:GPU's memory against the GPU's, the program's
    attention kernels and GEMMs) or stand for (simulated CPU devices: attention planned as on its GPUs, the CPU
    compiler's memory against the GPU's); `predict_time` False: no TPU step-time prediction (it compiles the loop
    bodies again)."""
    import jax

    from olmo3eqx.attention import planning_for
    from olmo3eqx.step import make_train_step

    devices = layout.mesh.devices.flatten()
    kind = devices[0].device_kind
    common = dict(devices=len(devices), device_kind=kind, hbm=hbm_bytes(kind) if devices[0].platform == "tpu"
                  else None)
    simulated = gpu is not None and devices[0].platform == "cpu"
    if simulated:
        common.update(device_kind=f"{gpu.device_kind} (simulated: CPU compiler)", hbm=gpu.hbm)
    elif gpu is not None:
        common.update(hbm=gpu.hbm, compiler="XLA:GPU")
    step = make_train_step(cfg, layout)
    start = time.perf_counter()
    dump = tempfile.TemporaryDirectory() if devices[0].platform == "cpu" else contextlib.nullcontext()
    gpu_target = devices[0].platform == "gpu"
    try:
        with (planning_for("gpu", gpu.device_kind) if simulated else contextlib.nullcontext(), dump as where,
              target_capability(gpu) if gpu_target and gpu is not None else contextlib.nullcontext()):
            lowered = step.lower(layout.state_target(), *layout.batch_target(cfg.data.seq_len))
            options = CPU_DUMP | {"xla_dump_to": where} if where else GPU_COMPILE if gpu_target else None
            with uncached() if where or compile_only(devices) else contextlib.nullcontext():
                compiled = lowered.compile(options)
            program = partitioned_program(where) if where else None
    except jax.errors.JaxRuntimeError as e:
        vmem, found = OUT_OF_VMEM.search(str(e)), OUT_OF_HBM.search(str(e))
        if vmem is None and found is None:
            raise
        said = (f"a kernel's scoped VMEM: {vmem.group(1)} (a smaller model.attention_block_q/_kv fits)" if vmem
                else found.group(0).strip())
        return StepReport(compile_s=time.perf_counter() - start, out_of_memory=said, **common)
    compile_s = time.perf_counter() - start
    mem = compiled.memory_analysis()
    memory = None
    if mem is not None:
        memory = {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
                  "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes}
        memory["total"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    cost = compiled.cost_analysis()
    flops = cost.get("flops") if isinstance(cost, dict) else None
    prediction = error = None
    if devices[0].platform == "tpu" and predict_time:
        from olmo3eqx.costmodel import CostModelError, predict

        try:
            prediction = predict(cfg, layout, compiled)
        except CostModelError as e:
            error = str(e)
    from olmo3eqx.sharding import granules_of

    text = compiled.as_text()
    traffic = collectives.account(program or text, layout.mesh, granules_of(layout.mesh, cfg.mesh.node_devices))
    held = estimated = None
    if devices[0].platform == "gpu":
        from olmo3eqx import gpu_estimate, gpu_program

        held = gpu_program.read(text)
        estimated = gpu_estimate.estimate_step(cfg, layout, compiled)
    return StepReport(compile_s=compile_s, memory=memory, flops=flops, prediction=prediction,
                      prediction_error=error, collectives=traffic, program=held, estimate=estimated, **common)


GPU_COMPILE = {"xla_gpu_enable_cub_radix_sort": False}
"""XLA:GPU's options for a compile without a GPU: XLA's own sort kernel in place of CUB's radix sort, whose scratch
size XLA asks the CUDA runtime for (without a device: "cudaErrorInvalidDevice: invalid device ordinal", seen on the
7B stage-3 step, 65,536-token packed rows; at 8,192 tokens XLA kept its own sort). A GPU would sort with CUB, whose
scratch the memory figure leaves out."""


@contextlib.contextmanager
def target_capability(gpu: GpuNode):
    """jax's cuDNN attention asks the local GPU's compute capability while tracing (packed documents need Hopper:
    jax._src.cudnn.fused_attention_stablehlo.check_compute_capability), which a host without a GPU has not: answered
    for `gpu`'s description instead, for the trace only."""
    from jax._src.cudnn import fused_attention_stablehlo as fmha

    spec = re.search(r"cuda_compute_capability \{\s*major: (\d+)(?:\s*minor: (\d+))?", gpu.description())
    have = (int(spec.group(1)), int(spec.group(2) or 0))
    asked = lambda capability: tuple(int(x) for x in capability.split("."))  # noqa: E731
    saved = fmha.check_compute_capability, fmha.is_cuda_compute_capability_equal
    fmha.check_compute_capability = lambda capability: have >= asked(capability)
    fmha.is_cuda_compute_capability_equal = lambda capability: have == asked(capability)
    try:
        yield
    finally:
        fmha.check_compute_capability, fmha.is_cuda_compute_capability_equal = saved


CPU_DUMP = {"xla_dump_hlo_pass_re": "all-reduce-promotion"}
"""XLA:CPU's runtime cannot run bfloat16 collectives, so after SPMD partitioning its all-reduce-promotion and
float-normalization passes widen them to float32: `compiled.as_text()` on CPU devices reads float32 for every
collective. The collectives of a CPU compile (the dry run on simulated devices, a GPU node planned here) are
therefore read from the program as partitioned, dumped just before that pass: the dtypes XLA:GPU and XLA:TPU keep."""


def partitioned_program(where: str) -> str | None:
    """The train step's program as dumped before all-reduce-promotion into `where` (CPU_DUMP), None if not found."""
    from pathlib import Path

    found = sorted(Path(where).glob("*jit_train_step*before_all-reduce-promotion.txt"))
    return found[-1].read_text() if found else None


def compile_for(cfg: TrainConfig, topology: str) -> StepReport:
    """`cfg`'s train step compiled for TPU topology `topology` (see the module doc), remat as cfg asks for its chip
    (model.remat_by_chip)."""
    from olmo3eqx.config import for_chip
    from olmo3eqx.sharding import build_layout

    devices = topology_devices(topology)
    cfg = for_chip(cfg, devices[0].device_kind)
    return compile_step(cfg, build_layout(cfg, devices))
