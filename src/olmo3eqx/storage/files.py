"""Reading and writing whole files and byte ranges, local or remote, with one API."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import uuid
from collections.abc import Iterable, Sequence

from olmo3eqx.errors import StorageError
from olmo3eqx.storage.paths import READ_ONLY, UnsupportedPath, check, is_url, join, redact, scheme
from olmo3eqx.storage.ranged import _http_get, _http_range, _http_size
from olmo3eqx.storage.retry import retrying
from olmo3eqx.storage.stores import _fresh, _key, filesystem


SHORT_READ_TRIES = 3
"""A ranged read that returns fewer bytes than asked is read again this many times before it is an error."""
READ_THREADS = 16
"""Concurrent ranged reads per process (read_many): a batch's instances are fetched in parallel."""




def size(p: str) -> int:
    """Bytes in the file or object `p` (HEAD / metadata for a URL)."""
    s = scheme(p)
    if s is None:
        return os.path.getsize(p)
    if s in READ_ONLY:
        return retrying(lambda: _http_size(p), p)
    fs = filesystem(s)
    return int(retrying(lambda: _fresh(fs, p).size(_key(p)), p))


def exists(p: str) -> bool:
    s = scheme(p)
    if s is None:
        return os.path.exists(p)
    try:
        size(p) if s in READ_ONLY else retrying(lambda: _fresh(filesystem(s), p).info(_key(p)), p)
    except FileNotFoundError:
        return False
    return True


def isfile(p: str) -> bool:
    s = scheme(p)
    if s is None:
        return os.path.isfile(p)
    if s in READ_ONLY:
        return exists(p)
    try:
        info = retrying(lambda: _fresh(filesystem(s), p).info(_key(p)), p)
    except FileNotFoundError:
        return False
    return info.get("type") == "file"


def isdir(p: str) -> bool:
    """A local directory, or a gs/s3 prefix holding at least one object; never for http(s), which cannot be
    listed."""
    s = scheme(p)
    if s is None:
        return os.path.isdir(p)
    if s in READ_ONLY:
        return False
    fs = filesystem(s)
    return bool(retrying(lambda: _fresh(fs, p).isdir(_key(p)), p))


def listdir(p: str) -> list[str]:
    """The full paths directly under directory (prefix) `p`, sorted."""
    s = scheme(p)
    if s is None:
        return sorted(os.path.join(p, name) for name in os.listdir(p))
    if s in READ_ONLY:
        raise UnsupportedPath(f"{redact(p)} cannot be listed (a web server has no directory listing); name its "
                              f"files one by one.")
    fs = filesystem(s)
    fs.invalidate_cache(_key(p))
    entries = retrying(lambda: fs.ls(_key(p), detail=False), p)
    return sorted(f"{s}://{e.rstrip('/')}" for e in entries if e.rstrip("/") != _key(p).rstrip("/"))


def glob(pattern: str) -> list[str]:
    """Sorted files matching a glob (`**` crosses directories), local or in a bucket."""
    s = scheme(pattern)
    if s is None:
        from glob import glob as local_glob

        return sorted(p for p in local_glob(pattern, recursive=True) if os.path.isfile(p))
    if s in READ_ONLY:
        raise UnsupportedPath(f"{redact(pattern)} is a glob over an {s}:// URL, which cannot be listed; name the "
                              f"files one by one (or use data.mix with data.mix_root).")
    fs = filesystem(s)
    fs.invalidate_cache()
    hits = retrying(lambda: fs.glob(_key(pattern), detail=True), pattern)
    return sorted(f"{s}://{k}" for k, info in hits.items() if info.get("type") == "file")


def read_bytes(p: str, start: int | None = None, end: int | None = None) -> bytes:
    """Bytes [start, end) of `p` (the whole file without them): exactly end - start bytes, or an error naming `p`,
    never fewer or other bytes. A URL is read with one ranged request, retried as `retrying` says."""
    s = scheme(p)
    if s is None:
        with open(p, "rb") as f:
            if start is None:
                return f.read()
            f.seek(start)
            data = f.read(end - start)
    else:
        data = retrying(lambda: _read_remote(s, p, start, end), p)
    if start is not None and len(data) != end - start:
        raise StorageError(f"{redact(p)} returned {len(data)} bytes for bytes {start}-{end - 1} ({end - start} "
                           f"asked): the file is shorter than when it was opened, or the server truncates its "
                           f"answers; relaunch to resume once it serves the file whole.")
    return data


def _read_remote(s: str, p: str, start: int | None, end: int | None) -> bytes:
    if start is None:
        return _http_get(p) if s in READ_ONLY else filesystem(s).cat_file(_key(p))
    for _ in range(SHORT_READ_TRIES):  # a short answer (a dropped connection) is read again
        data = _http_range(p, start, end) if s in READ_ONLY else filesystem(s).cat_file(_key(p), start=start, end=end)
        if len(data) == end - start:
            break
    return data


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_pid = 0


def read_many(reads: Sequence[tuple[str, int, int]]) -> list[bytes]:
    """read_bytes of each (path, start, end), remote ones READ_THREADS at a time (the first failure raises)."""
    global _pool, _pool_pid
    if not any(is_url(p) for p, _, _ in reads) or len(reads) < 2:
        return [read_bytes(p, a, b) for p, a, b in reads]
    if _pool is None or _pool_pid != os.getpid():
        _pool, _pool_pid = concurrent.futures.ThreadPoolExecutor(READ_THREADS, "olmo3eqx-read"), os.getpid()
    return list(_pool.map(lambda r: read_bytes(*r), reads))


def read_text(p: str) -> str:
    return read_bytes(p).decode("utf-8")




def _writable(p: str) -> str:
    return check(p, "Output", write=True)


def makedirs(p: str) -> None:
    """A local directory (and its parents); nothing for a bucket, whose prefixes exist once an object does."""
    if not is_url(p):
        os.makedirs(p, exist_ok=True)
    else:
        _writable(p)


def write_bytes(p: str, data: bytes) -> None:
    """Replace `p` with `data` at once: a reader sees the old content or the new, never part (local: a temporary
    file renamed over it; a bucket: one PUT)."""
    s = scheme(_writable(p))
    if s is None:
        tmp = f"{p}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return
    fs = filesystem(s)
    retrying(lambda: fs.pipe_file(_key(p), data), p, "writing")


def write_text(p: str, text: str) -> None:
    write_bytes(p, text.encode("utf-8"))


def remove(p: str) -> None:
    """Delete one file or object (a missing one is no error)."""
    s = scheme(_writable(p))
    if s is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)
        return
    fs = filesystem(s)
    with contextlib.suppress(FileNotFoundError):
        retrying(lambda: fs.rm(_key(p)), p, "deleting")


def rmtree(p: str) -> None:
    s = scheme(_writable(p))
    if s is None:
        shutil.rmtree(p, ignore_errors=True)
        return
    fs = filesystem(s)
    with contextlib.suppress(FileNotFoundError):
        retrying(lambda: fs.rm(_key(p), recursive=True), p, "deleting")


def upload_tree(local: str | os.PathLike, dst: str, last: Iterable[str] = ()) -> None:
    """Copy local directory `local` to `dst` (a local directory or a bucket prefix), file by file; the files named in
    `last` (paths relative to `local`, e.g. a commit marker) are copied after all the others."""
    local = str(local)
    late = set(last)
    files = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
    for rel in [f for f in files if f not in late] + [f for f in files if f in late]:
        target = join(dst, *rel.split(os.sep))
        if not is_url(dst):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(local, rel), target)
            continue
        fs = filesystem(scheme(dst))
        retrying(lambda: fs.put_file(os.path.join(local, rel), _key(target)), target, "writing")
