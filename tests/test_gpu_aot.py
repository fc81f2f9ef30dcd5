"""The train step compiled by XLA:GPU for GPU nodes that are not here (`train.py --dry-run --target h100x8`,
olmo3eqx.aot with jax's CUDA plugin, the `gpu-compile` extra) and the reading of the compiled GPU program
(olmo3eqx.gpu_program).

The compile tests are `-m gpu_small` (tiny models on 8 and 16 compile-only H100s; CI runs them after installing the
plugin): XLA:GPU itself is the reference for the memory, the kernels and the collectives they print."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from olmo3eqx import aot, gpu_program
from olmo3eqx.train import main

needs_plugin = pytest.mark.skipif(not aot.cuda_plugin(),
                                  reason="jax's CUDA plugin is not installed (pip install -e '.[gpu-compile]')")
TINY = ["--dry-run", "--model.num-hidden-layers", "4", "--model.compute-dtype", "bfloat16"]


@pytest.fixture
def restored_env(monkeypatch):
    """train.py sets JAX's variables for the compile; restored afterwards."""
    for name in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)


@needs_plugin
@pytest.mark.gpu_small
def test_tiny_model_on_one_h100_node(capsys, restored_env):
    """8 compile-only H100s: XLA:GPU's memory against the H100's, cuDNN's fused attention named for each layer kind
    with the window cuDNN was configured with, the GEMMs (none FP8), the step time estimated from the program, the
    collectives over NVLink only."""
    assert main([*TINY, "--target", "h100x8"]) == 0
    out = capsys.readouterr().out
    assert "devices:               8 x NVIDIA H100 80GB HBM3 (topology h100x8)" in out
    assert "compile-only devices of jax's CUDA plugin: XLA:GPU compiles the step here" in out
    assert re.search(r"compiled step memory per device \(XLA:GPU\): [\d.]+ GiB \(arguments [\d.]+, outputs [\d.]+, "
                     r"aliased [\d.]+, temporaries [\d.]+\); GPU memory 79\.11 GiB: fits with [\d.]+ GiB to spare", out)
    assert re.search(r"sliding layers: cuDNN fused attention: \d+ forward, \d+ backward calls \(CAUSAL, window 64\)",
                     out)
    assert re.search(r"global layers: cuDNN fused attention: \d+ forward, \d+ backward calls \(CAUSAL\)\n", out)
    assert re.search(r"GEMMs: .*bf16 x bf16.*; FP8: 0 ", out)
    assert re.search(r"estimated step time: +[\d.]+ s per step, [\d,]+ tokens/s per GPU, implied MFU [\d.]+% \(an "
                     r"ESTIMATE from XLA:GPU's compiled program", out)
    assert re.search(r"all-gather +bf16 +fsdp +NVLink \(node\)", out) and "network (nodes)   " not in out
    assert re.search(r"compile time: +[\d.]+ s", out)


@needs_plugin
@pytest.mark.gpu_small
def test_tiny_model_on_two_h100_nodes(capsys, restored_env):
    """16 compile-only H100s in 2 nodes, data across them: the gradients' all-reduce over data crosses the network,
    the weights' gathers stay on NVLink; cuDNN's attention compiles inside the step's per-replica region (data
    manual: olmo3eqx.attention.per_shard)."""
    assert main([*TINY, "--target", "2xh100x8", "--mesh.data", "2"]) == 0
    out = capsys.readouterr().out
    assert "devices:               16 x NVIDIA H100 80GB HBM3 (topology 2xh100x8)" in out
    assert "mesh:                  {'data': 2, 'fsdp': 8, 'tensor': 1}" in out
    assert "GPU memory 79.11 GiB: fits" in out and "cuDNN fused attention" in out
    assert re.search(r"all-gather +bf16 +fsdp +NVLink \(node\) ", out)
    assert re.search(r"all-reduce +f32 +data +network \(nodes\) ", out)


@needs_plugin
@pytest.mark.gpu_small
def test_bad_gpu_targets_are_one_sentence(capsys, restored_env):
    """A GPU this project does not describe, and a mesh whose fsdp axis would span the network."""
    assert main([*TINY, "--target", "a100x8"]) == 2
    assert "--target a100x8 names no GPU described here; name one of h100, h200, b200" in capsys.readouterr().err
    assert main([*TINY, "--target", "2xh100x8"]) == 2
    assert "mesh.fsdp=16 would span 2 nodes of 8 devices" in capsys.readouterr().err


def test_gpu_descriptions_are_package_data():
    """Each target's description names its GPU, memory and source; b200 is a target."""
    for target, kind, gib in (("h100x8", "NVIDIA H100 80GB HBM3", 79.11), ("h200x8", "NVIDIA H200 141GB HBM3e", 141.0),
                              ("4xb200x8", "NVIDIA B200", 178.36)):
        node = aot.gpu_node(target)
        assert node.device_kind == kind and round(node.hbm / aot.GIB, 2) == gib
        assert "openxla/xla" in node.description() and "collective_memory_granularity:" not in node.description()
    assert aot.gpu_node("4xb200x8").nodes == 4 and aot.gpu_node("v5p:2x2x1") is None


PROGRAM = """\
%fused_computation (param_0: f8e4m3fn[64,32]) -> f8e4m3fn[64,32] {
  ROOT %param_0 = f8e4m3fn[64,32]{1,0} parameter(0)
}

ENTRY %main (a: f8e4m3fn[16,64], b: f8e4m3fn[64,32], c: bf16[16,64], d: bf16[64,32]) -> bf16[16,32] {
  %a = f8e4m3fn[16,64]{1,0} parameter(0)
  %b = f8e4m3fn[64,32]{1,0} parameter(1)
  %c = bf16[16,64]{1,0} parameter(2)
  %d = bf16[64,32]{1,0} parameter(3)
  %fp8 = (bf16[16,32]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(f)/dot_general"}
  %gemm = (bf16[16,32]{1,0}, s8[0]{0}) custom-call(%c, %d), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/dot_general"}
  %fwd = (bf16[1,4,16,8]{3,2,1,0}, f32[1,4,16]{2,1,0}) custom-call(%c, %d), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(f)/jvp(sliding_attention)/dot_product_attention"}, backend_config={"cudnn_fmha_backend_config": {"mask_type": "CAUSAL", "sliding_window_length": 4096}}
  ROOT %out = bf16[16,32]{1,0} fusion(%c, %d), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(f)/global_attention/exp"}
}
"""


def test_program_reader_counts_fp8_gemms_and_names_kernels():
    """gpu_program.read on a small program in XLA:GPU's text form: an FP8 cuBLASLt GEMM (its operands' dtypes read
    from their definitions), a bf16 cuBLAS GEMM, cuDNN's attention with its mask for the sliding layers, and XLA's
    own fusions (no loop) for the global ones."""
    program = gpu_program.read(PROGRAM)
    assert program.gemms == {("cuBLASLt", "f8e4m3fn x f8e4m3fn"): 1, ("cuBLAS", "bf16 x bf16"): 1}
    assert program.fp8_gemms == 1
    assert [a.line() for a in program.attention] == [
        "sliding layers: cuDNN fused attention: 1 forward, 0 backward calls (CAUSAL, window 4096)",
        "global layers: XLA's own attention (fused dots and softmax)"]


REPO = Path(__file__).resolve().parents[1]
DOCUMENTED = re.compile(r"python train\.py [^`\n#|]*--target (?:[0-9]+x)?(?:h100|h200|b200)x[0-9]+[^`\n#|]*")


def documented_gpu_commands() -> list[str]:
    """Every `python train.py ... --target <GPU nodes> ... --dry-run` the README and docs/ print, once each."""
    found = {}  # the same flags in another order are the same command
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for command in DOCUMENTED.findall(path.read_text()):
            if "--dry-run" in command:
                found.setdefault(tuple(sorted(shlex.split(command))), " ".join(command.split()))
    return list(found.values())


@needs_plugin
@pytest.mark.slow  # each a 7B compiled by XLA:GPU: 40 s to minutes on 2 cores
@pytest.mark.parametrize("command", documented_gpu_commands())
def test_documented_gpu_recipe_fits(command):
    """Each GPU recipe the docs print, compiled by XLA:GPU as its own process: memory from XLA:GPU and a fit."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    done = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"compiled step memory per device \(XLA:GPU\): [\d.,]+ GiB .*: fits with", done.stdout), \
        done.stdout[-3000:]
