"""Ahead-of-time compiles for TPU topologies that are not here (olmo3eqx.aot, `train.py --dry-run --target`), and
what train.py tells JAX before it starts (olmo3eqx.jaxenv): CPU only on a host without accelerators, XLA's GPU
flags on NVIDIA hosts.

The TPU tests need libtpu (the `tpu` extra) and skip without it; XLA:TPU itself is the reference: its own
out-of-memory message for the HBM table, its memory and cost analyses for the compiled step."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from olmo3eqx import aot, jaxenv
from olmo3eqx.config import ConfigError, MeshConfig, load_yaml
from olmo3eqx.train import main

REPO = Path(__file__).resolve().parents[1]
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu]')")


def run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_gpu_flags_are_known_to_this_xla():
    """XLA aborts on a flag it does not know; the GPU flags start it cleanly (and an unknown one does not)."""
    code = "import jax, jax.numpy as jnp; print(jax.jit(lambda x: x + 1)(jnp.ones(2)).sum())"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(jaxenv.GPU_XLA_FLAGS)}
    ok = run_python(code, env)
    assert ok.returncode == 0 and ok.stdout.strip() == "4.0", ok.stderr
    bad = run_python(code, {**env, "XLA_FLAGS": env["XLA_FLAGS"] + " --xla_gpu_no_such_flag=true"})
    assert bad.returncode != 0 and "Unknown flag" in bad.stderr


def test_tpu_flags_by_chip_and_setting():
    ironwood = jaxenv.tpu_flags("auto", "TPU7x", {})
    assert ironwood["xla_tpu_enable_sparse_core_collective_offload_reduce_scatter"] == "true"
    assert ironwood["xla_tpu_scoped_vmem_limit_kib"] == "65536" and len(ironwood) == len(jaxenv.IRONWOOD_XLA_FLAGS)
    assert jaxenv.tpu_flags("auto", "TPU v5", {})["xla_tpu_enable_async_collective_fusion_fuse_all_gather"] == "true"
    assert jaxenv.tpu_flags("auto", "TPU v5 lite", {}) == {} and jaxenv.tpu_flags("auto", "cpu", {}) == {}
    assert jaxenv.tpu_flags("none", "TPU7x", {}) == {}
    assert jaxenv.tpu_flags("--xla_a=1 --xla_b=x", "TPU v5", {}) == {"xla_a": "1", "xla_b": "x"}
    assert jaxenv.tpu_flags("auto", "TPU7x", {"LIBTPU_INIT_ARGS": "--xla_x=1"}) == {}  # the user's flags instead
    jaxs = {"LIBTPU_INIT_ARGS": " " + " ".join(jaxenv.JAX_LIBTPU_FLAGS)}  # what `import jax` adds on a TPU VM
    assert jaxenv.tpu_flags("auto", "TPU v5", jaxs) == jaxenv.tpu_flags("auto", "TPU v5", {}) != {}
    assert jaxenv.tpu_flags("--xla_a=1", "TPU v5", {"LIBTPU_INIT_ARGS": "--xla_x=1"}) == {"xla_a": "1"}
    with pytest.raises(ConfigError, match=r"mesh.tpu_flags must be .*'xla_a=1' is not --name=value"):
        MeshConfig(tpu_flags="xla_a=1")


def test_prepare_decides_platforms_and_gpu_flags():
    cpu_host = {}
    assert jaxenv.prepare(cpu_host) is None and cpu_host == {"JAX_PLATFORMS": "cpu"}
    chosen = {"JAX_PLATFORMS": "tpu"}
    assert jaxenv.prepare(chosen) is None and chosen == {"JAX_PLATFORMS": "tpu"}
    gpu = {"JAX_PLATFORMS": "cuda"}
    note = jaxenv.prepare(gpu)
    assert gpu["XLA_FLAGS"] == " ".join(jaxenv.GPU_XLA_FLAGS) and "latency_hiding_scheduler" in gpu["XLA_FLAGS"]
    assert note.startswith("XLA GPU flags") and gpu["XLA_FLAGS"] in note
    own = {"JAX_PLATFORMS": "cuda,cpu", "XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    note = jaxenv.prepare(own)
    assert own["XLA_FLAGS"] == "--xla_dump_to=/tmp/x" and "set by the user" in note and "not applied" in note



def test_float32_models_get_full_precision_matmuls_on_accelerators_only():
    """A float32 model on a GPU or TPU host gets JAX_DEFAULT_MATMUL_PRECISION=highest (JAX's default is TF32 on GPUs:
    the default run moved 0.03 nats against the CPU, bench/measured/h200-2026-12-04); a CPU host, a bfloat16 model or
    the user's own setting is left alone."""
    for platforms in ("cuda", "tpu"):
        env = {"JAX_PLATFORMS": platforms}
        jaxenv.prepare(env)
        assert "highest" in jaxenv.float32_matmuls(env, "float32") and env["JAX_DEFAULT_MATMUL_PRECISION"] == "highest"
    cpu = {}
    jaxenv.prepare(cpu)
    assert jaxenv.float32_matmuls(cpu, "float32") is None and "JAX_DEFAULT_MATMUL_PRECISION" not in cpu
    bf16 = {"JAX_PLATFORMS": "cuda"}
    assert jaxenv.float32_matmuls(bf16, "bfloat16") is None and "JAX_DEFAULT_MATMUL_PRECISION" not in bf16
    own = {"JAX_PLATFORMS": "cuda", "JAX_DEFAULT_MATMUL_PRECISION": "tensorfloat32"}
    assert jaxenv.float32_matmuls(own, "float32") is None and own["JAX_DEFAULT_MATMUL_PRECISION"] == "tensorfloat32"


@pytest.mark.skipif(jaxenv.nvidia_gpu_host({}) or os.path.exists("/dev/accel0"), reason="an accelerator host")
def test_cpu_host_with_libtpu_starts_quietly_on_cpu():
    """JAX_PLATFORMS unset on a CPU host: after prepare, JAX starts the CPU backend only, without libtpu's warnings."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = ("import os; from olmo3eqx import jaxenv; jaxenv.prepare(os.environ); import jax; "
            "print(os.environ['JAX_PLATFORMS'], [d.platform for d in jax.devices()])")
    out = run_python(code, env)
    assert out.returncode == 0 and out.stdout.split() == ["cpu", "['cpu']"], out.stderr
    assert "TPU" not in out.stderr


def test_target_without_dry_run_and_unknown_names_are_one_sentence(capsys, monkeypatch):
    assert main(["--target", "v5p:2x2x1", "--steps", "1"]) == 2
    assert "add --dry-run" in capsys.readouterr().err
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else None)
    with pytest.raises(ConfigError, match=r"needs libtpu: pip install -e \"\.\[tpu\]\""):
        aot.topology_devices("v5p:2x2x1")


@needs_libtpu
def test_unknown_topology_is_named(capsys):
    assert main(["--dry-run", "--target", "v7x:2x2x1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Unknown TPU topology 'v7x:2x2x1'" in err and "tpu7x:4x4x4" in err


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2", "v4:2x2x1", "v5p:2x2x1", "tpu7x:2x2x1"])
def test_hbm_table_is_what_the_compiler_says(topology):
    """A program of 1 TiB per device: XLA:TPU refuses it and names the HBM available per device."""
    device = aot.topology_devices(topology)[0]
    big = jax.ShapeDtypeStruct((2**18, 2**20), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    with pytest.raises(jax.errors.JaxRuntimeError, match="exceeds available HBM") as err:
        jax.jit(lambda x: (x * 2).sum(axis=0)).lower(big).compile()
    available = float(re.search(r"available HBM \(([\d.]+)G\)", str(err.value)).group(1))
    assert aot.hbm_bytes(device.device_kind) == pytest.approx(available * aot.GIB)


def test_dry_run_on_this_host(capsys):
    """The plain dry run: this host's devices, the resolved attention, XLA's memory and FLOPs, the compile time."""
    assert main(["--dry-run", "--model.num-hidden-layers", "2", "--data.seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert f"devices:               {jax.device_count()} x cpu" in out and "attention:             blocked" in out
    assert "compiled step memory per device:" in out and "HBM" not in out  # no HBM figure for a CPU
    assert "compiled FLOPs:" in out and "compile time:" in out
    assert "collectives per step:" in out and re.search(r"all-gather +f32 +fsdp +within node/slice", out)
    assert "remat:                 dots\n" in out
    small = ["--dry-run", "--model.num-hidden-layers", "2", "--data.seq-len", "64"]
    assert main([*small, "--model.remat-by-chip", "v5p=full", "cpu=save_qkv_proj"]) == 0
    by_chip = capsys.readouterr().out
    assert "remat:                 save_qkv_proj (model.remat_by_chip: cpu)" in by_chip
    assert main([*small, "--model.remat", "save_qkv_proj"]) == 0  # the step compiled is the chip's policy's
    assert number_after(by_chip, "compiled FLOPs:") == number_after(capsys.readouterr().out, "compiled FLOPs:")
    assert number_after(by_chip, "compiled FLOPs:") != number_after(out, "compiled FLOPs:")  # not dots


@pytest.mark.slow  # ~20 s: test_collectives and test_accumulation compile multi-node plans in the default suite
def test_dry_run_plans_a_gpu_node(capsys, monkeypatch):
    """`--target h100x8`: a float32 model's packed documents get flash (cuDNN has no float32 kernel; bf16 would take
    cuDNN's packed layout), the 8 simulated devices stand for the node, memory is judged against an H100's; h200x4
    takes the first 4; more GPUs than devices is one sentence; 2xh100x4 plans two nodes of 4 (a mesh crossing
    them refused)."""
    for name in ("XLA_FLAGS", "JAX_PLATFORMS"):  # train.py asks for simulated devices there: restored afterwards
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.setattr(aot, "cuda_plugin", lambda: False)  # the plan without jax's CUDA plugin
    flags = ["--dry-run", "--model.num-hidden-layers", "2", "--data.seq-len", "256", "--data.packing"]
    assert main([*flags, "--target", "h100x8"]) == 0
    out = capsys.readouterr().out
    assert "attention:             flash, blocks 256 x 256 (documents masked)" in out
    assert ("GPU node plan:         8 x NVIDIA H100 80GB HBM3 (79.11 GiB each) on 8 simulated CPU devices: XLA:CPU's "
            "memory stands in for XLA:GPU's, which needs jax's CUDA plugin: pip install -e \".[gpu-compile]\"") in out
    assert "mesh:                  {'data': 1, 'fsdp': 8, 'tensor': 1}" in out
    assert re.search(r"HBM 79\.11 GiB: fits with [\d.]+ GiB to spare", out)
    assert main([*flags, "--target", "h200x4"]) == 0
    out = capsys.readouterr().out
    assert "4 x NVIDIA H200 141GB HBM3e (141.00 GiB each)" in out and "HBM 141.00 GiB" in out
    assert main([*flags, "--target", "h100x16"]) == 2
    assert "plans on 16 simulated devices but JAX has 8" in capsys.readouterr().err
    # Two nodes of 4: fsdp over all 8 would cross the network (refused); HSDP, data across the nodes, is planned.
    assert main([*flags, "--target", "2xh100x4"]) == 2
    assert "mesh.fsdp=8 would span 2 nodes of 4 devices" in capsys.readouterr().err
    assert main([*flags, "--target", "2xh100x4", "--mesh.data", "2"]) == 0
    out = capsys.readouterr().out
    assert ("GPU node plan:         2 nodes of 4, data across nodes and fsdp/tensor within (mesh.node_devices=4): "
            "8 x NVIDIA H100 80GB HBM3 (79.11 GiB each) on 8 simulated CPU devices") in out
    assert "mesh:                  {'data': 2, 'fsdp': 4, 'tensor': 1}" in out and "  node_devices: 4\n" in out


def number_after(text: str, label: str) -> float:
    return float(re.search(re.escape(label) + r"\s*([\d.,]+)", text).group(1).replace(",", ""))


@needs_libtpu
@pytest.mark.tpu
@pytest.mark.tpu_small
def test_tiny_dry_run_for_a_tpu_topology(capsys):
    """The default config compiled for 4 TPU v5e chips: splash attention, memory against the HBM, and XLA's FLOPs
    equal to flops.py's count less the attention (the tiny step has no loop; splash kernels count 0 in XLA). The
    compile-only topology's compiles leave the suite's persistent cache alone (compile_cache.compile_only): JAX could not load
    such an entry back."""
    cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    before = set(os.listdir(cache))
    assert main(["--dry-run", "--target", "v5e:2x2"]) == 0
    written = sorted(set(os.listdir(cache)) - before)
    assert not [name for name in written if name.startswith(("jit_train_step", "jit_body"))], written
    out = capsys.readouterr().out
    assert "devices:               4 x TPU v5 lite (topology v5e:2x2)" in out
    assert "attention:             splash, blocks 256 x 256" in out
    assert re.search(r"HBM 15\.75 GiB: fits with [\d.]+ GiB to spare", out)
    model = number_after(out, "TFLOP per device-step:")
    attention = number_after(out, "windowed, of which attention")
    assert number_after(out, "compiled FLOPs:") == pytest.approx(model - attention, rel=0.05)
    assert "compile time:" in out and "collectives per step:" in out
    predicted = re.search(r"predicted step time: +([\d.]+) s per step \(XLA:TPU's cost model, not a measurement", out)
    assert predicted and "MFU" in out and "splash kernels" in out and "step as compiled" in out


@needs_libtpu
@pytest.mark.tpu
@pytest.mark.tpu_small
def test_out_of_hbm_is_reported_with_the_compilers_numbers():
    """The tiny model at 1M tokens per v5e chip (16 GiB) without remat: XLA:TPU refuses; the report says so. (At
    128k it compiled to 14.26 GB and at 256k to 16.57 GB: both fit.)"""
    base = load_yaml(REPO / "configs" / "tiny.yaml")
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, remat="none"),
                              data=dataclasses.replace(base.data, seq_len=8192, global_batch=512),
                              mesh=dataclasses.replace(base.mesh, max_per_device_batch=128))
    report = aot.compile_for(cfg, "v5e:2x2")
    assert report.fits is False and "exceeds available HBM" in report.out_of_memory
    assert "does not fit" in report.lines()[0]


@needs_libtpu
@pytest.mark.tpu
def test_one_b_compiles_for_v5p_and_fits():
    cfg = load_yaml(REPO / "configs" / "olmo3-1b.yaml")
    report = aot.compile_for(cfg, "v5p:2x2x1")
    assert report.devices == 4 and report.fits and report.memory["total"] > 1 * aot.GIB
    assert report.flops > 0


@needs_libtpu
@pytest.mark.tpu
def test_splash_blocks_over_the_scoped_vmem_are_reported_and_the_default_fits():
    """Ironwood, 256-wide heads: 2048 x 2048 splash blocks overflow the kernel's 32 MiB scoped VMEM (XLA:TPU's own
    CompileTimeScopedVmemOom, reported as a does-not-fit line); the default for that width (1024) compiles."""
    base = load_yaml(REPO / "configs" / "tiny.yaml")
    model = dataclasses.replace(base.model, num_attention_heads=2, num_key_value_heads=2, head_dim=256,
                                compute_dtype="bfloat16", max_position_embeddings=8192)
    # 4 x 8192 tokens per device as the 7B recipe: the kernel is vmapped over the batch rows, which its blocks carry
    cfg = dataclasses.replace(base, model=model, data=dataclasses.replace(base.data, seq_len=8192, global_batch=32),
                              mesh=dataclasses.replace(base.mesh, max_per_device_batch=4))
    wide = dataclasses.replace(cfg, model=dataclasses.replace(model, attention_block_q=2048, attention_block_kv=2048))
    default_vmem = dataclasses.replace(wide, mesh=dataclasses.replace(cfg.mesh, tpu_flags="none"))
    over = aot.compile_for(default_vmem, "tpu7x:2x2x1")
    assert over.fits is False and "scoped VMEM" in over.out_of_memory, over.out_of_memory
    assert "does not fit" in over.lines()[0]
    fits = aot.compile_for(dataclasses.replace(cfg, mesh=default_vmem.mesh), "tpu7x:2x2x1")
    assert fits.out_of_memory is None and fits.fits, fits.lines()
    # The reproduction's Ironwood flags (mesh.tpu_flags auto) raise the scoped VMEM to 64 MiB: 2048 then compiles.
    recipe = aot.compile_for(wide, "tpu7x:2x2x1")
    assert recipe.out_of_memory is None and recipe.fits, recipe.lines()


@needs_libtpu
@pytest.mark.tpu
@pytest.mark.tpu_small
def test_tpu_flags_libtpu_does_not_know_are_one_sentence(capsys):
    for flags, said in (("--xla_tpu_no_such_flag=true", "No such compile option: 'xla_tpu_no_such_flag'"),
                        ("--xla_tpu_enable_sparse_core_collective_offload_all_gather=maybe", "Failed to parse 'maybe'")):
        assert main(["--dry-run", "--target", "tpu7x:2x2x1", f"--mesh.tpu-flags={flags}"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "mesh.tpu_flags: XLA:TPU on TPU7x refuses them" in err, err
        assert said in err
