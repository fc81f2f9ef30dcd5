"""The XLA:TPU flags the train step compiles with on a Cloud TPU VM (olmo3eqx.jaxenv.tpu_flags), where `import jax`
runs jax's own Cloud TPU setup (jax/_src/cloud_tpu_init.py) and it appends a flag of its own to LIBTPU_INIT_ARGS.

The processes here start as train.py starts: parse the command line, jaxenv.prepare, then import jax, with
JAX_FORCE_TPU_INIT=1 making jax's setup act as on a TPU VM on this host without TPUs (JAX_PLATFORMS=cpu keeps its
backend on the CPU; no TPU is used)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmo3eqx import jaxenv

REPO = Path(__file__).resolve().parents[1]
LAUNCH_BARRIER = "--xla_tpu_use_enhanced_launch_barrier=true"

STARTUP = """
import json, os, sys
from olmo3eqx import jaxenv
from olmo3eqx.train import parse_args

cfg, _ = parse_args(sys.argv[1:])
assert "jax" not in sys.modules, "jax imported before jaxenv.prepare"
jaxenv.prepare(os.environ)
import jax  # jax's Cloud TPU setup runs here

print(json.dumps({"LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS"),
                  "compiled": jaxenv.tpu_flags(cfg.mesh.tpu_flags, "TPU v5", os.environ),
                  "line": jaxenv.describe_tpu_flags(cfg.mesh.tpu_flags, "TPU v5", os.environ)}))
"""


def start_on_a_tpu_vm(args: list[str], libtpu_init_args: str | None = None) -> dict:
    """What a train.py process on a Cloud TPU VM (a v5p host) would compile its step with, and say."""
    env = {k: v for k, v in os.environ.items() if k not in ("LIBTPU_INIT_ARGS", "JAX_PLATFORMS")}
    env.update(JAX_FORCE_TPU_INIT="1", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO / "src"))
    if libtpu_init_args is not None:
        env["LIBTPU_INIT_ARGS"] = libtpu_init_args
    done = subprocess.run([sys.executable, "-c", STARTUP, *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    return json.loads(done.stdout.strip().splitlines()[-1])


def preset(kind: str) -> dict[str, str]:
    return jaxenv.parse_tpu_flags(" ".join(dict(jaxenv.TPU_XLA_FLAGS)[kind]))


def test_flags_jax_set_on_a_tpu_vm_are_not_the_users():
    """jax appends its launch-barrier flag to LIBTPU_INIT_ARGS; the step still compiles with the v5p preset (as with a
    clean environment), a user's --mesh.tpu-flags replace the preset, and a user's own LIBTPU_INIT_ARGS replaces it
    too (an explicit --mesh.tpu-flags still applies); the startup line names each flag's source."""
    auto = start_on_a_tpu_vm([])
    assert auto["LIBTPU_INIT_ARGS"].split() == [LAUNCH_BARRIER]  # jax's own setup ran and added its flag
    assert auto["compiled"] == preset("tpu v5") == jaxenv.tpu_flags("auto", "TPU v5", {})
    line = auto["line"]
    assert line.startswith("the train step compiles with " + " ".join(jaxenv.V5P_XLA_FLAGS))
    assert "(the TPU v5 preset, mesh.tpu_flags auto)" in line and f"{LAUNCH_BARRIER} (set by jax)" in line

    mine = start_on_a_tpu_vm(["--mesh.tpu-flags=--xla_tpu_scoped_vmem_limit_kib=65536"])
    assert mine["compiled"] == {"xla_tpu_scoped_vmem_limit_kib": "65536"}
    assert "--xla_tpu_scoped_vmem_limit_kib=65536 (--mesh.tpu-flags)" in mine["line"]

    users = start_on_a_tpu_vm([], "--xla_tpu_enable_data_parallel_all_reduce_opt=false")
    assert users["LIBTPU_INIT_ARGS"].split() == ["--xla_tpu_enable_data_parallel_all_reduce_opt=false",
                                                 LAUNCH_BARRIER]
    assert users["compiled"] == {}
    assert "no added flags (your LIBTPU_INIT_ARGS replaces the TPU v5 preset" in users["line"]
    assert "--xla_tpu_enable_data_parallel_all_reduce_opt=false (yours)" in users["line"]
    both = start_on_a_tpu_vm(["--mesh.tpu-flags=--xla_tpu_scoped_vmem_limit_kib=65536"],
                             "--xla_tpu_enable_data_parallel_all_reduce_opt=false")
    assert both["compiled"] == {"xla_tpu_scoped_vmem_limit_kib": "65536"}


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (the `tpu` extra)")
@pytest.mark.tpu
def test_the_dry_run_for_a_v5p_topology_on_a_tpu_vm_compiles_with_the_preset():
    """`train.py --dry-run --target v5p:2x2x1` where jax's Cloud TPU setup ran: the step compiles (libtpu checks
    the flags first) with the v5p preset, and the plan says so beside jax's own flag."""
    env = {k: v for k, v in os.environ.items() if k != "LIBTPU_INIT_ARGS"}
    env.update(JAX_FORCE_TPU_INIT="1", PYTHONPATH=str(REPO / "src"))
    done = subprocess.run([sys.executable, "train.py", "--dry-run", "--target", "v5p:2x2x1"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("XLA:TPU flags:")]
    assert line.split(None, 2)[2] == jaxenv.describe_tpu_flags(
        "auto", "TPU v5", {"LIBTPU_INIT_ARGS": LAUNCH_BARRIER})
    assert " ".join(jaxenv.V5P_XLA_FLAGS) in line and f"{LAUNCH_BARRIER} (set by jax)" in line
