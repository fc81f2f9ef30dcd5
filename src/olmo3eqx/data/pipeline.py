"""Global batches on grain: one permutation per epoch, one contiguous row per step, sharded exactly once.

Row r of the global order (epoch e = r // batches_per_epoch, row i = r % batches_per_epoch) holds the
instances perm_e[i*global_batch : (i+1)*global_batch]; instances left over at the end of an epoch's
permutation are dropped. perm_e depends on (seed, e, number of instances) only, never on the number of
processes. Process s of n takes the contiguous slice [s*g/n, (s+1)*g/n) of every row (`shard_rows`); nothing
else shards. The iterator's position is the number of global rows consumed, so a restored state yields the
same global rows whatever the process count, thread count or prefetch depth.
"""

from __future__ import annotations

import sys
import warnings

import grain
import numpy as np
from jaxtyping import Int, Int64

from olmo3eqx.config import DataConfig
from olmo3eqx.data.corpus import default_corpus
from olmo3eqx.data.filters import repeated_ngram_mask
from olmo3eqx.data.source import DataError, TokenSource, expand_paths

STATE_VERSION = 1
FEISTEL_ROUNDS = 6
"""Rounds of the keyed Feistel network behind each epoch's permutation."""


# --- order -----------------------------------------------------------------------------------------


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def epoch_permutation(positions: Int[np.ndarray, " k"], *, num_instances: int, seed: int,
                      epoch: int) -> Int64[np.ndarray, " k"]:
    """perm_e[positions]: a pseudo-random permutation of range(num_instances) keyed by (seed, epoch).

    A Feistel network is a bijection on [0, 2**k) for any round function (here unbalanced, the halves
    swapping sizes each round, so 2**k < 2 * num_instances); walking the cycle until the value falls below
    num_instances (< 2 steps on average) restricts it to a bijection on [0, num_instances). Each entry is
    computed on its own, so no O(num_instances) array is built (700M instances for 7B).
    """
    if seed < 0 or epoch < 0:
        raise DataError(f"seed and epoch must be non-negative, got seed={seed}, epoch={epoch}.")
    bits = max(2, (num_instances - 1).bit_length())
    keys = np.random.SeedSequence([seed, epoch]).generate_state(FEISTEL_ROUNDS, np.uint64)

    def encrypt(x):
        left_bits, right_bits = bits // 2, bits - bits // 2
        for key in keys:
            left, right = x >> np.uint64(right_bits), x & np.uint64((1 << right_bits) - 1)
            left ^= _mix64(right ^ key) & np.uint64((1 << left_bits) - 1)
            x = (right << np.uint64(left_bits)) | left
            left_bits, right_bits = right_bits, left_bits
        return x

    x = encrypt(positions.astype(np.uint64))
    outside = x >= num_instances
    while outside.any():
        x[outside] = encrypt(x[outside])
        outside = x >= num_instances
    return x.astype(np.int64)


class GlobalRow:
    """Global batch r -> the instance ids of row r % batches_per_epoch of epoch r // batches_per_epoch."""

    def __init__(self, num_instances: int, *, seed: int, global_batch: int):
        self.num_instances, self.seed, self.global_batch = num_instances, seed, global_batch
        self.batches_per_epoch = num_instances // global_batch

    def __call__(self, r: int) -> Int64[np.ndarray, " g"]:
        epoch, row = divmod(r, self.batches_per_epoch)
        positions = np.arange(row * self.global_batch, (row + 1) * self.global_batch, dtype=np.int64)
        return epoch_permutation(positions, num_instances=self.num_instances, seed=self.seed, epoch=epoch)


def global_order(num_instances: int, *, seed: int, global_batch: int) -> grain.MapDataset:
    """The endless sequence of global rows (element r: int64 [global_batch] instance ids), epoch after epoch."""
    if global_batch <= 0:
        raise DataError(f"global_batch must be positive, got {global_batch}.")
    if num_instances < global_batch:
        raise DataError(f"The data holds {num_instances} instances, fewer than one global batch of {global_batch}; "
                        f"add data or lower data.global_batch or data.seq_len.")
    return grain.MapDataset.range(sys.maxsize).map(GlobalRow(num_instances, seed=seed, global_batch=global_batch))


class ShardSlice:
    """A row -> this process's contiguous part of it."""

    def __init__(self, shard_index: int, shard_count: int):
        self.shard_index, self.shard_count = shard_index, shard_count

    def __call__(self, row: Int64[np.ndarray, " g"]) -> Int64[np.ndarray, " l"]:
        local = row.size // self.shard_count
        return row[self.shard_index * local:(self.shard_index + 1) * local]


def shard_rows(rows: grain.MapDataset, *, shard_index: int, shard_count: int) -> grain.MapDataset:
    """The one sharding step of the pipeline: process shard_index of shard_count takes its slice of each row.

    Applying a second sharding on top (as the MaxText port did with grain's ShardOptions) makes each
    process skip rows; tests/test_data_pipeline.py builds that on purpose and shows the exactly-once check fail.
    """
    if shard_count <= 0 or not 0 <= shard_index < shard_count:
        raise DataError(f"shard_index must lie in [0, shard_count), got {shard_index} of {shard_count}.")
    return rows.map(ShardSlice(shard_index, shard_count))


class ReadBatch:
    """Instance ids (-1: padding) -> {"tokens", "index", "mask"}; mask is 0 for padding and filtered instances."""

    def __init__(self, source: TokenSource, ngram_filter: bool):
        self.source, self.ngram_filter = source, ngram_filter

    def __call__(self, ids: Int64[np.ndarray, " b"]) -> dict[str, np.ndarray]:
        valid = ids >= 0
        tokens = np.zeros((ids.size, self.source.seq_len), np.int32)
        tokens[valid] = self.source.read(ids[valid])
        mask = valid.copy()
        if self.ngram_filter:
            mask &= ~repeated_ngram_mask(tokens)
        return {"tokens": tokens, "index": ids.astype(np.int64), "mask": mask.astype(np.float32)}


def _read_options(data_cfg: DataConfig) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=data_cfg.num_threads, prefetch_buffer_size=data_cfg.prefetch)


# --- paths -----------------------------------------------------------------------------------------


def resolve_paths(data_cfg: DataConfig) -> tuple[list[str], list[str]]:
    """(train files, held-out files): globs and directories expanded in config order; empty `paths` means the
    embedded default corpus (prepared on first use into data.cache_dir)."""
    heldout = expand_paths(data_cfg.heldout_paths, "data.heldout_paths")
    if data_cfg.paths:
        return expand_paths(data_cfg.paths, "data.paths"), heldout
    corpus = default_corpus(data_cfg.cache_dir)
    train = sorted(str(p) for p in corpus.glob("train_*.npy"))
    return train, heldout or sorted(str(p) for p in corpus.glob("heldout_*.npy"))


def _vocab_size(data_cfg: DataConfig, vocab_size: int | None) -> int | None:
    return vocab_size if vocab_size is not None else data_cfg.vocab_size


def _check_split(global_batch: int, shard_index: int, shard_count: int, what: str) -> None:
    if shard_count <= 0 or not 0 <= shard_index < shard_count:
        raise DataError(f"shard_index must lie in [0, shard_count), got {shard_index} of {shard_count}.")
    if global_batch <= 0 or global_batch % shard_count:
        raise DataError(f"{what} {global_batch} is not divisible by the {shard_count} data shards (processes); "
                        f"choose a {what} that is a multiple of {shard_count}.")


# --- train -----------------------------------------------------------------------------------------


class TrainIterator:
    """Endless iterator over this process's part of the global batches; `get_state()` restores it exactly."""

    def __init__(self, source: TokenSource, *, data_cfg: DataConfig, global_batch: int, seed: int,
                 shard_index: int, shard_count: int, batches_consumed: int = 0):
        self.source = source
        self.seq_len = source.seq_len
        self.global_batch, self.seed = global_batch, seed
        self.shard_index, self.shard_count = shard_index, shard_count
        self.num_instances = source.num_instances
        self.batches_per_epoch = source.num_instances // global_batch
        self.batches_consumed = batches_consumed
        self.masked_instances = 0
        """Instances this iterator has yielded with mask 0 (n-gram filter), since it was built."""
        rows = global_order(source.num_instances, seed=seed, global_batch=global_batch)
        rows = shard_rows(rows, shard_index=shard_index, shard_count=shard_count)
        batches = rows[batches_consumed:].map(ReadBatch(source, data_cfg.ngram_filter))
        self._it = iter(batches.to_iter_dataset(_read_options(data_cfg)))

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._it)
        # Counted only as batches are handed out, so prefetched batches never move the state.
        self.batches_consumed += 1
        self.masked_instances += int((batch["mask"] == 0).sum())
        return batch

    @property
    def epoch(self) -> int:
        return self.batches_consumed // self.batches_per_epoch

    def get_state(self) -> dict:
        """Small JSON-serialisable position: the next batch is global batch `batches_consumed`."""
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "batches_consumed": self.batches_consumed,
            "tokens_consumed": self.batches_consumed * self.global_batch * self.seq_len,
            "epoch": self.epoch,
            "batch_in_epoch": self.batches_consumed % self.batches_per_epoch,
            "num_instances": self.num_instances,
            "fingerprint": [list(f) for f in self.source.fingerprint],
        }


def _check_state(state: dict, it_args: dict, fingerprint: list[list], allow_mismatch: bool) -> int:
    """Validate a saved state against this run; returns batches consumed."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise DataError(f"Data-iterator state has version {state.get('version') if isinstance(state, dict) else None}, "
                        f"expected {STATE_VERSION}; it was written by an incompatible olmo3eqx.")
    for name in ("seq_len", "global_batch", "seed"):
        if state[name] != it_args[name]:
            raise DataError(f"The checkpoint's data state has {name}={state[name]} but this run has "
                            f"{name}={it_args[name]}; resume with the checkpoint's {name}.")
    saved = [list(f) for f in state["fingerprint"]]
    if saved != fingerprint:
        diff = next((f"{a} != {b}" for a, b in zip(saved, fingerprint) if a != b),
                    f"{len(saved)} files then, {len(fingerprint)} now")
        msg = (f"The token files differ from the ones the checkpoint was trained on ({diff}, as [name, bytes]); "
               f"restore the original files or set data.allow_fingerprint_mismatch=true to continue on these.")
        if not allow_mismatch:
            raise DataError(msg)
        warnings.warn(msg, stacklevel=3)
    return int(state["batches_consumed"])


def build_train_iterator(data_cfg: DataConfig, *, seq_len: int, global_batch: int, seed: int, shard_index: int,
                         shard_count: int, vocab_size: int | None = None,
                         state: dict | None = None) -> TrainIterator:
    """This process's iterator over global training batches (resumed from `state` if given).

    Batches are {"tokens": int32 [global_batch // shard_count, seq_len], "index": int64 global instance ids,
    "mask": float32 (0 for instances the n-gram filter rejects)}.
    """
    _check_split(global_batch, shard_index, shard_count, "global_batch")
    train, _ = resolve_paths(data_cfg)
    source = TokenSource(train, seq_len=seq_len, token_dtype=data_cfg.token_dtype,
                         vocab_size=_vocab_size(data_cfg, vocab_size))
    consumed = 0
    if state is not None:
        consumed = _check_state(state, {"seq_len": seq_len, "global_batch": global_batch, "seed": seed},
                                source.fingerprint, data_cfg.allow_fingerprint_mismatch)
    return TrainIterator(source, data_cfg=data_cfg, global_batch=global_batch, seed=seed, shard_index=shard_index,
                         shard_count=shard_count, batches_consumed=consumed)


# --- held-out --------------------------------------------------------------------------------------


class HeldoutRow:
    """Row r of the held-out pass: instances [r*b, (r+1)*b) in file order, -1 past the end."""

    def __init__(self, num_instances: int, batch_size: int):
        self.num_instances, self.batch_size = num_instances, batch_size

    def __call__(self, r: int) -> Int64[np.ndarray, " g"]:
        ids = np.arange(r * self.batch_size, (r + 1) * self.batch_size, dtype=np.int64)
        return np.where(ids < self.num_instances, ids, -1)


class HeldoutIterator:
    """One deterministic pass over every held-out instance; every process gets the same number of batches."""

    def __init__(self, source: TokenSource, *, data_cfg: DataConfig, batch_size: int, shard_index: int,
                 shard_count: int):
        self.num_instances = source.num_instances
        self.num_batches = -(-source.num_instances // batch_size)
        rows = grain.MapDataset.range(self.num_batches).map(HeldoutRow(source.num_instances, batch_size))
        rows = shard_rows(rows, shard_index=shard_index, shard_count=shard_count)
        batches = rows.map(ReadBatch(source, data_cfg.ngram_filter))
        self._it = iter(batches.to_iter_dataset(_read_options(data_cfg)))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> HeldoutIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)


def build_heldout_iterator(data_cfg: DataConfig, *, seq_len: int, batch_size: int, shard_index: int,
                           shard_count: int, vocab_size: int | None = None) -> HeldoutIterator:
    """A fresh finite pass over the held-out instances in file order; `batch_size` is global (all processes),
    and the last batch is padded with index -1 and mask 0 so every batch has the same shape."""
    _check_split(batch_size, shard_index, shard_count, "held-out batch_size")
    _, heldout = resolve_paths(data_cfg)
    if not heldout:
        raise DataError("No held-out token files; set data.heldout_paths (or leave data.paths empty to use the "
                        "default corpus's held-out split).")
    source = TokenSource(heldout, seq_len=seq_len, token_dtype=data_cfg.token_dtype,
                         vocab_size=_vocab_size(data_cfg, vocab_size), what="data.heldout_paths")
    return HeldoutIterator(source, data_cfg=data_cfg, batch_size=batch_size, shard_index=shard_index,
                           shard_count=shard_count)
