"""What an exception raised while writing or restoring a checkpoint means: the storage's fault or a bug in a write
(`storage_errno`, `remote_failure`), and one of RESTORE_OUTCOMES in a restore (`restore_failure`), with the one
sentence a resume stops with (`restore_error`)."""

from __future__ import annotations

import errno
import json
import re

from olmo3eqx import exits, storage
from olmo3eqx.errors import CheckpointOutOfMemory, ConfigError, StorageError

TENSORSTORE_ERRNO = re.compile(r"os_error_code='(\d+)'")
"""How tensorstore's errors (which orbax raises as ValueError) carry the OS error of a failed write."""
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})
"""OS errors that are the storage's fault (not a missing or unreadable input) when any write of a run fails."""


TENSORSTORE_UNREACHABLE = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|PERMISSION_DENIED|UNAUTHENTICATED|"
                                     r"RESOURCE_EXHAUSTED)\b")
"""tensorstore's status codes (in the text of the ValueError orbax raises) for a store that failed or refused."""


def remote_failure(e: BaseException | None) -> str | None:
    """What went wrong, in a few words, when `e` (or its cause) is a bucket's failure in a write (unreachable, refused,
    out of quota, an upload session the store dropped) rather than a bug; None otherwise."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if TENSORSTORE_UNREACHABLE.search(str(e)) or storage.failure_kind(e) is not None:
            return storage.first_line(e)
        e = e.__cause__ or e.__context__
    return None


def storage_errno(e: BaseException | None) -> int | None:
    """The OS error number of a storage failure (an OSError, or a tensorstore error anywhere on the cause chain);
    None when `e` is not one (a bug is not the disk's fault and keeps its traceback)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.errno
        found = TENSORSTORE_ERRNO.search(str(e))
        if found:
            return int(found.group(1))
        e = e.__cause__ or e.__context__
    return None


RESTORE_OUTCOMES = ("ok", "corrupt", "storage", "denied", "config", "memory", "error")
"""What restoring a step came to on one process, in the order processes' outcomes are weighed: the verdict is the
last any process reached, so a step is skipped only when every process restored it or found it damaged."""
TENSORSTORE_STATUS = re.compile(r"\b(DATA_LOSS|OUT_OF_RANGE|FAILED_PRECONDITION|NOT_FOUND|UNAVAILABLE|"
                                r"DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|ABORTED|PERMISSION_DENIED|UNAUTHENTICATED)\b")
"""tensorstore's status codes, which orbax's errors carry in their text."""
STATUS_OUTCOMES = {"DATA_LOSS": "corrupt", "OUT_OF_RANGE": "corrupt", "FAILED_PRECONDITION": "corrupt",
                   "NOT_FOUND": "corrupt", "UNAVAILABLE": "storage", "DEADLINE_EXCEEDED": "storage",
                   "RESOURCE_EXHAUSTED": "storage", "ABORTED": "storage", "PERMISSION_DENIED": "denied",
                   "UNAUTHENTICATED": "denied"}
"""What each means in a read of a committed step: the data is not what its index says (a checksum or length that
does not match, a chunk that does not decode, a part missing), or the store failed or refused."""
OUT_OF_MEMORY = re.compile(r"out of memory", re.IGNORECASE)
"""XLA's and tensorstore's words for an allocation that failed (XLA: RESOURCE_EXHAUSTED: Out of memory ...)."""


def restore_failure(e: BaseException) -> tuple[str, BaseException]:
    """What an exception raised while restoring a committed step means, as one of RESTORE_OUTCOMES, and the link of
    its cause chain that says so (the first that does; orbax wraps tensorstore's words in its own): 'corrupt' only
    when the step itself is verifiably incomplete or damaged (a part of it missing; data shorter than its index
    says, or that does not decode: tensorstore's DATA_LOSS, OUT_OF_RANGE, FAILED_PRECONDITION, NOT_FOUND; metadata
    that does not parse), 'storage' when the store failed (unreachable, timed out, an I/O error), 'denied',
    'memory' (a device or the host ran out), 'config' (a ConfigError), else 'error' (a bug keeps its traceback)."""
    seen, link = set(), e
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        outcome = _restore_failure_of(link)
        if outcome is not None:
            return outcome, link
        link = link.__cause__ or link.__context__
    return "error", e


def _restore_failure_of(e: BaseException) -> str | None:
    if isinstance(e, storage.AccessDenied):
        return "denied"
    if isinstance(e, StorageError):
        return "storage"
    if isinstance(e, ConfigError):
        return "config"
    if isinstance(e, MemoryError) or OUT_OF_MEMORY.search(str(e)):
        return "memory"
    if isinstance(e, json.JSONDecodeError) or "incomplete checkpoint" in str(e):  # orbax's own completeness check
        return "corrupt"
    code = e.errno if isinstance(e, OSError) else None
    found = TENSORSTORE_ERRNO.search(str(e))
    code = int(found.group(1)) if found else code
    if code == errno.ENOMEM:
        return "memory"
    if code in STORAGE_ERRNOS or code in storage.TRANSIENT_ERRNOS:
        return "storage"
    found = TENSORSTORE_STATUS.search(str(e))
    if found:
        return STATUS_OUTCOMES[found.group(1)]
    kind = storage.failure_kind(e)
    return {"missing": "corrupt", "transient": "storage", "denied": "denied"}.get(kind)


def restore_error(verdict: str, where, on: str, outcome: str, value: BaseException, reason: str) -> BaseException:
    """The error a resume stops with when the processes' verdict on a step is `verdict` (not 'ok' or 'corrupt'):
    this process's own exception where it is the verdict's and already one sentence, else one naming the step."""
    if verdict == "storage":
        return StorageError(f"Checkpoint {where} could not be read{on} ({reason}); nothing was set aside: check that "
                            f"the store is reachable and relaunch to resume from it.")
    if verdict == "memory":
        return CheckpointOutOfMemory(
            f"Restoring checkpoint {where} ran out of memory{on} ({reason}); the checkpoint is kept: resume on "
            f"devices with more memory or on more of them (the state is sharded over them), or free host memory.")
    if outcome == verdict and isinstance(value, exits.CommandError):
        return value
    if verdict == "denied":
        return storage.AccessDenied(f"Reading checkpoint {where} was denied{on} ({reason}); check the credentials "
                                    f"this host uses for the store.")
    if verdict == "config":
        return ConfigError(f"Checkpoint {where} does not fit this run's config{on} ({reason}).")
    if outcome == verdict:
        return value
    return RuntimeError(f"Restoring checkpoint {where} failed{on}; that process's traceback says why.")
