"""AI2's data mixes: `label,path` lists resolved against a data root exactly as OLMo-core's `DataMix.build` does.

A mix is an OLMo-core mix name, whose list ships with this package (data/mix_lists/*.txt, copied verbatim from
ai2-olmo-core by `python -m olmo3eqx.tools.regenerate_mixes`, so no torch is needed to read them), or the path of
a file in the same format. Each non-empty line not starting with '#' is `label,path`; the path must contain
`{TOKENIZER}`, which becomes the tokenizer id OLMo-core uses for that mix with the dolma2 tokenizer (OLMo 3's), and
the file is `<root>/<path>`. The order of the lines fixes the instance numbering; a file keeps its line's label. The
root is a local directory or a URL: AI2's own (https://olmo-data.org, OLMo-core's default data root), a bucket
(gs://, s3://); remote files are read by range, never copied.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from olmo3eqx import storage
from olmo3eqx.data.source import parallel
from olmo3eqx.errors import DataError

TOKENIZER_FIELD = "{TOKENIZER}"
DEFAULT_TOKENIZER_ID = "allenai/dolma2-tokenizer"
"""OLMo-core's `TokenizerName.dolma2`, the id a mix gets unless TOKENIZER_IDS names another."""
TOKENIZER_IDS = {
    # The evaluation sets are stored under the short name (olmo_core/data/mixes/__init__.py, DataMix.build).
    "v3-small-ppl-validation": "dolma2-tokenizer",
    "c4-ppl-validation": "dolma2-tokenizer",
    "code-fresh-ppl-validation": "dolma2-tokenizer",
    # OLMo 3's mixes were tokenized with the same tokenizer saved as "dolma3-tokenizer".
    "OLMo-mix-0625-official": "allenai/dolma3-tokenizer",
    "OLMo-mix-0925-official": "allenai/dolma3-tokenizer",
    "OLMo-midtraining-mix-0625-100B": "allenai/dolma3-tokenizer",
    "OLMo-midtraining-mix-0925-ingredient1-100B": "allenai/dolma3-tokenizer",
    "OLMo-midtraining-mix-0925-ingredient2-100B": "allenai/dolma3-tokenizer",
    "OLMo-longmino-mix-0625": "allenai/dolma3-tokenizer",
    "OLMo-longmino-mix-0925": "allenai/dolma3-tokenizer",
}
"""Mix name -> the id `{TOKENIZER}` becomes, for the dolma2 tokenizer; a mix file is known by its file name."""
SHIPPED = ("OLMo-mix-0625-official", "OLMo-midtraining-mix-0625-100B", "OLMo-longmino-mix-0625",
           "v3-small-ppl-validation")
"""The mixes whose lists ship with the package: stage 1, stage 2, stage 3 (long context), and the held-out
perplexity sets."""


@dataclass(frozen=True)
class MixFile:
    """One line of a mix: its label, the file it resolves to, and where it came from (for error messages)."""

    label: str
    path: str
    line: str
    line_number: int


def shipped_mix_dir() -> Path:
    return Path(str(resources.files("olmo3eqx.data") / "mix_lists"))


def mix_list(mix: str, what: str) -> tuple[str, Path]:
    """(mix name, its list file): a shipped mix by name, else a file path (its name is the file's stem)."""
    shipped = shipped_mix_dir() / f"{mix}.txt"
    if mix in SHIPPED and shipped.is_file():
        return mix, shipped
    path = Path(os.path.expanduser(mix))
    if path.is_file():
        return path.stem, path
    raise DataError(f"{what} {mix!r} is neither a mix shipped with olmo3eqx ({', '.join(SHIPPED)}) nor a mix file; "
                    f"give one of those names or the path of a file of label,path lines.")


def tokenizer_id(name: str) -> str:
    return TOKENIZER_IDS.get(name, DEFAULT_TOKENIZER_ID)


def mix_files(mix: str, root: str | None, what: str = "data.mix") -> list[MixFile]:
    """The files of `mix` under `root`, in mix order, as OLMo-core's DataMix.build names them."""
    name, list_file = mix_list(mix, what)
    if not root:
        raise DataError(f"{what} {mix} needs data.mix_root, the directory holding its files: AI2's own "
                        f"(https://olmo-data.org), a bucket (gs://, s3://) or a local copy; pass --data.mix-root.")
    root = storage.check(root, "data.mix_root")
    if not storage.is_url(root) and not os.path.isdir(root):
        raise DataError(f"data.mix_root {root} is not a directory; point it at the directory that holds {mix}'s "
                        f"files (the one their paths in {list_file} are relative to).")
    token_id = tokenizer_id(name)
    base = root if root.endswith("/") else root + "/"
    files = []
    for number, raw in enumerate(list_file.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(",")
        if len(fields) != 2 or not fields[0] or not fields[1]:
            raise DataError(f"Line {number} of mix {list_file} is {line!r}, not 'label,path'; fix the mix file.")
        label, path = fields
        if TOKENIZER_FIELD not in path:
            raise DataError(f"Line {number} of mix {list_file} ({line!r}) has no {TOKENIZER_FIELD} in its path; "
                            f"OLMo-core requires it (write the tokenizer directory as {TOKENIZER_FIELD}).")
        files.append(MixFile(label, base + path.replace(TOKENIZER_FIELD, token_id), line, number))
    if not files:
        raise DataError(f"Mix {list_file} lists no files; add label,path lines.")
    return files


def resolve_mix(mix: str, root: str | None, what: str = "data.mix") -> list[MixFile]:
    """mix_files, each checked to exist: a missing one is named with its mix line and the path it resolved to,
    before any work."""
    files = mix_files(mix, root, what)
    found = parallel(lambda f: storage.isfile(f.path), files, remote=storage.is_url(root))  # HEADs at once
    missing = [f for f, ok in zip(files, found) if not ok]
    if missing:
        first = missing[0]
        more = f" ({len(missing) - 1} more of its {len(files)} files are missing too)" if len(missing) > 1 else ""
        raise DataError(f"Line {first.line_number} of {what} {mix} ({first.line!r}) resolves to "
                        f"{storage.redact(first.path)}, which does not exist{more}; copy the file there or fix "
                        f"data.mix_root.")
    return files
