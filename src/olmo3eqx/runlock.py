"""One trainer per run directory: an exclusive lock on `<run dir>/trainer.lock`, held for the life of the run (a
local or mounted directory: RunLock), or a lease on that object (a run directory in a bucket: RunLease).

The lock is flock(2) on a file that also names its holder (host, PID, start time). The kernel drops it when the
holder ends however it ends (SIGKILL and the OOM killer included), so a relaunch (`--until-done`'s, or by hand) takes
it at once; when the file still names a holder, that holder ended without releasing it and the relaunch says whose
lock it took over. A second trainer on a run whose holder is alive stops with `RunLocked`, naming the holder. On NFS,
Linux turns flock into POSIX locks that the server holds across hosts (and frees when a dead client's lease ends); a
file system without locks gets a warning and no lock.

A bucket has no locks and outlives its clients, so there the lock is a lease: `trainer.lock` is created only if it
does not exist (GCS `ifGenerationMatch=0`, S3 `If-None-Match: *`), names its holder, and is rewritten by the holder
every LEASE_SECONDS / 4 (each write conditional on the version the holder last wrote, so a holder that lost the lease
finds out and stops). A trainer that finds the object taken stops with the same one-sentence `RunLocked`, unless
the holder is dead: on the same host, its process is gone (checked at once, so a relaunch after `kill -9` takes
over immediately); on another host, it has not renewed the lease for LEASE_SECONDS (by the store's clock of its last
write). The taker-over writes conditionally on the dead holder's version, so of two relaunches one wins. A release
writes an empty record, as the local lock empties its file. The module imports only the standard library (JAX,
lazily, for the multi-process broadcast; olmo3eqx.storage for a bucket).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from olmo3eqx.errors import RunLocked

LOCK_FILE = "trainer.lock"
LEASE_SECONDS = 120.0
"""A lease in a bucket not renewed for this long (its holder on another host died or lost the store) may be taken
over; the holder renews it every quarter of this."""


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

    def check(self) -> None:
        """Nothing to check: the kernel keeps the lock for its holder's whole life."""

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
        return parse_record(os.pread(fd, 1 << 16, 0))
    except OSError:
        return None


def process_start(pid: int) -> str | None:
    """An identity of process `pid` that a reused PID does not share (boot id and start time, Linux); None when
    there is no such process or this system cannot say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}:{start}"
    except (OSError, IndexError):
        return None


def holder_alive_here(record: dict) -> bool:
    """Whether the holder a lease names, on this host, still runs."""
    pid = record.get("pid")
    if not isinstance(pid, int):
        return False
    if record.get("process") is not None and os.path.exists("/proc"):
        return process_start(pid) == record["process"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLease:
    """The lock of a run directory in a bucket (gs://, s3://): `acquire()` takes the lease or raises RunLocked,
    `check()` raises RunLocked once another trainer has taken it over, `release()` gives it back."""

    def __init__(self, run_dir: str):
        from olmo3eqx import storage

        self.storage = storage
        self.path = storage.join(str(run_dir), LOCK_FILE)
        self.run_dir = str(run_dir)
        self.version: str | None = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return (json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": self._started,
                            "process": process_start(os.getpid()), "lease_seconds": LEASE_SECONDS}) + "\n").encode()

    def acquire(self, warn: Callable[[str], None]) -> RunLease:
        self._started = time.time()
        while True:
            current = self.storage.read_versioned(self.path)
            previous, expect = None, None
            if current is not None:
                data, expect, written = current
                previous = parse_record(data)
                if previous and not self._dead(previous, written):
                    raise RunLocked(f"Run directory {self.storage.redact(self.run_dir)} is in use by another trainer "
                                    f"({describe_holder(previous)}; lease {self.storage.redact(self.path)}, renewed "
                                    f"{max(0, time.time() - written):.0f} s ago); stop that run first, or train under "
                                    f"another --run.name (a dead holder's lease is taken over {LEASE_SECONDS:.0f} s "
                                    f"after its last renewal).")
            version = self.storage.write_versioned(self.path, self._record(), expect)
            if version is not None:
                break  # else another trainer wrote it between our read and write: look again
        if previous:
            warn(f"warning: taking over the lease of {self.storage.redact(self.run_dir)} from "
                 f"{describe_holder(previous)}, which ended without releasing it (killed or crashed).")
        self.version = version
        self._thread = threading.Thread(target=self._renew, name="olmo3eqx-lease", daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _dead(record: dict, written: float) -> bool:
        if record.get("host") == socket.gethostname():
            return not holder_alive_here(record)
        return time.time() - written > float(record.get("lease_seconds", LEASE_SECONDS))

    def _renew(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(LEASE_SECONDS / 4):
            try:
                version = self.storage.write_versioned(self.path, self._record(), self.version)
            except Exception as e:  # noqa: BLE001 - the store is away; the lease holds until it expires
                if time.monotonic() - last > LEASE_SECONDS:
                    self.lost = f"the lease could not be renewed for {LEASE_SECONDS:.0f} s ({e})"
                    return
                continue
            if version is None:
                self.lost = "another trainer took the lease over (this one had not renewed it in time)"
                return
            self.version, last = version, time.monotonic()

    def check(self) -> None:
        if self.lost is not None:
            raise RunLocked(f"Run directory {self.storage.redact(self.run_dir)} is no longer this trainer's: "
                            f"{self.lost}; stopping so two trainers never write one run.")

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.lost is None:
            try:  # an empty record: released, not abandoned
                self.storage.write_versioned(self.path, b"", self.version)
            except Exception:  # noqa: BLE001 - a store that is away must not stop the release; the lease expires
                pass

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def parse_record(data: bytes) -> dict | None:
    """The holder a lock file or lease names; None when it is empty (released) or unreadable (torn by a crash)."""
    try:
        record = json.loads(data) if data.strip() else None
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def lock_run(run_dir: str | Path, *, process_index: int, process_count: int,
             warn: Callable[[str], None]) -> RunLock | RunLease:
    """Process 0 locks `run_dir` (a lease when it is in a bucket); with several processes, every process learns (one
    broadcast) whether it did, so all of them stop together instead of the others waiting in a collective for a
    process that left."""
    lock = RunLease(str(run_dir)) if "://" in str(run_dir) else RunLock(run_dir)
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
            refused = RunLocked(f"Process 0 could not lock run directory {run_dir}: another trainer holds it "
                                f"(process 0's log names it).")
    if refused is not None:
        raise refused
    return lock
