"""Transparent huge pages for XLA's host buffers, set up by re-executing `python train.py` once.

XLA's CPU runtime allocates a step's temporary buffer (763 MiB for the tiny config, 2.2 GiB for bench_step's ~50M
config) with `malloc` and frees it after the step. glibc serves an allocation that large by `mmap` and unmaps it on
`free`, so every step faults the whole buffer in again, 4 KiB at a time, and the kernel zeroes every page: on the
2-core CPU, 600,000 faults and 1.6 s of kernel time per 6.3 s step of the ~50M config. glibc >= 2.35 has a tunable,
`glibc.malloc.hugetlb=1`, that asks for transparent huge pages (`madvise(MADV_HUGEPAGE)`) on those mappings: 2 MiB
faults, 1,700 per step, 0.3 s of kernel time, 14% less wall time (numbers and commands in README "Performance").

Tunables are read when a process starts, so `train.py` re-executes itself once with the tunable added to
`GLIBC_TUNABLES` (same PID, same arguments). Only on a host without an accelerator, where the step runs on these
buffers; nothing happens where it cannot help (not Linux/glibc >= 2.35, the kernel's THP mode `always`, already
huge, or `never`), when GLIBC_TUNABLES names the tunable already, or with OLMO3EQX_HUGE_PAGES=0.

Not done: keeping freed memory instead (`glibc.malloc.mmap_max=0`, a 64 GiB `trim_threshold`, `arena_max=1`)
removed the faults altogether, but the heap fragmented and peak RSS went from 3.5 to 12.3 GiB. Not applied to
other programs: `transformers`+torch ran 8-15% slower with huge pages on the same CPU (its many smaller allocations
fault in 2 MiB pages they do not fill), which is why bench_step gives each contender its own process.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "OLMO3EQX_HUGE_PAGES"
"""Set to 0 to run without the tunable (train.py then starts as it is)."""
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*")
"""Device files of NVIDIA GPUs, AMD GPUs and TPUs (accel on v4/v5e, vfio on v5p/v6e)."""


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode (`always`, `madvise` or `never`), None where it cannot be read."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library when it is glibc, else None."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def has_accelerator(env: Mapping[str, str]) -> bool:
    """Whether JAX will run on an accelerator here: JAX_PLATFORMS when set, else the device files present."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return any(p != "cpu" for p in platforms)
    return any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def tunables(env: Mapping[str, str], *, mode: str | None, glibc: tuple[int, int] | None, accelerator: bool,
             platform: str = sys.platform) -> str | None:
    """The GLIBC_TUNABLES value to re-execute with, or None when re-executing would change nothing."""
    if env.get(OPT_OUT, "1") == "0" or not platform.startswith("linux") or accelerator:
        return None
    if glibc is None or glibc < (2, 35) or mode != "madvise":
        return None
    current = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb=" in current:  # set already (by the user, or by us before the exec: never loops)
        return None
    return f"{current}:{TUNABLE}" if current else TUNABLE


def reexec_with_huge_pages() -> None:
    """Replace this process by itself with the tunable set (see the module doc); return if nothing to do.

    Call first thing in a script's `__main__` block, never from library code: the exec replaces the whole process."""
    value = tunables(os.environ, mode=thp_mode(), glibc=glibc_version(), accelerator=has_accelerator(os.environ))
    if value is None:
        return
    print(f"olmo3eqx: restarting with GLIBC_TUNABLES={value} (transparent huge pages for XLA's host buffers; "
          f"{OPT_OUT}=0 to skip)", file=sys.stderr, flush=True)
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "GLIBC_TUNABLES": value})
