"""Where each token file's documents lie, as [start, end) token spans, read without reading the file where possible.

- A remote file (gs://, s3://, http(s)://) with OLMo-core's document indices beside it, `NAME.csv.gz` for
  `NAME.npy` (gzip'd CSV, one `start,end` row per document, `end` one past its EOS): its rows, as
  olmo_core.data.utils.iter_document_indices reads them for a URL. This is the form AI2's remote data ships in, and
  what OLMo-core's write_document_indices and our `prepare` write; only that small file is read.
- Otherwise (a local file, as OLMo-core does; a remote one without indices): one scan for EOS, each document the
  tokens up to and including an EOS (tokens after the last EOS belong to none), a remote file read in ranged pieces,
  never held whole. The result is kept in `<cache_dir>/document-indices/`, keyed by the file's path, size (a local
  file's modification time too), the EOS id and the dtype, so a file is scanned once per host.

The two can disagree on data not written by the Dolma toolkit (a last document without EOS is a document in the
indices and dropped by the scan), exactly as they do in OLMo-core.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import sys
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from jaxtyping import Int64

from olmo3eqx import storage
from olmo3eqx.data.cache import build_once
from olmo3eqx.data.source import Tokens, chunks, parallel
from olmo3eqx.errors import DataError

INDEX_SUFFIX = ".csv.gz"
SCANS_DIR = "document-indices"
"""Under data.cache_dir: one .npy of document ends per scanned token file."""
SCAN_FORMAT = 1
"""Part of a scan's cache key; raised when what a cached scan holds changes."""
INDEX_COMPRESSLEVEL = 6
"""zlib's default: gzip's own 9 took 20 s a million rows here, 6 takes 3 s for the same size within 1%."""


def index_path(path: str) -> str | None:
    """OLMo-core's document-index file of token file `path` (its name with .npy replaced by .csv.gz, as
    iter_document_indices derives it); None for an http(s) URL with a query string (a signed URL signs one file)."""
    if storage.scheme(path) in storage.READ_ONLY and urlsplit(path).query:
        return None
    return storage.join(storage.parent(path), storage.basename(path).replace(".npy", INDEX_SUFFIX))


def format_index(spans: Int64[np.ndarray, "n 2"]) -> bytes:
    """The .csv.gz bytes of document spans, the rows write_document_indices writes."""
    text = "".join(f"{a},{b}\n" for a, b in spans.tolist())
    return gzip.compress(text.encode(), compresslevel=INDEX_COMPRESSLEVEL, mtime=0)


def parse_index(data: bytes, where: str, num_tokens: int) -> Int64[np.ndarray, "n 2"]:
    """The spans of a .csv.gz's rows (`start,end[,...]`), each checked to be a non-empty span inside the file's
    num_tokens tokens; `where` names the .csv.gz in errors."""
    try:
        text = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"Document indices {storage.redact(where)} are not gzip data ({e}); delete or rewrite them "
                        f"(olmo_core.data.utils.write_document_indices).") from None
    if not text.strip():
        return np.zeros((0, 2), np.int64)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spans = np.loadtxt(io.BytesIO(text), delimiter=",", dtype=np.int64, usecols=(0, 1), ndmin=2)
    except ValueError as e:
        raise DataError(f"Document indices {storage.redact(where)} are not 'start,end' rows of integers ({e}); "
                        f"rewrite them (olmo_core.data.utils.write_document_indices).") from None
    bad = np.flatnonzero((spans[:, 0] < 0) | (spans[:, 1] <= spans[:, 0]) | (spans[:, 1] > num_tokens))
    if bad.size:
        start, end = spans[bad[0]].tolist()
        raise DataError(f"Row {bad[0] + 1} of {storage.redact(where)} is the span {start},{end}, not a non-empty span "
                        f"of the file's {num_tokens:,} tokens; the indices belong to another file: rewrite them.")
    return spans


def eos_ends(tokens: Tokens, eos_id: int) -> Int64[np.ndarray, " n"]:
    """The end (one past the EOS) of each EOS-terminated document of one file; a remote file is scanned in ranged
    reads (olmo3eqx.data.source.chunks), never held whole."""
    parts = [np.flatnonzero(np.asarray(part) == eos_id).astype(np.int64) + (offset + 1)
             for offset, part in chunks(tokens)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def spans_from_ends(ends: Int64[np.ndarray, " n"]) -> Int64[np.ndarray, "n 2"]:
    return np.stack([np.concatenate([[0], ends])[:-1].astype(np.int64), ends.astype(np.int64)], axis=1)


def scan_index(tokens: Tokens, eos_id: int) -> bytes:
    """The .csv.gz of a file's EOS-terminated documents: the rows write_document_indices writes for it."""
    return format_index(spans_from_ends(eos_ends(tokens, eos_id)))


def file_key(path: str, tokens: Tokens) -> list:
    """What identifies a token file's content here: its path (a URL redacted, a local path absolute), bytes, dtype,
    and a local file's modification time (a file rewritten in place at the same size is scanned again)."""
    if storage.is_url(path):
        return [storage.redact(path), tokens.size * tokens.dtype.itemsize, str(tokens.dtype), None]
    return [os.path.abspath(path), tokens.size * tokens.dtype.itemsize, str(tokens.dtype), os.stat(path).st_mtime_ns]


def key_hash(fields) -> str:
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:32]


def scanned_spans(path: str, tokens: Tokens, eos_id: int, cache_dir: Path) -> Int64[np.ndarray, "n 2"]:
    """The EOS scan of one file, read from cache_dir's document-indices/ or scanned once and kept there."""
    readable = os.path.basename(urlsplit(path).path if storage.is_url(path) else path).removesuffix(".npy")[:64]
    target = cache_dir / SCANS_DIR / f"{readable}-{key_hash([SCAN_FORMAT, eos_id] + file_key(path, tokens))}.npy"

    def scan(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, eos_ends(tokens, eos_id))

    return spans_from_ends(np.load(build_once(target, scan, f"the document indices of {storage.redact(path)}")))


def fetch_index(path: str, num_tokens: int) -> Int64[np.ndarray, "n 2"] | None:
    """The spans of remote file `path`'s .csv.gz, None when it has none."""
    where = index_path(path)
    if where is None:
        return None
    try:
        data = storage.read_bytes(where)
    except FileNotFoundError:
        return None
    return parse_index(data, where, num_tokens)


def document_spans(paths: Sequence[str], arrays: Sequence[Tokens], *, eos_id: int,
                   cache_dir: str | os.PathLike) -> list[Int64[np.ndarray, "_ 2"]]:
    """Each file's document spans (module doc): remote indices fetched concurrently, then the scans the rest need,
    with a progress bar when they take a while."""
    from tqdm import tqdm

    remote = [i for i, p in enumerate(paths) if storage.is_url(p)]
    out: list = [None] * len(paths)
    with tqdm(total=len(paths), desc="document indices", unit="file", file=sys.stderr, delay=2.0) as bar:
        def fetch(i: int) -> None:
            out[i] = fetch_index(paths[i], arrays[i].size)
            if out[i] is not None:
                bar.update(1)

        parallel(fetch, remote, remote=True)
        for i in [i for i, spans in enumerate(out) if spans is None]:
            out[i] = scanned_spans(paths[i], arrays[i], eos_id, Path(cache_dir).expanduser())
            bar.update(1)
    return out
