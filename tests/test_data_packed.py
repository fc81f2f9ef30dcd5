"""data.packing against OLMo-core's own NumpyPackedFSLDataset (built from its config, with source_permutation_seed and
source_group_size) and its data loader and collator, on generated token files: the same global batches of instance
ids, tokens, label masks and document lengths, epoch after epoch; OLMo-core's labels; resume; the segment ids."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx.config import ConfigError, DataConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig
from olmo3eqx.data import DataError, build_train_iterator
from olmo3eqx.data import packed as packed_module
from olmo3eqx.data.packed import PackedSource, best_fit_decreasing, document_lengths, segment_ids
from olmo3eqx.loss import label_weights
from olmo3eqx.sharding import build_layout
from olmo3eqx.step import make_train_step

pytestmark = pytest.mark.filterwarnings("ignore:Token file .* is skipped")  # FSL files, packing off
pytest.importorskip("olmo_core")
from olmo_core.data import (  # noqa: E402
    DataCollator, NumpyDataLoaderBase, NumpyPackedFSLDatasetConfig, TokenizerConfig,
)
from olmo_core.data.utils import InstancePacker, get_cumulative_document_lengths, get_labels  # noqa: E402

SEQ = 64
BATCH = 8
SEED = 4123
PERMUTATION_SEED = 123
EOS, PAD, VOCAB = 3, 1, 100278


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Token files of EOS-terminated documents: many short ones of equal lengths (ties in the sort), lone EOS,
    documents longer than SEQ (truncated), files with no EOS, tails after the last EOS, ids > 2**16."""
    base = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(0)
    paths = []
    for i in range(30):
        docs = []
        for _ in range(int(rng.integers(0, 40)) if i % 13 else 0):
            n = int(rng.integers(0, 20)) if rng.random() < 0.6 else int(rng.integers(0, 3 * SEQ))
            docs.append(np.append(rng.integers(EOS + 1, VOCAB, n), EOS))
        # OLMo-core cannot memory-map an empty file, so a file without documents gets a tail without EOS.
        tail = rng.integers(EOS + 1, VOCAB, int(rng.integers(1, 2 * SEQ)) if i % 13 == 0 else int(rng.integers(0, 5)))
        path = base / f"part-{i:03d}.npy"
        np.concatenate(docs + [tail]).astype(np.uint32).tofile(path)
        paths.append(str(path))
    return paths


def data_cfg(paths, group_size: int, cache_dir, masks=()) -> DataConfig:
    return DataConfig(paths=tuple(paths), packing=True, source_group_size=group_size,
                      source_permutation_seed=PERMUTATION_SEED, order="olmo-core", seed=SEED, seq_len=SEQ,
                      global_batch=BATCH, token_dtype="uint32", cache_dir=str(cache_dir), label_mask_paths=tuple(masks))


def ours(paths, group_size, index_dir, *, shard_count=1, state=None, masks=()):
    return [build_train_iterator(data_cfg(paths, group_size, index_dir / "cache", masks), seq_len=SEQ,
                                 global_batch=BATCH, seed=SEED, shard_index=s, shard_count=shard_count,
                                 vocab_size=VOCAB, state=state, index_dir=index_dir, eos_id=EOS, pad_id=PAD)
            for s in range(shard_count)]


def olmo_core_loader(paths, group_size, work_dir, masks=None):
    dataset = NumpyPackedFSLDatasetConfig(
        paths=list(paths), source_permutation_seed=PERMUTATION_SEED, sequence_length=SEQ, generate_doc_lengths=True,
        source_group_size=group_size, tokenizer=TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=PAD),
        work_dir=str(work_dir), label_mask_paths=masks).build()
    dataset.prepare()
    return dataset, NumpyDataLoaderBase.wrap_numpy_dataset(
        dataset, global_batch_size=BATCH * SEQ, collator=DataCollator(pad_token_id=PAD), work_dir=str(work_dir),
        seed=SEED, num_threads=0)


def olmo_core_batches(loader, epochs: int) -> list[dict]:
    out = []
    for epoch in range(1, epochs + 1):
        loader.reshuffle(epoch=epoch)
        out += [{k: v.numpy() for k, v in b.items() if k in ("index", "input_ids", "label_mask", "doc_lens")}
                for b in loader]
        loader.reset()
    return out


def same(ours_batch: dict, ref: dict) -> bool:
    return (np.array_equal(ours_batch["index"], ref["index"])
            and np.array_equal(ours_batch["tokens"].astype(np.int64), ref["input_ids"])
            and np.array_equal(ours_batch["label_mask"], ref["label_mask"])
            and np.array_equal(ours_batch["doc_lens"], ref["doc_lens"]))


@pytest.mark.parametrize("group_size", [1, 8])
def test_packed_batches_equal_olmo_core_s(files, tmp_path, group_size):
    dataset, loader = olmo_core_loader(files, group_size, tmp_path / "oc")
    (it,) = ours(files, group_size, tmp_path / "ours")
    assert it.source.paths == list(dataset.paths)  # the same Random(123) file order
    assert it.num_instances == len(dataset) and it.batches_per_epoch == loader.total_batches
    want = olmo_core_batches(loader, 2)
    got = [next(it) for _ in want]
    mismatches = sum(not same(g, w) for g, w in zip(got, want))
    pad = sum(int((~b["label_mask"]).sum()) for b in got)
    print(f"\ngroup {group_size}: {len(files)} files, {len(dataset)} packed instances, {len(want)} global batches "
          f"(2 epochs) compared, padding {pad / (len(want) * BATCH * SEQ):.1%} of tokens, mismatches: {mismatches}")
    assert mismatches == 0, f"{mismatches} of {len(want)} global batches differ from OLMo-core's"
    assert any((b["doc_lens"] > 0).sum(axis=1).max() > 2 for b in got)  # instances do hold several documents
    assert any(b["doc_lens"].max() == SEQ and b["label_mask"].all(axis=1).any() for b in got)  # truncated ones
    for g, w in zip(got, want):
        # Labels: our loss weights are OLMo-core's non-ignored labels.
        ref_labels = get_labels({"input_ids": _torch(w["input_ids"]), "label_mask": _torch(w["label_mask"])})
        weights = np.asarray(label_weights(*(jnp.asarray(g[k]) for k in ("tokens", "mask", "label_mask"))))
        assert np.array_equal(weights > 0, ref_labels.numpy() != -100)
        # Segment ids change exactly at OLMo-core's cumulative document boundaries (the flash-attention cu_seqlens).
        cu = get_cumulative_document_lengths(_torch(w["doc_lens"])).numpy()
        flat = (g["segment_ids"] + np.arange(BATCH)[:, None] * SEQ).reshape(-1)
        starts = np.flatnonzero(np.diff(flat, prepend=-1))
        assert np.array_equal(np.append(starts, BATCH * SEQ), cu)


def test_packed_sft_batches_with_label_masks_equal_olmo_core_s(files, tmp_path):
    """data.label_mask_paths (supervised fine-tuning): OLMo-core's label_mask_paths read per document beside the
    tokens, shuffled with them, truncated with them; the padding stays unlabelled."""
    rng = np.random.default_rng(1)
    masks = []
    for path in files:
        mask = tmp_path / Path(path).name.replace("part", "mask")
        (rng.random(np.fromfile(path, np.uint32).size) < 0.5).tofile(mask)
        masks.append(str(mask))
    dataset, loader = olmo_core_loader(files, 8, tmp_path / "oc", masks)
    (it,) = ours(files, 8, tmp_path / "ours", masks=[str(tmp_path / "mask-*.npy")])
    want = olmo_core_batches(loader, 1)
    got = [next(it) for _ in want]
    assert all(same(g, w) for g, w in zip(got, want))
    labelled = sum(int(b["label_mask"].sum()) for b in got)
    assert 0.4 < labelled / sum(int((b["tokens"] != PAD).sum()) for b in got) < 0.6  # the masks', not all ones
    with pytest.raises(DataError, match="names 29 files for 30 token files"):
        ours(files, 8, tmp_path / "few", masks=masks[:-1])
    np.zeros(3, np.bool_).tofile(masks[0])
    with pytest.raises(DataError, match="has 3 entries for"):
        ours(files, 8, tmp_path / "short", masks=masks)


# --- over http(s) with OLMo-core's document indices, and the packing cache ---------------------------------


@pytest.fixture(scope="module")
def web(tmp_path_factory):
    """tests/stores.py's Range-honouring HTTP server on a directory of its own."""
    from stores import HttpServer, free_port

    server = HttpServer(tmp_path_factory.mktemp("www"), free_port())
    yield server
    server.stop()


def publish(web, local: list[str], prefix: str, *, indices: bool) -> list[str]:
    """Copy token files under the server's root (with OLMo-core's write_document_indices' .csv.gz beside each if
    `indices`); their URLs."""
    from olmo_core.data.utils import write_document_indices

    root = Path(web.server.root) / prefix
    root.mkdir()
    for path in local:
        shutil.copyfile(path, root / Path(path).name)
        if indices:
            write_document_indices(root / Path(path).name, dtype=np.uint32, eos_token_id=EOS)
    return [f"{web.url}/{prefix}/{Path(p).name}" for p in local]


def rewrite_index(npy: Path, edit) -> None:
    """Replace the .csv.gz rows of token file `npy` by edit(rows), rows as [start, end] lists."""
    index = npy.with_suffix(".csv.gz")
    rows = [[int(x) for x in line.split(",")] for line in gzip.decompress(index.read_bytes()).decode().splitlines()]
    index.write_bytes(gzip.compress("".join(f"{a},{b}\n" for a, b in edit(rows)).encode()))


def served_bytes(web) -> int:
    """Bytes of files the server has sent since its request log was cleared (ranged GETs: their ranges)."""
    total = 0
    for command, path, rng in web.server.requests:
        file = Path(web.server.root) / path.lstrip("/")
        if command == "GET" and file.is_file():
            a, b = (int(x) for x in rng.removeprefix("bytes=").split("-")) if rng else (0, file.stat().st_size - 1)
            total += min(b, file.stat().st_size - 1) - a + 1
    return total


def big_files(directory: Path, count: int, tokens: int, seed: int) -> list[str]:
    """uint32 token files of EOS-terminated documents of lognormal lengths (median 200), a tail after the last EOS."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        ids = rng.integers(EOS + 1, VOCAB, tokens).astype(np.uint32)
        ends = np.cumsum(np.clip(rng.lognormal(np.log(200), 1.2, tokens // 100), 1, None).astype(np.int64))
        ids[ends[ends < tokens - 5] - 1] = EOS
        ids.tofile(directory / f"big-{seed}-{i}.npy")
        paths.append(str(directory / f"big-{seed}-{i}.npy"))
    return paths


def test_packed_batches_over_https_with_document_indices_equal_olmo_core_s(files, web, tmp_path, monkeypatch):
    """The token files served over http with OLMo-core's .csv.gz indices beside them, two of them rewritten as data not
    written by the Dolma toolkit has them (a last document without EOS, OLMo-core PR 843's edge; two documents in one
    span): OLMo-core's dataset on the URLs takes the indices' documents, and so do we, document lengths included."""
    import cached_path.common

    monkeypatch.setattr(cached_path.common, "CACHE_DIRECTORY", tmp_path / "cached_path")  # OLMo-core's downloads
    urls = publish(web, files, "indexed", indices=True)
    served = [Path(web.server.root) / "indexed" / Path(p).name for p in files]
    eos_counts = [int((np.fromfile(p, np.uint32) == EOS).sum()) for p in served]
    tail = next(p for p, n in zip(served, eos_counts) if n and np.fromfile(p, np.uint32)[-1] != EOS)
    rewrite_index(tail, lambda rows: rows + [[rows[-1][1], tail.stat().st_size // 4]])
    merged = next(p for p, n in zip(served, eos_counts) if n > 3)
    rewrite_index(merged, lambda rows: [[rows[0][0], rows[1][1]]] + rows[2:])

    dataset, loader = olmo_core_loader(urls, 8, tmp_path / "oc")
    (it,) = ours(urls, 8, tmp_path / "ours")
    assert it.num_instances == len(dataset) and it.source.paths == list(dataset.paths)
    want = olmo_core_batches(loader, 1)
    got = [next(it) for _ in want]
    assert sum(not same(g, w) for g, w in zip(got, want)) == 0
    # The indices' documents were used: some row's lengths are not what a scan of its tokens finds.
    assert any(not np.array_equal(lens[lens > 0], document_lengths(tokens, EOS))
               for b in got for lens, tokens in zip(b["doc_lens"], b["tokens"]))


def test_a_packed_start_over_https_reads_the_indices_not_the_tokens_and_a_relaunch_reuses_the_packing(web, tmp_path):
    """Eight 2 MiB token files over http with .csv.gz indices: the first start reads the indices, under 10% of the
    token bytes (each file's HEAD and sampled ids, three batches); a relaunch reads no index (the packing is
    memory-mapped from data.cache_dir) and gives the same batches; both equal the local files' (scanned) packing."""
    local = big_files(tmp_path, 8, 2**19, 5)
    urls = publish(web, local, "big", indices=True)
    token_bytes = 8 * 2**19 * 4
    cfg = DataConfig(paths=tuple(urls), packing=True, source_group_size=4, seq_len=1024, global_batch=BATCH,
                     token_dtype="uint32", cache_dir=str(tmp_path / "cache"), num_threads=0, prefetch=0)

    def start(c):
        web.server.requests.clear()
        it = build_train_iterator(c, seq_len=1024, global_batch=BATCH, seed=SEED, shard_index=0, shard_count=1,
                                  vocab_size=VOCAB, eos_id=EOS, pad_id=PAD)
        return [next(it) for _ in range(3)], served_bytes(web), [p for _, p, _ in web.server.requests]

    first, first_bytes, first_paths = start(cfg)
    again, again_bytes, again_paths = start(cfg)
    print(f"\nfirst start read {first_bytes:,} bytes, relaunch {again_bytes:,} ({first_bytes / token_bytes:.2%}, "
          f"{again_bytes / token_bytes:.2%} of the token bytes)")
    assert first_bytes < 0.1 * token_bytes and again_bytes < 0.1 * token_bytes
    indices = sorted(p for p in first_paths if p.endswith(".csv.gz"))
    assert indices == sorted(f"/big/{Path(p).name.replace('.npy', '.csv.gz')}" for p in local)
    assert not any(p.endswith(".csv.gz") for p in again_paths)
    assert len(list((tmp_path / "cache" / "packing").glob("*.lock"))) == 1  # one packing
    scanned, _, _ = start(dataclasses.replace(cfg, paths=tuple(local), cache_dir=str(tmp_path / "local")))
    for a, b, c in zip(first, again, scanned):
        for key in ("index", "tokens", "label_mask", "doc_lens"):
            assert np.array_equal(a[key], b[key]) and np.array_equal(a[key], c[key])


def test_without_indices_a_remote_file_is_scanned_once_and_kept_in_the_cache_dir(web, tmp_path):
    """Remote files with no .csv.gz: the first start scans them (reads them whole, once) into
    data.cache_dir/document-indices/; a start at another seq_len (another packing) reuses the scans."""
    urls = publish(web, big_files(tmp_path, 2, 2**19, 6), "scan", indices=False)
    cache = tmp_path / "cache"
    for seq_len, least, most in ((1024, 1.0, 1.1), (512, 0.0, 0.1)):
        web.server.requests.clear()
        PackedSource(urls, seq_len=seq_len, eos_id=EOS, pad_id=PAD, cache_dir=cache, token_dtype="uint32",
                     vocab_size=VOCAB)
        assert least <= served_bytes(web) / (2 * 2**19 * 4) < most
    assert len(list((cache / "document-indices").glob("*.npy"))) == 2  # one scan a file
    assert len(list((cache / "packing").glob("*.lock"))) == 2  # two packings


BAD_INDICES = {
    "gzip": (b"0,5\n", r"indices http://.*/bad-gzip/big-8-0.csv.gz are not gzip data"),
    "text": (gzip.compress(b"0,5\n5,x\n"), r"/bad-text/big-8-0.csv.gz are not 'start,end' rows of integers"),
    "outside": (gzip.compress(b"0,5\n5,9999999\n"),
                r"Row 2 of .*/bad-outside/big-8-0.csv.gz is the span 5,9999999, not a non-empty span of the file's "
                r"65,536 tokens"),
    "empty": (gzip.compress(b"0,5\n5,5\n"), r"Row 2 of .* is the span 5,5"),
}


@pytest.mark.parametrize("case", BAD_INDICES)
def test_bad_document_indices_stop_with_one_sentence_naming_them(web, tmp_path, case):
    index, message = BAD_INDICES[case]
    (url,) = publish(web, big_files(tmp_path, 1, 2**16, 8), f"bad-{case}", indices=False)
    (Path(web.server.root) / f"bad-{case}" / "big-8-0.csv.gz").write_bytes(index)
    with pytest.raises(DataError, match=message):
        PackedSource([url], seq_len=1024, eos_id=EOS, pad_id=PAD, cache_dir=tmp_path, token_dtype="uint32",
                     vocab_size=VOCAB)
    assert all(p.name.endswith(".lock") for p in (tmp_path / "packing").iterdir())  # nothing half built


KILLED_BUILD = """
import sys, time
import numpy as np
import olmo3eqx.data.packed as packed
save = np.save
def hang(f, array):  # a crash mid-write: the first array written, then killed
    save(f, array)
    f.flush()
    time.sleep(600)
packed.np.save = hang
packed.PackedSource(sys.argv[2:], seq_len=1024, eos_id=3, pad_id=1, cache_dir=sys.argv[1], group_size=2,
                    token_dtype="uint32", vocab_size=100278)
"""


def test_one_builder_packs_the_others_wait_and_a_killed_packing_leaves_nothing_half_written(web, tmp_path,
                                                                                            monkeypatch):
    """A builder killed (SIGKILL) after writing part of the packing leaves only its temporary directory, never the
    packing's name; then four readers starting at once read each .csv.gz once between them (one packs and removes the
    dead builder's temporary, the others wait on the lock) and map the same packing, which a later start maps without
    a request for any index."""
    urls = publish(web, big_files(tmp_path, 4, 2**16, 7), "concurrent", indices=True)
    cache = tmp_path / "cache"
    killed = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(cache), *urls])
    deadline = time.time() + 60
    while not list((cache / "packing").glob(".*.tmp/*.npy")) and time.time() < deadline:
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    (stale,) = [p for p in (cache / "packing").iterdir() if not p.name.endswith(".lock")]
    assert stale.name.endswith(".tmp")

    pack = packed_module.pack_files
    builds = []

    def slow_pack(*args, **kw):
        builds.append(1)
        time.sleep(0.3)  # long enough for every other reader to reach the lock
        return pack(*args, **kw)

    monkeypatch.setattr(packed_module, "pack_files", slow_pack)
    web.server.requests.clear()
    got = [None] * 4

    def reader(i):
        got[i] = PackedSource(urls, seq_len=1024, eos_id=EOS, pad_id=PAD, cache_dir=cache, group_size=2,
                              token_dtype="uint32", vocab_size=VOCAB)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and all(g is not None for g in got) and not stale.exists()  # the next builder removed it
    assert sorted(p for _, p, _ in web.server.requests if p.endswith(".csv.gz")) == sorted(
        f"/concurrent/big-7-{i}.csv.gz" for i in range(4))
    assert all(g.num_instances == got[0].num_instances for g in got)
    ids = np.arange(0, got[0].num_instances, got[0].num_instances // 8)
    want = got[0].read_packed(ids)
    for g in got[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(g.read_packed(ids), want))
    web.server.requests.clear()
    again = PackedSource(urls, seq_len=1024, eos_id=EOS, pad_id=PAD, cache_dir=cache, group_size=2,
                         token_dtype="uint32", vocab_size=VOCAB)
    assert len(builds) == 1 and not any(p.endswith(".csv.gz") for _, p, _ in web.server.requests)
    assert all(np.array_equal(a, b) for a, b in zip(again.read_packed(ids), want))


def _torch(x):
    import torch
    return torch.from_numpy(np.ascontiguousarray(x))


@pytest.mark.parametrize("capacity", [2, 16, 128, 1024])
def test_best_fit_decreasing_equals_olmo_core_s_packer(capacity):
    """The packer alone against InstancePacker's bins and sorted documents, on lengths with many ties, documents of
    exactly capacity, capacity / 2 and 1, a lognormal spread, and none."""
    rng = np.random.default_rng(capacity)
    cases = [np.zeros(0, np.int64), np.full(7, capacity), np.full(9, max(1, capacity // 2)),
             np.concatenate([rng.integers(1, 9, 500), rng.integers(1, capacity + 1, 300), np.full(20, capacity)]),
             rng.choice([1, max(1, capacity // 2), capacity, max(1, capacity // 3)], 400),
             np.clip(rng.lognormal(np.log(capacity / 8), 1.5, 3000).astype(np.int64), 1, capacity)]
    for lengths in cases:
        lengths = np.minimum(lengths, capacity).astype(np.int64)
        starts = np.cumsum(lengths) - lengths
        spans = np.stack([starts, starts + lengths], axis=1).astype(np.uint64)
        ref_bins, ref_sorted, _ = InstancePacker(capacity).pack_documents(spans)
        order, instance = best_fit_decreasing(lengths, capacity)
        assert np.array_equal(spans[order], ref_sorted)
        assert [np.flatnonzero(instance == b).tolist() for b in range(len(ref_bins))] == ref_bins
        assert instance.size == 0 or instance.max() == len(ref_bins) - 1


def test_resume_and_process_counts_give_the_same_batches(files, tmp_path):
    iters = ours(files, 8, tmp_path, shard_count=2)
    first = [[next(it) for it in iters] for _ in range(30)]
    state = json.loads(json.dumps(iters[0].get_state()))
    assert state["packing"] == {"group_size": 8}
    resumed = ours(files, 8, tmp_path, shard_count=4, state=state)
    (whole,) = ours(files, 8, tmp_path)
    want = [next(whole) for _ in range(40)]
    for r, rows in enumerate(first + [[next(it) for it in resumed] for _ in range(10)]):
        for key in ("tokens", "label_mask", "segment_ids", "index"):
            assert np.array_equal(np.concatenate([b[key] for b in rows]), want[r][key]), (r, key)
    with pytest.raises(DataError, match="packing"):
        build_train_iterator(dataclasses.replace(data_cfg(files, 8, tmp_path), packing=False), seq_len=SEQ, global_batch=BATCH,
                             seed=SEED, shard_index=0, shard_count=1, vocab_size=VOCAB, state=state,
                             index_dir=tmp_path)


def test_segment_ids_number_documents_and_padding():
    lens = np.array([[3, 2, 0], [1, 1, 3]], np.int32)
    assert segment_ids(lens, 5).tolist() == [[0, 0, 0, 1, 1], [0, 1, 2, 2, 2]]


@pytest.mark.parametrize("change, message", [
    (dict(seq_len=96), "power-of-two"),
    (dict(max_target_seq_len=128), "max_target_seq_len"),
    (dict(source_group_size=0), "source_group_size"),
    (dict(cache_dir="gs://bucket/cache"), "data.cache_dir gs://bucket/cache is a URL"),
])
def test_bad_packing_configs_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        DataConfig(**{"packing": True, "seq_len": 64} | change)


# --- the train step on packed batches ---------------------------------------------------------------

STEP_MODEL = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                         eos_token_id=EOS, pad_token_id=PAD, compute_dtype="float32")
STEP_SEQ = 32


def packed_batch(seed: int) -> dict[str, np.ndarray]:
    """BATCH instances of several EOS-terminated documents each, then padding (the last one none)."""
    rng = np.random.default_rng(seed)
    tokens = np.full((BATCH, STEP_SEQ), PAD, np.int32)
    label_mask = np.zeros((BATCH, STEP_SEQ), bool)
    for row in range(BATCH):
        used = STEP_SEQ if row == BATCH - 1 else int(rng.integers(STEP_SEQ // 2, STEP_SEQ))
        tokens[row, :used] = rng.integers(EOS + 1, STEP_MODEL.vocab_size, used)
        tokens[row, rng.choice(used - 1, 3, replace=False)] = EOS
        label_mask[row, :used] = True
    doc_lens = [document_lengths(t, EOS) for t in tokens]
    padded = np.zeros((BATCH, max(x.size for x in doc_lens)), np.int32)
    for row, x in enumerate(doc_lens):
        padded[row, :x.size] = x
    return {"tokens": tokens, "mask": np.ones(BATCH, np.float32), "label_mask": label_mask,
            "segment_ids": segment_ids(padded, STEP_SEQ)}


def first_step_losses(mesh: MeshConfig, devices: int, batches: list[dict]) -> tuple[list[float], int]:
    """(train/loss of the first step from the initial state on each batch, accumulation steps)."""
    cfg = TrainConfig(steps=3, model=STEP_MODEL, mesh=mesh, optim=OptimConfig(lr=1e-3, warmup_steps=1),
                      data=DataConfig(seq_len=STEP_SEQ, global_batch=BATCH, packing=True))
    layout = build_layout(cfg, jax.devices()[:devices])
    step = make_train_step(cfg, layout)
    losses = [float(step(layout.init_state(cfg), *layout.put_batch(b))[1]["train/loss"]) for b in batches]
    return losses, layout.plan.accum_steps


def test_packed_loss_is_the_global_token_mean_over_olmo_core_s_labels():
    """train/loss on 4 devices with accumulation 2 = torch's cross-entropy mean over OLMo-core's non-ignored labels
    (get_labels) of the document-masked logits of the same initial model, on one device."""
    import torch
    batch = packed_batch(0)
    unmasked = dict(batch, label_mask=np.ones_like(batch["label_mask"]))
    (loss, loss_unmasked), accum = first_step_losses(MeshConfig(fsdp=4, max_per_device_batch=1), 4, [batch, unmasked])
    assert accum == 2
    cfg = TrainConfig(model=STEP_MODEL, data=DataConfig(seq_len=STEP_SEQ, global_batch=BATCH, packing=True))
    model = build_layout(cfg, jax.devices()[:1]).init_state(cfg).model
    logits = np.array(model(jnp.asarray(batch["tokens"]), segment_ids=jnp.asarray(batch["segment_ids"])), np.float32)
    labels = get_labels({"input_ids": _torch(batch["tokens"]).long(), "label_mask": _torch(batch["label_mask"])})
    ref = torch.nn.functional.cross_entropy(torch.from_numpy(logits).flatten(0, 1), labels.flatten(),
                                            ignore_index=-100, reduction="mean")
    assert loss == pytest.approx(float(ref), rel=1e-5)
    assert abs(loss_unmasked - loss) > 1e-3  # without the label mask the padding would count: another mean
