"""Global order (ours and OLMo-core's), exactly-once sharding, resume, epochs and data errors."""

import json
import shutil
import warnings

import numpy as np
import pytest

from olmo3eqx import exits
from olmo3eqx.config import DataConfig
from olmo3eqx.data import DataError, build_train_iterator
from olmo3eqx.data.order import ORDER_VERSIONS, OurOrder, epoch_permutation
from olmo3eqx.data.pipeline import build_order, global_order, shard_rows
from olmo3eqx.data.source import TokenSource

SEQ = 16
GLOBAL_BATCH = 96  # divisible by 1, 2, 3, 4 and 32
VOCAB = 1000
FILE_INSTANCES = (100, 92, 96)  # 288 instances: 3 global batches per epoch
NUM_INSTANCES = sum(FILE_INSTANCES)
BATCHES_PER_EPOCH = NUM_INSTANCES // GLOBAL_BATCH
ORDERS = ["ours", "olmo-core"]


def write_tokens(path, tokens, dtype=np.uint16):
    np.asarray(tokens, dtype).tofile(path)
    return str(path)


@pytest.fixture
def files(tmp_path):
    """Three uint16 token files; the second ends with a 5-token remainder that must be dropped."""
    rng = np.random.default_rng(0)
    paths = []
    for i, n in enumerate(FILE_INSTANCES):
        extra = 5 if i == 1 else 0
        paths.append(write_tokens(tmp_path / f"part-{i}.npy", rng.integers(0, VOCAB, n * SEQ + extra)))
    return paths


def config(paths, **kw):
    return DataConfig(paths=tuple(paths), token_dtype="uint16", seq_len=SEQ, global_batch=GLOBAL_BATCH, **kw)


@pytest.fixture
def index_dir(tmp_path):
    """Where OLMo-core's order keeps its per-epoch indices (train.py: the run directory), shared by the processes."""
    return tmp_path / "data_order"


def train_iters(cfg, shard_count, state=None, seed=0, index_dir=None):
    return [build_train_iterator(cfg, seq_len=SEQ, global_batch=GLOBAL_BATCH, seed=seed, shard_index=s,
                                 shard_count=shard_count, vocab_size=VOCAB, state=state, index_dir=index_dir)
            for s in range(shard_count)]


def global_rows(iters, n):
    """n global rows: each process's batch for the step, concatenated in process order."""
    return [np.concatenate([next(it)["index"] for it in iters]) for _ in range(n)]


def assert_exactly_once(indices, num_instances):
    ids = np.sort(np.concatenate(indices))
    assert ids.size == num_instances and np.array_equal(ids, np.arange(num_instances)), (
        f"{np.unique(ids).size} distinct of {num_instances} instances in {ids.size} reads")


def test_epoch_permutation_is_a_permutation():
    for n in (1, 2, 5, 64, 65, 1000, 4097):
        perm = epoch_permutation(np.arange(n), num_instances=n, seed=3, epoch=1)
        assert np.array_equal(np.sort(perm), np.arange(n))
    perm = epoch_permutation(np.arange(1000), num_instances=1000, seed=3, epoch=1)
    assert not np.array_equal(perm, np.arange(1000))
    assert not np.array_equal(perm, epoch_permutation(np.arange(1000), num_instances=1000, seed=4, epoch=1))


# The default order's first global batches, pinned: (seed, instances, global batch, processes) -> global batches 0-2,
# each process reading its contiguous slice of them.
PINNED_BATCHES = {
    (0, 20, 8, 2): [[2, 16, 4, 5, 10, 7, 6, 19], [9, 18, 0, 11, 8, 3, 15, 12],
                    [16, 14, 10, 8, 2, 19, 15, 13]],  # 2 batches per epoch: batch 2 opens epoch 1
    (34521, 1_000_003, 6, 3): [[622073, 85470, 408868, 657025, 473851, 464330],  # OLMo 3 stage 1's data seed
                               [90937, 522097, 759192, 806095, 753989, 239077],
                               [343746, 160753, 230604, 894982, 248680, 826468]],
    (1234, 700_000_000, 4, 4): [[470280176, 126747322, 86023984, 445422544],  # about the 7B's stage-1 instances
                                [24390260, 272516101, 265766870, 698683336],
                                [273197042, 495638217, 456023076, 129174027]],
}
ORDER_CHANGED = ("data.order ours now puts other instances in these batches, so a run resumed across the change would "
                 "read other data than its order promised: if the change is meant, bump ORDER_VERSIONS['ours'] "
                 "(data/order.py), which resume refuses across, and pin the new batches here.")


@pytest.mark.parametrize("seed, num_instances, global_batch, processes", PINNED_BATCHES)
def test_the_default_orders_first_batches_are_pinned(seed, num_instances, global_batch, processes):
    order = build_order(DataConfig(), num_instances, seq_len=SEQ, global_batch=global_batch, seed=seed,
                        index_dir=None)
    pinned = PINNED_BATCHES[seed, num_instances, global_batch, processes]
    got = [[shard_rows(global_order(order), shard_index=p, shard_count=processes)[r].tolist()
            for p in range(processes)] for r in range(len(pinned))]
    assert got == [[part.tolist() for part in np.split(np.array(row), processes)] for row in pinned], ORDER_CHANGED
    assert ORDER_VERSIONS["ours"] == 1, "a new version of ours: pin its batches above"


def test_the_iterator_yields_the_pinned_batches(tmp_path):
    (seed, num_instances, global_batch, processes), pinned = next(iter(PINNED_BATCHES.items()))
    path = write_tokens(tmp_path / "tokens.npy", np.arange(num_instances * SEQ) % VOCAB)
    iters = [build_train_iterator(DataConfig(paths=(path,), token_dtype="uint16"), seq_len=SEQ,
                                  global_batch=global_batch, seed=seed, shard_index=p, shard_count=processes,
                                  vocab_size=VOCAB) for p in range(processes)]
    assert [row.tolist() for row in global_rows(iters, len(pinned))] == pinned, ORDER_CHANGED


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shard_count", [1, 2, 3, 4, 32])
def test_every_instance_exactly_once_per_epoch(files, index_dir, shard_count, order):
    cfg = config(files, order=order)
    reference = global_rows(train_iters(cfg, 1, index_dir=index_dir), BATCHES_PER_EPOCH)
    iters = train_iters(cfg, shard_count, index_dir=index_dir)
    assert iters[0].num_instances == NUM_INSTANCES and iters[0].batches_per_epoch == BATCHES_PER_EPOCH
    batches = [[next(it) for _ in range(BATCHES_PER_EPOCH)] for it in iters]
    for shard in batches:
        for b in shard:
            assert b["tokens"].shape == (GLOBAL_BATCH // shard_count, SEQ) and b["tokens"].dtype == np.int32
            assert b["index"].dtype == np.int64 and b["mask"].dtype == np.float32
            assert np.all(b["mask"] == 1)
    assert_exactly_once([b["index"] for shard in batches for b in shard], NUM_INSTANCES)
    for r in range(BATCHES_PER_EPOCH):
        assert np.array_equal(np.concatenate([shard[r]["index"] for shard in batches]), reference[r])


def test_tokens_are_the_indexed_instances(files):
    source = TokenSource(files, seq_len=SEQ, token_dtype="uint16")
    flat = np.concatenate([np.fromfile(f, np.uint16)[: n * SEQ] for f, n in zip(files, FILE_INSTANCES)])
    batch = next(train_iters(config(files), 2)[1])
    for ids_row, tokens in zip(batch["index"], batch["tokens"]):
        assert np.array_equal(tokens, flat[ids_row * SEQ:(ids_row + 1) * SEQ])
    assert np.array_equal(source.read(batch["index"]), batch["tokens"])


@pytest.mark.parametrize("shard_count", [2, 4, 32])
def test_double_sharding_is_caught(shard_count):
    """The MaxText bug: shard inside (our slice) and again outside (a strided shard of the batches). The
    same exactly-once check must fail, so the test above would catch it."""
    indices = []
    for s in range(shard_count):
        rows = shard_rows(global_order(OurOrder(NUM_INSTANCES, seed=0, global_batch=GLOBAL_BATCH)),
                          shard_index=s, shard_count=shard_count)
        twice = rows[s::shard_count]
        indices += [twice[r] for r in range(BATCHES_PER_EPOCH)]
    with pytest.raises(AssertionError, match="distinct"):
        assert_exactly_once(indices, NUM_INSTANCES)
    # ... while sharding once passes it.
    once = [shard_rows(global_order(OurOrder(NUM_INSTANCES, seed=0, global_batch=GLOBAL_BATCH)), shard_index=s,
                       shard_count=shard_count)[r] for s in range(shard_count) for r in range(BATCHES_PER_EPOCH)]
    assert_exactly_once(once, NUM_INSTANCES)


@pytest.mark.parametrize("order", ORDERS)
def test_epochs_differ_and_are_each_exactly_once(files, index_dir, order):
    rows = global_rows(train_iters(config(files, order=order), 4, index_dir=index_dir), 3 * BATCHES_PER_EPOCH)
    epochs = [np.concatenate(rows[e * BATCHES_PER_EPOCH:(e + 1) * BATCHES_PER_EPOCH]) for e in range(3)]
    for e in epochs:
        assert_exactly_once([e], NUM_INSTANCES)
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])


@pytest.mark.parametrize("order", ORDERS)
def test_seed_changes_the_order(files, index_dir, order):
    a = global_rows(train_iters(config(files, order=order), 1, seed=0, index_dir=index_dir), 1)[0]
    b = global_rows(train_iters(config(files, order=order), 1, seed=1, index_dir=index_dir), 1)[0]
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("k", [1, BATCHES_PER_EPOCH - 1, BATCHES_PER_EPOCH, BATCHES_PER_EPOCH + 1])
def test_resume_continues_exactly(files, index_dir, k, order):
    cfg = config(files, num_threads=2, prefetch=4, order=order)
    uninterrupted = global_rows(train_iters(cfg, 2, index_dir=index_dir), k + 4)
    iters = train_iters(cfg, 2, index_dir=index_dir)
    global_rows(iters, k)
    states = [json.loads(json.dumps(it.get_state())) for it in iters]
    assert states[0] == states[1]  # the state is global: every process holds the same one
    assert states[0]["batches_consumed"] == k and states[0]["epoch"] == k // BATCHES_PER_EPOCH
    assert states[0]["tokens_consumed"] == k * GLOBAL_BATCH * SEQ
    resumed = train_iters(cfg, 2, state=states[0], index_dir=index_dir)
    for expected, got in zip(uninterrupted[k:], global_rows(resumed, 4)):
        assert np.array_equal(expected, got)
    assert resumed[0].batches_consumed == k + 4


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("old, new", [(2, 3), (4, 1), (1, 32)])
def test_resume_with_another_shard_count(files, index_dir, old, new, order):
    """Elastic resume: the new processes' slices concatenate to the uninterrupted global rows."""
    cfg = config(files, order=order)
    k = BATCHES_PER_EPOCH + 1
    uninterrupted = global_rows(train_iters(cfg, 1, index_dir=index_dir), k + 3)
    iters = train_iters(cfg, old, index_dir=index_dir)
    global_rows(iters, k)
    resumed = train_iters(cfg, new, state=iters[0].get_state(), index_dir=index_dir)
    for expected, got in zip(uninterrupted[k:], global_rows(resumed, 3)):
        assert np.array_equal(expected, got)


def test_ngram_filter_masks_and_counts(tmp_path):
    rng = np.random.default_rng(1)
    seq = 512
    tokens = rng.integers(0, VOCAB, 8 * seq)
    tokens[3 * seq + 10:3 * seq + 10 + 32 * 13] = np.tile(np.arange(13), 32)  # instance 3: rejected
    tokens[5 * seq + 10:5 * seq + 10 + 31 * 13] = np.tile(np.arange(13), 31)  # instance 5: passes
    path = write_tokens(tmp_path / "t.npy", tokens)
    for flag, masked in ((True, [3]), (False, [])):
        cfg = DataConfig(paths=(path,), token_dtype="uint16", ngram_filter=flag)
        it = build_train_iterator(cfg, seq_len=seq, global_batch=4, seed=0, shard_index=0, shard_count=1)
        batches = [next(it) for _ in range(2)]
        index = np.concatenate([b["index"] for b in batches])
        mask = np.concatenate([b["mask"] for b in batches])
        assert sorted(index[mask == 0].tolist()) == masked
        assert it.masked_instances == len(masked)
        assert np.array_equal(np.sort(index), np.arange(8))  # rejected instances keep their place


def test_heldout_instances_in_file_order_padded_with_minus_one(files):
    """What a held-out pass reads (evaluator.ShardedScorer.heldout_loss: ids 0..n-1 in file order, the last batch
    padded with -1): packed instances are the files' consecutive instances, a -1 row is all weight 0."""
    from olmo3eqx.data.heldout import heldout_instances

    packed = heldout_instances(files, mode="packed", seq_len=SEQ, token_dtype="uint16", vocab_size=VOCAB, eos_id=0,
                               pad_id=1, what="eval.heldout")
    assert packed.num_instances == NUM_INSTANCES
    flat = np.concatenate([np.fromfile(f, np.uint16)[: n * SEQ] for f, n in zip(files, FILE_INSTANCES)])
    ids = np.arange(0, NUM_INSTANCES + 40, dtype=np.int64)
    tokens, weights = packed.read(np.where(ids < NUM_INSTANCES, ids, -1))
    assert np.array_equal(tokens[:NUM_INSTANCES].ravel(), flat)
    assert np.all(weights[:NUM_INSTANCES, :-1] == 1) and np.all(weights[:, -1] == 0)
    assert np.all(weights[NUM_INSTANCES:] == 0)


# --- errors ----------------------------------------------------------------------------------------


def build(cfg, **kw):
    args = dict(seq_len=SEQ, global_batch=GLOBAL_BATCH, seed=0, shard_index=0, shard_count=1, vocab_size=VOCAB)
    return build_train_iterator(cfg, **(args | kw))


def test_missing_file(files, tmp_path):
    with pytest.raises(DataError, match="missing.npy does not exist"):
        build(config([*files, str(tmp_path / "missing.npy")]))
    with pytest.raises(DataError, match="No file matches"):
        build(config([str(tmp_path / "nothing-*.npy")]))


def test_size_not_a_multiple_of_dtype(tmp_path):
    path = tmp_path / "odd.npy"
    path.write_bytes(b"\0" * (GLOBAL_BATCH * SEQ * 2 + 1))
    with pytest.raises(DataError, match="odd.npy has .* not a multiple of 2"):
        build(config([str(path)]))


def test_token_id_beyond_vocab(tmp_path):
    tokens = np.zeros(GLOBAL_BATCH * SEQ, np.uint16)
    tokens[7] = VOCAB
    with pytest.raises(DataError, match=f"big.npy holds token id {VOCAB} >= vocab_size {VOCAB}"):
        build(config([write_tokens(tmp_path / "big.npy", tokens)]))


def test_token_id_beyond_vocab_outside_the_sample(tmp_path, monkeypatch):
    """Ids the open-time sample misses are still caught when the instance is read."""
    import olmo3eqx.data.source as source

    monkeypatch.setattr(source, "SAMPLE_TOKENS", 1)
    monkeypatch.setattr(source, "SAMPLE_CHUNKS", 1)
    tokens = np.zeros(GLOBAL_BATCH * SEQ, np.uint16)
    tokens[-1] = VOCAB + 5
    tokens[-1 - SEQ] = 0
    it = build(config([write_tokens(tmp_path / "late.npy", tokens)]), vocab_size=VOCAB)
    with pytest.raises(DataError, match="late.npy holds token id"):
        next(it)


def test_batch_not_divisible_by_shards(files):
    with pytest.raises(DataError, match="global_batch 96 is not divisible by the 5 data shards"):
        build(config(files), shard_count=5)


def test_too_little_data(files):
    with pytest.raises(DataError, match="fewer than one global batch"):
        build(config(files), global_batch=NUM_INSTANCES + 1)


def test_empty_files(tmp_path, files):
    short = write_tokens(tmp_path / "short.npy", np.zeros(SEQ - 1))
    with pytest.warns(UserWarning, match="short.npy has fewer than seq_len"):
        it = build(config([*files, short]))
    assert it.num_instances == NUM_INSTANCES
    with pytest.raises(DataError, match=f"No instance of seq_len {SEQ} in"), pytest.warns(UserWarning):
        build(config([short]))


@pytest.mark.parametrize("order", ORDERS)
def test_fingerprint_mismatch(tmp_path, files, index_dir, order):
    it = build(config(files, order=order), index_dir=index_dir)
    next(it)
    state = it.get_state()
    # The same names with one file grown, in a new place (rewriting a memory-mapped file in place is a crash).
    changed = tmp_path / "changed"
    changed.mkdir()
    grown = [shutil.copy(f, changed) for f in files]
    with open(grown[2], "ab") as f:
        f.write(np.zeros(SEQ, np.uint16).tobytes())
    with pytest.raises(DataError, match="differ from the ones the checkpoint was trained on"):
        build(config(grown, order=order), state=state, index_dir=index_dir)
    with pytest.warns(UserWarning, match="differ"):
        it = build(config(grown, allow_fingerprint_mismatch=True, order=order), state=state, index_dir=index_dir)
    assert it.batches_consumed == 1
    moved = tmp_path / "moved"
    moved.mkdir()
    same = config([shutil.copy(f, moved) for f in files], order=order)
    assert build(same, state=state, index_dir=index_dir).batches_consumed == 1  # same data


def test_state_of_another_run(files, index_dir):
    it = build(config(files))
    state = it.get_state()
    with pytest.raises(DataError, match="seq_len=16 but this run has seq_len=8"):
        build(config(files), seq_len=8, state=state)
    with pytest.raises(DataError, match="global_batch=96 but this run has global_batch=48"):
        build(config(files), global_batch=48, state=state)
    with pytest.raises(DataError, match="order=ours but this run has order=olmo-core"):
        build(config(files, order="olmo-core"), state=state, index_dir=index_dir)
    with pytest.raises(DataError, match="max_target_seq_len=None but this run has max_target_seq_len=32"):
        build(config(files, max_target_seq_len=2 * SEQ), state=state)
    with pytest.raises(DataError, match="seed=0 but this run has seed=5"):
        build(config(files), seed=5, state=state)
    with pytest.raises(DataError, match="version 0 of data.order ours but this olmo3eqx computes version 1") as e:
        build(config(files), state=state | {"order_version": 0})
    assert e.value.code == exits.BAD_INPUT
    # A state written before these fields: our order, its first version, no target.
    del state["order"], state["order_version"], state["max_target_seq_len"]
    assert build(config(files), state=state).batches_consumed == 0


def test_dtype_from_prepare_metadata(tmp_path):
    """token_dtype auto reads metadata.json beside the files; without it, the vocabulary decides."""
    tokens = np.arange(GLOBAL_BATCH * SEQ) % 70000
    path = write_tokens(tmp_path / "t.npy", tokens, np.uint32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        it = build_train_iterator(DataConfig(paths=(path,)), seq_len=SEQ, global_batch=GLOBAL_BATCH, seed=0,
                                  shard_index=0, shard_count=1, vocab_size=100352)
    assert np.array_equal(np.sort(next(it)["tokens"].ravel()), np.sort(tokens))
    (tmp_path / "metadata.json").write_text(json.dumps({"dtype": "uint16"}))
    it = build_train_iterator(DataConfig(paths=(path,)), seq_len=SEQ, global_batch=GLOBAL_BATCH, seed=0,
                              shard_index=0, shard_count=1)
    assert it.num_instances == 2 * GLOBAL_BATCH  # read as uint16, as the metadata says
    with pytest.raises(DataError, match="data.token_dtype is uint32 but .*metadata.json says"):
        build_train_iterator(DataConfig(paths=(path,), token_dtype="uint32"), seq_len=SEQ,
                             global_batch=GLOBAL_BATCH, seed=0, shard_index=0, shard_count=1)
