"""The step time of a train step compiled by XLA:GPU, estimated from its program: an estimate, not a measurement.

XLA:GPU's compile-only devices (jax's CUDA plugin on a host without a GPU, olmo3eqx.aot) give the program a GPU would
run, but no cost model: `cost_analysis()` answers None. `estimate(hlo_text, gpu, ...)` reads the program
(`compiled.as_text()`, after XLA:GPU's fusion) and costs every kernel it launches by the roofline:

- a kernel's time is max(FLOPs / the GPU's matrix peak for its operands' type, bytes / HBM bandwidth). FLOPs are the
  matmuls': each `dot` of a fusion (Triton GEMM fusions included) and each cuBLAS custom call, 2 x output elements x
  contracted size; cuDNN's fused attention (`__cudnn$fmha*`) counts its two matmuls per visible (query, key) pair
  (causal: the keys up to the query, within `sliding_window_length` when set; olmo3eqx.flops.mean_keys) and its
  backward five (S recomputed, dP, dS to dQ and dK, dV). Elementwise arithmetic is not counted: it sits far below
  the memory bound on these GPUs (67 TFLOP/s of float32 against 3.35 TB/s on an H100 is 20 FLOPs a byte).
- bytes are what a kernel reads and writes at its boundary: its operands and its result, except that an operand the
  fusion only slices (`dynamic-slice`, `slice`, as the layer scan takes one layer of the stacked weights) counts the
  slice, and a result written in place (a `dynamic-update-slice` root: the scan's stacked outputs and gradients)
  counts the update, not the whole buffer. Caches are not modelled: every byte goes to HBM.
- a loop body runs its trip count times (XLA's `known_trip_count`, else read from its condition:
  olmo3eqx.collectives.trip_count): the layer scan, gradient accumulation, the loss chunks; nested loops multiply.
  A loop neither states is counted once and the estimate says so. Of a conditional's branches the costliest counts.
- collectives (olmo3eqx.collectives.account: every collective, its bytes per device by the ring algorithm, within a
  node or across) take bytes / the link's bandwidth: NVLink within a node, the network across nodes. XLA:GPU runs
  them on their own streams beside the compute, so the step is the larger of the two (compute and communication
  overlapped); their sum, the bound with no overlap, is printed beside it.

What it leaves out, each of which only makes a real step slower: kernels below their roofline (a matmul at 70% of
peak, cuDNN attention at a third of it on an H200: docs/tpu-gpu.md), launch gaps between kernels, caches, collectives
that wait on compute. The GPU's figures (GPUS) are NVIDIA's datasheet figures, checked against XLA's own device
descriptions where those state them (`figures_from_target`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

from olmo3eqx import collectives
from olmo3eqx.collectives import (
    ARRAY,
    Instruction,
    bytes_by_dtype,
    called_computations,
    operand_names,
    parse_program,
    shape_tree,
    trip_count,
)
from olmo3eqx.costmodel import CUSTOM_CALL

TB = 1e12
GB = 1e9


@dataclass(frozen=True)
class Gpu:
    """The figures one GPU is costed by: dense (not sparse) tensor-core peaks, HBM bandwidth, and the bandwidth of
    each GPU's links in one direction."""

    name: str
    bf16_flops: float
    """Dense bf16/fp16 tensor-core FLOP/s."""
    fp8_flops: float
    """Dense fp8 tensor-core FLOP/s."""
    tf32_flops: float
    """Dense TF32 tensor-core FLOP/s: a float32 matmul at XLA's default precision."""
    fp32_flops: float
    """Float32 FLOP/s without tensor cores: a float32 matmul at precision HIGHEST."""
    hbm: float
    """HBM bytes/s."""
    nvlink: float
    """NVLink bytes/s per GPU, one direction (within a node)."""
    network: float
    """Network bytes/s per GPU, one direction (across nodes)."""
    source: str


GPUS = (
    ("b200", Gpu("NVIDIA B200", 2.25e15, 4.5e15, 1.1e15, 74.5e12, 8.0 * TB, 900 * GB, 50 * GB,
                 "NVIDIA DGX B200 datasheet: 72 PFLOPS fp8 training (8 GPUs, with sparsity: 4.5 PFLOP/s dense fp8, "
                 "2.25 bf16, 1.1 TF32 per GPU), 64 TB/s HBM3e (8 TB/s per GPU), fifth-generation NVLink 1.8 TB/s per "
                 "GPU (900 GB/s each way), 8 x 400 Gb/s ConnectX-7 (50 GB/s per GPU); float32 without tensor cores "
                 "from XLA's b200 description (148 SMs x 128 x 1.965 GHz x 2), which states 2.22 PFLOP/s bf16, 4.45 "
                 "fp8 and 7.67 TB/s")),
    ("h200", Gpu("NVIDIA H200 SXM", 989e12, 1979e12, 494.5e12, 67e12, 4.8 * TB, 450 * GB, 50 * GB,
                 "NVIDIA H200 datasheet (SXM): 989 TFLOP/s bf16 and 1,979 fp8 dense (half the sparse figures), 494 "
                 "TF32, 67 float32, 4.8 TB/s HBM3e, NVLink 900 GB/s (450 each way); DGX H200: 8 x 400 Gb/s "
                 "ConnectX-7 (50 GB/s per GPU)")),
    ("h100", Gpu("NVIDIA H100 SXM", 989e12, 1979e12, 494.5e12, 67e12, 3.35 * TB, 450 * GB, 50 * GB,
                 "NVIDIA H100 datasheet (SXM): 989 TFLOP/s bf16 and 1,979 fp8 dense (half the sparse figures), 494 "
                 "TF32, 67 float32, 3.35 TB/s HBM3, NVLink 900 GB/s (450 each way); DGX H100: 8 x 400 Gb/s "
                 "ConnectX-7 InfiniBand (50 GB/s per GPU)")),
)
"""The GPUs by substring of the lower-cased device kind (first match wins)."""

FMHA = re.compile(r"^__cudnn\$fmha")
CUBLAS = re.compile(r"^__cublas\$")
FREE = frozenset(("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "after-all",
                  "partition-id", "replica-id", "add-dependency", "domain", "async-update", "copy-done",
                  "send-done", "recv-done", "iota"))
"""Instructions that launch no kernel (or whose work is counted at their start)."""
COMMUNICATION = tuple(collectives.KINDS) + ("send", "recv")
SLICES = ("dynamic-slice", "slice")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_MASK = re.compile(r'"mask_type":\s*"(\w+)"')
_WINDOW = re.compile(r'"sliding_window_length":\s*"?(\d+)')
_INTERMEDIATE = re.compile(r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*"dimensions":\s*\[([^\]]*)\]')


def gpu_for(device_kind: str) -> Gpu:
    """The figures of the GPU `device_kind` names (GPUS); ValueError for one not in the table."""
    kind = device_kind.lower()
    for key, gpu in GPUS:
        if key in kind:
            return gpu
    raise ValueError(f"no roofline figures for {device_kind!r}; olmo3eqx.gpu_estimate.GPUS knows "
                     f"{', '.join(g.name for _, g in GPUS)}.")


def figures_from_target(text: str) -> dict[str, float]:
    """The figures XLA's GPU device description (a GpuTargetConfigProto's text) states: `hbm` (memory_bandwidth)
    and, where its matrix_unit_description and scalar_unit_description give them, bf16, fp8 (e4m3), tf32 and fp32
    FLOP/s (core_count x units_per_core x ops_per_clock x clock x 2: an op is a fused multiply-add)."""
    out: dict[str, float] = {}
    found = re.search(r"memory_bandwidth:\s*(\d+)", text)
    if found:
        out["hbm"] = float(found.group(1))
    cores = re.search(r"core_count:\s*(\d+)", text)
    if cores is None:
        return out

    def rates(unit: str) -> dict[int, float]:
        block = re.search(unit + r"\s*\{(.*?)\n  \}", text, re.S)
        if block is None:
            return {}
        table = {}
        for key, clock, units, ops in re.findall(r"key:\s*(\d+)\s*value\s*\{\s*clock_rate_ghz:\s*([\d.]+)\s*"
                                                  r"units_per_core:\s*(\d+)\s*ops_per_clock:\s*(\d+)", block.group(1)):
            table[int(key)] = int(cores.group(1)) * int(units) * int(ops) * float(clock) * 1e9 * 2
        return table

    # keys are XLA's PrimitiveType numbers: F32 11, BF16 16, F8E4M3FN 20
    matrix, scalar = rates("matrix_unit_description"), rates("scalar_unit_description")
    for name, table, key in (("bf16_flops", matrix, 16), ("fp8_flops", matrix, 20), ("tf32_flops", matrix, 11),
                             ("fp32_flops", scalar, 11)):
        if key in table:
            out[name] = table[key]
    return out


@dataclass(frozen=True)
class Kernel:
    """One kernel of the program, costed: FLOPs and bytes of one run, the seconds of one run, runs per step."""

    name: str
    kind: str
    """matmul, attention (cuDNN), or memory (everything else: elementwise, reductions, copies)."""
    flops: float
    bytes: float
    seconds: float
    count: int


@dataclass(frozen=True)
class Estimate:
    """The estimated step on one GPU (every GPU runs the same program) and what it is made of."""

    gpu: Gpu
    kernels: tuple[Kernel, ...]
    within_bytes: float
    """Bytes each GPU sends over NVLink per step (olmo3eqx.collectives' ring convention)."""
    across_bytes: float
    """Bytes each GPU sends over the network per step."""
    tokens_per_device: int
    model_flops: float
    """Model FLOPs per GPU and step (olmo3eqx.flops, window-aware): what MFU counts."""
    unknown_loops: int = 0
    """Loops whose trip count the program does not state, counted once."""

    @property
    def compute_s(self) -> float:
        return float(sum(k.seconds * k.count for k in self.kernels))

    @property
    def communication_s(self) -> float:
        return self.within_bytes / self.gpu.nvlink + self.across_bytes / self.gpu.network

    @property
    def seconds(self) -> float:
        """The step: compute and communication overlapped (the larger of the two)."""
        return max(self.compute_s, self.communication_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_device / self.seconds

    @property
    def mfu(self) -> float:
        """The MFU this estimate implies: model FLOPs per second over the GPU's dense bf16 peak."""
        return self.model_flops / self.seconds / self.gpu.bf16_flops

    def by_kind(self) -> dict[str, tuple[float, float]]:
        """(seconds, FLOPs) per step by kernel kind."""
        out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for k in self.kernels:
            out[k.kind][0] += k.seconds * k.count
            out[k.kind][1] += k.flops * k.count
        return {kind: (s, f) for kind, (s, f) in out.items()}

    def lines(self) -> list[str]:
        """What the dry run and bench/gpu_estimate.py print."""
        g = self.gpu
        out = [f"estimated step time:   {self.seconds:.3f} s per step, {self.tokens_per_s:,.0f} tokens/s per GPU, "
               f"implied MFU {100 * self.mfu:.1f}% (an ESTIMATE from XLA:GPU's compiled program, not a measurement: "
               f"each kernel at its roofline on an {g.name}, olmo3eqx.gpu_estimate)"]
        kinds = self.by_kind()
        parts = []
        for kind in ("matmul", "attention", "memory"):
            if kind in kinds:
                s, f = kinds[kind]
                parts.append(f"{kind} {s:.3f} s" + (f" ({f / 1e12:,.1f} TFLOP)" if f else ""))
        out.append(f"  compute {self.compute_s:.3f} s: " + ", ".join(parts)
                   + f"; {sum(k.count for k in self.kernels):,} kernel runs of {len(self.kernels):,} kernels")
        out.append(f"  communication {self.communication_s:.3f} s: {self.within_bytes / 2**30:,.2f} GiB over NVLink "
                   f"at {g.nvlink / GB:.0f} GB/s, {self.across_bytes / 2**30:,.2f} GiB over the network at "
                   f"{g.network / GB:.0f} GB/s per GPU; overlapped with compute (no overlap: "
                   f"{self.compute_s + self.communication_s:.3f} s)")
        out.append(f"  figures: {g.bf16_flops / TB:,.0f} TFLOP/s bf16, {g.fp8_flops / TB:,.0f} fp8, "
                   f"{g.hbm / TB:.2f} TB/s HBM ({g.source})")
        if self.unknown_loops:
            out.append(f"  {self.unknown_loops} loop(s) state no trip count: counted once (the estimate is low)")
        return out


def _dims(shape: str) -> list[int]:
    found = ARRAY.search(shape)
    if found is None:
        return []
    return [int(d.lstrip("<=")) for d in found.group(2).split(",") if d.strip()]


def _dtype(shape: str) -> str:
    found = ARRAY.search(shape)
    return found.group(1) if found else ""


def _bytes(shape: str) -> float:
    return sum(bytes_by_dtype(shape_tree(shape)).values())


def _peak(gpu: Gpu, types: list[str], attrs: str) -> float:
    """The matrix peak for a matmul of operands of these types."""
    if any(t.startswith("f8") for t in types) and not any(t in ("bf16", "f16", "f32") for t in types):
        return gpu.fp8_flops
    if "f32" in types or "f64" in types:
        return gpu.fp32_flops if "operand_precision={highest" in attrs else gpu.tf32_flops
    return gpu.bf16_flops


class _Program:
    """A parsed program and the costing of its kernels."""

    def __init__(self, text: str, gpu: Gpu):
        self.computations, self.by_name, self.entry = parse_program(text)
        self.gpu = gpu
        self.unknown_loops = 0

    def dot_cost(self, inst: Instruction) -> tuple[float, float]:
        """(FLOPs, peak) of a dot instruction."""
        ops = operand_names(inst)
        lhs = self.by_name[ops[0]]
        contracting = _CONTRACTING.search(inst.attrs)
        size = math.prod(_dims(lhs.shape)[int(i)] for i in contracting.group(1).split(",") if i) if contracting \
            else 1
        types = [_dtype(self.by_name[o].shape) for o in ops[:2]]
        return 2.0 * math.prod(_dims(inst.shape)) * size, _peak(self.gpu, types, inst.attrs)

    def fused_matmul_seconds(self, computation: str) -> tuple[float, float]:
        """(FLOPs, seconds at peak) of every dot inside a fused computation and the fusions it nests."""
        flops = seconds = 0.0
        for inst in self.computations.get(computation, ()):
            if inst.op == "dot":
                f, peak = self.dot_cost(inst)
                flops, seconds = flops + f, seconds + f / peak
            for _, called in called_computations(inst):
                f, s = self.fused_matmul_seconds(called)
                flops, seconds = flops + f, seconds + s
        return flops, seconds

    def fusion_bytes(self, inst: Instruction, computation: str) -> float:
        """Bytes a fusion reads and writes: its operands (an operand it only slices: the slices) and its result (a
        dynamic-update-slice root: the update, the buffer being written in place)."""
        body = self.computations.get(computation, ())
        params = {int(i.args.strip()): i for i in body if i.op == "parameter"}
        users: dict[str, list[Instruction]] = defaultdict(list)
        for i in body:
            for o in operand_names(i):
                users[o].append(i)
        root = next((i for i in body if i.root), None)
        in_place, written = set(), None
        outs = [] if root is None else [root] if root.op != "tuple" else [self.by_name.get(o)
                                                                         for o in operand_names(root)]
        if outs and all(o is not None and o.op == "dynamic-update-slice" for o in outs):
            written = 0.0
            for o in outs:
                target, update = operand_names(o)[:2]
                in_place.add(self._through_bitcasts(target))
                written += _bytes(self.by_name[update].shape)
        total = _bytes(inst.shape) if written is None else written
        for k, name in enumerate(operand_names(inst)):
            param = params.get(k)
            if param is not None and param.name in in_place:
                continue
            sliced = self._slices_only(param.name, users) if param is not None else None
            total += sliced if sliced is not None else _bytes(self.by_name[name].shape)
        return total

    def _through_bitcasts(self, name: str) -> str:
        inst = self.by_name.get(name)
        while inst is not None and inst.op == "bitcast":
            name = operand_names(inst)[0]
            inst = self.by_name.get(name)
        return name

    def _slices_only(self, name: str, users: dict[str, list[Instruction]]) -> float | None:
        """Bytes of the slices taken of `name` when every use of it (through bitcasts) slices it, else None."""
        total = 0.0
        for user in users.get(name, ()):
            if user.op == "bitcast":
                inner = self._slices_only(user.name, users)
                if inner is None:
                    return None
                total += inner
            elif user.op in SLICES and operand_names(user)[0] == name:
                total += _bytes(user.shape)
            else:
                return None
        return total if users.get(name) else None

    def moved(self, inst: Instruction) -> float:
        """Bytes an unfused instruction reads and writes: its operands and its result."""
        return _bytes(inst.shape) + sum(_bytes(self.by_name[o].shape) for o in operand_names(inst)
                                        if o in self.by_name)

    def custom_call(self, inst: Instruction, count: int) -> Kernel:
        """A cuBLAS GEMM, cuDNN's fused attention, or another library call (costed by its bytes)."""
        target = CUSTOM_CALL.search(inst.attrs)
        target = target.group(1) if target else ""
        ops = operand_names(inst)
        moved = self.moved(inst)
        if CUBLAS.match(target):
            elements = math.prod(_dims(inst.shape))  # the first array of (result, workspace)
            contracting = _GEMM_CONTRACTING.search(inst.attrs)
            lhs = _dims(self.by_name[ops[0]].shape)
            size = math.prod(lhs[int(i.strip('" '))] for i in contracting.group(1).split(",") if i.strip()) \
                if contracting else 1
            flops = 2.0 * elements * size
            peak = _peak(self.gpu, [_dtype(self.by_name[o].shape) for o in ops[:2]], inst.attrs)
            return Kernel(inst.name, "matmul", flops, moved, max(flops / peak, moved / self.gpu.hbm), count)
        if FMHA.match(target):
            flops = self.attention_flops(inst, target)
            return Kernel(inst.name, "attention", flops, moved,
                          max(flops / self.gpu.bf16_flops, moved / self.gpu.hbm), count)
        return Kernel(inst.name, "memory", 0.0, moved, moved / self.gpu.hbm, count)

    def attention_flops(self, inst: Instruction, target: str) -> float:
        """cuDNN fused attention's matmul FLOPs: 2 matmuls (forward) or 5 (backward) x 2 x head_dim per visible
        (query, key) pair, batch x heads x queries x the mean keys a query sees."""
        from olmo3eqx.flops import mean_keys

        dims = _INTERMEDIATE.search(inst.attrs)
        q = _dims(self.by_name[operand_names(inst)[0]].shape)
        if dims is None or not q:
            return 0.0
        batch, heads, queries, keys = (int(d.strip('" ')) for d in dims.group(1).split(","))
        mask = _MASK.search(inst.attrs)
        window = _WINDOW.search(inst.attrs)
        if mask is not None and "CAUSAL" in mask.group(1):
            seen = mean_keys(keys, int(window.group(1)) if window and int(window.group(1)) > 0 else None)
        else:
            seen = keys
        matmuls = 5 if "Backward" in target else 2
        return matmuls * 2.0 * batch * heads * queries * seen * q[-1]

    def kernels(self, computation: str, count: int) -> list[Kernel]:
        """Every kernel `computation` launches, with its runs per step (`count` runs of the computation)."""
        out: list[Kernel] = []
        for inst in self.computations.get(computation, ()):
            op = inst.op
            if op in FREE or op.startswith(COMMUNICATION) or op.endswith("-done"):
                continue
            called = dict(called_computations(inst))
            if op == "while":
                trips = trip_count(inst, self.computations, self.by_name)
                if trips is None:
                    self.unknown_loops += 1
                out += self.kernels(called["body"], count * (trips or 1))
            elif op == "conditional":
                branches = [self.kernels(c, count) for role, c in called_computations(inst)
                            if role in ("branch", "true_computation", "false_computation")]
                out += max(branches, key=lambda ks: sum(k.seconds * k.count for k in ks), default=[])
            elif op in ("call", "async-start"):
                out += self.kernels(called.get("calls") or called.get("to_apply", ""), count)
            elif op == "fusion":
                flops, matmul_s = self.fused_matmul_seconds(called["calls"])
                moved = self.fusion_bytes(inst, called["calls"])
                out.append(Kernel(inst.name, "matmul" if flops else "memory", flops, moved,
                                  max(matmul_s, moved / self.gpu.hbm), count))
            elif op == "custom-call":
                out.append(self.custom_call(inst, count))
            elif op == "dot":
                flops, peak = self.dot_cost(inst)
                moved = self.moved(inst)
                out.append(Kernel(inst.name, "matmul", flops, moved, max(flops / peak, moved / self.gpu.hbm), count))
            else:  # copies, unfused slices and updates, sorts...: memory-bound
                moved = (2 * _bytes(self.by_name[operand_names(inst)[1]].shape) if op == "dynamic-update-slice"
                         else self.moved(inst))  # an update in place reads and writes the update
                out.append(Kernel(inst.name, "memory", 0.0, moved, moved / self.gpu.hbm, count))
        return out


def estimate(hlo_text: str, gpu: Gpu, tokens_per_device: int = 0, model_flops: float = 0.0, mesh=None,
             granules=None) -> Estimate:
    """The estimated step of the XLA:GPU program `hlo_text` (compiled.as_text()) on `gpu` (see the module doc);
    `mesh` and `granules` (each device's node, shaped like mesh.devices): where its collectives run (None: a program
    without collectives, or one GPU); `tokens_per_device` and `model_flops` (per GPU and step) give the tokens/s and
    the MFU it implies."""
    program = _Program(hlo_text, gpu)
    kernels = tuple(program.kernels(program.entry, 1))
    within = across = 0.0
    if mesh is not None:
        traffic = collectives.account(hlo_text, mesh, granules)
        within, across = traffic.total(False), traffic.total(True)
    return Estimate(gpu, kernels, within, across, tokens_per_device, model_flops, program.unknown_loops)


def estimate_step(cfg, layout, compiled, gpu: Gpu | None = None) -> Estimate:
    """The estimate of `cfg`'s train step compiled over `layout` for compile-only GPUs (olmo3eqx.aot): the program,
    its collectives over the layout's mesh and nodes, and the model FLOPs of its tokens; `gpu` defaults to the
    mesh's device kind (gpu_for)."""
    from olmo3eqx import flops
    from olmo3eqx.sharding import granules_of

    device = layout.mesh.devices.flat[0]
    gpu = gpu or gpu_for(device.device_kind)
    seq = cfg.data.seq_len
    tokens = layout.tokens_per_device(seq)
    return estimate(compiled.as_text(), gpu, tokens, flops.train_flops_per_token(cfg.model, seq) * tokens,
                    layout.mesh, granules_of(layout.mesh, cfg.mesh.node_devices))
