"""prepare (text -> token files), the held-out split, and the embedded default corpus."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import olmo3eqx.data.prepare as prep
from olmo3eqx.config import DataConfig, EvalConfig
from olmo3eqx.data import BYTE_EOS, BYTE_PAD, BYTE_VOCAB, DataError, build_train_iterator, heldout_files, training_files
from olmo3eqx.data.heldout import open_heldout


@pytest.fixture
def corpus(tmp_path):
    """40 .txt documents, a .py file, a .jsonl of 30 documents and a .jsonl.gz of 5, all distinct."""
    root = tmp_path / "text"
    (root / "sub").mkdir(parents=True)
    for i in range(40):
        (root / "sub" / f"doc{i:02d}.txt").write_text(f"document {i}: héllo world {'x' * i}")
    (root / "code.py").write_text("def f():\n    return 1\n")
    (root / "ignored.bin").write_bytes(b"\0\1")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"id": f"j{i}", "text": f"json document {i} world"}) + "\n")
    with gzip.open(root / "more.jsonl.gz", "wt") as f:
        for i in range(5):
            f.write(json.dumps({"text": f"gzipped document {i}"}) + "\n")
    return root


def split_documents(out, split):
    meta = json.loads((out / "metadata.json").read_text())
    files = meta["splits"][split]["files"]
    if not files:
        return []
    tokens = np.concatenate([np.fromfile(out / f, meta["dtype"]) for f in files])
    assert tokens.size == 0 or tokens[-1] == meta["eos_id"]
    ends = np.flatnonzero(tokens == meta["eos_id"])
    return [tokens[a + 1:b] for a, b in zip(np.concatenate([[-1], ends[:-1]]), ends)]


def test_bytes_round_trip_and_disjoint_split(corpus, tmp_path):
    out = tmp_path / "tok"
    meta = prep.prepare([str(corpus)], tokenizer="bytes", out=out, heldout_fraction=0.3, shard_tokens=256,
                        progress=False)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == BYTE_VOCAB and meta["eos_id"] == BYTE_EOS
    train = [bytes(d.astype(np.uint8)).decode() for d in split_documents(out, "train")]
    heldout = [bytes(d.astype(np.uint8)).decode() for d in split_documents(out, "heldout")]
    every = ({f"document {i}: héllo world {'x' * i}" for i in range(40)} | {"def f():\n    return 1\n"}
             | {f"json document {i} world" for i in range(30)} | {f"gzipped document {i}" for i in range(5)})
    assert set(train).isdisjoint(heldout) and set(train) | set(heldout) == every
    assert len(train) + len(heldout) == 76 and 5 < len(heldout) < 40
    assert meta["splits"]["train"]["documents"] == len(train)
    for split in ("train", "heldout"):  # shards are cut every shard_tokens tokens
        sizes = [(out / f).stat().st_size // 2 for f in meta["splits"][split]["files"]]
        assert all(s == 256 for s in sizes[:-1]) and sum(sizes) == meta["splits"][split]["tokens"]
    assert not (out / ".work").exists()


def test_each_token_file_has_olmo_core_s_document_index_beside_it(corpus, tmp_path):
    """prepare writes NAME.csv.gz beside each NAME.npy with the rows OLMo-core's write_document_indices writes for it
    (a document cut by a shard's end is in neither shard's index, as an EOS scan finds)."""
    write_document_indices = pytest.importorskip("olmo_core.data.utils").write_document_indices
    out = tmp_path / "tok"
    meta = prep.prepare([str(corpus)], tokenizer="bytes", out=out, shard_tokens=256, progress=False)
    files = meta["splits"]["train"]["files"] + meta["splits"]["heldout"]["files"]
    assert sorted(p.name for p in out.glob("*.csv.gz")) == sorted(f.replace(".npy", ".csv.gz") for f in files)
    reference = tmp_path / "reference"
    reference.mkdir()
    for name in files:
        (reference / name).write_bytes((out / name).read_bytes())
        ref = write_document_indices(reference / name, dtype=np.uint16, eos_token_id=BYTE_EOS)
        ours = gzip.decompress((out / name.replace(".npy", ".csv.gz")).read_bytes())
        assert ours == gzip.decompress(ref.read_bytes()) and ours.count(b"\n") > 0


def test_split_is_by_document_id_not_position(corpus, tmp_path):
    """Adding a file leaves every other document on its side of the split."""
    a = prep.prepare([str(corpus)], tokenizer="bytes", out=tmp_path / "a", heldout_fraction=0.3, progress=False)
    (corpus / "sub" / "zzz.txt").write_text("a new document")
    prep.prepare([str(corpus)], tokenizer="bytes", out=tmp_path / "b", heldout_fraction=0.3, progress=False)
    for split in ("train", "heldout"):
        old = {bytes(d.astype(np.uint8)) for d in split_documents(tmp_path / "a", split)}
        new = {bytes(d.astype(np.uint8)) for d in split_documents(tmp_path / "b", split)}
        assert old <= new
    assert a["splits"]["heldout"]["documents"] > 0


def test_deterministic_and_parallel(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "CHUNK_BYTES", 200)  # many chunks, so the workers share them
    prep.prepare([str(corpus)], tokenizer="bytes", out=tmp_path / "a", shard_tokens=300, progress=False)
    prep.prepare([str(corpus)], tokenizer="bytes", out=tmp_path / "b", shard_tokens=300, progress=False)
    prep.prepare([str(corpus)], tokenizer="bytes", out=tmp_path / "c", shard_tokens=300, progress=False, workers=2)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert len(names) > 3
    for other in ("b", "c"):
        assert sorted(p.name for p in (tmp_path / other).iterdir()) == names
        for name in names:
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / other / name).read_bytes(), name


def test_restart_skips_finished_work(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "CHUNK_BYTES", 200)
    reference = tmp_path / "ref"
    prep.prepare([str(corpus)], tokenizer="bytes", out=reference, shard_tokens=300, progress=False)

    real_write = prep._write_shards

    def crash_on_heldout(out, split, *args):
        if split == "heldout":
            raise KeyboardInterrupt
        return real_write(out, split, *args)

    out = tmp_path / "tok"
    monkeypatch.setattr(prep, "_write_shards", crash_on_heldout)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare([str(corpus)], tokenizer="bytes", out=out, shard_tokens=300, progress=False)
    assert not (out / "metadata.json").exists() and (out / "train_00000.npy").exists()
    monkeypatch.setattr(prep, "_write_shards", real_write)
    calls = []
    real_tokenize = prep.tokenize_documents
    monkeypatch.setattr(prep, "tokenize_documents", lambda *a, **k: calls.append(1) or real_tokenize(*a, **k))
    prep.prepare([str(corpus)], tokenizer="bytes", out=out, shard_tokens=300, progress=False)
    assert calls == []  # every chunk was already tokenized
    for p in reference.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes()
    # A finished output is left alone; another corpus in the same place is refused.
    prep.prepare([str(corpus)], tokenizer="bytes", out=out, shard_tokens=300, progress=False)
    with pytest.raises(DataError, match="already holds token files prepared from other inputs"):
        prep.prepare([str(corpus / "code.py")], tokenizer="bytes", out=out, progress=False)


def word_tokenizer(path, vocab_size):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|endoftext|>": 1} | {f"w{i}": i for i in range(2, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("vocab_size, dtype", [(100, "uint16"), (70000, "uint32")])
def test_tokenizer_json(tmp_path, vocab_size, dtype):
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json", vocab_size)
    words = [f"w{i}" for i in range(2, vocab_size, max(1, vocab_size // 50))] + [f"w{vocab_size - 1}"]
    src = tmp_path / "in.txt"
    src.write_text(" ".join(words) + " unknown")
    meta = prep.prepare([str(src)], tokenizer=tokenizer, out=tmp_path / "tok", heldout_fraction=0.0,
                        progress=False)
    assert meta["dtype"] == dtype and meta["eos_id"] == 1 and meta["vocab_size"] == vocab_size
    tokens = np.fromfile(tmp_path / "tok" / "train_00000.npy", dtype)
    assert tokens.tolist() == [int(w[1:]) for w in words] + [0, 1]
    # The iterator reads the dtype from metadata.json and checks ids against the vocabulary.
    cfg = DataConfig(paths=(str(tmp_path / "tok"),))
    it = build_train_iterator(cfg, seq_len=4, global_batch=2, seed=0, shard_index=0, shard_count=1,
                              vocab_size=vocab_size)
    assert next(it)["tokens"].max() < vocab_size


def test_cli(corpus, tmp_path):
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json", 100)
    meta = prep.main(["--input", str(corpus / "docs.jsonl"), str(corpus / "code.py"), "--out",
                      str(tmp_path / "tok"), "--tokenizer", tokenizer, "--eos-id", "0", "--quiet"])
    assert meta["eos_id"] == 0 and meta["splits"]["train"]["documents"] + meta["splits"]["heldout"]["documents"] == 31
    assert json.loads((tmp_path / "tok" / "metadata.json").read_text()) == meta


def test_bad_inputs(tmp_path, corpus):
    def run(inputs, **kw):
        return prep.prepare(inputs, out=tmp_path / "out", progress=False, **({"tokenizer": "bytes"} | kw))

    with pytest.raises(DataError, match="missing.txt does not exist"):
        run([str(tmp_path / "missing.txt")])
    with pytest.raises(DataError, match="No input file matches"):
        run([str(tmp_path / "*.nothing")])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl at byte 17 is not a JSON object with a \"text\" field"):
        run([str(bad)])
    with pytest.raises(DataError, match="Tokenizer .*nope.json does not exist"):
        run([str(corpus)], tokenizer=str(tmp_path / "nope.json"))
    from tokenizers import Tokenizer, models

    no_eos = tmp_path / "noeos.json"
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(no_eos))
    with pytest.raises(DataError, match="has no <|endoftext|> token; pass --eos-id"):
        run([str(corpus)], tokenizer=str(no_eos))


def test_default_corpus(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from olmo3eqx.data.corpus import default_corpus

    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    with ThreadPoolExecutor(2) as pool:  # two first runs at once: one wins, both get the complete corpus
        assert len(set(pool.map(default_corpus, [cfg.cache_dir] * 2))) == 1
    (train, labels), heldout = training_files(cfg), heldout_files(cfg)
    assert train and heldout and set(train).isdisjoint(heldout) and labels is None
    (corpus_dir,) = (tmp_path / "cache").iterdir()
    assert corpus_dir.name.startswith("default-")
    meta = json.loads((corpus_dir / "metadata.json").read_text())
    train_docs, heldout_docs = meta["splits"]["train"]["documents"], meta["splits"]["heldout"]["documents"]
    assert train_docs > 100 and 0.01 < heldout_docs / (train_docs + heldout_docs) < 0.1
    assert training_files(cfg)[0] == train and heldout_files(cfg) == heldout  # prepared once, then found
    tokens = np.memmap(train[0], np.uint16, mode="r")
    assert tokens.max() == BYTE_EOS and bytes(tokens[:200].astype(np.uint8)).isascii()
    it = build_train_iterator(cfg, seq_len=128, global_batch=8, seed=0, shard_index=0, shard_count=1,
                              vocab_size=BYTE_VOCAB)
    assert next(it)["tokens"].shape == (8, 128)
    sets = open_heldout(EvalConfig(), cfg, seq_len=128, vocab_size=BYTE_VOCAB, eos_id=BYTE_EOS, pad_id=BYTE_PAD)
    assert list(sets) == ["heldout"] and sets["heldout"].num_instances > 10 * 8


def test_default_corpus_fingerprint_is_the_documented_one(tmp_path):
    """The shipped text, prepared here, gives the token files the docs state (so every Python trains on the same
    bytes), and a cache that differs is refused rather than trained on."""
    from olmo3eqx.data import corpus

    prepared = corpus.default_corpus(str(tmp_path))
    assert corpus.corpus_fingerprint(prepared) == corpus.FINGERPRINT
    documented = (Path(__file__).parents[1] / "docs" / "data.md").read_text()
    assert f"`{corpus.FINGERPRINT}`" in documented
    shard = sorted(prepared.glob("train_*.npy"))[0]
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    corpus._CHECKED.clear()
    with pytest.raises(DataError, match="fingerprint"):
        corpus.default_corpus(str(tmp_path))
