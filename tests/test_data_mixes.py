"""AI2's data mixes: resolution against OLMo-core's own DataMix.build, the shipped lists, and bad input."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from olmo3eqx.config import DataConfig
from olmo3eqx.data import DataError, build_train_iterator
from olmo3eqx.data.mixes import SHIPPED, mix_files, resolve_mix, shipped_mix_dir

pytest.importorskip("olmo_core")
from olmo_core.data.mixes import DataMix  # noqa: E402
from olmo_core.data.tokenizer import TokenizerName  # noqa: E402

OLMO_CORE_MIXES = Path(str(resources.files("olmo_core") / "data" / "mixes"))


def olmo_core_build(name: str, root: Path) -> tuple[list[str], list[str]]:
    return DataMix(name).build(str(root), TokenizerName.dolma2)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_mixes_resolve_as_olmo_core_builds_them(tmp_path, name):
    files = mix_files(name, str(tmp_path))
    paths, labels = olmo_core_build(name, tmp_path)
    assert [f.path for f in files] == paths and [f.label for f in files] == labels
    assert len(files) == {"OLMo-mix-0625-official": 1016, "OLMo-midtraining-mix-0625-100B": 11933,
                          "OLMo-longmino-mix-0625": 998, "v3-small-ppl-validation": 11}[name]


def test_every_olmo_core_mix_file_gets_its_tokenizer_id(tmp_path):
    """A mix file is known by its file name: each of OLMo-core's lists, read as a file, resolves as OLMo-core
    resolves that mix (the {TOKENIZER} rule differs between mixes)."""
    names = sorted(p.stem for p in OLMO_CORE_MIXES.glob("*.txt"))
    assert len(names) == len(DataMix)
    for name in names:
        files = mix_files(str(OLMO_CORE_MIXES / f"{name}.txt"), str(tmp_path))
        paths, labels = olmo_core_build(name, tmp_path)
        assert [f.path for f in files] == paths and [f.label for f in files] == labels, name


def test_shipped_lists_are_olmo_core_s_bytes(tmp_path):
    from olmo3eqx.tools.regenerate_mixes import main

    assert main(["--out", str(tmp_path)]) == 0
    for name in SHIPPED:
        assert (tmp_path / f"{name}.txt").read_bytes() == (shipped_mix_dir() / f"{name}.txt").read_bytes(), name
        assert (shipped_mix_dir() / f"{name}.txt").read_bytes() == (OLMO_CORE_MIXES / f"{name}.txt").read_bytes()


# --- bad input ---------------------------------------------------------------------------------------


def write_mix(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.fixture
def small_mix(tmp_path):
    """A two-line mix file whose files exist under tmp_path/root."""
    root = tmp_path / "root"
    for i in range(2):
        f = root / "allenai" / "dolma2-tokenizer" / f"part-{i}.npy"
        f.parent.mkdir(parents=True, exist_ok=True)
        np.arange(64, dtype=np.uint16).tofile(f)
    mix = write_mix(tmp_path / "small.txt", ["# a comment", "", "a,{TOKENIZER}/part-0.npy", "b,{TOKENIZER}/part-1.npy"])
    return mix, root


def test_labels_and_paths(small_mix):
    mix, root = small_mix
    files = resolve_mix(mix, str(root))
    tokenizer_dir = f"{root}/allenai/dolma2-tokenizer"
    assert [(f.label, f.path, f.line_number) for f in files] == [
        ("a", f"{tokenizer_dir}/part-0.npy", 3), ("b", f"{tokenizer_dir}/part-1.npy", 4)]
    it = build_train_iterator(DataConfig(mix=mix, mix_root=str(root), seq_len=8, global_batch=4, token_dtype="uint16"),
                              seq_len=8, global_batch=4, seed=0, shard_index=0, shard_count=1, vocab_size=100)
    assert it.source.labels == ["a", "b"] and it.num_instances == 16


def test_missing_file_names_the_mix_line_and_the_resolved_path(small_mix):
    mix, root = small_mix
    (root / "allenai" / "dolma2-tokenizer" / "part-1.npy").unlink()
    with pytest.raises(DataError, match=r"Line 4 of data.mix .*small.txt \('b,\{TOKENIZER\}/part-1.npy'\) resolves to "
                                        rf"{root}/allenai/dolma2-tokenizer/part-1.npy, which does not exist"):
        resolve_mix(mix, str(root))


def test_size_not_a_multiple_of_the_dtype(small_mix):
    mix, root = small_mix
    with open(root / "allenai" / "dolma2-tokenizer" / "part-1.npy", "ab") as f:
        f.write(b"\0")
    cfg = DataConfig(mix=mix, mix_root=str(root), seq_len=8, global_batch=4, token_dtype="uint16")
    with pytest.raises(DataError, match=r"part-1.npy has 129 bytes, not a multiple of 2 \(uint16\)"):
        build_train_iterator(cfg, seq_len=8, global_batch=4, seed=0, shard_index=0, shard_count=1)


def test_path_without_tokenizer_field(small_mix, tmp_path):
    _, root = small_mix
    mix = write_mix(tmp_path / "bad.txt", ["a,{TOKENIZER}/part-0.npy", "b,allenai/dolma2-tokenizer/part-1.npy"])
    with pytest.raises(DataError, match=r"Line 2 of mix .*bad.txt \('b,allenai/dolma2-tokenizer/part-1.npy'\) has no "
                                        r"\{TOKENIZER\} in its path"):
        resolve_mix(mix, str(root))
    mix = write_mix(tmp_path / "bad.txt", ["a,b,{TOKENIZER}/part-0.npy"])
    with pytest.raises(DataError, match=r"Line 1 of mix .*bad.txt is 'a,b,\{TOKENIZER\}/part-0.npy', not 'label,path'"):
        resolve_mix(mix, str(root))


def test_missing_mix_root_or_mix(small_mix, tmp_path):
    mix, _ = small_mix
    with pytest.raises(DataError, match="needs data.mix_root"):
        resolve_mix(mix, None)
    with pytest.raises(DataError, match=f"data.mix_root {tmp_path}/nowhere is not a directory"):
        resolve_mix(mix, str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="'OLMo-mix-9999' is neither a mix shipped with olmo3eqx"):
        resolve_mix("OLMo-mix-9999", str(tmp_path))


def test_config_refuses_mix_with_paths_and_a_bad_max_target():
    from olmo3eqx.config import ConfigError

    with pytest.raises(ConfigError, match="data.mix and data.paths both name training data"):
        DataConfig(mix="OLMo-mix-0625-official", paths=("x.npy",))
    with pytest.raises(ConfigError, match="max_target_seq_len 24 must be a multiple of data.seq_len 16"):
        DataConfig(seq_len=16, max_target_seq_len=24)
    with pytest.raises(ConfigError, match="data.seed must be non-negative"):
        DataConfig(seed=-1)
