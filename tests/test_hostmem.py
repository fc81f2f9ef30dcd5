"""hostmem: when train.py restarts itself with, and that the restart keeps the process."""

import os
import subprocess
import sys

import pytest

from olmo3eqx import hostmem
from olmo3eqx.hostmem import tunables

CPU_HOST = {"mode": "madvise", "glibc": (2, 36), "accelerator": False, "platform": "linux"}
HUGE = "glibc.malloc.hugetlb=1"


def test_tunable_added_on_a_cpu_host():
    assert tunables({}, **CPU_HOST) == HUGE
    # the user's own tunables are kept, ours appended
    assert tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **CPU_HOST) == f"glibc.malloc.arena_max=2:{HUGE}"


@pytest.mark.parametrize("env, host", [
    ({"GLIBC_TUNABLES": HUGE}, {}),  # after the restart: never loops
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {}),  # the user decided
    ({"OLMO3EQX_HUGE_PAGES": "0"}, {}),
    ({}, {"accelerator": True}),  # the step does not run on host buffers
    ({}, {"mode": "always"}),  # every large mapping is huge already
    ({}, {"mode": "never"}),
    ({}, {"mode": None}),  # no THP in this kernel
    ({}, {"glibc": (2, 34)}),  # no hugetlb tunable before glibc 2.35
    ({}, {"glibc": None}),  # musl, macOS
    ({}, {"platform": "darwin"}),
])
def test_nothing_to_do(env, host):
    assert tunables(env, **{**CPU_HOST, **host}) is None


def test_accelerator_from_jax_platforms_first(monkeypatch):
    assert not hostmem.has_accelerator({"JAX_PLATFORMS": "cpu"})
    assert hostmem.has_accelerator({"JAX_PLATFORMS": "cuda,cpu"})
    monkeypatch.setattr(hostmem.glob, "glob", lambda pattern: ["/dev/nvidia0"] if "nvidia" in pattern else [])
    assert hostmem.has_accelerator({}) and not hostmem.has_accelerator({"JAX_PLATFORMS": "cpu"})
    monkeypatch.setattr(hostmem.glob, "glob", lambda pattern: [])
    assert not hostmem.has_accelerator({})


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hostmem.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert hostmem.thp_mode(f) == "always"
    assert hostmem.thp_mode(tmp_path / "missing") is None


def test_glibc_version_is_parsed_here():
    version = hostmem.glibc_version()
    assert version is None or (len(version) == 2 and version >= (2, 0))


RESTART = """
import os, sys
from olmo3eqx import hostmem
hostmem.thp_mode = lambda: "madvise"  # as on a host where it applies, whatever this one has
hostmem.glibc_version = lambda: (2, 36)
print("start", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], flush=True)
hostmem.reexec_with_huge_pages()
print("main", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], flush=True)
"""


def test_restart_is_the_same_process_with_the_same_arguments(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(RESTART)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "OLMO3EQX_HUGE_PAGES")}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run([sys.executable, str(script), "--steps", "3"], env=env, capture_output=True, text=True,
                       check=True)
    lines = [line.split(" ", 3) for line in p.stdout.splitlines()]
    assert [line[0] for line in lines] == ["start", "start", "main"], p.stdout + p.stderr  # restarted once
    assert lines[0][1] == lines[1][1] == lines[2][1]  # exec: one process (signals, supervisors, PIDs still hold)
    assert lines[0][2] == "None" and lines[1][2] == lines[2][2] == HUGE
    assert lines[0][3] == lines[2][3] == "['--steps', '3']"
    assert f"restarting with GLIBC_TUNABLES={HUGE}" in p.stderr

    env["OLMO3EQX_HUGE_PAGES"] = "0"
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
    assert [line.split()[0] for line in p.stdout.splitlines()] == ["start", "main"]
