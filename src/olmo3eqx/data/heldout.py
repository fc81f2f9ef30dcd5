"""Held-out sets: which token files make each named set (eval.heldout), and their instances in either layout.

A set's instances are either `packed` (seq_len consecutive tokens, documents running into each other, as training
sees them) or `document` (OLMo's padded layout for its v3 small perplexity sets: every document, up to and
including its EOS, is its own instance, split every seq_len tokens and padded with the pad id, the padding not
scored). `read(ids)` gives tokens and label weights (weights[b, t] scores the prediction of tokens[b, t + 1]).
"""

from __future__ import annotations

import os
from glob import glob
from pathlib import Path

import numpy as np
from jaxtyping import Float, Int

from olmo3eqx.config import ConfigError, DataConfig, EvalConfig, parse_named
from olmo3eqx.data.pipeline import resolve_paths
from olmo3eqx.data.source import DataError, TokenSource, check_ids, expand_paths, file_dtype

DEFAULT_SET = "heldout"
"""Name of the held-out set used when eval.heldout names none (data.heldout_paths or the default corpus's)."""


def _npy_under(directory: str) -> list[str]:
    return sorted(p for p in glob(os.path.join(directory, "**", "*.npy"), recursive=True) if os.path.isfile(p))


def heldout_sets(eval_cfg: EvalConfig, data_cfg: DataConfig) -> dict[str, list[str]]:
    """Set name -> token files, in config order. `name=glob` names one set (repeating a name adds files); a bare
    directory is OLMo's layout: each subdirectory holding .npy files (at any depth, e.g. `c4_en/val/`) is one
    set named after it, or the directory itself when it holds .npy files directly. No entry: the single set
    `heldout` from data.heldout_paths or the default corpus's held-out split."""
    if not eval_cfg.heldout:
        _, files = resolve_paths(data_cfg)
        if not files:
            raise DataError("No held-out token files; set eval.heldout or data.heldout_paths (or leave data.paths "
                            "empty to use the default corpus's held-out split).")
        return {DEFAULT_SET: files}
    sets: dict[str, list[str]] = {}
    for name, pattern in parse_named(eval_cfg.heldout, "eval.heldout"):
        if name is not None:
            sets.setdefault(name, []).extend(expand_paths([pattern], f"eval.heldout ({name})"))
            continue
        path = os.path.expanduser(pattern)
        if not os.path.isdir(path):
            raise ConfigError(f"eval.heldout entry {pattern!r} is neither 'name=glob' nor a directory; "
                              f"write it as name={pattern}.")
        if glob(os.path.join(path, "*.npy")):
            sets.setdefault(Path(path).name, []).extend(expand_paths([path], "eval.heldout"))
            continue
        found = False
        for sub in sorted(p for p in Path(path).iterdir() if p.is_dir()):
            files = _npy_under(str(sub))
            if files:
                sets.setdefault(sub.name, []).extend(files)
                found = True
        if not found:
            raise ConfigError(f"Directory {path} in eval.heldout holds no .npy token files (directly or in "
                              f"subdirectories, one per set).")
    return sets


class PackedInstances:
    """seq_len consecutive tokens of one file, documents packed (the training layout)."""

    def __init__(self, files: list[str], *, seq_len: int, token_dtype: str, vocab_size: int, what: str):
        self.source = TokenSource(files, seq_len=seq_len, token_dtype=token_dtype, vocab_size=vocab_size, what=what)
        self.num_instances = self.source.num_instances
        self.seq_len = seq_len

    def read(self, ids: Int[np.ndarray, " b"]) -> tuple[Int[np.ndarray, "b s"], Float[np.ndarray, "b s"]]:
        """Tokens and label weights of instances `ids` (-1: padding, weight 0)."""
        valid = ids >= 0
        tokens = np.zeros((ids.size, self.seq_len), np.int32)
        tokens[valid] = self.source.read(ids[valid])
        weights = np.zeros((ids.size, self.seq_len), np.float32)
        weights[valid, :-1] = 1.0
        return tokens, weights


class DocumentInstances:
    """OLMo's padded layout: each document (through its EOS) is its own instance, split every seq_len tokens."""

    def __init__(self, files: list[str], *, seq_len: int, token_dtype: str, vocab_size: int, eos_id: int,
                 pad_id: int, what: str):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.arrays, file_idx, starts, lengths = [], [], [], []
        for path in expand_paths(files, what):
            if not os.path.isfile(path):
                raise DataError(f"Token file {path} does not exist; fix {what}.")
            dtype = file_dtype(path, token_dtype, vocab_size)
            if os.path.getsize(path) % dtype.itemsize:
                raise DataError(f"Token file {path} is not a whole number of {dtype} tokens; it is truncated or "
                                f"holds another dtype.")
            tokens = np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)
            check_ids(path, tokens, vocab_size)
            ends = np.flatnonzero(tokens == eos_id) + 1
            if ends.size == 0 or ends[-1] != tokens.size:
                ends = np.append(ends, tokens.size)  # a last document without EOS is still a document
            doc_starts = np.concatenate([[0], ends[:-1]])
            for a, b in zip(doc_starts.tolist(), ends.tolist()):
                for s in range(a, b, seq_len):
                    if min(b, s + seq_len) - s >= 2:  # one token has nothing to predict
                        file_idx.append(len(self.arrays))
                        starts.append(s)
                        lengths.append(min(b, s + seq_len) - s)
            self.arrays.append(tokens)
        if not starts:
            raise DataError(f"{what} holds no document of two or more tokens.")
        self.file_idx, self.starts, self.lengths = (np.asarray(x, np.int64) for x in (file_idx, starts, lengths))
        self.num_instances = len(starts)

    def read(self, ids: Int[np.ndarray, " b"]) -> tuple[Int[np.ndarray, "b s"], Float[np.ndarray, "b s"]]:
        tokens = np.full((ids.size, self.seq_len), self.pad_id, np.int32)
        weights = np.zeros((ids.size, self.seq_len), np.float32)
        for row, i in enumerate(ids.tolist()):
            if i < 0:
                continue
            start, n = int(self.starts[i]), int(self.lengths[i])
            tokens[row, :n] = self.arrays[int(self.file_idx[i])][start:start + n]
            weights[row, :n - 1] = 1.0
        return tokens, weights


def heldout_instances(files: list[str], *, mode: str, seq_len: int, token_dtype: str, vocab_size: int,
                      eos_id: int, pad_id: int, what: str):
    if mode == "packed":
        return PackedInstances(files, seq_len=seq_len, token_dtype=token_dtype, vocab_size=vocab_size, what=what)
    return DocumentInstances(files, seq_len=seq_len, token_dtype=token_dtype, vocab_size=vocab_size, eos_id=eos_id,
                             pad_id=pad_id, what=what)
