"""Global orders: global batch r (0-based, epoch after epoch) -> the instance ids it holds.

Both orders cut each epoch's permutation perm_e into rows of global_batch instances, row i holding
perm_e[i*global_batch : (i+1)*global_batch], and drop the instances left over at the end; they depend on (seed,
epoch, number of instances) only, never on the number of processes.

- `ours` (OurOrder): perm_e is a keyed Feistel permutation computed entry by entry, so nothing of size
  num_instances is ever built; epochs count from 0.
- `olmo-core` (OlmoCoreOrder): OLMo-core's NumpyFSLDataLoader order. perm_e is np.arange(num_instances, uint32)
  shuffled in place by np.random.Generator(PCG64(seed + e)), epochs counted from 1 (OLMo-core's trainer starts at
  epoch 1); with chunk_size c > 1 (max_target_seq_len = c * seq_len) the chunk ids are shuffled instead and each
  expands to c consecutive instances. Each epoch's index is written once beside the run under OLMo-core's own file
  name (global_indices_dataset_size{N}_epoch{E}_seed{S}_v1.npy, the same bytes OLMo-core caches in its work_dir),
  by one process per file system while the others wait on a file lock (only that process ever holds an epoch's
  index in memory, while building it), renamed into place when complete, and memory-mapped read-only: a resumed
  run or another process maps the same file.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
from jaxtyping import Int, Int64

from olmo3eqx.data.cache import build_once
from olmo3eqx.errors import DataError

FEISTEL_ROUNDS = 6
"""Rounds of the keyed Feistel network behind each epoch's permutation (ours)."""
ORDER_VERSIONS = {"ours": 1, "olmo-core": 1}
"""Version of each order's mapping from global batch to instance ids, stored in the data-iterator state: a change to
which instances any batch holds must bump it (tests/test_data_pipeline.py pins ours' first batches), and a resume
refuses a state of another version (data/pipeline.py). olmo-core follows OLMo-core's NumpyFSLDataLoader, whose
index files carry their own version (v1 in their names)."""
INDEX_DTYPE = np.dtype(np.uint32)
"""OLMo-core stores its global indices as uint32 (so it refuses 2**32 - 1 instances or more)."""


# --- ours ------------------------------------------------------------------------------------------


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


class OurOrder:
    """Global batch r -> row r % batches_per_epoch of epoch r // batches_per_epoch of the Feistel permutation."""

    def __init__(self, num_instances: int, *, seed: int, global_batch: int):
        self.num_instances, self.seed, self.global_batch = num_instances, seed, global_batch
        self.batches_per_epoch = num_instances // global_batch

    def __call__(self, r: int) -> Int64[np.ndarray, " g"]:
        epoch, row = divmod(r, self.batches_per_epoch)
        positions = np.arange(row * self.global_batch, (row + 1) * self.global_batch, dtype=np.int64)
        return epoch_permutation(positions, num_instances=self.num_instances, seed=self.seed, epoch=epoch)


# --- OLMo-core's -----------------------------------------------------------------------------------


def olmo_core_index_name(*, num_instances: int, seed: int, epoch: int, chunk_size: int) -> str:
    """OLMo-core's file name for one epoch's global indices (NumpyFSLDataLoader._global_indices_file)."""
    fields = {"seed": seed, "epoch": epoch, "dataset_size": num_instances,
              "chunk": chunk_size if chunk_size > 1 else None, "v": 1}
    return "_".join(["global_indices"] + [f"{k}{v}" for k, v in sorted(fields.items()) if v is not None]) + ".npy"


def index_size(num_instances: int, chunk_size: int) -> int:
    return num_instances // chunk_size * chunk_size


def epoch_index(*, num_instances: int, seed: int, epoch: int, chunk_size: int) -> np.ndarray:
    """OLMo-core's global indices of one epoch (NumpyFSLDataLoader._build_global_indices), in memory."""
    rng = np.random.Generator(np.random.PCG64(seed + epoch))
    if chunk_size == 1:
        index = np.arange(num_instances, dtype=INDEX_DTYPE)
        rng.shuffle(index)
        return index
    chunks = np.arange(num_instances // chunk_size, dtype=INDEX_DTYPE)
    rng.shuffle(chunks)
    return (chunks[:, None] * INDEX_DTYPE.type(chunk_size) + np.arange(chunk_size, dtype=INDEX_DTYPE)).reshape(-1)


def write_epoch_index(path: Path, *, num_instances: int, seed: int, epoch: int, chunk_size: int) -> None:
    """Build one epoch's index in memory (shuffling it in a file mapping instead ran 5x slower: every random swap
    dirties a page the kernel must write back) and write it to `path`."""
    index = epoch_index(num_instances=num_instances, seed=seed, epoch=epoch, chunk_size=chunk_size)
    with open(path, "wb") as f:
        index.tofile(f)


def cached_epoch_index(path: Path, *, num_instances: int, seed: int, epoch: int, chunk_size: int) -> np.memmap:
    """The epoch's index memory-mapped from `path`, built first if no process has (olmo3eqx.data.cache.build_once:
    one process builds it under the file lock, the others wait and then map it)."""
    expected = index_size(num_instances, chunk_size) * INDEX_DTYPE.itemsize
    build_once(path, lambda tmp: write_epoch_index(tmp, num_instances=num_instances, seed=seed, epoch=epoch,
                                                   chunk_size=chunk_size),
               f"the global order's index ({expected:,} bytes)")
    if os.path.getsize(path) != expected:
        raise DataError(f"The global order's index {path} has {os.path.getsize(path):,} bytes, not {expected:,}; "
                        f"it is not this data's index: delete it and it is rebuilt.")
    return np.memmap(path, dtype=INDEX_DTYPE, mode="r")


class OlmoCoreOrder:
    """Global batch r -> row r % batches_per_epoch of OLMo-core's epoch 1 + r // batches_per_epoch."""

    def __init__(self, num_instances: int, *, seed: int, global_batch: int, chunk_size: int, cache_dir: Path):
        if num_instances >= np.iinfo(INDEX_DTYPE).max:
            raise DataError(f"The data holds {num_instances:,} instances; OLMo-core's order indexes them as uint32 "
                            f"and allows fewer than {np.iinfo(INDEX_DTYPE).max:,} (use data.order ours).")
        if seed < 0:
            raise DataError(f"OLMo-core's order needs a non-negative data.seed, got {seed}.")
        self.num_instances, self.seed, self.global_batch = num_instances, seed, global_batch
        self.chunk_size, self.cache_dir = chunk_size, Path(cache_dir)
        self.batches_per_epoch = num_instances // global_batch
        self._mapped: dict[int, np.memmap] = {}
        self._lock = threading.Lock()

    def index_path(self, epoch: int) -> Path:
        return self.cache_dir / olmo_core_index_name(num_instances=self.num_instances, seed=self.seed, epoch=epoch,
                                                     chunk_size=self.chunk_size)

    def mapped_index(self, epoch: int) -> np.memmap:
        """Epoch `epoch`'s (1-based) index, memory-mapped; the epochs next to it stay mapped so reader threads on
        both sides of an epoch boundary never remap."""
        index = self._mapped.get(epoch)
        if index is None:
            with self._lock:
                index = self._mapped.get(epoch)
                if index is None:
                    index = cached_epoch_index(self.index_path(epoch), num_instances=self.num_instances,
                                               seed=self.seed, epoch=epoch, chunk_size=self.chunk_size)
                    self._mapped = {e: m for e, m in self._mapped.items() if abs(e - epoch) == 1} | {epoch: index}
        return index

    def __call__(self, r: int) -> Int64[np.ndarray, " g"]:
        epoch, row = divmod(r, self.batches_per_epoch)
        index = self.mapped_index(epoch + 1)
        return index[row * self.global_batch:(row + 1) * self.global_batch].astype(np.int64)
