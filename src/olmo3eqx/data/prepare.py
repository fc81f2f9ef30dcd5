"""Text -> OLMo token files.

    python -m olmo3eqx.data.prepare --input data/*.jsonl src/ --tokenizer tokenizer.json --out tokens/

Every document is tokenized (HF `tokenizers` from a tokenizer.json, or the built-in byte-level tokenizer),
followed by EOS, and the documents are concatenated in sorted input order into raw headerless token files
(`train_00000.npy`, ..., `heldout_00000.npy`, ...; uint16 when the vocabulary fits, else uint32), cut every
`shard_tokens` tokens, plus `metadata.json`. A document is held out when a hash of its id falls below
`heldout_fraction`, so the split does not depend on order, workers or machine.

Beside each token file goes OLMo-core's document index, `train_00000.csv.gz` (one `start,end` row per
EOS-terminated document, as olmo_core.data.utils.write_document_indices writes it), so a packed run over the files
in a bucket or behind https reads those instead of the tokens (olmo3eqx.data.documents).

Work happens in two restartable stages: input chunks are tokenized in parallel into `.work/` (a chunk whose
result exists is skipped), then the shards are cut from them (a shard already complete is skipped). Every
file is written under a temporary name and renamed, and `metadata.json`, written last, marks the output done.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jaxtyping import UInt

from olmo3eqx import exits, storage
from olmo3eqx.data.documents import INDEX_SUFFIX, scan_index
from olmo3eqx.data.source import METADATA, token_dtype_for_vocab
from olmo3eqx.errors import DataError

BYTES = "bytes"
"""--tokenizer value of the built-in byte-level tokenizer."""
BYTE_EOS = 256
BYTE_PAD = 257
BYTE_VOCAB = 258
"""Byte-level tokenizer: token id = byte value 0..255, EOS 256, PAD 257, no BOS."""
EOS_TOKEN = "<|endoftext|>"
"""EOS of a tokenizer.json when --eos-id is not given (dolma2 and GPT-style tokenizers)."""
TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", ".jsonl.gz", ".json.gz")
"""Files taken from an input directory; files named explicitly are taken whatever their suffix."""
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz")
"""One JSON document per line with a "text" field (and an optional "id", used for the held-out hash)."""
DEFAULT_SHARD_TOKENS = 2**28
"""Tokens per output file (512 MiB as uint16, 1 GiB as uint32); a power of two so no instance is lost at
file boundaries for power-of-two sequence lengths."""
CHUNK_BYTES = 32 * 2**20
"""Input bytes per work unit: small files are grouped, large plain .jsonl files split at line starts."""
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of an input file (end -1: to the end), with the id its documents are hashed by."""

    path: str
    doc_id: str
    start: int = 0
    end: int = -1


# --- tokenizers ------------------------------------------------------------------------------------


def tokenizer_info(tokenizer: str, eos_id: int | None = None) -> dict:
    """Name, vocabulary size, EOS and a content hash of a tokenizer spec ('bytes' or a tokenizer.json)."""
    if tokenizer == BYTES:
        if eos_id not in (None, BYTE_EOS):
            raise DataError(f"The byte-level tokenizer's EOS is {BYTE_EOS}; drop --eos-id {eos_id}.")
        return {"name": BYTES, "vocab_size": BYTE_VOCAB, "eos_id": BYTE_EOS, "pad_id": BYTE_PAD, "sha256": BYTES}
    path = Path(tokenizer).expanduser()
    if not path.is_file():
        raise DataError(f"Tokenizer {tokenizer} does not exist; give a tokenizer.json or '{BYTES}'.")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if eos_id is None:
        eos_id = tok.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise DataError(f"Tokenizer {tokenizer} has no {EOS_TOKEN} token; pass --eos-id.")
    if not 0 <= eos_id < vocab:
        raise DataError(f"--eos-id {eos_id} is outside the tokenizer's vocabulary of {vocab}.")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"name": path.name, "vocab_size": vocab, "eos_id": eos_id, "pad_id": None, "sha256": sha}


_TOKENIZERS: dict = {}


def _hf_tokenizer(tokenizer: str):
    """The tokenizer.json at path `tokenizer`, loaded once per process."""
    if tokenizer not in _TOKENIZERS:
        from tokenizers import Tokenizer

        _TOKENIZERS[tokenizer] = Tokenizer.from_file(str(Path(tokenizer).expanduser()))
    return _TOKENIZERS[tokenizer]


def encode_texts(texts: list[bytes], tokenizer: str) -> list[np.ndarray]:
    """Token ids of each text (no EOS added): bytes as ids 0..255, or a tokenizer.json's encoding."""
    if tokenizer == BYTES:
        return [np.frombuffer(t, np.uint8) for t in texts]
    strings = [t.decode("utf-8", errors="replace") for t in texts]
    return [np.asarray(e.ids, np.int64)
            for e in _hf_tokenizer(tokenizer).encode_batch(strings, add_special_tokens=False)]


def decode_ids(ids: Sequence[int], tokenizer: str) -> str:
    """The text of token ids, encode_texts' inverse: bytes (ids >= 256, EOS and PAD, dropped; invalid UTF-8
    replaced) or a tokenizer.json's decoding, special tokens kept."""
    if tokenizer == BYTES:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")
    return _hf_tokenizer(tokenizer).decode([int(i) for i in ids], skip_special_tokens=False)


def tokenize_documents(texts: list[bytes], *, tokenizer: str, eos_id: int,
                       dtype: str) -> UInt[np.ndarray, " n"]:
    """The documents' tokens, each document followed by EOS, concatenated."""
    parts = []
    eos = np.array([eos_id], dtype)
    for ids in encode_texts(texts, tokenizer):
        parts += [ids.astype(dtype), eos]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def is_heldout(doc_id: str, fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of sha256(doc_id) as a fraction of 2**64."""
    h = int.from_bytes(hashlib.sha256(doc_id.encode()).digest()[:8], "little")
    return h < fraction * 2**64


# --- inputs ----------------------------------------------------------------------------------------


def _glob_root(pattern: str) -> str:
    parts = Path(pattern).parts
    root = [p for p in parts[: next(i for i, p in enumerate(parts) if any(c in p for c in "*?["))]]
    return str(Path(*root)) if root else "."


def resolve_inputs(inputs: Sequence[str]) -> list[Piece]:
    """Input files in argument order, each argument's files sorted; doc ids are paths relative to the
    argument (a directory or a glob's fixed prefix) so the split does not depend on where data lives."""
    from glob import glob

    pieces: list[Piece] = []
    for arg in inputs:
        arg = os.path.expanduser(arg)
        if any(c in arg for c in "*?["):
            root = _glob_root(arg)
            files = sorted(p for p in glob(arg, recursive=True) if os.path.isfile(p))
            if not files:
                raise DataError(f"No input file matches {arg!r}; fix the --input pattern.")
        elif os.path.isdir(arg):
            root = arg
            files = sorted(str(p) for p in Path(arg).rglob("*")
                           if p.is_file() and str(p).endswith(TEXT_SUFFIXES)
                           and not any(q.startswith(".") for q in p.relative_to(arg).parts))
            if not files:
                raise DataError(f"Input directory {arg} holds no {', '.join(TEXT_SUFFIXES)} files.")
        elif os.path.isfile(arg):
            root, files = os.path.dirname(arg) or ".", [arg]
        else:
            raise DataError(f"Input {arg} does not exist; give files, directories or globs of text.")
        pieces += [Piece(f, os.path.relpath(f, root)) for f in files]
    return pieces


def _line_starts(path: str, size: int) -> list[int]:
    """Byte offsets that split a plain .jsonl file into ~CHUNK_BYTES ranges at line starts."""
    cuts = [0]
    with open(path, "rb") as f:
        for target in range(CHUNK_BYTES, size, CHUNK_BYTES):
            if target <= cuts[-1]:
                continue
            f.seek(target)
            f.readline()
            if f.tell() < size:
                cuts.append(f.tell())
    return cuts + [size]


def make_chunks(pieces: Sequence[Piece]) -> list[list[Piece]]:
    """Work units of about CHUNK_BYTES, in input order."""
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    current_bytes = 0
    for piece in pieces:
        size = os.path.getsize(piece.path)
        if piece.path.endswith(".jsonl") and size > CHUNK_BYTES:
            cuts = _line_starts(piece.path, size)
            chunks += [[Piece(piece.path, piece.doc_id, a, b)] for a, b in zip(cuts[:-1], cuts[1:])]
            continue
        if current and current_bytes + size > CHUNK_BYTES:
            chunks.append(current)
            current, current_bytes = [], 0
        current.append(piece)
        current_bytes += size
    if current:
        chunks.append(current)
    return chunks


def _documents(piece: Piece) -> Iterator[tuple[str, bytes]]:
    """(doc id, utf-8 text) of each document in a piece."""
    if not piece.path.endswith(JSONL_SUFFIXES):
        with open(piece.path, "rb") as f:
            yield piece.doc_id, f.read()
        return
    opener = gzip.open if piece.path.endswith(".gz") else open
    with opener(piece.path, "rb") as f:
        f.seek(piece.start)
        offset = piece.start
        end = piece.end if piece.end >= 0 else float("inf")
        while offset < end:
            line = f.readline()
            if not line:
                break
            where = offset
            offset += len(line)
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                text = doc["text"]
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{piece.path} at byte {where} is not a JSON object with a \"text\" field; "
                                f"fix the line or remove the file from --input.") from None
            yield f"{piece.doc_id}:{doc.get('id', where)}", text.encode("utf-8")


# --- stage 1: chunks -> work files -----------------------------------------------------------------

SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Job:
    """One chunk to tokenize into `work_dir/key.{split}.npy` and `key.json` (the completion marker)."""

    pieces: tuple[Piece, ...]
    key: str
    work_dir: str
    tokenizer: str
    eos_id: int
    dtype: str
    heldout_fraction: float


def run_job(job: Job) -> dict:
    """Tokenize one chunk; returns its counts (tokens, documents, text bytes per split)."""
    done = Path(job.work_dir) / f"{job.key}.json"
    if done.is_file():
        return json.loads(done.read_text())
    texts: dict[str, list[bytes]] = {s: [] for s in SPLITS}
    for piece in job.pieces:
        for doc_id, text in _documents(piece):
            texts["heldout" if is_heldout(doc_id, job.heldout_fraction) else "train"].append(text)
    counts = {}
    for split in SPLITS:
        tokens = tokenize_documents(texts[split], tokenizer=job.tokenizer, eos_id=job.eos_id, dtype=job.dtype)
        _atomic_write(Path(job.work_dir) / f"{job.key}.{split}.npy", tokens)
        counts[split] = {"tokens": int(tokens.size), "documents": len(texts[split]),
                         "text_bytes": sum(len(t) for t in texts[split])}
    _atomic_write_text(done, json.dumps(counts))
    return counts


def _atomic_write(path: Path, tokens: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tokens.tofile(tmp)
    os.replace(tmp, path)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write_bytes(path, text.encode())


# --- stage 2: work files -> shards -----------------------------------------------------------------


def _write_shards(out: Path, split: str, work: list[tuple[Path, int]], dtype: str, shard_tokens: int,
                  eos_id: int) -> list[str]:
    """Cut the concatenation of the work files into files of shard_tokens tokens, each with its document index
    (.csv.gz); complete ones are kept."""
    total = sum(n for _, n in work)
    itemsize = np.dtype(dtype).itemsize
    names = []
    starts = np.cumsum([0] + [n for _, n in work])
    for k in range(-(-total // shard_tokens)):
        lo, hi = k * shard_tokens, min((k + 1) * shard_tokens, total)
        name = f"{split}_{k:05d}.npy"
        names.append(name)
        final = out / name
        if not (final.is_file() and final.stat().st_size == (hi - lo) * itemsize):
            tmp = out / f".{name}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                for (path, n), start in zip(work, starts[:-1]):
                    a, b = max(lo, start), min(hi, start + n)
                    if a < b:
                        f.write(np.fromfile(path, dtype, count=b - a, offset=(a - start) * itemsize).tobytes())
            os.replace(tmp, final)
        index = final.with_name(name.replace(".npy", INDEX_SUFFIX))
        if not index.is_file():
            _atomic_write_bytes(index, scan_index(np.memmap(final, dtype, mode="r"), eos_id))
    return names


# --- driver ----------------------------------------------------------------------------------------


def prepare_pieces(pieces: Sequence[Piece], *, tokenizer: str, out: str | Path, eos_id: int | None = None,
                   heldout_fraction: float = 0.05, shard_tokens: int = DEFAULT_SHARD_TOKENS,
                   workers: int = 1, progress: bool = True, inputs: Sequence[str] = ()) -> dict:
    """Tokenize `pieces` into token files and metadata.json under `out`; returns the metadata."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction must lie in [0, 1), got {heldout_fraction}.")
    if shard_tokens <= 0:
        raise DataError(f"shard_tokens must be positive, got {shard_tokens}.")
    if not pieces:
        raise DataError("No input documents; give --input files, directories or globs.")
    tok = tokenizer_info(tokenizer, eos_id)
    dtype = str(token_dtype_for_vocab(tok["vocab_size"]))
    chunks = make_chunks(pieces)
    spec = {"format": FORMAT_VERSION, "tokenizer": tok["sha256"], "eos_id": tok["eos_id"], "dtype": dtype,
            "heldout_fraction": heldout_fraction, "shard_tokens": shard_tokens}
    inputs_key = hashlib.sha256(json.dumps(
        [spec, [[(p.path, p.doc_id, p.start, p.end, os.path.getsize(p.path)) for p in c] for c in chunks]]
    ).encode()).hexdigest()

    out = Path(out).expanduser()
    meta_path = out / METADATA
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("inputs_key") == inputs_key:
            _log(progress, f"{out} is already prepared from these inputs; nothing to do.")
            return meta
        raise DataError(f"{out} already holds token files prepared from other inputs or settings; "
                        f"choose another --out or delete {out}.")
    work_dir = out / ".work"
    work_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for i, chunk in enumerate(chunks):
        key = hashlib.sha256(json.dumps([spec, [(p.path, p.doc_id, p.start, p.end) for p in chunk]]).encode())
        jobs.append(Job(tuple(chunk), f"{i:06d}-{key.hexdigest()[:16]}", str(work_dir), tokenizer,
                        tok["eos_id"], dtype, heldout_fraction))

    workers = max(1, min(workers, len(jobs)))
    bar = _progress(progress, len(jobs), "tokenize", "chunk")
    if workers == 1:
        results = []
        for job in jobs:
            results.append(run_job(job))
            bar.update(1)
    else:
        # spawn: the caller may hold threads (grain, JAX), which fork does not copy safely.
        with multiprocessing.get_context("spawn").Pool(workers, initializer=_quiet_worker) as pool:
            results = []
            for counts in pool.imap(run_job, jobs):
                results.append(counts)
                bar.update(1)
    bar.close()

    meta = {"format": FORMAT_VERSION, "tokenizer": tok["name"], "tokenizer_sha256": tok["sha256"],
            "vocab_size": tok["vocab_size"], "eos_id": tok["eos_id"], "pad_id": tok["pad_id"], "bos_id": None,
            "dtype": dtype, "heldout_fraction": heldout_fraction, "shard_tokens": shard_tokens,
            "inputs": list(inputs), "inputs_key": inputs_key, "splits": {}}
    for split in SPLITS:
        work = [(work_dir / f"{job.key}.{split}.npy", r[split]["tokens"]) for job, r in zip(jobs, results)]
        files = _write_shards(out, split, work, dtype, shard_tokens, tok["eos_id"])
        meta["splits"][split] = {
            "files": files,
            "tokens": sum(r[split]["tokens"] for r in results),
            "documents": sum(r[split]["documents"] for r in results),
            "text_bytes": sum(r[split]["text_bytes"] for r in results),
        }
    _atomic_write_text(meta_path, json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(work_dir, ignore_errors=True)
    for split in SPLITS:
        s = meta["splits"][split]
        _log(progress, f"{split}: {s['documents']:,} documents, {s['tokens']:,} tokens in {len(s['files'])} "
                       f"{dtype} files")
    return meta


def prepare(inputs: Sequence[str], *, tokenizer: str, out: str | Path, **kwargs) -> dict:
    """Resolve files/directories/globs and prepare them (see `prepare_pieces` for the options). Local files only:
    a URL is refused in one sentence (it would otherwise become a local folder named after it)."""
    for what, path in [*(("--input", p) for p in inputs), ("--out", str(out))]:
        if storage.is_url(path):
            storage.check(path, what)  # a scheme nothing here reaches is named as such
            raise storage.UnsupportedPath(f"{what} {storage.redact(path)} is a URL; olmo3eqx-prepare reads and "
                                          f"writes local files: prepare on local disk, then copy the token "
                                          f"directory to the bucket (data.paths and data.mix_root read it there).")
    return prepare_pieces(resolve_inputs(inputs), tokenizer=tokenizer, out=out, inputs=inputs, **kwargs)


def _quiet_worker() -> None:
    # Workers already run in parallel; the tokenizers' own thread pool would oversubscribe the cores.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _log(enabled: bool, msg: str) -> None:
    if enabled:
        print(msg, file=sys.stderr)


def _progress(enabled: bool, total: int, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not enabled)


@dataclass(frozen=True)
class Args:
    """Tokenize text into OLMo token files (raw .npy, documents ending in EOS) plus metadata.json."""

    input: tuple[str, ...]
    """Text files, directories (searched for .txt .md .py .jsonl .jsonl.gz .json.gz) or globs; .jsonl lines
    are JSON objects with a "text" field."""
    out: str
    """Output directory; rerun with the same arguments to resume an interrupted run."""
    tokenizer: str = BYTES
    """A tokenizer.json (e.g. dolma2's) or 'bytes' (id = byte, EOS 256, PAD 257, vocab 258)."""
    eos_id: int | None = None
    """EOS id of a tokenizer.json; default: its <|endoftext|> token."""
    heldout_fraction: float = 0.05
    """Fraction of documents held out, chosen by a hash of the document id."""
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    """Tokens per output file."""
    workers: int = os.cpu_count() or 1
    """Processes tokenizing in parallel."""
    quiet: bool = False
    """No progress bar or summary."""


def main(argv: Sequence[str] | None = None) -> dict:
    """Prepare what the command line asks; the metadata written."""
    import tyro

    args = tyro.cli(Args, args=argv, prog="python -m olmo3eqx.data.prepare")
    return prepare(args.input, tokenizer=args.tokenizer, out=args.out, eos_id=args.eos_id,
                   heldout_fraction=args.heldout_fraction, shard_tokens=args.shard_tokens, workers=args.workers,
                   progress=not args.quiet)


@exits.command
def cli(argv: Sequence[str] | None = None) -> int:
    """`olmo3eqx-prepare` (through olmo3eqx.tools.prepare) and `python -m olmo3eqx.data.prepare` (main returns the
    metadata; a command returns its exit code)."""
    main(argv)
    return exits.OK


if __name__ == "__main__":
    sys.exit(cli())
