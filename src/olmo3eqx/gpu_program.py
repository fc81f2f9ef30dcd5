"""What a program XLA:GPU compiled holds, read from its text (`compiled.as_text()`): which kernel each attention runs
and which GEMMs run in FP8. olmo3eqx.aot prints it for a GPU target; tests and benches read it the same way.

- Attention. Each layer kind's attention is traced under a named scope (model.SLIDING_SCOPE, GLOBAL_SCOPE), so its
  instructions carry it in their op_name. In that scope the program holds one of: cuDNN's fused attention (custom
  calls `__cudnn$fmha...`: forward and backward, with the mask type and sliding window cuDNN was configured with),
  a Pallas kernel (Triton custom calls `__gpu$xla.gpu.triton`, the kernel's name), our flash (olmo3eqx.flash: XLA's
  own fusions in loops over key blocks), or XLA's own attention (fused dots and a softmax, no loop).
- GEMMs. A matrix multiply runs as a cuBLAS or cuBLASLt custom call (`__cublas$gemm`, `__cublas$lt$matmul`,
  `__cublas$lt$matmul$f8`), a Triton GEMM fusion (`__triton_gemm`, `__triton_nested_gemm_fusion`) or a cuDNN GEMM
  fusion; FP8 when its first two operands are f8 types. Counts are of the program's instructions: a loop body (the
  layer scan, the micro-batches) counts once.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass

from olmo3eqx.model import GLOBAL_SCOPE, SLIDING_SCOPE

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)$", re.M)
TARGET = re.compile(r'custom_call_target="([^"]+)"')
OP_NAME = re.compile(r'op_name="([^"]*)"')
FUSION_KIND = re.compile(r'"fusion_backend_config":\{"kind":"([^"]+)"')
OPERANDS = re.compile(r"(?:custom-call|fusion)\((.*?)\), (?:custom_call_target|kind)=")
SHAPE_DTYPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[")
CUDNN_ATTENTION = "__cudnn$fmha"
TRITON_CALL = "__gpu$xla.gpu.triton"
CUBLAS = {"__cublas$gemm": "cuBLAS", "__cublas$lt$matmul": "cuBLASLt", "__cublas$lt$matmul$f8": "cuBLASLt"}
TRITON_GEMMS = {"__triton_gemm": "Triton GEMM", "__triton_nested_gemm_fusion": "Triton GEMM",
                "__cudnn$fusion": "cuDNN GEMM fusion"}
FP8 = ("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e3m4", "f8e8m0fnu")
SCOPES = ((SLIDING_SCOPE, "sliding"), (GLOBAL_SCOPE, "global"))


@dataclass(frozen=True)
class Attention:
    """One layer kind's attention as the program holds it."""

    layers: str
    """"sliding" or "global"."""
    kernel: str
    """"cudnn", "pallas", "flash" or "xla"."""
    forward: int = 0
    backward: int = 0
    """cuDNN's or Pallas's calls (forward, backward) in the program."""
    masks: tuple[str, ...] = ()
    """cuDNN: the mask type and window each call was configured with ("CAUSAL, window 4096"); Pallas: kernel names."""

    def line(self) -> str:
        what = {"cudnn": "cuDNN fused attention", "pallas": "a Pallas kernel (Triton)",
                "flash": "our flash (olmo3eqx.flash: XLA fusions in loops over key blocks)",
                "xla": "XLA's own attention (fused dots and softmax)"}[self.kernel]
        calls = f": {self.forward} forward, {self.backward} backward calls" if self.forward or self.backward else ""
        masks = f" ({'; '.join(self.masks)})" if self.masks else ""
        return f"{self.layers} layers: {what}{calls}{masks}"


@dataclass(frozen=True)
class Program:
    """The attention kernels and GEMMs of one compiled GPU program."""

    attention: tuple[Attention, ...]
    gemms: dict[tuple[str, str], int]
    """(engine, operand dtypes "bf16 x bf16") -> instructions."""

    @property
    def fp8_gemms(self) -> int:
        return sum(n for (_, dtypes), n in self.gemms.items() if any(d in FP8 for d in dtypes.split(" x ")))

    def lines(self) -> list[str]:
        out = [f"attention kernel:      {a.line()}" for a in self.attention] or [
            "attention kernel:      none found in the program"]
        gemms = ", ".join(f"{n} {engine} ({dtypes})" for (engine, dtypes), n in sorted(self.gemms.items()))
        out.append(f"GEMMs:                 {gemms or 'none'}; FP8: {self.fp8_gemms} "
                   f"(instructions in the program, each loop body once)")
        return out


def instructions(text: str) -> list[tuple[str, str]]:
    """(name, the rest of the line) of every instruction of every computation."""
    return INSTRUCTION.findall(text)


def operand_dtypes(rest: str, text_by_name: dict[str, str]) -> str:
    """The dtypes of a call's first two operands, as "bf16 x bf16", read from the operands' own definitions."""
    found = OPERANDS.search(rest)
    names = re.findall(r"%([\w.\-]+)", found.group(1)) if found else []
    inline = SHAPE_DTYPE.findall(found.group(1)) if found else []
    dtypes = inline[:2] if len(inline) >= 2 else [
        (SHAPE_DTYPE.match(text_by_name.get(n, "")) or [None, "?"])[1] for n in names[:2]]
    return " x ".join(dtypes)


def cudnn_mask(rest: str) -> str:
    """cuDNN's mask configuration of one fused-attention call: its mask type and sliding window."""
    config = re.search(r"backend_config=(\{.*\})\s*$", rest)
    try:
        fmha = json.loads(config.group(1))["cudnn_fmha_backend_config"] if config else {}
    except (json.JSONDecodeError, KeyError):
        return "configuration unread"
    window = int(fmha.get("sliding_window_length", 0) or 0)
    return fmha.get("mask_type", "NO_MASK") + (f", window {window}" if window else "")


def read(text: str) -> Program:
    """The attention kernels and GEMMs of the compiled program `text` (module doc)."""
    found = instructions(text)
    by_name = {name: rest for name, rest in found}
    scoped: dict[str, list[tuple[str, str]]] = {scope: [] for scope, _ in SCOPES}
    gemms: Counter = Counter()
    loops = set()
    for name, rest in found:
        op = OP_NAME.search(rest)
        for scope, _ in SCOPES:
            if op and scope in op.group(1):
                scoped[scope].append((name, rest))
        target = TARGET.search(rest)
        if target and target.group(1) in CUBLAS:
            gemms[(CUBLAS[target.group(1)], operand_dtypes(rest, by_name))] += 1
        kind = FUSION_KIND.search(rest)
        if kind and kind.group(1) in TRITON_GEMMS:
            gemms[(TRITON_GEMMS[kind.group(1)], operand_dtypes(rest, by_name))] += 1
        if " while(" in rest:
            loops.add(name)
    attention = []
    for scope, layers in SCOPES:
        held = scoped[scope]
        if not held:
            continue
        targets = [(TARGET.search(rest), rest) for _, rest in held]
        cudnn = [(t.group(1), rest) for t, rest in targets if t and t.group(1).startswith(CUDNN_ATTENTION)]
        triton = [rest for t, rest in targets if t and t.group(1) == TRITON_CALL]
        if cudnn:
            backward = sum("Backward" in t for t, _ in cudnn)
            masks = tuple(sorted({cudnn_mask(rest) for _, rest in cudnn}))
            attention.append(Attention(layers, "cudnn", len(cudnn) - backward, backward, masks))
        elif triton:
            names = tuple(sorted({m.group(1) for r in triton if (m := re.search(r'"name":\s*"([^"]+)"', r))}))
            backward = sum("bwd" in n or "backward" in n for n in names)
            attention.append(Attention(layers, "pallas", len(triton) - backward, backward, names))
        else:
            kernel = "flash" if any(name in loops for name, _ in held) else "xla"
            attention.append(Attention(layers, kernel))
    return Program(tuple(attention), dict(gemms))
