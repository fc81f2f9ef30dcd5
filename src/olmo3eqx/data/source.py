"""Token files -> fixed-length instances: random access over np.memmaps (local files) or one ranged read per
instance (gs://, s3://, http(s):// URLs, olmo3eqx.storage: nothing downloaded whole, no local copy), validated when
opened.

Instances are cut as OLMo-core's NumpyFSLDataset cuts them: instance k of a file is its tokens
[k*seq_len, (k+1)*seq_len); each file's tail is dropped (with max_target_seq_len, the tail beyond a multiple of
max_target_seq_len, so a longer-sequence run can later reuse the same token boundaries), and instances never span
files. Files keep their configured order (globs expanded and sorted; a mix's line order), so the global instance
id of instance k of file f is (instances in the files before f) + k. A file's size comes from the store (HEAD or
object metadata) for a URL, so instance numbers, the fingerprint and OLMo-core's order are those of a local copy.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import warnings
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from jaxtyping import Int, Int32

from olmo3eqx import storage
from olmo3eqx.errors import DataError

METADATA = "metadata.json"
"""Written by `prepare` beside its token files; gives their dtype and tokenizer."""
UINT16_MAX_VOCAB = 2**16
"""Vocabularies up to this size fit uint16 token files; larger ones need uint32."""
SAMPLE_CHUNKS = 4
SAMPLE_TOKENS = 4096
"""Token ids checked on open: SAMPLE_CHUNKS evenly spaced runs of SAMPLE_TOKENS tokens per file, cheap even
for thousands of files; every id is checked again as its instance is read."""
SCAN_BYTES = 16 << 20
"""A remote file read whole (its EOS positions, for packing and the padded held-out layout) comes in ranged reads of
this size, a few at a time, never held whole."""
OPEN_THREADS = 32
"""Remote files opened at once (a HEAD and the sampled ids each): a mix of 1,016 files opens in seconds."""


def _is_glob(pattern: str) -> bool:
    """Glob characters in a path (in an http(s) URL, '?' starts the query string)."""
    if storage.scheme(pattern) in storage.READ_ONLY:
        return any(c in pattern.split("?", 1)[0] for c in "*[")
    return any(c in pattern for c in "*?[")


def expand_paths(patterns: Sequence[str], what: str = "data.paths") -> list[str]:
    """Files in config order: a glob becomes its sorted matches, a directory its sorted `*.npy` files; local paths
    and gs://, s3:// URLs alike (an http(s):// URL names one file: a web server cannot be listed)."""
    out: list[str] = []
    for pattern in patterns:
        pattern = storage.check(pattern, what)
        web = storage.scheme(pattern) in storage.READ_ONLY
        if _is_glob(pattern):
            hits = storage.glob(pattern)  # an http(s) URL cannot be listed: refused there with one sentence
            if not hits:
                raise DataError(f"No file matches {storage.redact(pattern)!r} in {what}; fix the pattern or prepare "
                                f"the files first.")
            out += hits
        elif not web and (not storage.is_url(pattern) or not pattern.endswith(".npy")) and storage.isdir(pattern):
            hits = storage.glob(storage.join(pattern, "*.npy"))
            if not hits:
                raise DataError(f"Directory {storage.redact(pattern)} in {what} holds no .npy token files; "
                                f"run python -m olmo3eqx.data.prepare --out {pattern} first.")
            out += hits
        else:
            out.append(pattern)
    return out


def parallel(fn: Callable, items: Sequence, *, remote: bool) -> list:
    """[fn(x) for x in items]: for remote items OPEN_THREADS at a time (each is a round trip), local ones in order."""
    if not remote or len(items) < 2:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(min(OPEN_THREADS, len(items)), "olmo3eqx-open") as pool:
        return list(pool.map(fn, items))


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """OLMo's rule: uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_MAX_VOCAB else np.uint32)


def read_metadata_dtype(directory: str) -> str | None:
    """The dtype `prepare`'s metadata.json in `directory` names, None without one."""
    try:
        return json.loads(storage.read_text(storage.join(directory, METADATA))).get("dtype")
    except (FileNotFoundError, IsADirectoryError):
        return None


remote_metadata_dtype = functools.lru_cache(maxsize=256)(read_metadata_dtype)
"""read_metadata_dtype of a URL's directory, read once per process: a mix's files share a few directories."""


def stem(path: str) -> str:
    """A file's name without its suffix (a file's default label)."""
    return os.path.splitext(storage.basename(path))[0]


def file_dtype(path: str, token_dtype: str, vocab_size: int | None) -> np.dtype:
    meta_path = storage.join(storage.parent(path), METADATA)
    directory = storage.parent(path)
    meta_dtype = remote_metadata_dtype(directory) if storage.is_url(path) else read_metadata_dtype(directory)
    if token_dtype != "auto":
        if meta_dtype is not None and meta_dtype != token_dtype:
            raise DataError(f"data.token_dtype is {token_dtype} but {meta_path} says {path} holds {meta_dtype}; "
                            f"set data.token_dtype to {meta_dtype} or auto.")
        return np.dtype(token_dtype)
    if meta_dtype is not None:
        return np.dtype(meta_dtype)
    if vocab_size is None:
        raise DataError(f"Cannot tell the dtype of {path} (no {METADATA} beside it and no vocab_size); "
                        f"set data.token_dtype to uint16 or uint32.")
    return token_dtype_for_vocab(vocab_size)


def check_ids(path: str, tokens: np.ndarray, vocab_size: int | None) -> None:
    if vocab_size is not None and tokens.size and int(tokens.max()) >= vocab_size:
        raise DataError(
            f"Token file {storage.redact(path)} holds token id {int(tokens.max())} >= vocab_size {vocab_size}; it was tokenized "
            f"with a larger vocabulary (set model.vocab_size or data.vocab_size to the tokenizer's) or "
            f"data.token_dtype does not match the file.")


class RemoteTokens:
    """A token file at a URL as an array of `size` tokens of `dtype`: a slice is one ranged read (exactly its
    bytes, retried when the store fails transiently, an error naming the URL otherwise), nothing else is read."""

    def __init__(self, url: str, dtype: np.dtype, size: int):
        self.url, self.dtype, self.size = url, dtype, size

    def __len__(self) -> int:
        return self.size

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    def span(self, start: int, stop: int) -> tuple[str, int, int]:
        """The ranged read of tokens [start, stop)."""
        return self.url, start * self.dtype.itemsize, stop * self.dtype.itemsize

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self.size)
        if step != 1:
            raise IndexError("RemoteTokens takes contiguous slices only")
        if stop <= start:
            return np.zeros(0, self.dtype)
        return np.frombuffer(storage.read_bytes(*self.span(start, stop)), self.dtype)


Tokens = np.ndarray | RemoteTokens
"""A token file: a read-only memmap (local) or RemoteTokens (a URL)."""


def read_slices(slices: Sequence[tuple[Tokens, int, int]]) -> list[np.ndarray]:
    """tokens[start:stop] for each (tokens, start, stop); the remote ones fetched concurrently (storage.read_many)."""
    remote = [i for i, (t, _, _) in enumerate(slices) if isinstance(t, RemoteTokens)]
    out: list[np.ndarray | None] = [None if isinstance(t, RemoteTokens) else t[a:b] for t, a, b in slices]
    fetched = storage.read_many([slices[i][0].span(slices[i][1], slices[i][2]) for i in remote])
    for i, data in zip(remote, fetched):
        out[i] = np.frombuffer(data, slices[i][0].dtype)
    return out


def chunks(tokens: Tokens) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, tokens) covering a whole file in order: a memmap at once, a remote file SCAN_BYTES at a time (a few
    ranged reads in flight; none of it kept)."""
    if not isinstance(tokens, RemoteTokens):
        yield 0, tokens
        return
    step = max(1, SCAN_BYTES // tokens.dtype.itemsize)
    starts = list(range(0, tokens.size, step))
    ahead = storage.READ_THREADS // 4 or 1
    for i in range(0, len(starts), ahead):
        group = starts[i:i + ahead]
        for start, data in zip(group, read_slices([(tokens, a, min(a + step, tokens.size)) for a in group])):
            yield start, data


def open_tokens(path: str, *, token_dtype: str, vocab_size: int | None, what: str) -> Tokens:
    """A token file as a read-only memmap (local) or RemoteTokens (a URL), after the checks every reader makes: it
    exists, its size is whole tokens of its dtype, and a sample of its ids lies below vocab_size. An empty file
    gives an empty array."""
    remote = storage.is_url(path)
    try:
        size = storage.size(path) if remote else (os.path.getsize(path) if os.path.isfile(path) else None)
    except FileNotFoundError:
        size = None
    if size is None:
        raise DataError(f"Token file {storage.redact(path)} does not exist; fix {what} or create it with "
                        f"python -m olmo3eqx.data.prepare.")
    dtype = file_dtype(path, token_dtype, vocab_size)
    if size % dtype.itemsize:
        raise DataError(f"Token file {storage.redact(path)} has {size} bytes, not a multiple of {dtype.itemsize} "
                        f"({dtype}); it is truncated or holds another dtype (set data.token_dtype to the one it was "
                        f"written with).")
    if size == 0:
        return np.zeros(0, dtype)
    tokens = RemoteTokens(path, dtype, size // dtype.itemsize) if remote else np.memmap(path, dtype=dtype, mode="r")
    chunk = min(SAMPLE_TOKENS, tokens.size)
    starts = np.unique(np.linspace(0, tokens.size - chunk, SAMPLE_CHUNKS).astype(np.int64)).tolist()
    for sample in read_slices([(tokens, a, a + chunk) for a in starts]):
        check_ids(path, sample, vocab_size)
    return tokens


def file_size(path: str) -> int:
    """Bytes of a token file (the store's metadata for a URL), as the fingerprint records it."""
    return storage.size(path) if storage.is_url(path) else os.path.getsize(path)


def instances_in(num_tokens: int, seq_len: int, max_target_seq_len: int | None) -> int:
    """OLMo-core's count of a file's instances (NumpyFSLDataset._get_file_size_and_length)."""
    if max_target_seq_len is None or max_target_seq_len == seq_len:
        return num_tokens // seq_len
    return num_tokens // max_target_seq_len * (max_target_seq_len // seq_len)


class TokenSource:
    """Random access to the fixed-length instances of a list of token files: memory-mapped or read by range, never
    loaded whole."""

    def __init__(self, paths: Sequence[str], *, seq_len: int, token_dtype: str = "auto",
                 vocab_size: int | None = None, max_target_seq_len: int | None = None,
                 labels: Sequence[str] | None = None, what: str = "data.paths"):
        if seq_len <= 0:
            raise DataError(f"seq_len must be positive, got {seq_len}.")
        files = expand_paths(paths, what)
        if not files:
            raise DataError(f"{what} names no token files; give .npy files, directories or globs.")
        if labels is not None and len(labels) != len(files):
            raise DataError(f"{len(labels)} labels for {len(files)} files in {what}; give one label per file.")
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.fingerprint: list[list] = []
        self.paths: list[str] = []
        self.labels: list[str] = []
        """The label of each file in `paths` (a mix line's label; the file name without a mix)."""
        self._arrays: list[Tokens] = []
        counts: list[int] = []
        opened = parallel(lambda p: open_tokens(p, token_dtype=token_dtype, vocab_size=vocab_size, what=what), files,
                          remote=any(map(storage.is_url, files)))
        for i, (path, tokens) in enumerate(zip(files, opened)):
            self.fingerprint.append([storage.basename(path), tokens.size * tokens.dtype.itemsize])
            n = instances_in(tokens.size, seq_len, max_target_seq_len)
            if n == 0:
                limit = f"max_target_seq_len={max_target_seq_len}" if max_target_seq_len else f"seq_len={seq_len}"
                warnings.warn(f"Token file {storage.redact(path)} has fewer than {limit} tokens and is skipped.",
                              stacklevel=2)
                continue
            self.paths.append(path)
            self.labels.append(labels[i] if labels is not None else stem(path))
            self._arrays.append(tokens)
            counts.append(n)
        if not counts:
            raise DataError(f"No instance of seq_len {seq_len} in {', '.join(map(storage.redact, files))}; every "
                            f"file is shorter than seq_len tokens (lower seq_len or add data).")
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_instances = int(self._offsets[-1])

    def __len__(self) -> int:
        return self.num_instances

    def read(self, ids: Int[np.ndarray, " b"]) -> Int32[np.ndarray, "b s"]:
        """Tokens of global instances `ids` (each in [0, num_instances)), as int32 rows; a remote file's instances
        are one ranged read each, the batch's reads in flight together."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_instances):
            raise DataError(f"Instance ids must lie in [0, {self.num_instances}), got {ids.min()}..{ids.max()}.")
        files = np.searchsorted(self._offsets, ids, side="right") - 1
        out = np.empty((ids.size, self.seq_len), np.int32)
        starts = [(i - int(self._offsets[f])) * self.seq_len for f, i in zip(files.tolist(), ids.tolist())]
        rows = read_slices([(self._arrays[f], a, a + self.seq_len) for f, a in zip(files.tolist(), starts)])
        for row, tokens in enumerate(rows):
            out[row] = tokens
        # Ids were only sampled on open; a bad one would be clamped silently by the embedding gather.
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            row = int(np.argmax(out.max(axis=1) >= self.vocab_size))
            check_ids(self.paths[int(files[row])], out[row], self.vocab_size)
        return out
