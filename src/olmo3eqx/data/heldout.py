"""Held-out sets: which token files make each named set (eval.heldout_mix, eval.heldout), and their instances in
either layout.

A set's instances are either `packed` (seq_len consecutive tokens, documents running into each other, as training
sees them) or `document`, OLMo-core's NumpyPaddedFSLDataset for its perplexity sets: one instance per document
(the tokens up to and including an EOS; tokens after a file's last EOS belong to no document), its first seq_len
tokens, right-padded with the pad id. `read(ids)` gives tokens and label weights (weights[b, t] scores the
prediction of tokens[b, t + 1]), so a document of n tokens scores its n - 1 predictions and the padding none.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Float, Int

from olmo3eqx import storage
from olmo3eqx.config import DataConfig, EvalConfig, parse_named
from olmo3eqx.errors import ConfigError, DataError
from olmo3eqx.data.mixes import resolve_mix
from olmo3eqx.data.documents import eos_ends
from olmo3eqx.data.pipeline import heldout_files
from olmo3eqx.data.source import TokenSource, check_ids, chunks, expand_paths, open_tokens, read_slices

DEFAULT_SET = "heldout"
"""Name of the held-out set used when eval.heldout names none (data.heldout_paths or the default corpus's)."""


def _npy_under(directory: str) -> list[str]:
    return storage.glob(storage.join(directory, "**", "*.npy"))


def heldout_sets(eval_cfg: EvalConfig, data_cfg: DataConfig) -> dict[str, list[str]]:
    """Set name -> token files of eval.heldout, in config order. `name=glob` names one set (repeating a name adds
    files); a bare directory is OLMo's layout: each subdirectory holding .npy files (at any depth, e.g. `c4_en/val/`)
    is one set named after it, or the directory itself when it holds .npy files directly. No entry: the single set
    `heldout` from data.heldout_paths or the default corpus's held-out split, unless eval.heldout_mix names sets."""
    if not eval_cfg.heldout:
        if eval_cfg.heldout_mix:
            return {}
        files = heldout_files(data_cfg)
        if not files:
            raise DataError("No held-out token files; set eval.heldout_mix, eval.heldout or data.heldout_paths (or "
                            "leave data.paths empty to use the default corpus's held-out split).")
        return {DEFAULT_SET: files}
    sets: dict[str, list[str]] = {}
    for name, pattern in parse_named(eval_cfg.heldout, "eval.heldout"):
        if name is not None:
            sets.setdefault(name, []).extend(expand_paths([pattern], f"eval.heldout ({name})"))
            continue
        path = storage.check(pattern, "eval.heldout")
        if not storage.isdir(path):
            raise ConfigError(f"eval.heldout entry {storage.redact(pattern)!r} is neither 'name=glob' nor a "
                              f"directory (an http(s) URL cannot be listed); write it as name={pattern}.")
        if storage.glob(storage.join(path, "*.npy")):
            sets.setdefault(storage.basename(path), []).extend(expand_paths([path], "eval.heldout"))
            continue
        found = False
        for sub in (p for p in storage.listdir(path) if storage.isdir(p)):
            files = _npy_under(sub)
            if files:
                sets.setdefault(storage.basename(sub), []).extend(files)
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


def mix_sets(eval_cfg: EvalConfig, data_cfg: DataConfig) -> dict[str, list[str]]:
    """Label -> token files of eval.heldout_mix under data.mix_root, in mix order (empty without a mix)."""
    sets: dict[str, list[str]] = {}
    if eval_cfg.heldout_mix:
        for f in resolve_mix(eval_cfg.heldout_mix, data_cfg.mix_root, "eval.heldout_mix"):
            sets.setdefault(f.label, []).append(f.path)
    return sets


class DocumentInstances:
    """OLMo-core's padded layout: each EOS-terminated document is one instance, its first seq_len tokens."""

    def __init__(self, files: list[str], *, seq_len: int, token_dtype: str, vocab_size: int, eos_id: int,
                 pad_id: int, what: str):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.arrays, file_idx, starts, lengths = [], [], [], []
        for path in expand_paths(files, what):
            tokens = open_tokens(path, token_dtype=token_dtype, vocab_size=vocab_size, what=what)
            for _, part in chunks(tokens):  # every id: the file is read whole for its EOS positions anyway
                check_ids(path, part, vocab_size)
            ends = eos_ends(tokens, eos_id)
            doc_starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
            file_idx.append(np.full(ends.size, len(self.arrays), np.int64))
            starts.append(doc_starts)
            lengths.append(np.minimum(ends - doc_starts, seq_len))
            self.arrays.append(tokens)
        self.file_idx, self.starts, self.lengths = (np.concatenate(x) for x in (file_idx, starts, lengths))
        if not np.any(self.lengths >= 2):  # a one-token document has nothing to predict
            raise DataError(f"{what} holds no EOS-terminated document of two or more tokens; check the files and "
                            f"model.eos_token_id.")
        self.num_instances = int(self.starts.size)

    def read(self, ids: Int[np.ndarray, " b"]) -> tuple[Int[np.ndarray, "b s"], Float[np.ndarray, "b s"]]:
        """Tokens and label weights of instances `ids` (-1: padding, weight 0)."""
        tokens = np.full((ids.size, self.seq_len), self.pad_id, np.int32)
        weights = np.zeros((ids.size, self.seq_len), np.float32)
        rows = [row for row, i in enumerate(ids.tolist()) if i >= 0]
        spans = [(int(self.starts[ids[r]]), int(self.lengths[ids[r]])) for r in rows]
        docs = read_slices([(self.arrays[int(self.file_idx[ids[r]])], a, a + n) for r, (a, n) in zip(rows, spans)])
        for row, (_, n), doc in zip(rows, spans, docs):
            tokens[row, :n] = doc
            weights[row, :n - 1] = 1.0
        return tokens, weights


def heldout_instances(files: list[str], *, mode: str, seq_len: int, token_dtype: str, vocab_size: int,
                      eos_id: int, pad_id: int, what: str):
    if mode == "packed":
        return PackedInstances(files, seq_len=seq_len, token_dtype=token_dtype, vocab_size=vocab_size, what=what)
    return DocumentInstances(files, seq_len=seq_len, token_dtype=token_dtype, vocab_size=vocab_size, eos_id=eos_id,
                             pad_id=pad_id, what=what)


def open_heldout(eval_cfg: EvalConfig, data_cfg: DataConfig, *, seq_len: int, vocab_size: int, eos_id: int,
                 pad_id: int) -> dict:
    """Set name -> its instances, every file opened and checked now: eval.heldout_mix's sets (OLMo-core's padded
    layout), then eval.heldout's (or the default set) in eval.heldout_instances' layout."""
    common = dict(seq_len=seq_len, token_dtype=data_cfg.token_dtype, vocab_size=vocab_size, eos_id=eos_id,
                  pad_id=pad_id)
    sets = {name: heldout_instances(files, mode="document", what=f"eval.heldout_mix ({name})", **common)
            for name, files in mix_sets(eval_cfg, data_cfg).items()}
    for name, files in heldout_sets(eval_cfg, data_cfg).items():
        if name in sets:
            raise ConfigError(f"Held-out set {name} is named by both eval.heldout_mix and eval.heldout; rename the "
                              f"eval.heldout one with name=path.")
        sets[name] = heldout_instances(files, mode=eval_cfg.heldout_instances, what=f"eval.heldout ({name})",
                                       **common)
    return sets
