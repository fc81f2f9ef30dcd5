"""data.packing against OLMo-core's own NumpyPackedFSLDataset (built from its config, with source_permutation_seed and
source_group_size) and its data loader and collator, on generated token files: the same global batches of instance
ids, tokens, label masks and document lengths, epoch after epoch; OLMo-core's labels; resume; the segment ids."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx.config import ConfigError, DataConfig, MeshConfig, ModelConfig, OptimConfig, TrainConfig
from olmo3eqx.data import DataError, build_train_iterator
from olmo3eqx.data.packed import best_fit_decreasing, document_lengths, segment_ids
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


def data_cfg(paths, group_size: int, cache_dir) -> DataConfig:
    return DataConfig(paths=tuple(paths), packing=True, source_group_size=group_size,
                      source_permutation_seed=PERMUTATION_SEED, order="olmo-core", seed=SEED, seq_len=SEQ,
                      global_batch=BATCH, token_dtype="uint32", cache_dir=str(cache_dir))


def ours(paths, group_size, index_dir, *, shard_count=1, state=None):
    return [build_train_iterator(data_cfg(paths, group_size, index_dir / "cache"), seq_len=SEQ, global_batch=BATCH, seed=SEED,
                                 shard_index=s, shard_count=shard_count, vocab_size=VOCAB, state=state,
                                 index_dir=index_dir, eos_id=EOS, pad_id=PAD) for s in range(shard_count)]


def olmo_core_loader(paths, group_size, work_dir):
    dataset = NumpyPackedFSLDatasetConfig(
        paths=list(paths), source_permutation_seed=PERMUTATION_SEED, sequence_length=SEQ, generate_doc_lengths=True,
        source_group_size=group_size, tokenizer=TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=PAD),
        work_dir=str(work_dir)).build()
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
