"""One trainer per run directory: an exclusive lock on `<run dir>/trainer.lock`, held for the life of the run.

The lock is flock(2) on a file that also names its holder (host, PID, start time). The kernel drops it when the
holder ends however it ends (SIGKILL and the OOM killer included), so a relaunch (`--until-done`'s, or by hand) takes
it at once; when the file still names a holder, that holder ended without releasing it and the relaunch says whose
lock it took over. A second trainer on a run whose holder is alive stops with `RunLocked`, naming the holder. On NFS,
Linux turns flock into POSIX locks that the server holds across hosts (and frees when a dead client's lease ends); a
file system without locks gets a warning and no lock. The module imports only the standard library (JAX, lazily,
for the multi-process broadcast).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

LOCK_FILE = "trainer.lock"


class RunLocked(Exception):
    """Another live trainer holds the run directory (exit code 2: a relaunch would stop the same way)."""


def describe_holder(record: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.get("started", 0)))
    return f"PID {record.get('pid', '?')} on host {record.get('host', '?')}, started {started}"


class RunLock:
    """`acquire()` takes the lock or raises RunLocked; `release()` gives it back (also on `with` exit). The file
    stays (emptied) after a release: unlinking it would let a process that opened the old file and one that creates
    a new one both hold "the" lock."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, warn: Callable[[str], None]) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            previous = read_record(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                holder = describe_holder(previous) if previous else "a process that has not written its name yet"
                raise RunLocked(f"Run directory {self.path.parent} is in use by another trainer ({holder}; lock "
                                f"{self.path}); stop that run first, or train under another --run.name.") from None
            warn(f"warning: cannot lock {self.path} ({os.strerror(e.errno)}): this file system has no locks, so a "
                 f"second trainer on this run would not be stopped.")
            return self
        previous = read_record(fd)
        if previous:
            warn(f"warning: taking over the lock of {self.path.parent} from {describe_holder(previous)}, which ended "
                 f"without releasing it (killed or crashed).")
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # an empty file: released, not abandoned
        except OSError:
            pass  # a full or failing disk must not stop the release; the next holder then warns needlessly
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def read_record(fd: int) -> dict | None:
    """The holder named in the lock file; None when it is empty (released) or unreadable (torn by a crash)."""
    try:
        data = os.pread(fd, 1 << 16, 0)
        record = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def lock_run(run_dir: str | Path, *, process_index: int, process_count: int,
             warn: Callable[[str], None]) -> RunLock:
    """Process 0 locks `run_dir`; with several processes, every process learns (one broadcast) whether it did, so
    all of them stop together instead of the others waiting in a collective for a process that left."""
    lock = RunLock(run_dir)
    refused = None
    if process_index == 0:
        try:
            lock.acquire(warn)
        except RunLocked as e:
            refused = e
    if process_count > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        if int(multihost_utils.broadcast_one_to_all(np.int32(refused is not None))) and refused is None:
            refused = RunLocked(f"Process 0 could not lock run directory {Path(run_dir)}: another trainer holds it "
                                f"(process 0's log names it).")
    if refused is not None:
        raise refused
    return lock
