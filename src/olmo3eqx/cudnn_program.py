"""cuDNN's fused-attention calls read from a compiled XLA:GPU program (`compiled.as_text()`): which kernel each is
and the mask configuration XLA hands cuDNN, from the custom call's target, operand shapes and backend_config (the
proto jax's cuDNN call fills: mask_type, sliding_window_length, max_seg_per_batch). What a compile proves: which
kernel and mask run, not that they compute what was meant (tests/test_cudnn_context.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

TARGET = re.compile(r'custom_call_target="(__cudnn\$fmha[A-Za-z]*)"')
OPERANDS = re.compile(r"operand_layout_constraints=\{(.*?)\}, api_version")
SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclass(frozen=True)
class CudnnAttention:
    """One cuDNN fused-attention custom call: `backward` its gradient kernel; `mask` cuDNN's mask type (NO_MASK,
    PADDING, CAUSAL, PADDING_CAUSAL, ALIBI); `window` the sliding window in keys (None: none); `runs` the document
    runs per row of the packed layout (1: not packed); `lengths`, `offsets`: whether sequence lengths and packed
    offsets are passed; `q`, `kv`: the query and key shapes [batch, seq, heads, dim]."""

    target: str
    backward: bool
    mask: str
    window: int | None
    runs: int
    lengths: bool
    offsets: bool
    q: tuple[int, ...]
    kv: tuple[int, ...]

    @property
    def key(self) -> tuple[str, int | None, bool]:
        """(mask, window, packed): what tells the calls of a layer apart."""
        return self.mask, self.window, self.runs > 1


def cudnn_attentions(program: str) -> list[CudnnAttention]:
    """Every cuDNN fused-attention call in `program` (an HLO module's text), in program order."""
    found = []
    for line in program.splitlines():
        target = TARGET.search(line)
        operands = OPERANDS.search(line)
        at = line.find("backend_config=")
        if target is None or operands is None or at < 0:
            continue
        config = json.JSONDecoder().raw_decode(line, at + len("backend_config="))[0]["cudnn_fmha_backend_config"]
        shapes = [(dtype, tuple(int(n) for n in dims.split(",") if n)) for dtype, dims in
                  SHAPE.findall(operands.group(1))]
        ints = sum(dtype == "s32" for dtype, _ in shapes)  # q/kv lengths, then q/kv offsets
        window = int(config.get("sliding_window_length", 0))
        found.append(CudnnAttention(target=target.group(1), backward="Backward" in target.group(1),
                                    mask=config["mask_type"], window=window or None,
                                    runs=int(config.get("max_seg_per_batch", 1)), lengths=ints >= 2,
                                    offsets=ints >= 4, q=shapes[0][1], kv=shapes[1][1]))
    return found
