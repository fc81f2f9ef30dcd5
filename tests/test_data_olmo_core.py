"""data.order olmo-core against OLMo-core's own NumpyFSLDataset and NumpyFSLDataLoader, and eval.heldout_mix against
its NumpyPaddedFSLDataset, on generated token files: the same instance ids and tokens for every global batch,
across the epoch boundary, with max_target_seq_len equal to and larger than seq_len; OLMo-core's resume; the
per-epoch index cache (OLMo-core's own file, byte for byte; built once under a lock); train.py's iterator."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from olmo3eqx.config import DataConfig, EvalConfig
from olmo3eqx.data import build_train_iterator
from olmo3eqx.data.heldout import open_heldout
from olmo3eqx.data import order as order_module

pytest.importorskip("olmo_core")
import olmo_core.data.mixes as olmo_mixes  # noqa: E402
from olmo_core.data import DataCollator, NumpyDataLoaderBase, NumpyFSLDataset, NumpyPaddedFSLDataset  # noqa: E402
from olmo_core.data.mixes import DataMix  # noqa: E402
from olmo_core.data.tokenizer import TokenizerName  # noqa: E402
from olmo_core.data.utils import get_labels  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Token file .* is skipped")  # the short files, on purpose
SEQ = 16
BATCH = 8  # instances per global batch
SEED = 34521
EOS, PAD = 3, 1
MIXES = {
    # name: (OLMo-core mix whose {TOKENIZER} rule the file gets, dtype, vocab, files); the uint32 mix holds ids
    # above 2**16, and is named as OLMo 3's stage-1 mix so it resolves with that mix's tokenizer id.
    "uint32": ("OLMo-mix-0625-official", np.uint32, 100278, 240),
    "uint16": ("dolma17", np.uint16, 50280, 160),
}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """name -> (mix file, data root, dtype, vocab): hundreds of token files of uneven sizes (empty, shorter than
    one instance, tails of every length) under labelled directories, listed in a mix file with {TOKENIZER}."""
    base = tmp_path_factory.mktemp("mixes")
    rng = np.random.default_rng(0)
    out = {}
    for name, (member, dtype, vocab, n_files) in MIXES.items():
        root = base / name / "root"
        tokenizer = "allenai/dolma3-tokenizer" if member == "OLMo-mix-0625-official" else "allenai/dolma2-tokenizer"
        lines = []
        for i in range(n_files):
            label = f"source_{i % 7}"
            rel = f"preprocessed/{{TOKENIZER}}/{label}/part-{i:04d}.npy"
            n = int(rng.integers(0, 30 * SEQ)) if i % 11 else int(rng.integers(0, SEQ))
            path = root / rel.replace("{TOKENIZER}", tokenizer)
            path.parent.mkdir(parents=True, exist_ok=True)
            rng.integers(0, vocab, n).astype(dtype).tofile(path)
            lines.append(f"{label},{rel}")
        mix = base / name / f"{member}.txt"  # a mix file is known by its name: it gets that mix's {TOKENIZER} rule
        mix.write_text("# generated\n" + "\n".join(lines) + "\n")
        out[name] = (mix, root, dtype, vocab)
    return out


@contextlib.contextmanager
def olmo_core_reads(mix: Path):
    """OLMo-core's DataMix reads only its packaged lists: point its reader at our generated file."""
    original = olmo_mixes._get_data_mix_path

    @contextlib.contextmanager
    def generated_list(name):
        yield mix

    olmo_mixes._get_data_mix_path = generated_list
    try:
        yield
    finally:
        olmo_mixes._get_data_mix_path = original


def olmo_core_dataset(generated, name, max_target):
    mix, root, dtype, vocab = generated[name]
    with olmo_core_reads(mix):
        paths, labels = DataMix(MIXES[name][0]).build(str(root), TokenizerName.dolma2)
    return NumpyFSLDataset(*paths, sequence_length=SEQ, pad_token_id=PAD, eos_token_id=EOS, vocab_size=vocab,
                           dtype=dtype, max_target_sequence_length=max_target,
                           metadata=[{"label": label} for label in labels])


def olmo_core_loader(dataset, work_dir, *, dp_rank=0, dp_world_size=1):
    dataset.work_dir = work_dir
    dataset.prepare()
    return NumpyDataLoaderBase.wrap_numpy_dataset(
        dataset, global_batch_size=BATCH * SEQ, collator=DataCollator(pad_token_id=PAD), work_dir=work_dir,
        seed=SEED, dp_rank=dp_rank, dp_world_size=dp_world_size, num_threads=0)


def olmo_core_batches(loader, n: int, *, start_epoch: int = 1, skip: int = 0):
    """(index, input_ids) of n batches as OLMo-core's trainer draws them: reshuffle(epoch) before each epoch,
    reset() after it; with `skip`, the loader's state says that many batches of start_epoch are done."""
    out, epoch = [], start_epoch
    loader.batches_processed = skip
    while len(out) < n:
        loader.reshuffle(epoch=epoch)
        for batch in loader:
            out.append((batch["index"].numpy().astype(np.int64), batch["input_ids"].numpy()))
            if len(out) == n:
                break
        else:
            loader.reset()
            epoch += 1
    return out


def ours(generated, name, max_target, index_dir, *, shard_count=1, state=None):
    mix, root, dtype, vocab = generated[name]
    cfg = DataConfig(mix=str(mix), mix_root=str(root), order="olmo-core", seed=SEED, seq_len=SEQ, global_batch=BATCH,
                     max_target_seq_len=max_target, token_dtype=np.dtype(dtype).name, num_threads=2, prefetch=4)
    return [build_train_iterator(cfg, seq_len=SEQ, global_batch=BATCH, seed=SEED, shard_index=s,
                                 shard_count=shard_count, vocab_size=vocab, state=state, index_dir=index_dir)
            for s in range(shard_count)]


def rows(iters, n):
    return [[next(it) for it in iters] for _ in range(n)]


@pytest.mark.parametrize("max_target", [None, SEQ, 4 * SEQ])
@pytest.mark.parametrize("name", list(MIXES))
def test_every_global_batch_equals_olmo_core_s(generated, tmp_path, name, max_target):
    dataset = olmo_core_dataset(generated, name, max_target)
    loader = olmo_core_loader(dataset, tmp_path / "olmo_core")
    (it,) = ours(generated, name, max_target, tmp_path / "ours")
    assert it.num_instances == len(dataset) and it.batches_per_epoch == loader.total_batches
    assert it.source.labels == [m["label"] for m, (a, b) in zip(dataset.metadata, dataset.offsets) if b > a]
    n = loader.total_batches + 100  # the whole first epoch and 100 batches into the second
    assert loader.total_batches > 200
    mismatches = 0
    for r, (index, input_ids) in enumerate(olmo_core_batches(loader, n)):
        batch = next(it)
        same = np.array_equal(batch["index"], index) and np.array_equal(batch["tokens"].astype(np.int64), input_ids)
        mismatches += not same
    print(f"\n{name} mix, {len(dataset.paths)} files, {len(dataset):,} instances, max_target_seq_len {max_target}: "
          f"{n} global batches compared ({loader.total_batches} in epoch 1), mismatches: {mismatches}")
    assert mismatches == 0, f"{mismatches} of {n} global batches differ from OLMo-core's"
    # The cached indices are OLMo-core's own files, byte for byte, under the same names.
    oc_file = loader._global_indices_file  # epoch 2's, where the loader is now
    for epoch in (1, 2):
        want = oc_file.with_name(oc_file.name.replace("epoch2", f"epoch{epoch}"))
        assert (tmp_path / "ours" / want.name).read_bytes() == want.read_bytes()


@pytest.mark.parametrize("max_target", [None, 4 * SEQ])
def test_resume_equals_olmo_core_s_resume(generated, tmp_path, max_target):
    """Stop after k batches, save both loaders' states, resume (ours on another process count): the same batches."""
    name = "uint32"
    dataset = olmo_core_dataset(generated, name, max_target)
    bpe = olmo_core_loader(dataset, tmp_path / "oc").total_batches
    for k in (137, bpe + 5):
        loader = olmo_core_loader(dataset, tmp_path / "oc")
        olmo_core_batches(loader, k)
        saved = json.loads(json.dumps(loader.state_dict()))
        resumed_loader = olmo_core_loader(dataset, tmp_path / "oc")
        resumed_loader.load_state_dict(saved)
        want = olmo_core_batches(resumed_loader, 20, start_epoch=saved["epoch"], skip=resumed_loader.batches_processed)
        iters = ours(generated, name, max_target, tmp_path / "ours", shard_count=2)
        rows(iters, k)
        state = json.loads(json.dumps(iters[0].get_state()))
        resumed = ours(generated, name, max_target, tmp_path / "ours", shard_count=4, state=state)
        for (index, input_ids), got in zip(want, rows(resumed, 20)):
            assert np.array_equal(np.concatenate([b["index"] for b in got]), index)
            assert np.array_equal(np.concatenate([b["tokens"] for b in got]).astype(np.int64), input_ids)


def test_data_parallel_ranks_hold_the_same_global_batches(generated, tmp_path):
    """OLMo-core's ranks take strided parts of a batch, ours contiguous: the same instances per global batch."""
    dataset = olmo_core_dataset(generated, "uint16", None)
    ranks = [olmo_core_batches(olmo_core_loader(dataset, tmp_path / "oc", dp_rank=r, dp_world_size=4), 50)
             for r in range(4)]
    for r, got in enumerate(rows(ours(generated, "uint16", None, tmp_path / "ours", shard_count=4), 50)):
        want = {int(i): row.tolist() for rank in ranks for i, row in zip(*rank[r])}
        have = {int(i): row.tolist() for b in got for i, row in zip(b["index"], b["tokens"])}
        assert have == want


def test_heldout_mix_gives_olmo_core_s_padded_instances(tmp_path):
    """v3-small-ppl-validation's eleven files, generated under a root: one instance per EOS-terminated document
    (some longer than SEQ, some a lone EOS, a tail without EOS), as OLMo-core's NumpyPaddedFSLDataset builds them."""
    rng = np.random.default_rng(1)
    vocab = 100278
    paths, labels = DataMix.v3_small_ppl_validation.build(str(tmp_path / "root"), TokenizerName.dolma2)
    for path in paths:
        docs = [np.append(rng.integers(EOS + 1, vocab, rng.integers(0, 3 * SEQ)), EOS) for _ in range(25)]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        np.concatenate(docs + [rng.integers(EOS + 1, vocab, 5)]).astype(np.uint32).tofile(path)
    reference = NumpyPaddedFSLDataset(*paths, sequence_length=SEQ, pad_token_id=PAD, eos_token_id=EOS,
                                      vocab_size=vocab, dtype=np.uint32, metadata=[{"label": x} for x in labels])
    reference.work_dir = tmp_path / "work"
    reference.prepare()
    sets = open_heldout(EvalConfig(heldout_mix="v3-small-ppl-validation"),
                        DataConfig(mix_root=str(tmp_path / "root"), token_dtype="uint32"),
                        seq_len=SEQ, vocab_size=vocab, eos_id=EOS, pad_id=PAD)
    assert list(sets) == list(dict.fromkeys(labels)) and "c4_en-validation" in sets
    position = {name: 0 for name in sets}
    for i in range(len(reference)):
        item = reference[i]
        name = item["metadata"]["label"]
        tokens, weights = sets[name].read(np.array([position[name]]))
        position[name] += 1
        assert np.array_equal(tokens[0], item["input_ids"].numpy())
        scored = get_labels({"input_ids": item["input_ids"][None], "label_mask": item["label_mask"][None]})[0] != -100
        assert np.array_equal(weights[0] > 0, scored.numpy())
    assert position == {name: s.num_instances for name, s in sets.items()}


def test_one_process_builds_the_index_the_others_wait_and_reuse(tmp_path, monkeypatch):
    """Four readers of one run ask for epoch 1's index at once: it is written once (under the file lock), renamed
    into place complete, memory-mapped by all of them, and a later reader (a resumed run) maps it again unbuilt."""
    builds = []
    write = order_module.write_epoch_index

    def slow_write(path, **kw):
        builds.append(path)
        time.sleep(0.3)  # long enough for every other reader to reach the lock
        write(path, **kw)

    monkeypatch.setattr(order_module, "write_epoch_index", slow_write)
    path = tmp_path / "data_order" / "global_indices_dataset_size5000_epoch1_seed7_v1.npy"
    got = [None] * 4

    def reader(i):
        got[i] = order_module.cached_epoch_index(path, num_instances=5000, seed=7, epoch=1, chunk_size=1)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and all(isinstance(g, np.memmap) for g in got)
    want = np.arange(5000, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(7 + 1)).shuffle(want)
    assert all(np.array_equal(g, want) for g in got)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".lock"]  # no temporary left
    order_module.cached_epoch_index(path, num_instances=5000, seed=7, epoch=1, chunk_size=1)
    assert len(builds) == 1
    path.write_bytes(b"\0" * 12)
    with pytest.raises(order_module.DataError, match="has 12 bytes, not 20,000; it is not this data's index"):
        order_module.cached_epoch_index(path, num_instances=5000, seed=7, epoch=1, chunk_size=1)


def test_train_loop_data_is_olmo_core_s_order_with_data_seed(tmp_path):
    """train.py's iterator (train.train_data) for data.order olmo-core: data.seed, not run.seed, seeds the order,
    and each epoch's index lies in the run directory's data_order/."""
    from olmo3eqx.config import RunConfig, TrainConfig
    from olmo3eqx.data import training_files
    from olmo3eqx.train import train_data

    data = DataConfig(order="olmo-core", seed=11, seq_len=64, global_batch=16, cache_dir=str(tmp_path / "cache"))
    cfg = TrainConfig(run=RunConfig(name="oc", dir=str(tmp_path), seed=5), data=data)
    it = train_data(cfg, 0, None)
    files, _ = training_files(data)
    dataset = NumpyFSLDataset(*files, sequence_length=64, pad_token_id=257, eos_token_id=256, vocab_size=384,
                              dtype=np.uint16)
    dataset.work_dir = tmp_path / "oc_work"
    dataset.prepare()
    loader = NumpyDataLoaderBase.wrap_numpy_dataset(dataset, global_batch_size=16 * 64,
                                                    collator=DataCollator(pad_token_id=257), work_dir=tmp_path / "w",
                                                    seed=11, num_threads=0)
    for index, input_ids in olmo_core_batches(loader, 3):
        batch = next(it)
        assert np.array_equal(batch["index"], index) and np.array_equal(batch["tokens"], input_ids)
    assert (cfg.run_dir / "data_order" / loader._global_indices_file.name).is_file()
