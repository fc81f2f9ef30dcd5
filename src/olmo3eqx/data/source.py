"""Token files -> fixed-length instances: random access over np.memmaps, validated when opened.

Instances are cut as OLMo-core's NumpyFSLDataset cuts them: instance k of a file is its tokens
[k*seq_len, (k+1)*seq_len); each file's tail is dropped (with max_target_seq_len, the tail beyond a multiple of
max_target_seq_len, so a longer-sequence run can later reuse the same token boundaries), and instances never span
files. Files keep their configured order (globs expanded and sorted; a mix's line order), so the global instance
id of instance k of file f is (instances in the files before f) + k.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from glob import glob
from pathlib import Path

import numpy as np
from jaxtyping import Int, Int32

METADATA = "metadata.json"
"""Written by `prepare` beside its token files; gives their dtype and tokenizer."""
UINT16_MAX_VOCAB = 2**16
"""Vocabularies up to this size fit uint16 token files; larger ones need uint32."""
SAMPLE_CHUNKS = 4
SAMPLE_TOKENS = 4096
"""Token ids checked on open: SAMPLE_CHUNKS evenly spaced runs of SAMPLE_TOKENS tokens per file, cheap even
for thousands of files; every id is checked again as its instance is read."""


class DataError(ValueError):
    """Bad data or data config; the message names the file or field and the fix."""


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")


def expand_paths(patterns: Sequence[str], what: str = "data.paths") -> list[str]:
    """Files in config order: a glob becomes its sorted matches, a directory its sorted `*.npy` files."""
    out: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        if _is_glob(pattern):
            hits = sorted(p for p in glob(pattern, recursive=True) if os.path.isfile(p))
            if not hits:
                raise DataError(f"No file matches {pattern!r} in {what}; fix the pattern or prepare the files first.")
            out += hits
        elif os.path.isdir(pattern):
            hits = sorted(glob(os.path.join(pattern, "*.npy")))
            if not hits:
                raise DataError(f"Directory {pattern} in {what} holds no .npy token files; "
                                f"run python -m olmo3eqx.data.prepare --out {pattern} first.")
            out += hits
        else:
            out.append(pattern)
    return out


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """OLMo's rule: uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= UINT16_MAX_VOCAB else np.uint32)


def file_dtype(path: str, token_dtype: str, vocab_size: int | None) -> np.dtype:
    meta_path = Path(path).parent / METADATA
    meta_dtype = None
    if meta_path.is_file():
        meta_dtype = json.loads(meta_path.read_text()).get("dtype")
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
            f"Token file {path} holds token id {int(tokens.max())} >= vocab_size {vocab_size}; it was tokenized "
            f"with a larger vocabulary (set model.vocab_size or data.vocab_size to the tokenizer's) or "
            f"data.token_dtype does not match the file.")


def open_tokens(path: str, *, token_dtype: str, vocab_size: int | None, what: str) -> np.ndarray:
    """A token file as a read-only memmap, after the checks every reader makes: it exists, its size is whole
    tokens of its dtype, and a sample of its ids lies below vocab_size. An empty file gives an empty array."""
    if not os.path.isfile(path):
        raise DataError(f"Token file {path} does not exist; fix {what} or create it with "
                        f"python -m olmo3eqx.data.prepare.")
    dtype = file_dtype(path, token_dtype, vocab_size)
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        raise DataError(f"Token file {path} has {size} bytes, not a multiple of {dtype.itemsize} ({dtype}); "
                        f"it is truncated or holds another dtype (set data.token_dtype to the one it was "
                        f"written with).")
    if size == 0:
        return np.zeros(0, dtype)
    tokens = np.memmap(path, dtype=dtype, mode="r")
    chunk = min(SAMPLE_TOKENS, tokens.size)
    for start in np.unique(np.linspace(0, tokens.size - chunk, SAMPLE_CHUNKS).astype(np.int64)):
        check_ids(path, tokens[start:start + chunk], vocab_size)
    return tokens


def instances_in(num_tokens: int, seq_len: int, max_target_seq_len: int | None) -> int:
    """OLMo-core's count of a file's instances (NumpyFSLDataset._get_file_size_and_length)."""
    if max_target_seq_len is None or max_target_seq_len == seq_len:
        return num_tokens // seq_len
    return num_tokens // max_target_seq_len * (max_target_seq_len // seq_len)


class TokenSource:
    """Random access to the fixed-length instances of a list of token files, memory-mapped, never loaded."""

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
        self._arrays: list[np.ndarray] = []
        counts: list[int] = []
        for i, path in enumerate(files):
            tokens = open_tokens(path, token_dtype=token_dtype, vocab_size=vocab_size, what=what)
            self.fingerprint.append([os.path.basename(path), os.path.getsize(path)])
            n = instances_in(tokens.size, seq_len, max_target_seq_len)
            if n == 0:
                limit = f"max_target_seq_len={max_target_seq_len}" if max_target_seq_len else f"seq_len={seq_len}"
                warnings.warn(f"Token file {path} has fewer than {limit} tokens and is skipped.", stacklevel=2)
                continue
            self.paths.append(path)
            self.labels.append(labels[i] if labels is not None else Path(path).stem)
            self._arrays.append(tokens)
            counts.append(n)
        if not counts:
            raise DataError(f"No instance of seq_len {seq_len} in {', '.join(files)}; every file is shorter than "
                            f"seq_len tokens (lower seq_len or add data).")
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_instances = int(self._offsets[-1])

    def __len__(self) -> int:
        return self.num_instances

    def read(self, ids: Int[np.ndarray, " b"]) -> Int32[np.ndarray, "b s"]:
        """Tokens of global instances `ids` (each in [0, num_instances)), as int32 rows."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_instances):
            raise DataError(f"Instance ids must lie in [0, {self.num_instances}), got {ids.min()}..{ids.max()}.")
        files = np.searchsorted(self._offsets, ids, side="right") - 1
        out = np.empty((ids.size, self.seq_len), np.int32)
        for row, (f, i) in enumerate(zip(files.tolist(), ids.tolist())):
            start = (i - int(self._offsets[f])) * self.seq_len
            out[row] = self._arrays[f][start:start + self.seq_len]
        # Ids were only sampled on open; a bad one would be clamped silently by the embedding gather.
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            row = int(np.argmax(out.max(axis=1) >= self.vocab_size))
            check_ids(self.paths[int(files[row])], out[row], self.vocab_size)
        return out
