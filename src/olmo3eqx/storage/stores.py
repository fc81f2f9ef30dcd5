"""The stores behind gs:// and s3:// URLs: fsspec file systems, endpoints and credentials, path objects."""

from __future__ import annotations

import functools
import logging
import os
import threading
from pathlib import Path

from etils import epath

from olmo3eqx.storage.paths import (CLOUD_EXTRA, READ_ONLY, WRITABLE, MissingExtra, UnsupportedPath, check, redact,
                                    scheme)


StorePath = Path | epath.Path
"""What `path` returns: a pathlib.Path for a local path, an etils.epath.Path for gs:// and s3://."""


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




@functools.cache
def _gcs_client():
    from google.cloud import storage as gcs

    configure_endpoints()
    try:
        return gcs.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT") or None)
    except Exception:  # noqa: BLE001 - no credentials and no project: reads of public buckets still work
        return gcs.Client.create_anonymous_client()


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
