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
writes an empty record, as the local lock empties its file.

A holder stops once its lease is no longer safely its own: taken over by another trainer, `RunLocked` (exit 2: a
relaunch would be refused the same way); not renewed for LEASE_SECONDS because the store was away, `StorageError`
(exit 74: `--until-done` relaunches after its backoff, and the relaunch takes the lease back as a dead holder's once
the store answers). With several processes only process 0 holds the lease; every process checks its status at every
step (AgreedLease: one small collective, read a step late), so all of them stop at the same step. The module imports
only the standard library (JAX, lazily, for the multi-process broadcast and check; olmo3eqx.storage for a bucket).
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
over; the holder renews it every quarter of this, and stops (StorageError, exit 74) once it has gone this long
without a renewal. Override with OLMO3EQX_LEASE_SECONDS."""


def lease_seconds() -> float:
    return float(os.environ.get("OLMO3EQX_LEASE_SECONDS", LEASE_SECONDS))


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


HELD, AWAY, TAKEN = 0, 1, 2
"""A lease's status, as process 0 shares it with the other processes: held; not renewed for lease_seconds() (the
store away: a storage failure, exit 74); taken over by another trainer (RunLocked, exit 2)."""


class RunLease:
    """The lock of a run directory in a bucket (gs://, s3://): `acquire()` takes the lease or raises RunLocked,
    `check()` raises StorageError once the lease has gone lease_seconds() without a renewal (the store away; a
    relaunch takes it back as a dead holder's) and RunLocked once another trainer has taken it over, `release()` gives
    it back."""

    def __init__(self, run_dir: str):
        from olmo3eqx import storage

        self.storage = storage
        self.path = storage.join(str(run_dir), LOCK_FILE)
        self.run_dir = str(run_dir)
        self.seconds = lease_seconds()
        self.version: str | None = None
        self.renewed: float | None = None
        """time.monotonic() of the last renewal; None until acquired (and on every process but 0)."""
        self.taken = self.expired = False
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _record(self) -> bytes:
        return (json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": self._started,
                            "process": process_start(os.getpid()), "lease_seconds": self.seconds}) + "\n").encode()

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
                                    f"another --run.name (a dead holder's lease is taken over {self.seconds:.0f} s "
                                    f"after its last renewal).")
            version = self.storage.write_versioned(self.path, self._record(), expect)
            if version is not None:
                break  # else another trainer wrote it between our read and write: look again
        if previous:
            warn(f"warning: taking over the lease of {self.storage.redact(self.run_dir)} from "
                 f"{describe_holder(previous)}, which ended without releasing it (killed or crashed).")
        self.version, self.renewed = version, time.monotonic()
        self._thread = threading.Thread(target=self._renew, name="olmo3eqx-lease", daemon=True)
        self._thread.start()
        return self

    def _dead(self, record: dict, written: float) -> bool:
        if record.get("host") == socket.gethostname():
            return not holder_alive_here(record)
        return time.time() - written > float(record.get("lease_seconds", self.seconds))

    def _renew(self) -> None:
        while not self._stop.wait(self.seconds / 4):
            try:
                version = self.storage.write_versioned(self.path, self._record(), self.version)
            except Exception as e:  # noqa: BLE001 - the store is away; the lease holds until it expires
                self.failure = self.storage.first_line(e)
                if self.status() != HELD:
                    return
                continue
            if version is None:
                self.taken = True
                return
            if self.status() != HELD:
                return  # renewed after it had expired: another trainer may have taken the run meanwhile
            self.version, self.renewed = version, time.monotonic()

    def status(self) -> int:
        """HELD, AWAY or TAKEN; AWAY stays once it is seen, even if the store comes back."""
        if self.renewed is None:
            return HELD
        if self.taken:
            return TAKEN
        self.expired = self.expired or time.monotonic() - self.renewed > self.seconds
        return AWAY if self.expired else HELD

    def error(self, status: int, process_0: bool = True) -> Exception | None:
        """The error that stops a trainer whose lease has `status` (None while HELD), in the words of process 0 or
        (`process_0` False) of the other processes, which stop with it."""
        from olmo3eqx.errors import StorageError

        where = self.storage.redact(self.run_dir)
        if status == TAKEN:
            who = "This trainer" if process_0 else "Process 0"
            return RunLocked(f"Run directory {where} is no longer this trainer's: another trainer took its lease over "
                             f"({who} had not renewed it in time); stopping so two trainers never write one run.")
        if status == AWAY:
            why = f" ({self.failure})" if process_0 and self.failure else ""
            who = "" if process_0 else "process 0 reports that "
            return StorageError(f"Stopping: {who}the lease of run directory {where} could not be renewed for "
                                f"{self.seconds:.0f} s{why}, so another trainer may take the run over; the committed "
                                f"checkpoints are intact: relaunch to resume once the store is reachable.")
        return None

    def check(self) -> None:
        error = self.error(self.status())
        if error is not None:
            raise error

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        held = self.status() == HELD
        if held:  # else its thread may be waiting out the store's retries; it is a daemon
            self._thread.join()
        self._thread = None
        if held and self.status() == HELD:
            try:  # an empty record: released, not abandoned
                self.storage.write_versioned(self.path, b"", self.version)
            except Exception:  # noqa: BLE001 - a store that is away must not stop the release; the lease expires
                pass

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AgreedLease:
    """Process 0's lease as every process of a multi-process trainer sees it: `check()`, called by every process once
    a step, raises on all of them at the same step. Each call dispatches a sum over every device of process 0's
    status (a few bytes) and reads the one the previous call dispatched, which the devices ran before the step now
    queued: the host does not wait on the devices for it, and every process stops one step after process 0 saw the
    lease go (the others would otherwise wait in the step's collectives for a process that left)."""

    def __init__(self, lease: RunLease, process_index: int):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P

        self.lease, self.primary = lease, process_index == 0
        devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
        mesh = jax.sharding.Mesh(devices, ("processes", "local"))
        self._rows = NamedSharding(mesh, P("processes"))
        self._sum = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(mesh, P()))
        self._pending = None

    def check(self) -> None:
        import jax
        import numpy as np

        mine = np.full((1,), self.lease.status() if self.primary else HELD, np.int32)
        agreed = self._sum(jax.make_array_from_process_local_data(self._rows, mine))
        agreed.copy_to_host_async()
        previous, self._pending = self._pending, agreed
        if previous is not None:
            error = self.lease.error(int(np.asarray(previous.addressable_data(0))), process_0=self.primary)
            if error is not None:
                raise error

    def release(self) -> None:
        self.lease.release()

    def __enter__(self) -> AgreedLease:
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
             warn: Callable[[str], None]) -> RunLock | RunLease | AgreedLease:
    """Process 0 locks `run_dir` (a lease when it is in a bucket); with several processes, every process learns (one
    broadcast) whether it did, and a lease is checked by all of them (AgreedLease), so all of them stop together
    instead of the others waiting in a collective for a process that left."""
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
    if isinstance(lock, RunLease) and process_count > 1:
        return AgreedLease(lock, process_index)
    return lock
