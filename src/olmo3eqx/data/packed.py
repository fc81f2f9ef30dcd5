"""Documents packed into fixed-length instances as OLMo-core's NumpyPackedFSLDataset packs them (stage 3).

A file's documents are its document spans (olmo3eqx.data.documents: OLMo-core's .csv.gz indices beside a remote
file, else an EOS scan); one longer than seq_len keeps its first seq_len tokens (OLMo-core's LongDocStrategy.truncate).
The files are taken in groups of `group_size` consecutive files (OLMo-core's source_group_size), each group treated as
one concatenated file, and each group's documents are packed by Optimized Best-Fit Decreasing
(https://arxiv.org/pdf/2404.10830): documents sorted by decreasing length (numpy's default argsort, as OLMo-core
sorts, so ties break the same way), each into the open instance with the least room that still fits it (the oldest
such instance), else a new one. Instance i of group g holds its documents in packing order followed by PAD tokens;
global instance ids run through the groups in order.

The packing is computed once and kept in `<cache_dir>/packing/<key>/` (the documents by instance and the instance
offsets, memory-mapped by every process), the key a hash of the files' paths, sizes and dtypes, seq_len, the EOS id
and the group size, as OLMo-core keeps its in work_dir/dataset-common/: a relaunch reads no document index at all.

Per instance this gives what OLMo-core's `__getitem__` and collator give: the tokens, `label_mask` (False on the
padding; with label-mask files, OLMo-core's label_mask_paths, each document's mask read beside its tokens), and `doc_lens`: the lengths of the documents it holds, then the padding as OLMo-core's
get_document_lengths splits it (one more document, or one per PAD when PAD is the EOS id).
"""

from __future__ import annotations

import bisect
import json
import os
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from jaxtyping import Bool, Int, Int32, Int64

from olmo3eqx import storage
from olmo3eqx.data.cache import build_once
from olmo3eqx.data.documents import document_spans, file_key, key_hash
from olmo3eqx.data.source import (RemoteTokens, Tokens, check_ids, expand_paths, open_tokens, parallel, read_slices,
                                  stem)
from olmo3eqx.errors import DataError

PACKING_DIR = "packing"
"""Under data.cache_dir: one directory per packed dataset."""
PACKING_FORMAT = 1
"""Part of the packing's cache key; raised when what a cached packing holds changes."""
DOCUMENTS, OFFSETS = "documents.npy", "instance_offsets.npy"


def best_fit_decreasing(lengths: Int[np.ndarray, " n"], capacity: int) -> tuple[Int64[np.ndarray, " n"],
                                                                             Int64[np.ndarray, " n"]]:
    """(order, instance): `order` sorts the documents by decreasing length, and instance[j] is the instance of the
    j-th document in that order; an instance's documents in sorted order are its packing order. OLMo-core's
    InstancePacker (one document at a time, a segment tree over the remaining room), computed a run of equal lengths
    and an instance at a time.

    Within a run of documents of length L, every room in [L, r) is empty while the run takes from the least room
    r >= L (nothing of the run lands there: a filled instance keeps r mod L < L), so the oldest instance with room r
    takes r // L documents in a row before the next one is chosen, and whole queues of equal room are handled as one
    array. Documents longer than capacity / 2 never fit an open instance (each holds one at least as long): they
    open one instance each, at once."""
    if capacity & (capacity - 1):
        raise DataError(f"Packing needs a power-of-two data.seq_len (OLMo-core's segment tree), got {capacity}.")
    order = np.argsort(-1 * lengths.astype(np.int64))
    sizes = lengths[order].astype(np.int64)
    if sizes.size and (sizes[0] > capacity or sizes[-1] <= 0):
        raise DataError(f"Document lengths must lie in [1, {capacity}], got {sizes[-1]}..{sizes[0]}.")
    instance = np.empty(sizes.size, np.int64)
    queues: dict[int, deque] = {}  # room -> arrays of instances, oldest first
    rooms: list[int] = []  # the rooms with a queue, ascending

    def push(room: int, ids: np.ndarray) -> None:
        if room <= 0 or not ids.size:
            return
        if room not in queues:
            queues[room] = deque()
            bisect.insort(rooms, room)
        queues[room].append(ids)

    def take(room: int, n: int) -> np.ndarray:
        queue, parts, got = queues[room], [], 0
        while queue and got < n:
            head = queue[0]
            if head.size <= n - got:
                parts.append(queue.popleft())
            else:
                parts.append(head[:n - got])
                queue[0] = head[n - got:]
            got += parts[-1].size
        if not queue:
            del queues[room]
            rooms.pop(bisect.bisect_left(rooms, room))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    long = int(np.count_nonzero(sizes > capacity // 2))
    instance[:long] = np.arange(long)
    count = long
    left_room = capacity - sizes[:long]  # ascending
    firsts = np.flatnonzero(np.diff(left_room, prepend=-1))
    for a, b in zip(firsts.tolist(), np.append(firsts[1:], long).tolist()):
        push(int(left_room[a]), np.arange(a, b, dtype=np.int64))

    starts = long + np.flatnonzero(np.diff(sizes[long:], prepend=-1))
    for pos, end in zip(starts.tolist(), np.append(starts[1:], sizes.size).tolist()):
        length = int(sizes[pos])
        while pos < end:
            i = bisect.bisect_left(rooms, length)
            if i == len(rooms):  # no open instance fits: new ones
                room, per = capacity, capacity // length
                ids = np.arange(count, count + -(-(end - pos) // per), dtype=np.int64)
                count += ids.size
            else:
                room = rooms[i]
                per = room // length
                ids = take(room, -(-(end - pos) // per))
            n = min(end - pos, ids.size * per)
            instance[pos:pos + n] = ids[np.arange(n) // per]
            full, part = divmod(n, per)
            push(room - per * length, ids[:full])
            if part:  # the run ends inside this instance, which keeps room >= length
                push(room - part * length, ids[full:full + 1])
            pos += n
    return order, instance


def document_lengths(tokens: Int[np.ndarray, " s"], eos_id: int) -> Int32[np.ndarray, " d"]:
    """OLMo-core's get_document_lengths without BOS: a document ends at each EOS and at the end of the tokens."""
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


def pack_files(spans: Sequence[Int64[np.ndarray, "_ 2"]], *, seq_len: int,
               group_size: int) -> tuple[Int64[np.ndarray, "d 3"], Int64[np.ndarray, " i"]]:
    """(documents, offsets): documents[offsets[i]:offsets[i + 1]] are instance i's documents in packing order, each
    (file, start, end) with end - start <= seq_len; groups of group_size files packed one after the other."""
    from tqdm import tqdm

    documents, counts = [], []
    for g in tqdm(range(0, len(spans), group_size), desc="packing", unit="group", file=sys.stderr, delay=2.0):
        group = [np.concatenate([np.full((s.shape[0], 1), f, np.int64), s], axis=1)
                 for f, s in enumerate(spans[g:g + group_size], start=g)]
        docs = np.concatenate(group) if group else np.zeros((0, 3), np.int64)
        docs[:, 2] = np.minimum(docs[:, 2], docs[:, 1] + seq_len)
        order, instance = best_fit_decreasing(docs[:, 2] - docs[:, 1], seq_len)
        documents.append(docs[order][np.argsort(instance, kind="stable")])
        counts.append(np.bincount(instance, minlength=int(instance.max(initial=-1)) + 1))
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
    return np.concatenate(documents), offsets


def open_label_mask(path: str, tokens: Tokens) -> Tokens:
    """A label-mask file (np.bool_, one byte per token, OLMo-core's label_mask_paths) as a read-only memmap or
    RemoteTokens, after checking it has as many entries as its token file has tokens."""
    remote = storage.is_url(path)
    if not (storage.isfile(path) if remote else os.path.isfile(path)):
        raise DataError(f"Label mask file {storage.redact(path)} does not exist; fix data.label_mask_paths.")
    size = storage.size(path) if remote else os.path.getsize(path)
    if size != tokens.size:
        raise DataError(f"Label mask file {storage.redact(path)} has {size:,} entries for {tokens.size:,} tokens; "
                        f"data.label_mask_paths must pair each token file with its own mask, in data.paths' order.")
    if size == 0:
        return np.zeros(0, np.bool_)
    return RemoteTokens(path, np.dtype(np.bool_), size) if remote else np.memmap(path, np.bool_, mode="r")


class PackedSource:
    """Random access to the packed instances of a list of token files (the TokenSource interface plus `read_packed`)."""

    def __init__(self, paths: Sequence[str], *, seq_len: int, eos_id: int, pad_id: int, cache_dir: str | os.PathLike,
                 group_size: int = 1, token_dtype: str = "auto", vocab_size: int | None = None,
                 labels: Sequence[str] | None = None, what: str = "data.paths",
                 label_mask_paths: Sequence[str] | None = None):
        if seq_len <= 0 or group_size <= 0:
            raise DataError(f"seq_len and data.source_group_size must be positive, got {seq_len}, {group_size}.")
        files = expand_paths(paths, what)
        if not files:
            raise DataError(f"{what} names no token files; give .npy files, directories or globs.")
        self.seq_len, self.eos_id, self.pad_id, self.vocab_size = seq_len, eos_id, pad_id, vocab_size
        self.paths = files
        self.labels = list(labels) if labels is not None else [stem(p) for p in files]
        self._arrays = parallel(lambda p: open_tokens(p, token_dtype=token_dtype, vocab_size=vocab_size, what=what),
                                files, remote=any(map(storage.is_url, files)))
        self._masks = None if label_mask_paths is None else parallel(
            lambda pa: open_label_mask(*pa), list(zip(label_mask_paths, self._arrays)),
            remote=any(map(storage.is_url, label_mask_paths)))
        self.fingerprint = [[storage.basename(p), a.size * a.dtype.itemsize] for p, a in zip(files, self._arrays)]
        key = [PACKING_FORMAT, seq_len, eos_id, group_size] + [file_key(p, a) for p, a in zip(files, self._arrays)]
        cache = Path(cache_dir).expanduser()
        directory = build_once(cache / PACKING_DIR / key_hash(key),
                               lambda tmp: self._pack(tmp, key, cache, group_size),
                               f"the packing of {len(files)} token files")
        self._documents = np.load(directory / DOCUMENTS, mmap_mode="r")
        self._offsets = np.load(directory / OFFSETS, mmap_mode="r")
        self.num_instances = int(self._offsets.size - 1)

    def _pack(self, out: Path, key: list, cache: Path, group_size: int) -> None:
        """Pack the files and write the result into directory `out`."""
        spans = document_spans(self.paths, self._arrays, eos_id=self.eos_id, cache_dir=cache)
        documents, offsets = pack_files(spans, seq_len=self.seq_len, group_size=group_size)
        if offsets.size == 1:
            names = ", ".join(map(storage.redact, self.paths))
            raise DataError(f"No document (EOS id {self.eos_id}) in {names}; check the files and model.eos_token_id.")
        out.mkdir()
        for name, array in ((DOCUMENTS, documents), (OFFSETS, offsets)):
            with open(out / name, "wb") as f:
                np.save(f, array)
        (out / "key.json").write_text(json.dumps(key) + "\n")
        print(f"Packed {documents.shape[0]:,} documents of {len(self.paths)} token files into {offsets.size - 1:,} "
              f"instances of {self.seq_len} tokens; kept in {out.parent}.", file=sys.stderr, flush=True)

    def __len__(self) -> int:
        return self.num_instances

    def read_packed(self, ids: Int[np.ndarray, " b"]) -> tuple[Int32[np.ndarray, "b s"], Bool[np.ndarray, "b s"],
                                                                Int32[np.ndarray, "b d"]]:
        """(tokens, label_mask, doc_lens) of global instances `ids`; doc_lens zero-padded to the batch's most
        documents, as OLMo-core's collator pads them. The batch's documents are read together (storage.read_many)."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_instances):
            raise DataError(f"Instance ids must lie in [0, {self.num_instances}), got {ids.min()}..{ids.max()}.")
        docs = [np.asarray(self._documents[self._offsets[i]:self._offsets[i + 1]]) for i in ids.tolist()]
        flat = np.concatenate(docs) if docs else np.zeros((0, 3), np.int64)
        parts = read_slices([(self._arrays[f], a, b) for f, a, b in flat.tolist()])
        masks = None if self._masks is None else read_slices([(self._masks[f], a, b) for f, a, b in flat.tolist()])
        tokens = np.full((ids.size, self.seq_len), self.pad_id, np.int32)
        label_mask = np.zeros((ids.size, self.seq_len), bool)
        lens, first = [], 0
        for row, row_docs in enumerate(docs):
            row_parts = parts[first:first + len(row_docs)]
            first += len(row_docs)
            for (f, _, _), part in zip(row_docs.tolist(), row_parts):
                # Ids were only sampled on open; a bad one would be clamped silently by the embedding gather.
                if self.vocab_size is not None and part.size and int(part.max()) >= self.vocab_size:
                    check_ids(self.paths[f], part, self.vocab_size)
            n = int(sum(p.size for p in row_parts))
            tokens[row, :n] = np.concatenate(row_parts)
            label_mask[row, :n] = True if masks is None else np.concatenate(masks[first - len(row_docs):first])
            lens.append(np.concatenate([(row_docs[:, 2] - row_docs[:, 1]).astype(np.int32),
                                        document_lengths(tokens[row, n:], self.eos_id)]))
        doc_lens = np.zeros((ids.size, max((x.size for x in lens), default=0)), np.int32)
        for row, x in enumerate(lens):
            doc_lens[row, :x.size] = x
        return tokens, label_mask, doc_lens

    def read(self, ids: Int[np.ndarray, " b"]) -> Int32[np.ndarray, "b s"]:
        return self.read_packed(ids)[0]
