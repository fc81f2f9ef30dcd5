"""Global batches on grain: a global order (data/order.py), one row per step, sharded exactly once.

Row r of the global order holds the instance ids of global batch r (ours or OLMo-core's order, epoch after epoch).
Process s of n takes the contiguous slice [s*g/n, (s+1)*g/n) of every row (`shard_rows`); nothing else shards. The
iterator's position is the number of global rows consumed, so a restored state yields the same global rows
whatever the process count, thread count or prefetch depth.
"""

from __future__ import annotations

import random
import sys
import warnings
from pathlib import Path

import grain
import numpy as np
from jaxtyping import Int64

from olmo3eqx.config import DataConfig
from olmo3eqx.data.corpus import default_corpus
from olmo3eqx.data.filters import repeated_ngram_mask
from olmo3eqx.data.mixes import resolve_mix
from olmo3eqx.data.order import ORDER_VERSIONS, OlmoCoreOrder, OurOrder
from olmo3eqx.data.packed import PackedSource, segment_ids
from olmo3eqx.data.source import TokenSource, expand_paths
from olmo3eqx.errors import DataError

STATE_VERSION = 1


def global_order(order) -> grain.MapDataset:
    """The endless sequence of global rows (element r: int64 [global_batch] instance ids of `order(r)`)."""
    return grain.MapDataset.range(sys.maxsize).map(order)


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
    """Instance ids -> {"tokens", "index", "mask"}; mask is 0 for instances the n-gram filter rejects. Packed
    instances add "label_mask" (bool [b, s], False on padding), "doc_lens" (int32 [b, d], zero-padded) and
    "segment_ids" (int32 [b, s], each token's document in its instance; the padding is a document of its own)."""

    def __init__(self, source: TokenSource | PackedSource, ngram_filter: bool):
        self.source, self.ngram_filter = source, ngram_filter

    def __call__(self, ids: Int64[np.ndarray, " b"]) -> dict[str, np.ndarray]:
        packed = isinstance(self.source, PackedSource)
        if packed:
            tokens, label_mask, doc_lens = self.source.read_packed(ids)
        else:
            tokens = self.source.read(ids)
        mask = ~repeated_ngram_mask(tokens) if self.ngram_filter else np.ones(ids.size, bool)
        batch = {"tokens": tokens, "index": ids.astype(np.int64), "mask": mask.astype(np.float32)}
        if packed:
            batch |= {"label_mask": label_mask, "doc_lens": doc_lens,
                      "segment_ids": segment_ids(doc_lens, tokens.shape[1])}
        return batch


# --- files -----------------------------------------------------------------------------------------


def training_files(data_cfg: DataConfig) -> tuple[list[str], list[str] | None]:
    """(training token files in instance order, their labels or None): data.mix's files under data.mix_root, else
    data.paths expanded in config order, else the embedded default corpus (prepared on first use); then shuffled
    by data.source_permutation_seed if set."""
    if data_cfg.mix:
        mix = resolve_mix(data_cfg.mix, data_cfg.mix_root)
        files, labels = [f.path for f in mix], [f.label for f in mix]
    elif data_cfg.paths:
        files, labels = expand_paths(data_cfg.paths, "data.paths"), None
    else:
        files, labels = sorted(str(p) for p in default_corpus(data_cfg.cache_dir).glob("train_*.npy")), None
    return permuted(files, data_cfg.source_permutation_seed), None if labels is None else permuted(
        labels, data_cfg.source_permutation_seed)


def permuted(items: list, seed: int | None) -> list:
    """`items` shuffled by data.source_permutation_seed (None: as they are)."""
    if seed is None:
        return items
    order = list(range(len(items)))  # OLMo-core's NumpyDatasetConfig._resolve_paths_metadata, line for line
    random.Random(seed).shuffle(order)
    return [items[i] for i in order]


def label_mask_files(data_cfg: DataConfig, num_files: int) -> list[str] | None:
    """data.label_mask_paths expanded and shuffled as the token files are (one per file), or None when unset."""
    if not data_cfg.label_mask_paths:
        return None
    masks = expand_paths(data_cfg.label_mask_paths, "data.label_mask_paths")
    if len(masks) != num_files:
        raise DataError(f"data.label_mask_paths names {len(masks)} files for {num_files} token files in data.paths; "
                        f"give one mask per token file, in the same order.")
    return permuted(masks, data_cfg.source_permutation_seed)


def heldout_files(data_cfg: DataConfig) -> list[str]:
    """data.heldout_paths expanded; without them the default corpus's held-out split when it is the training data."""
    if data_cfg.heldout_paths:
        return expand_paths(data_cfg.heldout_paths, "data.heldout_paths")
    if data_cfg.paths or data_cfg.mix:
        return []
    return sorted(str(p) for p in default_corpus(data_cfg.cache_dir).glob("heldout_*.npy"))


def _check_split(global_batch: int, shard_index: int, shard_count: int) -> None:
    if shard_count <= 0 or not 0 <= shard_index < shard_count:
        raise DataError(f"shard_index must lie in [0, shard_count), got {shard_index} of {shard_count}.")
    if global_batch <= 0 or global_batch % shard_count:
        raise DataError(f"global_batch {global_batch} is not divisible by the {shard_count} data shards (processes); "
                        f"choose a global_batch that is a multiple of {shard_count}.")


def build_order(data_cfg: DataConfig, num_instances: int, *, seq_len: int, global_batch: int, seed: int,
                index_dir: str | Path | None):
    """data.order's global order over `num_instances` instances."""
    if global_batch <= 0:
        raise DataError(f"global_batch must be positive, got {global_batch}.")
    if num_instances < global_batch:
        raise DataError(f"The data holds {num_instances} instances, fewer than one global batch of {global_batch}; "
                        f"add data or lower data.global_batch or data.seq_len.")
    if data_cfg.order == "ours":
        return OurOrder(num_instances, seed=seed, global_batch=global_batch)
    if index_dir is None:
        raise DataError("data.order olmo-core keeps each epoch's index on disk; give the iterator a directory for "
                        "it (train.py uses the run directory).")
    return OlmoCoreOrder(num_instances, seed=seed, global_batch=global_batch, cache_dir=Path(index_dir),
                         chunk_size=(data_cfg.max_target_seq_len or seq_len) // seq_len)


# --- train -----------------------------------------------------------------------------------------


def packing_state(data_cfg: DataConfig) -> dict | None:
    """How instances are cut, as the iterator state records it: None for fixed-length instances."""
    return {"group_size": data_cfg.source_group_size} if data_cfg.packing else None


class TrainIterator:
    """Endless iterator over this process's part of the global batches; `get_state()` restores it exactly."""

    def __init__(self, source: TokenSource | PackedSource, order, *, data_cfg: DataConfig, shard_index: int,
                 shard_count: int, batches_consumed: int = 0):
        self.source, self.order = source, order
        self.order_name, self.max_target_seq_len = data_cfg.order, data_cfg.max_target_seq_len
        self.packing = packing_state(data_cfg)
        self.seq_len = source.seq_len
        self.global_batch, self.seed = order.global_batch, order.seed
        self.shard_index, self.shard_count = shard_index, shard_count
        self.num_instances = source.num_instances
        self.batches_per_epoch = order.batches_per_epoch
        self.batches_consumed = batches_consumed
        self.masked_instances = 0
        """Instances this iterator has yielded with mask 0 (n-gram filter), since it was built."""
        order(batches_consumed)  # OLMo-core's order builds or maps this epoch's index now, before step 1
        rows = shard_rows(global_order(order), shard_index=shard_index, shard_count=shard_count)
        batches = rows[batches_consumed:].map(ReadBatch(source, data_cfg.ngram_filter))
        options = grain.ReadOptions(num_threads=data_cfg.num_threads, prefetch_buffer_size=data_cfg.prefetch)
        self._it = iter(batches.to_iter_dataset(options))

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
        """Epochs completed (0-based; OLMo-core's order calls the current one epoch + 1)."""
        return self.batches_consumed // self.batches_per_epoch

    def get_state(self) -> dict:
        """Small JSON-serialisable position: the next batch is global batch `batches_consumed`."""
        return {
            "version": STATE_VERSION,
            "order": self.order_name,
            "order_version": ORDER_VERSIONS[self.order_name],
            "seed": self.seed,
            "seq_len": self.seq_len,
            "max_target_seq_len": self.max_target_seq_len,
            "packing": self.packing,
            "global_batch": self.global_batch,
            "batches_consumed": self.batches_consumed,
            "tokens_consumed": self.batches_consumed * self.global_batch * self.seq_len,
            "epoch": self.epoch,
            "batch_in_epoch": self.batches_consumed % self.batches_per_epoch,
            "num_instances": self.num_instances,
            "fingerprint": [list(f) for f in self.source.fingerprint],
        }


STATE_DEFAULTS = {"order": "ours", "order_version": 1, "max_target_seq_len": None, "packing": None}
"""What a state written before these fields existed meant."""


def _check_state(state: dict, run: dict, fingerprint: list[list], allow_mismatch: bool) -> int:
    """Validate a saved state against this run; returns batches consumed."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise DataError(f"Data-iterator state has version {state.get('version') if isinstance(state, dict) else None}, "
                        f"expected {STATE_VERSION}; it was written by an incompatible olmo3eqx.")
    for name, value in run.items():
        saved = state.get(name, STATE_DEFAULTS.get(name))
        if saved != value:
            raise DataError(f"The checkpoint's data state has {name}={saved} but this run has {name}={value}; "
                            f"resume with the checkpoint's {name}.")
    order = run["order"]
    version = state.get("order_version", STATE_DEFAULTS["order_version"])
    if version != ORDER_VERSIONS[order]:
        raise DataError(f"The checkpoint's data state is version {version} of data.order {order} but this olmo3eqx "
                        f"computes version {ORDER_VERSIONS[order]}, which puts other instances in the batches; resume "
                        f"with the olmo3eqx that wrote the checkpoint, or start a new run.")
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
                         shard_count: int, vocab_size: int | None = None, state: dict | None = None,
                         index_dir: str | Path | None = None, eos_id: int | None = None,
                         pad_id: int | None = None) -> TrainIterator:
    """This process's iterator over global training batches in data.order (resumed from `state` if given);
    `index_dir` holds OLMo-core's order's per-epoch indices (train.py: the run directory's data_order/).

    Batches are {"tokens": int32 [global_batch // shard_count, seq_len], "index": int64 global instance ids,
    "mask": float32 (0 for instances the n-gram filter rejects)}, plus with data.packing (documents packed with
    `eos_id` ends and `pad_id` padding) "label_mask", "doc_lens" and "segment_ids" (ReadBatch).
    """
    _check_split(global_batch, shard_index, shard_count)
    files, labels = training_files(data_cfg)
    common = dict(seq_len=seq_len, token_dtype=data_cfg.token_dtype, labels=labels,
                  vocab_size=vocab_size if vocab_size is not None else data_cfg.vocab_size,
                  what="data.mix" if data_cfg.mix else "data.paths")
    if data_cfg.packing:
        if eos_id is None or pad_id is None:
            raise DataError("data.packing needs the EOS and PAD token ids (model.eos_token_id, model.pad_token_id).")
        source = PackedSource(files, eos_id=eos_id, pad_id=pad_id, group_size=data_cfg.source_group_size,
                              cache_dir=data_cfg.cache_dir, label_mask_paths=label_mask_files(data_cfg, len(files)),
                              **common)
    else:
        source = TokenSource(files, max_target_seq_len=data_cfg.max_target_seq_len, **common)
    consumed = 0
    if state is not None:
        run = {"order": data_cfg.order, "seq_len": seq_len, "max_target_seq_len": data_cfg.max_target_seq_len,
               "packing": packing_state(data_cfg),
               "global_batch": global_batch, "seed": seed}
        consumed = _check_state(state, run, source.fingerprint, data_cfg.allow_fingerprint_mismatch)
    order = build_order(data_cfg, source.num_instances, seq_len=seq_len, global_batch=global_batch, seed=seed,
                        index_dir=index_dir)
    return TrainIterator(source, order, data_cfg=data_cfg, shard_index=shard_index, shard_count=shard_count,
                         batches_consumed=consumed)
