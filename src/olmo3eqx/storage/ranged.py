"""http(s) URLs: one Range request per read, its Content-Range checked before the body is read."""

from __future__ import annotations

import contextlib
import re
import threading

from olmo3eqx.errors import ConfigError
from olmo3eqx.storage.paths import redact
from olmo3eqx.storage.retry import HttpStatus


HTTP_TIMEOUT_S = 60.0


class RangeIgnored(ConfigError):
    """An http(s) server answered a Range request with the whole file, or with other bytes than asked."""




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
