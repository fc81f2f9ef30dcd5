"""Data-loader benchmark: instances/s of the training iterator on one thread, with and without the n-gram
filter, against what a 7B step consumes; and prepare's throughput in MB/s of text.

    python bench/bench_data.py [--gib 0.5] [--seconds 8]

Prints a table and writes bench/results/data.json. The token files are freshly written, so reads come from
the page cache: this measures the loader's CPU cost, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from olmo3eqx.config import DataConfig
from olmo3eqx.data import build_train_iterator
from olmo3eqx.data.corpus import extract_text
from olmo3eqx.data.filters import repeated_ngram_mask

SEQ_LEN = 8192
PER_DEVICE_BATCH = 4
"""Instances a 7B step consumes per device (per-device batch 4 x 8192 tokens)."""
STEP_TIMES = (1.0, 10.0)
VOCAB = 100352
PREPARE_CHUNK_BYTES = 4 * 2**20
PREPARE_CLI = (f"import sys, olmo3eqx.data.prepare as p; p.CHUNK_BYTES = {PREPARE_CHUNK_BYTES}; "
               f"p.main(sys.argv[1:])")
"""python -m olmo3eqx.data.prepare with work units small enough that ~12 MB of text is shared by the workers."""
RESULTS = Path(__file__).parent / "results" / "data.json"


def write_tokens(out: Path, gib: float) -> list[str]:
    """uint32 files of Zipf-distributed ids (a rough stand-in for BPE token frequencies), 128 MiB each."""
    rng = np.random.default_rng(0)
    per_file = 2**25  # tokens: 128 MiB of uint32, 4096 instances of 8192
    paths = []
    for i in range(max(1, round(gib * 2**30 / (4 * per_file)))):
        ids = np.minimum(rng.zipf(1.2, per_file), VOCAB) - 1
        path = out / f"part-{i:03d}.npy"
        ids.astype(np.uint32).tofile(path)
        paths.append(str(path))
    return paths


def loader_rate(paths: list[str], *, ngram_filter: bool, seconds: float) -> float:
    cfg = DataConfig(paths=tuple(paths), token_dtype="uint32", ngram_filter=ngram_filter, num_threads=1, prefetch=4)
    it = build_train_iterator(cfg, seq_len=SEQ_LEN, global_batch=PER_DEVICE_BATCH, seed=0, shard_index=0,
                              shard_count=1, vocab_size=VOCAB)
    for _ in range(8):
        next(it)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        n += next(it)["tokens"].shape[0]
    return n / (time.perf_counter() - start)


def filter_rate(tokens: np.ndarray, seconds: float) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        repeated_ngram_mask(tokens)
        n += tokens.shape[0]
    return n / (time.perf_counter() - start)


def train_bpe(text_dir: Path, path: Path, vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(text_dir.rglob("*.py"))][:200], trainer)
    tok.save(str(path))
    return str(path)


def prepare_rate(text_dir: Path, tokenizer: str, out: Path, workers: int) -> tuple[float, dict]:
    """MB/s of text through the CLI, end to end (a fresh interpreter, as a user runs it)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", PREPARE_CLI, "--input", str(text_dir), "--tokenizer", tokenizer,
                    "--out", str(out), "--workers", str(workers), "--quiet"], check=True)
    seconds = time.perf_counter() - start
    meta = json.loads((out / "metadata.json").read_text())
    text = sum(s["text_bytes"] for s in meta["splits"].values())
    shutil.rmtree(out)
    return text / seconds / 1e6, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=0.5, help="synthetic uint32 token data to read")
    parser.add_argument("--seconds", type=float, default=6.0, help="measuring time per loader row")
    args = parser.parse_args()
    rows, results = [], {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                     "python": sys.version.split()[0]}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "tokens").mkdir()
        paths = write_tokens(tmp / "tokens", args.gib)
        gib = sum(os.path.getsize(p) for p in paths) / 2**30

        needed = {f"{t:g}s": PER_DEVICE_BATCH / t for t in STEP_TIMES}
        for flag in (False, True):
            rate = loader_rate(paths, ngram_filter=flag, seconds=args.seconds)
            name = f"loader, 1 thread, seq 8192 uint32, filter {'on' if flag else 'off'}"
            results[f"loader_filter_{'on' if flag else 'off'}_instances_per_s"] = rate
            rows.append((name, f"{rate:,.0f} inst/s",
                         ", ".join(f"{rate / need:,.0f}x need @ {k}/step" for k, need in needed.items())))
        text_dir = tmp / "text"
        pieces = extract_text(text_dir)  # the default corpus's .py sources
        stdlib = np.concatenate([np.frombuffer(open(p.path, "rb").read(), np.uint8) for p in pieces[:300]])
        for name, tokens in (("zipf ids", np.fromfile(paths[0], np.uint32, count=64 * SEQ_LEN).astype(np.int32)),
                             ("python source bytes", stdlib[: 64 * SEQ_LEN].astype(np.int32))):
            rate = filter_rate(tokens.reshape(64, SEQ_LEN), seconds=args.seconds / 4)
            results[f"filter_only_{name.replace(' ', '_')}_instances_per_s"] = rate
            rows.append((f"n-gram filter alone, {name}", f"{rate:,.0f} inst/s", ""))
        results["needed_instances_per_s"] = needed
        for k, need in needed.items():
            rows.append((f"needed by a 7B step of {k} (4 x 8192 per device)", f"{need:g} inst/s", ""))

        tokenizer = train_bpe(text_dir, tmp / "tokenizer.json", vocab_size=32000)
        for label, tok in (("bytes", "bytes"), ("BPE tokenizer.json (32k, trained here)", tokenizer)):
            for workers in sorted({1, os.cpu_count() or 1}):
                rate, meta = prepare_rate(text_dir, tok, tmp / "out", workers)
                results[f"prepare_{'bytes' if tok == 'bytes' else 'bpe'}_{workers}_workers_mb_per_s"] = rate
                text_mb = sum(s["text_bytes"] for s in meta["splits"].values()) / 1e6
                rows.append((f"prepare, {label}, {workers} worker(s)", f"{rate:,.1f} MB/s",
                             f"{text_mb:.1f} MB of stdlib .py"))
    results["token_data_gib"] = gib
    width = max(len(r[0]) for r in rows)
    print(f"data benchmark ({gib:.2f} GiB uint32 tokens, {os.cpu_count()} cpus)")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>16}  {note}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
