"""AI2's SFT mixtures: open-instruct's `--dataset_mixer_list` as a file `olmo3eqx-prepare chat --mix` reads.

A mix is a name shipped with the package (data/sft_mixes/<name>.txt, each line's source in AI2's scripts named in
its comments) or the path of a file in the same format: one `SOURCE AMOUNT` per line, `#` starts a comment. SOURCE
is `OWNER/NAME` (a Hugging Face Hub dataset, as open-instruct names them; olmo3eqx.data.hub) or anything
`--input` takes. AMOUNT is read as open-instruct's `load_dataset_configs` reads it: with a decimal point a proportion
of the source's rows (1.0 all of them, 3.0 each three times, 0.5 half), without one a number of rows ("1" is one
row, not all).

Rows are selected as open-instruct's `DatasetConfig.select_samples` selects them: a target of int(proportion x n)
rows (or the count), made of target // n passes over the source in order, then target % n distinct rows drawn with
`numpy.random.RandomState(42).choice(n, k, replace=False)`, in the order drawn; sources follow in file order. As in
open-instruct the selection comes first, then each selected row is tokenized or skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from olmo3eqx.data import hub
from olmo3eqx.errors import DataError

SEED = 42
"""open-instruct's dataset_config_seed default (convert_sft_data_for_olmocore.py passes none)."""


@dataclass(frozen=True)
class Source:
    spec: str
    """What the rows are read from: hf://OWNER/NAME or an --input path."""
    amount: int | float
    """A proportion (float) or a number of rows (int), as open-instruct reads the mixer list."""
    line: str


def shipped_dir() -> Path:
    return Path(str(resources.files("olmo3eqx.data") / "sft_mixes"))


def shipped() -> list[str]:
    return sorted(p.stem for p in shipped_dir().glob("*.txt"))


def read_mix(mix: str) -> tuple[str, list[Source]]:
    """(name, sources) of a shipped mix name or a mix file."""
    path = shipped_dir() / f"{mix}.txt"
    if not path.is_file():
        path = Path(mix).expanduser()
        if not path.is_file():
            raise DataError(f"--mix {mix!r} is neither a mix shipped with olmo3eqx ({', '.join(shipped())}) nor a "
                            f"file of 'SOURCE AMOUNT' lines.")
    sources = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise DataError(f"Line {number} of mix {path} is {line!r}, not 'SOURCE AMOUNT'; fix the mix file.")
        spec, text = fields
        try:
            amount: int | float = float(text) if "." in text else int(text)
        except ValueError:
            raise DataError(f"Line {number} of mix {path}: amount {text!r} is neither a proportion (1.0) nor a number "
                            f"of rows (1000).") from None
        if amount <= 0:
            raise DataError(f"Line {number} of mix {path}: amount {text} must be positive.")
        sources.append(Source(source_spec(spec), amount, f"{path.name} line {number}"))
    if not sources:
        raise DataError(f"Mix {path} names no source; add 'SOURCE AMOUNT' lines.")
    return path.stem, sources


def source_spec(spec: str) -> str:
    """`OWNER/NAME` that is not a local path (nor a file name) is a Hub dataset, as open-instruct's mixer list
    reads it."""
    if "://" in spec or Path(spec).expanduser().exists() or spec.count("/") != 1 or \
            spec.endswith((".jsonl", ".jsonl.gz", ".json")):
        return spec
    return hub.SCHEME + spec


def target_rows(n: int, amount: int | float) -> int:
    """Rows taken from a source of n rows (open-instruct's load_dataset_configs)."""
    return int(amount * n) if isinstance(amount, float) else int(amount)


def select(n: int, target: int, seed: int = SEED) -> tuple[int, np.ndarray]:
    """(full passes, then the indices drawn) of `target` rows of n (open-instruct's select_samples)."""
    extra = target % n
    drawn = np.random.RandomState(seed).choice(n, size=extra, replace=False) if extra else np.zeros(0, np.int64)
    return target // n, drawn


def mix_rows(sources: list[Source], split: str, read: Callable[[str], Iterator[tuple[str, object]]],
             stats: list[dict]) -> Iterator[tuple[str, object]]:
    """The selected rows of every source in order; `read(spec)` gives a source's (where, row) pairs; one dict per
    source (source, amount, rows, selected) is appended to `stats`."""
    for source in sources:
        n = _count(source.spec, split, read)
        if n == 0:
            raise DataError(f"Mix source {source.spec} ({source.line}) has no rows.")
        passes, drawn = select(n, target_rows(n, source.amount))
        for _ in range(passes):
            yield from read(source.spec)
        if drawn.size:
            wanted = set(drawn.tolist())
            kept = {i: item for i, item in enumerate(read(source.spec)) if i in wanted}
            yield from (kept[i] for i in drawn.tolist())
        stats.append({"source": source.spec, "amount": source.amount, "rows": n,
                      "selected": passes * n + int(drawn.size)})


def _count(spec: str, split: str, read: Callable[[str], Iterator[tuple[str, object]]]) -> int:
    if hub.is_hub(spec):  # parquet footers: no row decoded
        files = hub.data_files(spec, split)
        if all(f.suffix == ".parquet" for f in files):
            return sum(hub.parquet_num_rows(f) for f in files)
    return sum(1 for _ in read(spec))
