"""The embedded default corpus: the running interpreter's standard-library .py sources, byte-tokenized.

Prepared once into `<cache_dir>/stdlib-py<version>-<hash>/` (the hash covers every file's relative path
and size), built in a temporary directory and renamed into place, so concurrent first runs are safe and a
directory that exists is complete. About 5% of files are held out by a hash of their relative path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from olmo3eqx.data.prepare import BYTES, FORMAT_VERSION, Piece, prepare_pieces
from olmo3eqx.data.source import METADATA

HELDOUT_FRACTION = 0.05
"""Share of standard-library files held out."""
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""Installed packages (not the standard library) and test suites (large generated data, version noise)."""


def stdlib_pieces() -> list[Piece]:
    """Standard-library .py files, sorted by path relative to the stdlib root (their document id)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    pieces = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith(".")]
        rel = Path(dirpath).relative_to(root)
        pieces += [Piece(str(Path(dirpath) / f), (rel / f).as_posix()) for f in filenames if f.endswith(".py")]
    return sorted(pieces, key=lambda p: p.doc_id)


def default_corpus(cache_dir: str) -> Path:
    """Directory holding the prepared default corpus (train_*.npy, heldout_*.npy, metadata.json)."""
    pieces = stdlib_pieces()
    listing = "".join(f"{p.doc_id}\0{os.path.getsize(p.path)}\n" for p in pieces)
    key = hashlib.sha256(f"{FORMAT_VERSION}\n{HELDOUT_FRACTION}\n{listing}".encode()).hexdigest()[:12]
    version = ".".join(map(str, sys.version_info[:3]))
    final = Path(cache_dir).expanduser() / f"stdlib-py{version}-{key}"
    if (final / METADATA).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        prepare_pieces(pieces, tokenizer=BYTES, out=tmp, heldout_fraction=HELDOUT_FRACTION, workers=1,
                       progress=False, inputs=[f"<stdlib python {version}>"])
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / METADATA).is_file():  # not another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
