"""`python train.py` with a double-sharded data loader, for bench/reference_run.py's fault rerun (never a trainer
option).

    python bench/reference_fault.py --shards K [train.py's flags ...]

grain's legacy DataLoader shards by asking its sampler for global positions `index * shard_count + shard_index`,
and a sampler built with ShardOptions maps position i to record `i // shard_count` of its own shard (grain 0.2's
IndexSampler.__getitem__). Shard once in each and the two cancel; shard the sampler but hand the loader
NoSharding() and every process reads each record of its shard `shard_count` times in a row (PITFALLS.md). Here K
simulated processes read that way: process s's k-th record is the k-th instance of its own part of the global order
(its slice of each row, pipeline.ShardSlice: what it reads when sharded once), and at step r it reads records
(r * b + j) // K, j < b, with b = global_batch / K its batch. Over a run each instance that is read at all is read K
times within a few steps, and only 1/K of the instances are read. (The MaxText port's own mistake ran its cursor K
times too fast instead, resampling the epoch about Poisson(1); docs/reproduction.md says why that one is left out.)
The run is otherwise `python train.py`: same checkpoints and resume (the position is the batch count), same metrics.
"""

from __future__ import annotations

import sys

import numpy as np


class DoubleSharded:
    """The train iterator of train.train_data, read as K processes with a sharded sampler under an unsharded loader."""

    def __init__(self, inner, shards: int):
        from olmo3eqx.data.pipeline import ReadBatch

        if inner.global_batch % shards or inner.shard_count != 1:
            raise ValueError(f"--shards {shards} must divide the global batch {inner.global_batch} of a one-process "
                             f"run.")
        self.inner, self.shards = inner, shards
        self.local = inner.global_batch // shards
        self.batches_consumed = inner.batches_consumed
        self.read = ReadBatch(inner.source, ngram_filter=False)

    def __iter__(self):
        return self

    def ids(self, step: int) -> np.ndarray:
        """Global instance ids of 0-based batch `step`: each process's records (step * b + j) // K, j < b."""
        from olmo3eqx.data.pipeline import ShardSlice

        out = []
        for s in range(self.shards):
            part = ShardSlice(s, self.shards)
            for j in range(self.local):
                k = (step * self.local + j) // self.shards
                out.append(part(self.inner.order(k // self.local))[k % self.local])
        return np.asarray(out, np.int64)

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.read(self.ids(self.batches_consumed))
        self.batches_consumed += 1
        return batch

    def get_state(self) -> dict:
        batches = self.batches_consumed
        return {**self.inner.get_state(), "batches_consumed": batches,
                "tokens_consumed": batches * self.inner.global_batch * self.inner.seq_len}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--shards" or not argv[1].isdigit() or int(argv[1]) < 1:
        print("usage: python bench/reference_fault.py --shards K [train.py's flags ...]", file=sys.stderr)
        return 2
    shards = int(argv[1])
    from olmo3eqx import train

    real = train.train_data

    def double_sharded(cfg, start, state):
        return DoubleSharded(real(cfg, start, state), shards)

    train.train_data = double_sharded
    return train.main(argv[2:])


if __name__ == "__main__":
    from olmo3eqx.tools.hostmem import reexec_with_caching_malloc

    reexec_with_caching_malloc()  # as train.py does: the same host allocator on both of our runs
    sys.exit(main(sys.argv[1:]))
