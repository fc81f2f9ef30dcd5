"""The host allocator train.py runs under (olmo3eqx/tools/hostmem.py): when it re-executes itself with tcmalloc or with
glibc tuned, when it does not, and real re-execs in a subprocess (same PID, same arguments; tcmalloc mapped; glibc
tuned keeps a freed 256 MiB block for the next malloc of a thread instead of re-faulting it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmo3eqx import jaxenv
from olmo3eqx.tools import hostmem

ROOT = Path(__file__).resolve().parents[1]
TC = "libtcmalloc_minimal.so.4"


def plan(env=None, *, loaded=None, accelerator=False, tcmalloc=TC, platform="linux"):
    return hostmem.choose_allocator(env or {}, loaded=loaded, accelerator=accelerator, tcmalloc=tcmalloc, platform=platform)


def test_cpu_linux_host_with_tcmalloc_installed_reexecutes_with_it():
    env, line = plan()
    assert env["LD_PRELOAD"] == TC and TC in line and "GLIBC_TUNABLES" not in env


def test_without_tcmalloc_or_when_asked_glibc_is_tuned_instead():
    for env, line in (plan(tcmalloc=None), plan({hostmem.CHOICE: "glibc"})):
        assert "LD_PRELOAD" not in env and hostmem.is_tuned(env) and "one arena, no mmap, no trim" in line
        assert hostmem.tunables(env) == {"glibc.malloc.arena_max": "1", "glibc.malloc.mmap_max": "0",
                                         "glibc.malloc.trim_threshold": str(1 << 62)}
    env, line = plan({hostmem.REEXECED: "1", "GLIBC_TUNABLES": hostmem.tuned_glibc_env({})["GLIBC_TUNABLES"]},
                     tcmalloc=None)
    assert env is None and line.endswith("by train.py")  # after the re-exec: no second one


def test_tuned_glibc_keeps_the_users_tunables_and_their_values_win():
    env = hostmem.tuned_glibc_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.arena_max=4", "PATH": "/b"})
    assert hostmem.tunables(env) == {"glibc.malloc.arena_max": "4", "glibc.malloc.mmap_max": "0",
                                     "glibc.malloc.trim_threshold": str(1 << 62), "glibc.malloc.hugetlb": "1"}
    assert env["PATH"] == "/b" and not hostmem.is_tuned(env)


@pytest.mark.parametrize("kwargs, says", [
    ({"loaded": "/usr/lib/libjemalloc.so.2"}, "libjemalloc.so.2"),  # a caching malloc is there already
    ({"env": {hostmem.CHOICE: "system"}}, "system"),  # the user's opt-out
    ({"env": {hostmem.CHOICE: "system"}, "tcmalloc": None}, "as it comes"),  # also of the tuning
    ({"accelerator": True}, "accelerator is present"),  # the step's buffers live on the device
    ({"platform": "darwin"}, "off Linux: darwin"),
    ({"env": {hostmem.REEXECED: "1", "LD_PRELOAD": "libtcmalloc_minimal.so.4"}}, "did not preload"),  # never loops
])
def test_no_reexec_where_it_cannot_help_or_was_declined(kwargs, says):
    env = kwargs.pop("env", None)
    new_env, line = plan(env, **kwargs)
    assert new_env is None and says in line and line.startswith("host malloc:")


def test_after_the_reexec_the_log_line_says_train_py_preloaded_it():
    env, line = plan({hostmem.REEXECED: "1"}, loaded="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10")
    assert env is None and line == "host malloc: libtcmalloc_minimal.so.4.5.10 (preloaded by train.py)"


def test_a_library_named_by_the_user_is_preloaded_and_a_wrong_name_stops_with_the_fix(tmp_path):
    lib = tmp_path / "libmymalloc.so"
    lib.write_bytes(b"")
    assert plan({hostmem.CHOICE: str(lib)})[0]["LD_PRELOAD"] == str(lib)
    with pytest.raises(hostmem.MallocChoiceError, match="neither 'system', 'glibc' nor an existing shared library"):
        plan({hostmem.CHOICE: str(tmp_path / "missing.so")})


def test_preload_env_goes_first_keeps_the_users_preloads_and_settings():
    env = hostmem.preload_env({"LD_PRELOAD": "/opt/libother.so", "PATH": "/bin"}, TC)
    assert env["LD_PRELOAD"] == f"{TC}:/opt/libother.so" and env["PATH"] == "/bin"
    assert int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40  # no report per step of XLA's temp buffer
    mine = hostmem.preload_env({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "5"}, TC)
    assert mine["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "5" and mine["LD_PRELOAD"] == TC
    assert "MALLOC_CONF" not in mine
    # jemalloc caches blocks over 8 MiB only when told to (else XLA's temporary buffer is purged every step)
    assert hostmem.preload_env({}, "/usr/lib/libjemalloc.so.2")["MALLOC_CONF"] == "oversize_threshold:0"
    assert hostmem.preload_env({"MALLOC_CONF": "narenas:2"}, "libjemalloc.so.2")["MALLOC_CONF"] == "narenas:2"


def test_loaded_allocator_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
        "7f04-7f05 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10\n")
    assert hostmem.loaded_allocator(maps) == "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert hostmem.loaded_allocator(maps) is None
    assert hostmem.loaded_allocator(tmp_path / "no-such-file") is None


def test_accelerator_detection_follows_jax_platforms_first():
    assert jaxenv.has_accelerator({"JAX_PLATFORMS": "cpu"}) is False
    assert jaxenv.has_accelerator({"JAX_PLATFORMS": "cuda,cpu"}) is True


SCRIPT = """
import ctypes, json, os, resource, sys, threading
from olmo3eqx import jaxenv
from olmo3eqx.tools import hostmem
hostmem.reexec_with_caching_malloc()

def refaults(nbytes=256 << 20):
    # in a thread, as XLA's worker threads allocate: malloc, touch every page, free; twice. The page faults of the
    # second round are the ones a caching setup saves (each step's temporary buffer is that second round).
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    faults = []
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(nbytes)
        ctypes.memset(block, 1, nbytes)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults

out = {}
thread = threading.Thread(target=lambda: out.update(faults=refaults()))
thread.start()
thread.join()
print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "loaded": hostmem.loaded_allocator(),
                  "line": hostmem.describe(), "tunables": os.environ.get("GLIBC_TUNABLES"), **out}))
"""


def run_script(tmp_path, **env_overrides) -> tuple[dict, int]:
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "GLIBC_TUNABLES", hostmem.CHOICE, hostmem.REEXECED)}
    env.update(JAX_PLATFORMS="cpu", **env_overrides)
    proc = subprocess.Popen([sys.executable, str(script), "--steps", "3", "two words"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), proc.pid


@pytest.mark.skipif(hostmem.find_tcmalloc() is None or not sys.platform.startswith("linux"),
                    reason="tcmalloc is not installed (apt install libtcmalloc-minimal4)")
def test_real_reexec_keeps_pid_and_arguments_and_maps_tcmalloc(tmp_path):
    seen, pid = run_script(tmp_path)
    assert seen["pid"] == pid  # exec, not a child: signals sent to the PID still reach the trainer
    assert seen["argv"] == ["--steps", "3", "two words"]
    assert "libtcmalloc" in Path(seen["loaded"]).name
    assert seen["line"].endswith("(preloaded by train.py)")
    declined, _ = run_script(tmp_path, **{hostmem.CHOICE: "system"})
    assert declined["loaded"] is None and "system" in declined["line"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc tunables: Linux only")
def test_real_reexec_with_glibc_tuned_keeps_a_freed_large_block_instead_of_refaulting_it(tmp_path):
    pages = (256 << 20) // 4096
    tuned, pid = run_script(tmp_path, **{hostmem.CHOICE: "glibc"})
    assert tuned["pid"] == pid and tuned["argv"] == ["--steps", "3", "two words"] and tuned["loaded"] is None
    assert hostmem.is_tuned({"GLIBC_TUNABLES": tuned["tunables"]}) and tuned["line"].endswith("by train.py")
    assert tuned["faults"][0] > pages // 2 and tuned["faults"][1] < pages // 20  # the second round reuses the pages
    plain, _ = run_script(tmp_path, **{hostmem.CHOICE: "system"})
    assert plain["tunables"] is None and plain["faults"][1] > pages // 2  # glibc as it comes: faulted again


def test_a_wrong_malloc_choice_stops_train_py_before_any_work_with_exit_code_2(tmp_path):
    env = {**os.environ, hostmem.CHOICE: str(tmp_path / "libnothere.so")}
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), "--run.dir", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "libnothere.so" in p.stderr and "neither 'system'" in p.stderr
    assert "Traceback" not in p.stderr and not any(tmp_path.iterdir())  # nothing built, nothing written
