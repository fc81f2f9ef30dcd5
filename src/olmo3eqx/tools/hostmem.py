"""The host allocator of XLA's CPU runtime: `python train.py` re-executes itself once with malloc set up to keep
XLA's per-step temporary buffer.

Why: XLA's CPU runtime mallocs each step's temporary buffer (hundreds of MiB even for the tiny config) and frees it
when the step ends. glibc, as it comes, serves a block that large with `mmap` and gives it back with `munmap` on
`free`, so every step faults the whole buffer in again, 4 KiB at a time, and the kernel zeroes every page (tiny:
~175k page faults per step). Two ways out, both bit-identical in losses, both paying in RSS about one more
temporary buffer:

- glibc tuned (needs nothing installed; the default when no tcmalloc is found): GLIBC_TUNABLES with one arena, no
  mmap and no trimming. All three are needed: XLA's threads malloc from their own arenas, which `mmap` any block
  larger than an arena heap (64 MiB) whatever the mmap settings say, so only `arena_max=1` sends the buffer to the
  main heap; `mmap_max=0` keeps it there (glibc's mmap threshold tops out at 32 MiB); and a trim threshold beyond
  any buffer stops `free` from handing the top of the heap back to the kernel.
- tcmalloc (`apt install libtcmalloc-minimal4`), preloaded: keeps freed spans and hands the same pages to the next
  step.

Numbers and commands: docs/performance.md (bench/bench_step.py --malloc). The allocator of a process is fixed when
it starts, hence the re-exec (same PID, same arguments, LD_PRELOAD or GLIBC_TUNABLES added). It happens only where
it helps: Linux, no accelerator (there the step's buffers live on the device), no caching malloc loaded already,
and not OLMO3EQX_MALLOC=system. OLMO3EQX_MALLOC=glibc picks the tuned glibc even where tcmalloc is installed;
OLMO3EQX_MALLOC=/path/to/lib.so preloads that library instead (jemalloc, say, which is then told to cache large
blocks too: JEMALLOC_CONF).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from olmo3eqx import exits
from olmo3eqx.jaxenv import has_accelerator

CHOICE = "OLMO3EQX_MALLOC"
"""`system` keeps the C library's malloc as it comes; `glibc` tunes it (GLIBC_TUNED); a path to a shared library
preloads that one; unset: tcmalloc if found, else the tuned glibc."""
TUNED_GLIBC = "glibc"
"""The CHOICE value that asks for the tuned glibc."""
GLIBC_TUNED = {"glibc.malloc.arena_max": "1", "glibc.malloc.mmap_max": "0",
               "glibc.malloc.trim_threshold": str(1 << 62)}
"""glibc tunables (glibc >= 2.26) that keep XLA's temporary buffer in the heap between steps (module doc)."""
REEXECED = "OLMO3EQX_MALLOC_REEXEC"
"""Set in the re-executed process, so a preload the dynamic linker ignored can never loop."""
TCMALLOC = ("tcmalloc_minimal", "tcmalloc")
"""Library names ctypes.util.find_library looks up, minimal (no heap profiler) first."""
CACHING = ("libtcmalloc", "libjemalloc", "libmimalloc")
"""File-name prefixes of caching allocators: one of these mapped into a process means it has one already."""
QUIET = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}
"""tcmalloc reports every allocation over 1 GiB on stderr by default; XLA's temporary buffer is one every step."""
JEMALLOC_CONF = {"MALLOC_CONF": "oversize_threshold:0"}
"""jemalloc 5 serves blocks over 8 MiB from an arena that purges them at once, which is glibc's behaviour again; with
this setting it caches them too (bench/bench_step.py --malloc jemalloc measures it)."""


class MallocChoiceError(ValueError):
    """OLMO3EQX_MALLOC names nothing usable."""


def loaded_allocator(maps: Path = Path("/proc/self/maps")) -> str | None:
    """Path of the caching allocator mapped into this process, None when there is none (or no /proc)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()  # address perms offset dev inode [path]
        if len(fields) >= 6 and Path(fields[5]).name.startswith(CACHING):
            return fields[5]
    return None


def find_tcmalloc() -> str | None:
    """The tcmalloc library the dynamic linker knows (a soname such as libtcmalloc_minimal.so.4), or None."""
    for name in TCMALLOC:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def preload_env(env: Mapping[str, str], library: str) -> dict[str, str]:
    """`env` with `library` first in LD_PRELOAD, set up to cache large blocks (jemalloc) and not to report them
    (tcmalloc); settings already in `env` win."""
    current = env.get("LD_PRELOAD", "")
    settings = {**QUIET, **(JEMALLOC_CONF if "jemalloc" in Path(library).name else {})}
    return {**settings, **env, "LD_PRELOAD": f"{library}:{current}" if current else library}


def tunables(env: Mapping[str, str]) -> dict[str, str]:
    """GLIBC_TUNABLES of `env` as name -> value."""
    pairs = (item.split("=", 1) for item in env.get("GLIBC_TUNABLES", "").split(":") if "=" in item)
    return dict(pairs)


def with_tunables(env: Mapping[str, str], settings: Mapping[str, str]) -> dict[str, str]:
    """`env` with `settings` (glibc tunable name -> value) added to its GLIBC_TUNABLES; tunables already set in
    `env` win."""
    merged = {**settings, **tunables(env)}
    return {**env, "GLIBC_TUNABLES": ":".join(f"{k}={v}" for k, v in merged.items())}


def tuned_glibc_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with GLIBC_TUNED added to its GLIBC_TUNABLES (with_tunables)."""
    return with_tunables(env, GLIBC_TUNED)


def is_tuned(env: Mapping[str, str]) -> bool:
    """Whether `env`'s GLIBC_TUNABLES hold GLIBC_TUNED (set by the user or by train.py's re-exec)."""
    return tunables(env).items() >= GLIBC_TUNED.items()


TUNED_LINE = ("host malloc: the C library's, tuned to keep XLA's temporary buffer between steps "
              "(one arena, no mmap, no trim)")


def choose_allocator(env: Mapping[str, str], *, loaded: str | None, accelerator: bool, tcmalloc: str | None,
                     platform: str = sys.platform) -> tuple[dict[str, str] | None, str]:
    """(the environment to re-execute with, or None to run on as is; one line saying what the host allocator is and
    why)."""
    choice = env.get(CHOICE, "")
    if loaded:
        how = " (preloaded by train.py)" if env.get(REEXECED) else ""
        return None, f"host malloc: {Path(loaded).name}{how}"
    if choice == "system":
        return None, f"host malloc: the C library's as it comes ({CHOICE}=system)"
    if is_tuned(env):
        return None, TUNED_LINE + (" by train.py" if env.get(REEXECED) else "")
    if env.get(REEXECED):
        return None, (f"host malloc: the C library's; the dynamic linker did not preload {env.get('LD_PRELOAD')!r} "
                      f"(check {CHOICE})")
    if not platform.startswith("linux"):
        return None, f"host malloc: the C library's (no preload or tuning off Linux: {platform})"
    if accelerator:
        return None, "host malloc: the C library's (an accelerator is present: the step's buffers live on it)"
    if choice == TUNED_GLIBC:
        return tuned_glibc_env(env), f"{TUNED_LINE} ({CHOICE}={TUNED_GLIBC})"
    if choice:
        if not Path(choice).is_file():
            raise MallocChoiceError(f"{CHOICE}={choice!r} is neither 'system', '{TUNED_GLIBC}' nor an existing "
                                    f"shared library; unset it for the default (tcmalloc if installed, else glibc "
                                    f"tuned).")
        return preload_env(env, choice), f"host malloc: {choice} ({CHOICE})"
    if tcmalloc is not None:
        return preload_env(env, tcmalloc), f"host malloc: {tcmalloc}"
    return tuned_glibc_env(env), TUNED_LINE


def _choice_here() -> tuple[dict[str, str] | None, str]:
    return choose_allocator(os.environ, loaded=loaded_allocator(), accelerator=has_accelerator(os.environ),
                tcmalloc=find_tcmalloc())


def describe() -> str:
    """One line for the run log: which host allocator this process has, and why."""
    return _choice_here()[1]


def reexec_with_caching_malloc() -> None:
    """Replace this process by itself with a caching malloc preloaded or glibc tuned (see the module doc); return if
    there is nothing to do. Call first thing in a script's `__main__` block, before jax is imported, never from library
    code: the exec replaces the whole process. A bad OLMO3EQX_MALLOC stops here with exit code 2 (bad input)."""
    try:
        env, _ = _choice_here()
    except MallocChoiceError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(exits.BAD_INPUT) from None
    if env is None:
        return
    env = {**env, REEXECED: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    raise AssertionError("unreachable: execve returns only by raising")


def release_freed_memory() -> None:
    """Give back to the OS the memory glibc's malloc keeps in freed chunks (malloc_trim); a no-op without glibc.

    The conversions call it between model leaves: orbax's writes and reads free many small buffers that glibc keeps in
    its arenas, so without it each leaf starts above the last and the peak follows the model, not the largest leaf.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
