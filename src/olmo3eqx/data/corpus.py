"""The embedded default corpus: a fixed, shipped text (CPython 3.11.7's standard-library .py sources), byte-tokenized.

The text travels with the package (`default_corpus/python-3.11.7-stdlib.tar.xz`, 2.0 MB; the PSF licence beside it),
so the default run trains on the same bytes whatever Python, jax or machine runs it. It is prepared once into
`<cache_dir>/default-<fingerprint>/`, built in a temporary directory and renamed into place, so concurrent first runs
are safe and a directory that exists is complete. About 5% of files are held out by a hash of their relative path.
Every use checks the prepared token files against FINGERPRINT (the sha256 the docs state): a different corpus stops
the run instead of silently training on other data.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from olmo3eqx.data.prepare import BYTES, Piece, prepare_pieces
from olmo3eqx.data.source import METADATA
from olmo3eqx.errors import DataError

ARCHIVE = Path(__file__).parent / "default_corpus" / "python-3.11.7-stdlib.tar.xz"
SOURCE = "CPython 3.11.7's standard library"
"""What the archive holds: every .py file under CPython 3.11.7's Lib/ outside site-packages, dist-packages and the
test suites (test, tests, idle_test), 734 files, 12.1 MB, at their paths relative to Lib/ (write_archive)."""
FINGERPRINT = "3f2f716ce15e614854e62470b0024ba598d8046a6aeb4991aa9dd0e840ed6bd9"
"""sha256 of the prepared token files (corpus_fingerprint): what the default run trains and evaluates on."""
HELDOUT_FRACTION = 0.05
"""Share of files held out."""
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""Installed packages (not the standard library) and test suites (large generated data, version noise)."""


def write_archive(lib_dir: str | Path, out: str | Path) -> int:
    """Write the corpus archive from a CPython Lib/ directory (how ARCHIVE was made, from 3.11.7's); returns the number
    of files. Members are sorted, with zeroed owners and times, so the same sources give the same bytes."""
    root = Path(lib_dir)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(".")]
        files += [(Path(dirpath) / f).relative_to(root).as_posix() for f in filenames if f.endswith(".py")]
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for rel in sorted(files):
            info = tar.gettarinfo(root / rel, arcname=rel)
            info.uid = info.gid = info.mtime = 0
            info.uname = info.gname = ""
            info.mode = 0o644
            with open(root / rel, "rb") as f:
                tar.addfile(info, f)
    return len(files)


def corpus_fingerprint(directory: str | Path) -> str:
    """sha256 over the names and bytes of a prepared corpus's token files (train_*.npy, then heldout_*.npy)."""
    h = hashlib.sha256()
    for split in ("train", "heldout"):
        for path in sorted(Path(directory).glob(f"{split}_*.npy")):
            h.update(f"{path.name}\0{path.stat().st_size}\n".encode())
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
    return h.hexdigest()


_CHECKED: set[Path] = set()
SAFE_EXTRACT = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
"""Refuse links and paths outside the target (Python 3.11.4+; the archive has neither)."""


def default_corpus(cache_dir: str) -> Path:
    """Directory holding the prepared default corpus (train_*.npy, heldout_*.npy, metadata.json), its fingerprint
    checked (once per process)."""
    final = Path(cache_dir).expanduser() / f"default-{FINGERPRINT[:12]}"
    if final in _CHECKED:
        return final
    if not (final / METADATA).is_file():
        _prepare(final)
    found = corpus_fingerprint(final)
    if found != FINGERPRINT:
        raise DataError(f"The default corpus in {final} has fingerprint {found[:12]}, not the documented "
                        f"{FINGERPRINT[:12]} (olmo3eqx.data.corpus.FINGERPRINT): a changed package or a damaged "
                        f"cache. Delete {final} to prepare it again from {ARCHIVE.name}.")
    _CHECKED.add(final)
    return final


def describe(cache_dir: str) -> str:
    """The log line naming the default corpus and its checked fingerprint."""
    import json

    meta = json.loads((default_corpus(cache_dir) / METADATA).read_text())
    train, heldout = (meta["splits"][s] for s in ("train", "heldout"))
    return (f"data: the default corpus ({SOURCE}, byte tokens): {train['tokens']:,} training and "
            f"{heldout['tokens']:,} held-out tokens ({train['documents']} + {heldout['documents']} files), "
            f"sha256 {FINGERPRINT[:12]} checked")


def extract_text(directory: str | Path) -> list[Piece]:
    """The archive's files written under `directory`; their pieces (path, relative path as document id), sorted."""
    with tarfile.open(ARCHIVE, "r:xz") as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
        tar.extractall(directory, **SAFE_EXTRACT)
    return [Piece(str(Path(directory) / name), name) for name in names]


def _prepare(final: Path) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        pieces = extract_text(tmp / "text")
        prepare_pieces(pieces, tokenizer=BYTES, out=tmp / "tokens", heldout_fraction=HELDOUT_FRACTION, workers=1,
                       progress=False, inputs=[f"<{SOURCE}>"])
        try:
            os.rename(tmp / "tokens", final)
        except OSError:
            if not (final / METADATA).is_file():  # not another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
