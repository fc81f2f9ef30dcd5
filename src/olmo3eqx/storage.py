"""One notion of a path for everything a run reads or writes: a local path, or a URL.

- `gs://bucket/key` (Google Cloud Storage) and `s3://bucket/key` (Amazon S3 and S3-compatible stores: R2, MinIO, ...):
  read and written, through fsspec's gcsfs and s3fs (the `cloud` extra: `pip install -e ".[cloud]"`), which
  orbax's paths (etils.epath) use too, so a checkpoint and a metrics file reach a bucket with the same credentials.
- `http://` and `https://`: read only (token files, mix roots, task files), one HTTP Range request per read
  (requests, a core dependency); a server that ignores Range is an error, never a whole-file download.
- Any other scheme is refused with one sentence naming it (`check`), before any work; a URL never becomes a local
  path (`pathlib.Path("s3://b/x")` is the relative path `s3:/b/x`: nothing here builds one from a URL).

Credentials are each ecosystem's own: GCS application-default credentials (anonymous when there are none), the AWS
chain (environment, profiles, instance roles; unsigned requests when there are none), none for http(s). The endpoint
variables are honoured: `STORAGE_EMULATOR_HOST` (and, from it, tensorstore's `TENSORSTORE_GCS_HTTP_URL`),
`AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`. `redact` strips credentials and signatures from a URL before it is
printed or stored.

Failures are told apart by the exception's type (`failure_kind`): a missing object is FileNotFoundError, a denied
one (401/403, or no credentials) `AccessDenied`, another 4xx answer or a malformed URL `BadRequest`, each permanent
and named in one sentence at once. Transient ones (connection errors, timeouts, 408/425/429/5xx) are retried with
exponential backoff for up to `retry_seconds()` (120 s; `OLMO3EQX_STORAGE_RETRY_SECONDS`), then `StorageError`
(exit 74: relaunch to resume once the store is back), as is a ranged read that stays short.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # noqa: F401 - see _stopping
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import random
import re
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

from etils import epath

from olmo3eqx.errors import ConfigError, StorageError

WRITABLE = ("gs", "s3")
"""Schemes a run can write to (run.dir, convert.py's --out, checkpoints) and read from."""
READ_ONLY = ("http", "https")
"""Schemes read one Range request at a time; nothing is ever written there and they cannot be listed."""
CLOUD_EXTRA = 'pip install -e ".[cloud]"'
RETRY_SECONDS = 120.0
"""How long a transient failure (timeouts, refused connections, 408/429/5xx) is retried before the run stops with
exit 74; override with OLMO3EQX_STORAGE_RETRY_SECONDS."""
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 8.0
"""Backoff between retries: doubling from the first to the largest pause, each pause jittered by +-50%."""
SHORT_READ_TRIES = 3
"""A ranged read that returns fewer bytes than asked is read again this many times before it is an error."""
HTTP_TIMEOUT_S = 60.0
READ_THREADS = 16
"""Concurrent ranged reads per process (read_many): a batch's instances are fetched in parallel."""
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
StorePath = Path | epath.Path
"""What `path` returns: a pathlib.Path for a local path, an etils.epath.Path for gs:// and s3://."""


class UnsupportedPath(ConfigError):
    """A URL whose scheme nothing here reads, or a read-only URL given where something is written."""


class MissingExtra(ConfigError):
    """gs:// or s3:// without the `cloud` extra installed."""


class AccessDenied(ConfigError):
    """The store refused access (401/403, or no credentials where the bucket needs them): permanent."""


class RangeIgnored(ConfigError):
    """An http(s) server answered a Range request with the whole file, or with other bytes than asked."""


class BadRequest(ConfigError):
    """A malformed URL, or a request the store refuses as such (a 4xx answer other than 401/403/404/408/425/429):
    permanent, so never retried."""


# --- paths -----------------------------------------------------------------------------------------


def scheme(path: str | os.PathLike) -> str | None:
    """The URL scheme of `path` (lower case), None for a local path."""
    found = _URL.match(str(path))
    return found.group(1).lower() if found else None


def is_url(path: str | os.PathLike) -> bool:
    return scheme(path) is not None


def check(path: str | os.PathLike, what: str, *, write: bool = False) -> str:
    """`path` as a string (a local one with ~ expanded), after refusing a scheme nothing here handles or, with
    `write`, a read-only URL: one sentence naming `what` and the scheme."""
    s = scheme(path)
    if s is None:
        return os.path.expanduser(str(path))
    if s not in WRITABLE + READ_ONLY:
        raise UnsupportedPath(f"{what} {redact(path)} uses {s}://, which olmo3eqx cannot reach: give a local path, "
                              f"a gs:// or s3:// URL, or (to read) an http(s):// URL.")
    if write and s in READ_ONLY:
        raise UnsupportedPath(f"{what} {redact(path)} is an {s}:// URL, which olmo3eqx only reads: give a local path "
                              f"or a gs:// or s3:// URL to write to.")
    return str(path)


def path(p: str | os.PathLike, what: str, *, write: bool = False) -> StorePath:
    """A directory or file to read or write as a path object: `pathlib.Path` for a local path, `etils.epath.Path`
    (the pathlib API over gcsfs/s3fs, what orbax takes) for gs:// and s3://. http(s) URLs name single files only
    (read them with read_bytes); they are refused here."""
    s = scheme(p)
    if s is None:
        return Path(os.path.expanduser(str(p)))
    check(p, what, write=write)
    if s in READ_ONLY:
        raise UnsupportedPath(f"{what} {redact(p)} is an {s}:// URL: a web server cannot be listed, so it cannot hold "
                              f"a checkpoint or run directory; give a local path or a gs:// or s3:// URL.")
    filesystem(s)  # the extra is installed, endpoints and credentials configured
    return epath.Path(str(p))


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base` joined with `parts` by '/', for URLs and local paths alike."""
    if not is_url(base):
        return os.path.join(str(base), *parts)
    out = str(base).rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


def basename(p: str | os.PathLike) -> str:
    return str(p).rstrip("/").rsplit("/", 1)[-1] if is_url(p) else os.path.basename(str(p))


def parent(p: str | os.PathLike) -> str:
    if not is_url(p):
        return os.path.dirname(str(p))
    head = str(p).rstrip("/").rsplit("/", 1)[0]
    return head + "/" if head.endswith(":/") else head


def redact(p: str | os.PathLike) -> str:
    """`p` with the user:password of a URL and its query string (signed URLs' signatures) replaced by '***'."""
    s = str(p)
    if not is_url(s):
        return s
    try:
        parts = urlsplit(s)
    except ValueError:  # malformed (an unclosed IPv6 bracket): redacted by hand, for the sentence that says so
        head, query, _ = s.partition("?")
        return re.sub(r"//[^/]*@", "//***@", head) + ("?***" if query else "")
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", parts.fragment))


def redact_tree(value):
    """A config dict (nested dicts, lists, strings) with every URL in it redacted."""
    if isinstance(value, dict):
        return {k: redact_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_tree(v) for v in value)
    return redact(value) if isinstance(value, str) and is_url(value) else value


def local_cache_dir() -> Path:
    """This host's directory for what a run directory in a bucket cannot hold (W&B's own files)."""
    return Path(os.path.expanduser("~/.cache/olmo3eqx"))


# --- the stores behind the URLs ---------------------------------------------------------------------


_configured = False
_configure_lock = threading.Lock()


def configure_endpoints(environ=os.environ) -> None:
    """What the libraries need to reach the same stores as the standard variables name, set once per process:
    tensorstore (orbax's array writes) learns a GCS emulator from STORAGE_EMULATOR_HOST (it reads its own
    TENSORSTORE_GCS_HTTP_URL, and an emulator takes any token); s3fs reads S3 unsigned when the AWS chain finds no
    credentials (public buckets, as OLMo-core does); the libraries' per-request warnings stay out of the log."""
    global _configured
    with _configure_lock:
        if _configured:
            return
        emulator = environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            url = emulator if "://" in emulator else f"http://{emulator}"
            environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
            environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
        for name in ("gcsfs", "s3fs", "aiobotocore", "botocore", "google.auth", "urllib3"):
            logging.getLogger(name).setLevel(logging.CRITICAL)  # their retries log tracebacks; ours say one line
        _configured = True


@functools.cache
def s3_anonymous() -> bool:
    """Whether the AWS chain finds no credentials on this host (then S3 is read unsigned)."""
    try:
        import botocore.session
    except ImportError:
        return False
    return botocore.session.get_session().get_credentials() is None


def filesystem(s: str):
    """The fsspec filesystem of scheme gs or s3 (one per process, shared with etils.epath and so with orbax)."""
    configure_endpoints()
    import fsspec

    if s == "s3" and s3_anonymous():
        fsspec.config.conf.setdefault("s3", {}).setdefault("anon", True)
    try:
        # etils.epath opens GCS as protocol "gcs" with finalize_on_close: the same arguments give the same instance
        # (fsspec caches them), so orbax's paths and ours share one client and one cache of listings
        return fsspec.filesystem("gcs", finalize_on_close=True) if s == "gs" else fsspec.filesystem(s)
    except ImportError:
        module = {"gs": "gcsfs", "s3": "s3fs"}.get(s, s)
        raise MissingExtra(f"{s}:// paths need {module}, which is not installed: {CLOUD_EXTRA}.") from None


def _key(url: str) -> str:
    """The fsspec path of a gs/s3 URL: bucket/key."""
    return url.split("://", 1)[1]


def _fresh(fs, url: str):
    """`fs` with what it cached of `url` and its parents dropped: orbax writes arrays through tensorstore, and other
    processes write too, so a listing cached earlier may not hold an object that now exists."""
    fs.invalidate_cache(_key(url))
    return fs


def forget_listings(p: str) -> None:
    """Drop every listing this process's client of `p`'s store has cached (orbax's too: they share it), after
    another process changed a directory there; nothing for a local path."""
    s = scheme(p)
    if s in WRITABLE:
        filesystem(s).invalidate_cache()


# --- failures and retries ---------------------------------------------------------------------------


class HttpStatus(OSError):
    """An http(s) answer that is not the one asked for."""

    def __init__(self, status: int, url: str):
        super().__init__(f"HTTP {status} from {redact(url)}")
        self.status = status


TRANSIENT_HTTP = frozenset({408, 425, 429})
"""4xx answers worth another try (every 5xx is too)."""
TRANSIENT_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT,
                              errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN})


def http_kind(status: int) -> str:
    """failure_kind of an HTTP status that is not a success."""
    if status in (401, 403):
        return "denied"
    if status in (404, 410):
        return "missing"
    if status in TRANSIENT_HTTP or status >= 500:
        return "transient"
    return "refused"


def failure_kind(e: BaseException) -> str | None:
    """What a failure of a remote operation means, decided by the exception's type (and an HTTP status where it
    carries one): 'missing' (404/410), 'denied' (401/403, no credentials), 'refused' (another 4xx, a malformed URL,
    a TLS failure: permanent, so never retried), 'transient' (connection errors, timeouts, 408/425/429/5xx); None
    when it is none of these (a bug keeps its traceback)."""
    code = getattr(e, "status", None) or getattr(e, "code", None)
    if isinstance(code, int) and 100 <= code < 600:  # an HTTP status (aiohttp, gcsfs, google-cloud-storage, ours)
        return http_kind(code) if code >= 400 else None
    if isinstance(e, FileNotFoundError):
        return "missing"
    if isinstance(e, PermissionError) or (type(e) is OSError and str(e).startswith("Forbidden")):  # gcsfs's 403
        return "denied"
    kind = _client_kind(e)
    if kind is not None:
        return kind
    if isinstance(e, (TimeoutError, ConnectionError)):
        return "transient"
    if isinstance(e, OSError) and not isinstance(e, (FileExistsError, IsADirectoryError, NotADirectoryError)):
        # gcsfs/s3fs raise plain OSErrors for server errors they gave up retrying
        return "transient" if e.errno in TRANSIENT_ERRNOS or e.errno in (None, errno.EIO) else None
    return None


def _client_kind(e: BaseException) -> str | None:
    """failure_kind by the types of the storage clients' own exceptions (botocore, requests, aiohttp, urllib3,
    google-api-core, google-auth). Each module is looked up only if it is imported: one that is not raised nothing."""
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None:
        if isinstance(e, botocore.ClientError):  # an S3 answer s3fs did not translate
            response = e.response or {}
            if response.get("Error", {}).get("Code") in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return "denied"
            if response.get("Error", {}).get("Code") in ("NoSuchKey", "NoSuchBucket"):
                return "missing"
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return http_kind(status) if status >= 400 else None
        if isinstance(e, (botocore.NoCredentialsError, botocore.PartialCredentialsError)):
            return "denied"
        if isinstance(e, botocore.SSLError):
            return "refused"
        if isinstance(e, (botocore.ConnectionError, botocore.HTTPClientError)):
            return "transient"
        if isinstance(e, botocore.BotoCoreError):
            return None
    requests = sys.modules.get("requests.exceptions")
    if requests is not None and isinstance(e, requests.RequestException):
        if isinstance(e, (requests.InvalidURL, requests.MissingSchema, requests.InvalidSchema, requests.InvalidHeader,
                          requests.URLRequired, requests.SSLError, requests.TooManyRedirects)):
            return "refused"
        if isinstance(e, (requests.ConnectionError, requests.Timeout, requests.ChunkedEncodingError,
                          requests.ContentDecodingError)):
            return "transient"
        response = getattr(e, "response", None)
        return http_kind(response.status_code) if response is not None and response.status_code >= 400 else None
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(e, aiohttp.ClientError):
        if isinstance(e, (aiohttp.InvalidURL, aiohttp.ClientSSLError)):
            return "refused"
        return "transient" if isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)) else None
    urllib3 = sys.modules.get("urllib3.exceptions")
    if urllib3 is not None and isinstance(e, urllib3.HTTPError):
        return "refused" if isinstance(e, (urllib3.LocationValueError, urllib3.SSLError)) else "transient"
    google_auth = sys.modules.get("google.auth.exceptions")
    if google_auth is not None and isinstance(e, google_auth.GoogleAuthError):
        return "transient" if isinstance(e, google_auth.TransportError) else "denied"
    google_api = sys.modules.get("google.api_core.exceptions")
    if google_api is not None and isinstance(e, google_api.RetryError):  # the client's own retries ran out
        return "transient"
    return None


def retry_seconds() -> float:
    return float(os.environ.get("OLMO3EQX_STORAGE_RETRY_SECONDS", RETRY_SECONDS))


def first_line(e: BaseException) -> str:
    """The type and the first line (200 characters at most) of an exception, for a one-sentence error."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


T = TypeVar("T")
_stopping = threading.Event()
# At interpreter exit, before concurrent.futures joins its workers (grain's prefetch threads among them), retries give
# up: an ending process never waits out a reader's retries. Exit callbacks run last registered first, and
# concurrent.futures.thread registers its join when first imported: hence that import first.
threading._register_atexit(_stopping.set)
WARN_EVERY_S = 30.0
"""A store that fails for many readers at once is reported once per this many seconds, not once per read."""
_warned: dict[str, float] = {}
_warned_lock = threading.Lock()


def _warn_store(url: str, message: str) -> None:
    """Print `message` unless this URL's store (scheme and host) was reported in the last WARN_EVERY_S seconds."""
    parts = urlsplit(url)
    key, now = f"{parts.scheme}://{parts.netloc}", time.monotonic()
    with _warned_lock:
        if now - _warned.get(key, -WARN_EVERY_S) < WARN_EVERY_S:
            return
        _warned[key] = now
    print(message, file=sys.stderr, flush=True)


def retrying(op: Callable[[], T], url: str, what: str = "reading") -> T:
    """op(), retried while it fails transiently, for up to retry_seconds(); then StorageError. A missing object is
    FileNotFoundError and a denied one AccessDenied, each one sentence naming the URL (callers say what to fix)."""
    deadline = time.monotonic() + retry_seconds()
    pause, warned = RETRY_FIRST_S, False
    while True:
        try:
            return op()
        except Exception as e:  # noqa: BLE001 - classified below; anything unknown is re-raised as it is
            kind = failure_kind(e)
            if kind == "missing":
                raise FileNotFoundError(f"{redact(url)} does not exist") from None
            if kind == "denied":
                raise AccessDenied(
                    f"Access to {redact(url)} was denied ({first_line(e)}); check the credentials this host uses "
                    f"for {scheme(url)}:// ({credentials_hint(url)}) and that they may read"
                    f"{'' if what == 'reading' else ' and write'} the bucket.") from None
            if kind == "refused":
                raise BadRequest(f"{what.capitalize()} {redact(url)} was refused ({first_line(e)}): a malformed URL "
                                 f"or a request the store will always refuse; check the URL.") from None
            if kind != "transient":
                raise
            if time.monotonic() + pause > deadline or _stopping.is_set():
                waited = "as the process ended" if _stopping.is_set() else f"for {retry_seconds():.0f} s"
                raise StorageError(f"{what.capitalize()} {redact(url)} failed {waited} ({first_line(e)}); check that "
                                   f"the store is reachable and relaunch to resume") from None
            if not warned:
                _warn_store(url, f"warning: {what} {redact(url)} failed ({first_line(e)}); retrying for up to "
                                 f"{retry_seconds():.0f} s.")
                warned = True
            _stopping.wait(pause * random.uniform(0.5, 1.5))
            pause = min(2 * pause, RETRY_MAX_S)


def credentials_hint(url: str) -> str:
    s = scheme(url)
    if s == "gs":
        return "application-default credentials: gcloud auth application-default login, or " \
               "GOOGLE_APPLICATION_CREDENTIALS"
    if s == "s3":
        return "AWS_PROFILE, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or the instance role; AWS_ENDPOINT_URL for R2 " \
               "and MinIO"
    return "the URL itself: a signed URL may have expired"


# --- http(s): one Range request per read -------------------------------------------------------------


_http_local = threading.local()


def _http():
    session = getattr(_http_local, "session", None)
    if session is None:
        import requests

        session = _http_local.session = requests.Session()
    return session


HEAD_REFUSED = frozenset({403, 405})
"""Answers to HEAD after which the size is asked with a one-byte ranged GET instead: a URL presigned for GET refuses
any other method (403), and some servers do not implement HEAD (405)."""


def _http_size(url: str) -> int:
    """The size from HEAD's Content-Length, else from the Content-Range of a one-byte ranged GET."""
    r = _http().head(url, allow_redirects=True, timeout=HTTP_TIMEOUT_S)
    if r.status_code not in (200, *HEAD_REFUSED):
        raise HttpStatus(r.status_code, url)
    if r.status_code == 200 and "content-length" in r.headers and \
            r.headers.get("content-encoding") in (None, "identity"):
        return int(r.headers["content-length"])
    r = _http().get(url, headers={"Range": "bytes=0-0", "Accept-Encoding": "identity"}, stream=True,
                    timeout=HTTP_TIMEOUT_S)
    with contextlib.closing(r):
        total = _content_range(r, url)[2]
    return total


def _content_range(r, url: str) -> tuple[int, int, int]:
    found = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", r.headers.get("content-range", "").strip())
    if r.status_code != 206 or not found:
        if r.status_code in (200, 206):
            raise RangeIgnored(f"{redact(url)} ignored a Range request (HTTP {r.status_code}, Content-Range "
                               f"{r.headers.get('content-range')!r}): olmo3eqx reads token files one instance at a "
                               f"time and never downloads whole files; serve them from a server that honours Range "
                               f"requests, or copy them to local disk or a bucket.")
        raise HttpStatus(r.status_code, url)
    return int(found.group(1)), int(found.group(2)), int(found.group(3))


def _http_range(url: str, start: int, end: int) -> bytes:
    headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    r = _http().get(url, headers=headers, stream=True, timeout=HTTP_TIMEOUT_S)
    with contextlib.closing(r):
        if r.status_code not in (200, 206):
            raise HttpStatus(r.status_code, url)
        first, last, _ = _content_range(r, url)  # before the body: a 200 is never read
        if (first, last) != (start, end - 1):
            raise RangeIgnored(f"{redact(url)} answered bytes {first}-{last} to a request for {start}-{end - 1}; "
                               f"serve the files from a server that honours Range requests.")
        return r.raw.read(end - start, decode_content=False)


def _http_get(url: str) -> bytes:
    r = _http().get(url, timeout=HTTP_TIMEOUT_S)
    if r.status_code != 200:
        raise HttpStatus(r.status_code, url)
    return r.content


# --- reading -----------------------------------------------------------------------------------------


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


# --- writing -----------------------------------------------------------------------------------------


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


S3_MIN_PART = 5 << 20
"""S3's smallest part of a multipart upload but the last: an object this large is appended to by a server-side copy
into a multipart upload, a smaller one is written again whole (read back, put with the new bytes)."""


@dataclasses.dataclass(frozen=True)
class Version:
    """An object's version as its store names it (GCS generation, S3 ETag) and its size."""

    tag: str
    size: int


def _version(s: str, p: str) -> Version | None:
    bucket, _, key = _key(p).partition("/")
    if s == "gs":
        blob = _gcs_client().bucket(bucket).get_blob(key, retry=None)
        return None if blob is None else Version(str(blob.generation), int(blob.size))
    try:
        head = filesystem(s).call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None
    return Version(head["ETag"], int(head["ContentLength"]))


def _precondition_failed(e: BaseException) -> bool:
    """A conditional write refused because the object is not at the version asked (HTTP 412), as each client says
    it (s3fs turns it into FileExistsError or an EINVAL naming the pre-condition)."""
    return (412 in (getattr(e, "code", None), getattr(e, "status", None)) or type(e).__name__ == "PreconditionFailed"
            or isinstance(e, FileExistsError) or "pre-condition" in str(e).lower())


def append_bytes(p: str, data: bytes) -> None:
    """Add `data` at the end of object `p` (created if absent), once: GCS composes the object with a part uploaded
    beside it, S3 copies it server-side into a multipart upload (an object under S3_MIN_PART is put again whole).
    Each append is atomic (readers see it whole or not at all) and never doubled: the object's version is read
    first, every write is conditional on it, and every retry first looks whether an earlier try landed with its
    answer lost (the object is then that version plus `data`), so a retried append adds nothing. The part object
    of a GCS append is deleted after, apart from the append's retries: a deletion that fails leaves it behind, with
    a warning, and appends nothing again. One writer per object: another's write in between is a StorageError."""
    s = scheme(_writable(p))
    if s is None:
        with open(p, "ab") as f:
            f.write(data)
        return
    before = retrying(lambda: _version(s, p), p)
    part = f"{_key(p)}.part-{uuid.uuid4().hex}" if s == "gs" and before is not None else None

    def append():
        if _appended(s, p, before, data):
            return
        try:
            (_gcs_append if s == "gs" else _s3_append)(p, data, before, part)
        except Exception as e:  # noqa: BLE001 - a refused precondition may be our own earlier try: look
            if not _precondition_failed(e):
                raise
            if not _appended(s, p, before, data):
                raise StorageError(f"Appending to {redact(p)} was refused as if it had changed, but it has not "
                                   f"({first_line(e)}); check the store and relaunch.") from None

    retrying(append, p, "writing")
    if part is not None:
        _remove_part(part)


def _appended(s: str, p: str, before: Version | None, data: bytes) -> bool:
    """Whether object `p` is `before` plus `data` (an earlier try of this append landed): False while it is still
    `before`; StorageError when another writer changed it."""
    now = _version(s, p)
    if now == before:
        return False
    size = before.size if before is not None else 0
    if now is not None and now.size == size + len(data) and _read_remote(s, p, size, now.size) == data:
        return True
    raise StorageError(f"{redact(p)} changed while olmo3eqx appended to it: another process writes it too (one "
                       f"writer per file: give each its own run directory) or it was replaced; relaunch to resume.")


def _gcs_append(p: str, data: bytes, before: Version | None, part: str | None) -> None:
    bucket_name, _, key = _key(p).partition("/")
    bucket = _gcs_client().bucket(bucket_name)
    if before is None:
        bucket.blob(key).upload_from_string(data, if_generation_match=0, retry=None)
        return
    part_blob = bucket.blob(part.partition("/")[2])
    part_blob.upload_from_string(data, retry=None)
    bucket.blob(key).compose([bucket.blob(key), part_blob], if_generation_match=int(before.tag), retry=None)


def _s3_append(p: str, data: bytes, before: Version | None, _part: None) -> None:
    fs = filesystem("s3")
    bucket, _, key = _key(p).partition("/")
    if before is None:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    elif before.size < S3_MIN_PART:
        old = _read_remote("s3", p, 0, before.size) if before.size else b""
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=old + data, IfMatch=before.tag)
    else:
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        try:
            copied = fs.call_s3("upload_part_copy", Bucket=bucket, Key=key, UploadId=upload, PartNumber=1,
                                CopySource={"Bucket": bucket, "Key": key}, CopySourceIfMatch=before.tag)
            added = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=2, Body=data)
            fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload, IfMatch=before.tag,
                       MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": copied["CopyPartResult"]["ETag"]},
                                                  {"PartNumber": 2, "ETag": added["ETag"]}]})
        except BaseException:
            with contextlib.suppress(Exception):  # after a lost answer to the completion there is nothing to abort
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            raise


def _remove_part(part: str) -> None:
    """Delete a GCS append's part object (bucket/key); a failure leaves it behind with a warning: the append it
    served is done either way."""
    bucket_name, _, key = part.partition("/")
    url = f"gs://{part}"
    try:
        retrying(lambda: _gcs_client().bucket(bucket_name).blob(key).delete(retry=None), url, "deleting")
    except FileNotFoundError:
        pass
    except (StorageError, ConfigError) as e:
        print(f"warning: {e}; the append it was a part of is complete: delete {redact(url)} by hand.",
              file=sys.stderr, flush=True)


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


# --- conditional writes (the run lease) ----------------------------------------------------------------


@functools.cache
def _gcs_client():
    from google.cloud import storage as gcs

    configure_endpoints()
    try:
        return gcs.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT") or None)
    except Exception:  # noqa: BLE001 - no credentials and no project: reads of public buckets still work
        return gcs.Client.create_anonymous_client()


def _gcs_blob(url: str):
    bucket, _, key = _key(url).partition("/")
    return _gcs_client().bucket(bucket).blob(key)


def read_versioned(p: str) -> tuple[bytes, str, float] | None:
    """(content, version, server time of the last write in unix seconds) of object `p`, None when it does not exist;
    the version (a GCS generation, an S3 ETag) is what write_versioned compares against. The clients' own retries
    are off: `retrying` bounds them."""
    s = scheme(_writable(p))
    if s == "gs":
        def read():
            bucket, _, key = _key(p).partition("/")
            while True:
                blob = _gcs_client().bucket(bucket).get_blob(key, retry=None)  # metadata: generation, time
                if blob is None:
                    return None
                try:  # the content of that generation, or a new look when the object changed in between
                    data = blob.download_as_bytes(if_generation_match=blob.generation, retry=None)
                except Exception as e:  # noqa: BLE001
                    if failure_kind(e) == "missing" or getattr(e, "code", None) == 412:
                        continue
                    raise
                return data, str(blob.generation), blob.updated.timestamp()
        return retrying(read, p)
    fs = filesystem(s)
    bucket, _, key = _key(p).partition("/")

    async def get():
        out = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        async with out["Body"] as body:
            return await body.read(), out["ETag"], out["LastModified"].timestamp()

    def read():
        import fsspec.asyn

        try:
            return fsspec.asyn.sync(fs.loop, get)
        except FileNotFoundError:
            return None
    return retrying(read, p)


def write_versioned(p: str, data: bytes, expect: str | None) -> str | None:
    """Write object `p` only if it is still at version `expect` (None: only if it does not exist yet); the new
    version, or None when another writer got there first (a refusal after a retry whose first try landed with its
    answer lost finds `data` there: the write is ours). (No conditional delete: fake-gcs-server ignores its
    precondition, so the lease releases by writing an empty record instead.)"""
    s = scheme(_writable(p))
    if s == "gs":
        def write():
            blob = _gcs_blob(p)
            try:
                blob.upload_from_string(data, if_generation_match=0 if expect is None else int(expect), retry=None)
            except Exception as e:  # noqa: BLE001
                if _precondition_failed(e):
                    return _ours(p, data)
                raise
            return str(blob.generation)
        return retrying(write, p, "writing")
    fs = filesystem(s)
    bucket, _, key = _key(p).partition("/")
    condition = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect}

    def write():
        try:
            out = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except OSError as e:
            if _precondition_failed(e):
                return _ours(p, data)
            raise
        return out["ETag"]
    return retrying(write, p, "writing")


def _ours(p: str, data: bytes) -> str | None:
    """After a conditional write of `data` was refused: the object's version if it holds `data` (an earlier try
    of the same write landed, its answer lost), else None (another writer's)."""
    current = read_versioned(p)
    return current[1] if current is not None and current[0] == data else None


def describe(p: str) -> str:
    """How a path is reached, for the log: 'local', or the store and its endpoint."""
    s = scheme(p)
    if s is None:
        return "local disk"
    if s == "gs":
        host = os.environ.get("STORAGE_EMULATOR_HOST")
        return f"Google Cloud Storage{f' (emulator {host})' if host else ''}"
    if s == "s3":
        host = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return f"S3{f' at {host}' if host else ''}{' (unsigned)' if s3_anonymous() else ''}"
    return "HTTP Range requests"
