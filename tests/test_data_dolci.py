"""AI2's SFT data by name (olmo3eqx.data.hub, olmo3eqx.data.chat_mix): a Hub dataset in Dolci's schema read through
huggingface_hub's own cache with HF_HUB_OFFLINE=1 (the `prepare chat` command in a subprocess, as a user runs it)
equals the same rows given as JSON Lines; a mixture with open-instruct's amounts selects the rows open-instruct's
select_samples selects; the shipped mixes name AI2's datasets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo3eqx.data import chat, chat_mix
from olmo3eqx.errors import DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("huggingface_hub")

FIXTURE = Path(__file__).parent / "fixtures" / "dolci" / "Dolci-Instruct-SFT.jsonl"
MESSAGE = pa.struct([("content", pa.string()), ("function_calls", pa.string()), ("functions", pa.string()),
                     ("role", pa.string())])
DOLCI = pa.schema([("id", pa.string()), ("messages", pa.list_(MESSAGE)), ("source_dataset", pa.string()),
                   ("domain", pa.string())])
"""The features AI2's Dolci-Instruct-SFT sub-sets declare on their cards (id; messages of content, function_calls,
functions, role strings; source_dataset; domain)."""
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fixture_rows() -> list[dict]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


def hub_cache(cache: Path, repo: str, rows: list[dict]) -> None:
    """`repo` as huggingface_hub's cache holds a downloaded dataset: refs/main -> snapshots/<commit>/, its rows in
    data/train-00000-of-00001.parquet (push_to_hub's layout, the one AI2's cards name)."""
    folder = cache / f"datasets--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    (snapshot / "data").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    pq.write_table(pa.Table.from_pylist(rows, schema=DOLCI), snapshot / "data" / "train-00000-of-00001.parquet")


def prepare_cli(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "olmo3eqx.tools.prepare", "chat", "--quiet", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def outputs(out: Path) -> list[np.ndarray]:
    meta = json.loads((out / "metadata.json").read_text())
    return [np.fromfile(out / name, np.uint16 if "token" in name else np.bool_) for f in meta["files"] for name in f]


def test_hub_dataset_read_offline_from_the_cache_equals_its_jsonl(tmp_path):
    hub_cache(tmp_path / "hub", "allenai/Dolci-Instruct-SFT", fixture_rows())
    got = prepare_cli(["--input", "hf://allenai/Dolci-Instruct-SFT", "--out", str(tmp_path / "hub_out")],
                      tmp_path / "hub")
    assert got.returncode == 0, got.stderr
    want = chat.prepare_chat([str(FIXTURE)], tokenizer="bytes", out=tmp_path / "jsonl_out", progress=False)
    meta = json.loads((tmp_path / "hub_out" / "metadata.json").read_text())
    assert meta["rows"] == want["rows"] == 4 and meta["conversations"] == want["conversations"] >= 3
    for x, y in zip(outputs(tmp_path / "hub_out"), outputs(tmp_path / "jsonl_out"), strict=True):
        np.testing.assert_array_equal(x, y)
    missing = prepare_cli(["--input", "hf://allenai/Dolci-Nonesuch", "--out", str(tmp_path / "none")],
                          tmp_path / "hub")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "Cannot fetch dataset allenai/Dolci-Nonesuch" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr


def test_selection_is_open_instructs_select_samples():
    """open-instruct (dataset_transformation.py): a float is a proportion, an int a count; target // n passes in
    order, then target % n rows from RandomState(42).choice(n, k, replace=False)."""
    assert [chat_mix.target_rows(10, a) for a in (1.0, 3.0, 0.25, 2, 15)] == [10, 30, 2, 2, 15]
    passes, drawn = chat_mix.select(10, 13)
    assert passes == 1 and drawn.tolist() == np.random.RandomState(42).choice(10, 3, replace=False).tolist()
    assert chat_mix.select(10, 30)[0] == 3 and chat_mix.select(10, 30)[1].size == 0


def test_mix_with_weights_prepares_the_selected_rows(tmp_path):
    rows = fixture_rows()
    hub_cache(tmp_path / "hub", "allenai/Dolci-Instruct-SFT", rows)
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["id"] != "fixture-2"))
    mix = tmp_path / "mix.txt"
    mix.write_text("# two sources, open-instruct's amounts\nallenai/Dolci-Instruct-SFT 1.0\n"
                   f"{tmp_path / 'plain.jsonl'} 2.0  # each row twice\n{tmp_path / 'plain.jsonl'} 2\n")
    got = prepare_cli(["--mix", str(mix), "--out", str(tmp_path / "out")], tmp_path / "hub")
    assert got.returncode == 0, got.stderr
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert [(s["rows"], s["selected"]) for s in meta["mix"]["sources"]] == [(4, 4), (3, 6), (3, 2)]
    assert meta["rows"] == 12
    # the same rows written out by hand, in open-instruct's order, prepare to the same files
    plain = [r for r in rows if r["id"] != "fixture-2"]
    drawn = np.random.RandomState(42).choice(3, 2, replace=False).tolist()
    (tmp_path / "by_hand.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + plain * 2 +
                                                    [plain[i] for i in drawn]))
    chat.prepare_chat([str(tmp_path / "by_hand.jsonl")], tokenizer="bytes", out=tmp_path / "by_hand", progress=False)
    for x, y in zip(outputs(tmp_path / "out"), outputs(tmp_path / "by_hand"), strict=True):
        np.testing.assert_array_equal(x, y)


def test_shipped_mixes_name_ai2s_datasets(tmp_path):
    assert chat_mix.shipped() == ["dolci-instruct-sft", "dolci-think-sft-7b", "olmo-hybrid-think-sft"]
    # repr: "1.0" (all rows) and "1" (one row) are equal numbers but not the same amount
    assert [(s.spec, repr(s.amount)) for s in chat_mix.read_mix("dolci-instruct-sft")[1]] == \
        [("hf://allenai/Dolci-Instruct-SFT", "1.0")]
    assert [(s.spec, repr(s.amount)) for s in chat_mix.read_mix("dolci-think-sft-7b")[1]] == \
        [("hf://allenai/Dolci-Think-SFT-7B", "1.0")]
    hybrid = chat_mix.read_mix("olmo-hybrid-think-sft")[1]
    assert [repr(s.amount) for s in hybrid] == ["1.0"] + ["3.0"] * 5
    assert hybrid[0].spec == "hf://allenai/Dolci-Think-SFT-32B"
    (tmp_path / "bad.txt").write_text("allenai/Dolci-Instruct-SFT all\n")
    with pytest.raises(DataError, match="neither a proportion"):
        chat_mix.read_mix(str(tmp_path / "bad.txt"))


def test_shuffle_seed_writes_the_order_datasets_shuffle_gives(tmp_path):
    """open-instruct filters, then shuffles the tokenized set with datasets' Dataset.shuffle(seed=42), then writes:
    --shuffle-seed 42 writes the kept conversations in that order (several files, a skipped row not counted)."""
    datasets = pytest.importorskip("datasets")
    kept = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a" * i}]}
            for i in range(9)]
    rows = kept[:3] + [{"messages": [{"role": "user", "content": "no answer"}]}] + kept[3:]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = chat.prepare_chat([str(tmp_path / "rows.jsonl")], tokenizer="bytes", out=tmp_path / "shuffled",
                             shard_tokens=64, shuffle_seed=42, progress=False)
    order = datasets.Dataset.from_dict({"i": list(range(len(kept)))}).shuffle(seed=42)["i"]
    assert order != sorted(order) and meta["shuffle_seed"] == 42 and meta["conversations"] == 9
    (tmp_path / "by_hand.jsonl").write_text("".join(json.dumps(kept[i]) + "\n" for i in order))
    chat.prepare_chat([str(tmp_path / "by_hand.jsonl")], tokenizer="bytes", out=tmp_path / "by_hand", shard_tokens=64,
                      progress=False)
    got, want = outputs(tmp_path / "shuffled"), outputs(tmp_path / "by_hand")
    assert len(got) > 2
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(x, y)
    assert meta["files"] == json.loads((tmp_path / "by_hand" / "metadata.json").read_text())["files"]
    assert all((tmp_path / "shuffled" / t.replace(".npy", ".csv.gz")).is_file() for t, _ in meta["files"])
    assert not (tmp_path / "shuffled" / chat.UNSHUFFLED).exists()
