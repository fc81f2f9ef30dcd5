"""Chat datasets on the Hugging Face Hub by name: `hf://OWNER/NAME[@REVISION]`, as `olmo3eqx-prepare chat --input`
reads them (AI2's SFT sets: hf://allenai/Dolci-Instruct-SFT, hf://allenai/Dolci-Think-SFT-7B).

The repository's data files for the split are fetched by huggingface_hub's `snapshot_download` into its cache
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub), so a second run reads the cache and
`HF_HUB_OFFLINE=1` works on a machine that cannot reach the Hub once the cache holds the files. The split's files
are those `push_to_hub` writes and AI2's dataset cards name (`configs: data_files: - split: train, path:
data/train-*`): `data/<split>-*.parquet`, or JSON Lines `data/<split>-*.jsonl[.gz]`. Parquet is read a batch of rows
at a time with pyarrow; a row comes as `datasets` gives it (a struct field a message lacks, such as `function_calls`
on a plain turn, is None).
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterator
from pathlib import Path

from olmo3eqx.errors import DataError

SCHEME = "hf://"
_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PATTERNS = ("data/{split}-*.parquet", "data/{split}-*.jsonl", "data/{split}-*.jsonl.gz")
"""The split's data files in a dataset repository (push_to_hub's layout), parquet first."""
PARQUET_BATCH = 256
"""Rows decoded at a time from a parquet file (Dolci-Think's reasoning traces are long)."""


def is_hub(spec: str) -> bool:
    return spec.startswith(SCHEME)


def parse(spec: str) -> tuple[str, str | None]:
    """(repo id, revision or None) of `hf://OWNER/NAME[@REVISION]`."""
    name, _, revision = spec[len(SCHEME):].partition("@")
    if not _NAME.match(name):
        raise DataError(f"--input {spec} is not hf://OWNER/NAME[@REVISION] (e.g. hf://allenai/Dolci-Instruct-SFT).")
    return name, revision or None


def data_files(spec: str, split: str) -> list[Path]:
    """The local copies of `spec`'s data files for `split`, fetched into the Hugging Face cache if need be."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise DataError(f"Reading {spec} needs huggingface_hub: pip install huggingface_hub.") from None
    repo, revision = parse(spec)
    patterns = [p.format(split=split) for p in PATTERNS]
    try:
        root = Path(snapshot_download(repo, repo_type="dataset", revision=revision, allow_patterns=patterns))
    except Exception as e:  # offline with an empty cache, no network, no such repository, gated: one sentence
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        why = "HF_HUB_OFFLINE is set and the Hugging Face cache holds no copy" if offline else \
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}"
        raise DataError(f"Cannot fetch dataset {repo} from the Hugging Face Hub ({why}); fetch it where the Hub is "
                        f"reachable (the same command fills the cache, HF_HUB_CACHE), or write it as JSON Lines with "
                        f"`datasets` and pass the file.") from None
    for pattern in patterns:  # an offline snapshot is the cached folder: filter it here
        found = sorted(p for p in root.rglob("*") if fnmatch.fnmatch(p.relative_to(root).as_posix(), pattern))
        if found:
            return found
    raise DataError(f"Dataset {repo} has no {' or '.join(patterns)} files for split {split!r} (the layout "
                    f"push_to_hub writes); pass --split, or write it as JSON Lines with `datasets` and pass the file.")


def parquet_rows(path: Path, where: str) -> Iterator[tuple[str, dict]]:
    """(where row n, row) of a parquet file, decoded PARQUET_BATCH rows at a time."""
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH):
        for row in batch.to_pylist():
            yield f"{where} row {n}", row
            n += 1


def parquet_num_rows(path: Path) -> int:
    """Rows of a parquet file, from its footer (no row decoded)."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows
