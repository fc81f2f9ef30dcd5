"""Documents packed into fixed-length instances as OLMo-core's NumpyPackedFSLDataset packs them (stage 3).

A document is the tokens up to and including an EOS (tokens after a file's last EOS belong to none); one longer
than seq_len keeps its first seq_len tokens (OLMo-core's LongDocStrategy.truncate). The files are taken in groups of
`group_size` consecutive files (OLMo-core's source_group_size), each group treated as one concatenated file, and each
group's documents are packed by Optimized Best-Fit Decreasing (https://arxiv.org/pdf/2404.10830): documents sorted
by decreasing length (numpy's default argsort, as OLMo-core sorts, so ties break the same way), each into the open
instance with the least room that still fits it (the oldest such instance), else a new one. Instance i of group g
holds its documents in packing order followed by PAD tokens; global instance ids run through the groups in order.

Per instance this gives what OLMo-core's `__getitem__` and collator give: the tokens, `label_mask` (False on the
padding), and `doc_lens`, the lengths OLMo-core's get_document_lengths finds by scanning the padded instance for EOS
(the padding is one more document, or one per PAD when PAD is the EOS id).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
from jaxtyping import Bool, Int, Int32, Int64

from olmo3eqx import storage
from olmo3eqx.data.source import (DataError, Tokens, check_ids, chunks, expand_paths, open_tokens, parallel,
                                  read_slices, stem)


def eos_ends(tokens: Tokens, eos_id: int) -> Int64[np.ndarray, " n"]:
    """The end (one past the EOS) of each EOS-terminated document of one file; a remote file is scanned in ranged
    reads (olmo3eqx.data.source.chunks), never held whole."""
    parts = [np.flatnonzero(np.asarray(part) == eos_id).astype(np.int64) + (offset + 1)
             for offset, part in chunks(tokens)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def document_spans(tokens: Tokens, eos_id: int, seq_len: int) -> Int64[np.ndarray, "n 2"]:
    """[start, end) of each EOS-terminated document of one file, cut to its first seq_len tokens."""
    ends = eos_ends(tokens, eos_id)
    starts = np.concatenate([[0], ends])[:-1].astype(np.int64)
    return np.stack([starts, np.minimum(ends, starts + seq_len)], axis=1)


def best_fit_decreasing(lengths: Int64[np.ndarray, " n"], capacity: int) -> tuple[np.ndarray, list[list[int]]]:
    """(order, bins): `order` sorts the documents by decreasing length; bins[i] lists the positions in that sorted
    order of the documents instance i holds. OLMo-core's InstancePacker, the same segment tree over remaining room
    (leaf r-1 holds r while some instance has room r; the last leaf always holds `capacity`, a new instance)."""
    if capacity & (capacity - 1):
        raise DataError(f"Packing needs a power-of-two data.seq_len (OLMo-core's segment tree), got {capacity}.")
    order = np.argsort(-1 * lengths.astype(np.int64))
    tree = [0] * (2 * capacity)

    def set_leaf(room: int, weight: int) -> None:
        node = capacity + room - 1
        tree[node] = weight
        while node > 1:
            node //= 2
            tree[node] = max(tree[2 * node], tree[2 * node + 1])

    set_leaf(capacity, capacity)
    bins: list[list[int]] = []
    by_room: dict[int, deque[int]] = {}
    for doc, length in enumerate(lengths[order].tolist()):
        node = 1
        while node < capacity:  # the leftmost leaf whose room fits: the least room that fits
            node = 2 * node if length <= tree[2 * node] else 2 * node + 1
        room = node - capacity + 1
        if room == capacity:
            bins.append([])
            b = len(bins) - 1
        else:
            waiting = by_room[room]
            b = waiting.popleft()
            if not waiting:
                set_leaf(room, 0)
        bins[b].append(doc)
        left = room - length
        if left > 0:
            waiting = by_room.setdefault(left, deque())
            if not waiting:
                set_leaf(left, left)
            waiting.append(b)
    return order, bins


def document_lengths(tokens: Int[np.ndarray, " s"], eos_id: int) -> Int32[np.ndarray, " d"]:
    """OLMo-core's get_document_lengths without BOS: a document ends at each EOS and at the end of the instance."""
    ends = np.flatnonzero(tokens == eos_id) + 1
    if tokens.size and tokens[-1] != eos_id:
        ends = np.append(ends, tokens.size)
    return np.diff(np.concatenate([[0], ends])).astype(np.int32)


def segment_ids(doc_lens: Int[np.ndarray, "b d"], seq_len: int) -> Int32[np.ndarray, "b s"]:
    """Per token the index of its document in its instance (0, 1, ...), from zero-padded document lengths."""
    out = np.empty((doc_lens.shape[0], seq_len), np.int32)
    for row, lens in enumerate(doc_lens):
        out[row] = np.repeat(np.arange(lens.size, dtype=np.int32), lens)
    return out


class _Group:
    """One packed group of files: its documents (sorted, as token ranges of the concatenated group) and instances."""

    def __init__(self, arrays: list[np.ndarray], eos_id: int, seq_len: int):
        self.arrays = arrays
        self.file_starts = np.concatenate([[0], np.cumsum([a.size for a in arrays])]).astype(np.int64)
        spans = [document_spans(a, eos_id, seq_len) + start for a, start in zip(arrays, self.file_starts)]
        spans_all = np.concatenate(spans) if spans else np.zeros((0, 2), np.int64)
        order, self.bins = best_fit_decreasing(spans_all[:, 1] - spans_all[:, 0], seq_len)
        self.spans = spans_all[order]

    def tokens(self, instance: int) -> np.ndarray:
        slices = []
        for doc in self.bins[instance]:
            start, end = self.spans[doc].tolist()
            f = int(np.searchsorted(self.file_starts, start, side="right")) - 1
            base = int(self.file_starts[f])
            slices.append((self.arrays[f], start - base, end - base))
        return np.concatenate(read_slices(slices))


class PackedSource:
    """Random access to the packed instances of a list of token files (the TokenSource interface plus `read_packed`)."""

    def __init__(self, paths: Sequence[str], *, seq_len: int, eos_id: int, pad_id: int, group_size: int = 1,
                 token_dtype: str = "auto", vocab_size: int | None = None, labels: Sequence[str] | None = None,
                 what: str = "data.paths"):
        if seq_len <= 0 or group_size <= 0:
            raise DataError(f"seq_len and data.source_group_size must be positive, got {seq_len}, {group_size}.")
        files = expand_paths(paths, what)
        if not files:
            raise DataError(f"{what} names no token files; give .npy files, directories or globs.")
        self.seq_len, self.eos_id, self.pad_id, self.vocab_size = seq_len, eos_id, pad_id, vocab_size
        self.paths = files
        self.labels = list(labels) if labels is not None else [stem(p) for p in files]
        arrays = parallel(lambda p: open_tokens(p, token_dtype=token_dtype, vocab_size=vocab_size, what=what), files,
                          remote=any(map(storage.is_url, files)))
        self.fingerprint = [[storage.basename(p), a.size * a.dtype.itemsize] for p, a in zip(files, arrays)]
        self._groups = [_Group(arrays[i:i + group_size], eos_id, seq_len) for i in range(0, len(arrays), group_size)]
        self._group_paths = [files[i:i + group_size] for i in range(0, len(files), group_size)]
        counts = [len(g.bins) for g in self._groups]
        self._offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_instances = int(self._offsets[-1])
        if not self.num_instances:
            names = ", ".join(map(storage.redact, files))
            raise DataError(f"No EOS-terminated document (EOS id {eos_id}) in {names}; check the files and "
                            f"model.eos_token_id.")

    def __len__(self) -> int:
        return self.num_instances

    def read_packed(self, ids: Int[np.ndarray, " b"]) -> tuple[Int32[np.ndarray, "b s"], Bool[np.ndarray, "b s"],
                                                                Int32[np.ndarray, "b d"]]:
        """(tokens, label_mask, doc_lens) of global instances `ids`; doc_lens zero-padded to the batch's most
        documents, as OLMo-core's collator pads them."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_instances):
            raise DataError(f"Instance ids must lie in [0, {self.num_instances}), got {ids.min()}..{ids.max()}.")
        tokens = np.full((ids.size, self.seq_len), self.pad_id, np.int32)
        label_mask = np.zeros((ids.size, self.seq_len), bool)
        lens = []
        for row, i in enumerate(ids.tolist()):
            g = int(np.searchsorted(self._offsets, i, side="right")) - 1
            docs = self._groups[g].tokens(i - int(self._offsets[g]))
            # Ids were only sampled on open; a bad one would be clamped silently by the embedding gather.
            if self.vocab_size is not None and docs.size and int(docs.max()) >= self.vocab_size:
                check_ids(", ".join(self._group_paths[g]), docs, self.vocab_size)
            tokens[row, :docs.size] = docs
            label_mask[row, :docs.size] = True
            lens.append(document_lengths(tokens[row], self.eos_id))
        doc_lens = np.zeros((ids.size, max((x.size for x in lens), default=0)), np.int32)
        for row, x in enumerate(lens):
            doc_lens[row, :x.size] = x
        return tokens, label_mask, doc_lens

    def read(self, ids: Int[np.ndarray, " b"]) -> Int32[np.ndarray, "b s"]:
        return self.read_packed(ids)[0]
