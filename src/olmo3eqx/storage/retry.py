"""What a failed remote operation means (by the type of what the client raised) and retrying the transient ones."""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - see _stopping
import errno
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

from olmo3eqx.errors import ConfigError, StorageError
from olmo3eqx.storage.paths import redact, scheme


RETRY_SECONDS = 120.0
"""How long a transient failure (timeouts, refused connections, 408/429/5xx) is retried before the run stops with
exit 74; override with OLMO3EQX_STORAGE_RETRY_SECONDS."""
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 8.0
"""Backoff between retries: doubling from the first to the largest pause, each pause jittered by +-50%."""


class AccessDenied(ConfigError):
    """The store refused access (401/403, or no credentials where the bucket needs them): permanent."""


class BadRequest(ConfigError):
    """A malformed URL, or a request the store refuses as such (a 4xx answer other than 401/403/404/408/425/429):
    permanent, so never retried."""




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


def _precondition_failed(e: BaseException) -> bool:
    """A conditional write refused because the object is not at the version asked (HTTP 412), as each client says
    it (s3fs turns it into FileExistsError or an EINVAL naming the pre-condition)."""
    return (412 in (getattr(e, "code", None), getattr(e, "status", None)) or type(e).__name__ == "PreconditionFailed"
            or isinstance(e, FileExistsError) or "pre-condition" in str(e).lower())
