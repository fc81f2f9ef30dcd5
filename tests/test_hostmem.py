"""The host allocator train.py runs under (olmo3eqx/tools/hostmem.py): when it re-executes itself with tcmalloc, when it
does not, and a real re-exec in a subprocess (same PID, same arguments, tcmalloc mapped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from olmo3eqx.tools import hostmem

ROOT = Path(__file__).resolve().parents[1]
TC = "libtcmalloc_minimal.so.4"


def plan(env=None, *, loaded=None, accelerator=False, tcmalloc=TC, platform="linux"):
    return hostmem.choose_allocator(env or {}, loaded=loaded, accelerator=accelerator, tcmalloc=tcmalloc, platform=platform)


def test_cpu_linux_host_with_tcmalloc_installed_reexecutes_with_it():
    library, line = plan()
    assert library == TC and TC in line


@pytest.mark.parametrize("kwargs, says", [
    ({"loaded": "/usr/lib/libjemalloc.so.2"}, "libjemalloc.so.2"),  # a caching malloc is there already
    ({"env": {hostmem.CHOICE: "system"}}, "system"),  # the user's opt-out
    ({"accelerator": True}, "accelerator is present"),  # the step's buffers live on the device
    ({"platform": "darwin"}, "off Linux: darwin"),
    ({"tcmalloc": None}, "apt install libtcmalloc-minimal4"),  # not installed: say how to get it
    ({"env": {hostmem.REEXECED: "1", "LD_PRELOAD": "libtcmalloc_minimal.so.4"}}, "did not preload"),  # never loops
])
def test_no_reexec_where_it_cannot_help_or_was_declined(kwargs, says):
    env = kwargs.pop("env", None)
    library, line = plan(env, **kwargs)
    assert library is None and says in line and line.startswith("host malloc:")


def test_after_the_reexec_the_log_line_says_train_py_preloaded_it():
    library, line = plan({hostmem.REEXECED: "1"}, loaded="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10")
    assert library is None and line == "host malloc: libtcmalloc_minimal.so.4.5.10 (preloaded by train.py)"


def test_a_library_named_by_the_user_is_preloaded_and_a_wrong_name_stops_with_the_fix(tmp_path):
    lib = tmp_path / "libmymalloc.so"
    lib.write_bytes(b"")
    assert plan({hostmem.CHOICE: str(lib)})[0] == str(lib)
    with pytest.raises(hostmem.MallocChoiceError, match="neither 'system' nor an existing shared library"):
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
    assert hostmem.has_accelerator({"JAX_PLATFORMS": "cpu"}) is False
    assert hostmem.has_accelerator({"JAX_PLATFORMS": "cuda,cpu"}) is True


SCRIPT = """
import json, os, sys
from olmo3eqx.tools import hostmem
hostmem.reexec_with_caching_malloc()
print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "loaded": hostmem.loaded_allocator(),
                  "line": hostmem.describe()}))
"""


def run_script(tmp_path, **env_overrides) -> tuple[dict, int]:
    script = tmp_path / "entry.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", hostmem.CHOICE, hostmem.REEXECED)}
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


def test_a_wrong_malloc_choice_stops_train_py_before_any_work_with_exit_code_2(tmp_path):
    env = {**os.environ, hostmem.CHOICE: str(tmp_path / "libnothere.so")}
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), "--run.dir", str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "libnothere.so" in p.stderr and "neither 'system'" in p.stderr
    assert "Traceback" not in p.stderr and not any(tmp_path.iterdir())  # nothing built, nothing written
