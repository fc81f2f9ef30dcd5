"""One notion of a path: a local path or a URL, its scheme checked, joined, split and redacted."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from olmo3eqx.errors import ConfigError


WRITABLE = ("gs", "s3")
"""Schemes a run can write to (run.dir, convert.py's --out, checkpoints) and read from."""
READ_ONLY = ("http", "https")
"""Schemes read one Range request at a time; nothing is ever written there and they cannot be listed."""
CLOUD_EXTRA = 'pip install -e ".[cloud]"'
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class UnsupportedPath(ConfigError):
    """A URL whose scheme nothing here reads, or a read-only URL given where something is written."""


class MissingExtra(ConfigError):
    """gs:// or s3:// without the `cloud` extra installed."""




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
