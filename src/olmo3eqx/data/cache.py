"""Files and directories built once per file system and then memory-mapped by every process that needs them.

The first process to take the target's lock file (flock) builds it under a temporary name beside the target and
renames it into place when complete, so a crash mid-write leaves nothing under the real name (the next start builds
it again and removes the dead builder's temporary; the kernel released its lock). The others block on the lock, then find it complete. On
one host, or hosts sharing the file system (flock reaches NFS servers as POSIX locks), that is one build; hosts with
disks of their own each build their own copy, once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from olmo3eqx.errors import DataError

WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""Failures of writing the cache (full, read-only or not ours), told as such; any other error keeps its own."""


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def build_once(path: Path, build: Callable[[Path], None], what: str) -> Path:
    """`path`, built by `build(temporary path)` unless it exists (the temporary is renamed to `path` when build
    returns, removed when it raises); `what` names it in messages."""
    if path.exists():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(path.name + ".lock"), "a")
    except OSError as e:
        raise DataError(f"Cannot write {what} in {path.parent} ({e.strerror}); make it writable.") from None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"Waiting for another process to finish {what} {path}.", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the holder closes the file, or dies
        if path.exists():
            return path
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # a killed builder's: only the lock holder writes
            _remove(stale)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            build(tmp)
            os.replace(tmp, path)
        except OSError as e:
            if e.errno not in WRITE_ERRNOS:  # a failed read of the data keeps its own message
                raise
            raise DataError(f"Cannot write {what} {path} ({e.strerror}); make {path.parent} writable with room for "
                            f"it.") from None
        finally:
            _remove(tmp)
    return path
