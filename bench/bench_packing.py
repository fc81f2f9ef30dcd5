"""Start-up of a packed run (data.packing) over many remote token files: wall time and bytes the server sent until the
first global batch, for a first launch and a relaunch, with and without OLMo-core's `.csv.gz` document indices
beside the files; and the packer alone against OLMo-core's InstancePacker (when ai2-olmo-core is installed).

    python bench/bench_packing.py [--files 64] [--tokens 2097152] [--seq-len 8192] [--group-size 8]
                                  [--src DIR] [--scenarios csv,scan] [--packer-documents 300000]

The token files (uint32, EOS-terminated documents of lognormal lengths, some longer than seq_len) are served by the
test suite's Range-honouring HTTP server (tests/stores.py) in this process; each launch is a fresh process
(`build_train_iterator` then one batch, no reader threads) whose code comes from `--src` (default: this checkout's
src/; give another checkout's src/ to measure that code on the same files). Bytes are counted from the requests the
server answered. The packer rows time `--src`'s best_fit_decreasing and OLMo-core's InstancePacker (one document at a
time) on the same lognormal lengths, in a fresh process too. Prints a table and writes bench/results/packing.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the Range-honouring HTTP server the tests use
RESULTS = Path(__file__).parent / "results" / "packing.json"
EOS, PAD, VOCAB = 100257, 100277, 100352
MEDIAN_DOC, SIGMA_DOC = 600, 1.4
"""Document lengths: lognormal around a median of 600 tokens (mean ~1,600), a tail past seq_len."""
GLOBAL_BATCH = 8
PACKER_CASES = ((8192, 600), (65536, 600), (65536, 5000))
"""(seq_len, median document length) of the packer rows; lengths lognormal with sigma SIGMA_DOC, cut to seq_len."""

LAUNCH = """
import json, sys, time
t0 = time.perf_counter()
from olmo3eqx.config import DataConfig
from olmo3eqx.data import build_train_iterator
a = json.loads(sys.argv[1])
t1 = time.perf_counter()
cfg = DataConfig(paths=tuple(a["paths"]), packing=True, source_group_size=a["group"], seq_len=a["seq"],
                 global_batch=a["batch"], token_dtype="uint32", cache_dir=a["cache"], num_threads=0, prefetch=0)
it = build_train_iterator(cfg, seq_len=a["seq"], global_batch=a["batch"], seed=0, shard_index=0, shard_count=1,
                          vocab_size=a["vocab"], eos_id=a["eos"], pad_id=a["pad"])
batch = next(it)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "startup_s": t2 - t1, "instances": it.num_instances,
                  "first_tokens": int(batch["label_mask"].sum())}))
"""


def write_files(out: Path, files: int, tokens: int, seq_len: int) -> tuple[list[str], int]:
    """`files` uint32 token files of `tokens` tokens each (the last document cut by the file's end, as a shard cut
    mid-document is) with a `.csv.gz` of their EOS-terminated documents beside each; (names, documents)."""
    rng = np.random.default_rng(0)
    names, docs = [], 0
    for i in range(files):
        lengths = np.maximum(1, rng.lognormal(np.log(MEDIAN_DOC), SIGMA_DOC, 2 * tokens // MEDIAN_DOC).astype(np.int64))
        lengths = np.minimum(lengths, 4 * seq_len)
        ends = np.cumsum(lengths)
        ends = ends[ends <= tokens]
        ids = rng.integers(0, EOS, tokens, dtype=np.uint32)
        ids[ends - 1] = EOS
        name = f"part-{i:04d}.npy"
        ids.tofile(out / name)
        starts = np.concatenate([[0], ends[:-1]])
        with gzip.open(out / name.replace(".npy", ".csv.gz"), "wt") as f:
            f.write("".join(f"{a},{b}\n" for a, b in zip(starts.tolist(), ends.tolist())))
        names.append(name)
        docs += ends.size
    return names, docs


PACK = """
import json, sys, time
import numpy as np
from olmo3eqx.data.packed import best_fit_decreasing
try:
    from olmo_core.data.utils import InstancePacker
except ImportError:
    InstancePacker = None
documents, sigma, cases = json.loads(sys.argv[1])
rng = np.random.default_rng(1)
rows = []
for seq_len, median in cases:
    lengths = np.clip(rng.lognormal(np.log(median), sigma, documents).astype(np.int64), 1, seq_len)
    t = time.perf_counter()
    best_fit_decreasing(lengths, seq_len)
    row = {"seq_len": seq_len, "median": median, "documents": documents, "ours_s": time.perf_counter() - t}
    if InstancePacker is not None:
        spans = np.stack([np.cumsum(lengths) - lengths, np.cumsum(lengths)], axis=1).astype(np.uint64)
        t = time.perf_counter()
        InstancePacker(seq_len).pack_documents(spans)
        row["olmo_core_s"] = time.perf_counter() - t
    rows.append(row)
print(json.dumps(rows))
"""


def packer_rows(src: Path, documents: int) -> list[dict]:
    """Seconds to pack `documents` lognormal lengths with `src`'s best_fit_decreasing, and with OLMo-core's
    InstancePacker where installed."""
    rows = json.loads(run(src, PACK, [documents, SIGMA_DOC, PACKER_CASES]))
    for row in rows:
        theirs = f"  OLMo-core's InstancePacker {row['olmo_core_s']:6.2f} s" if "olmo_core_s" in row else ""
        print(f"packer: {documents:,} documents (median {row['median']}) into {row['seq_len']}: "
              f"olmo3eqx {row['ours_s']:6.2f} s{theirs}")
    return rows


def served_bytes(server, root: Path) -> int:
    """Bytes of the files' GET answers the server has sent (a ranged GET: its range; a whole GET: the file)."""
    total = 0
    for command, path, rng in server.server.requests:
        file = root / path.lstrip("/")
        if command != "GET" or not file.is_file():  # HEAD, or a 404
            continue
        size = file.stat().st_size
        found = re.fullmatch(r"bytes=(\d+)-(\d+)", rng or "")
        total += min(int(found.group(2)), size - 1) - int(found.group(1)) + 1 if found else size
    return total


def run(src: Path, code: str, args) -> str:
    """The last line `code` printed, run in a fresh process on the olmo3eqx of source tree `src` with JSON `args`."""
    env = dict(os.environ, PYTHONPATH=str(src), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(args)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"a benchmark process failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--tokens", type=int, default=2**21, help="tokens per file")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--src", default=str(ROOT / "src"), help="the olmo3eqx source tree to launch")
    p.add_argument("--scenarios", default="csv,scan", help="csv: .csv.gz beside the files; scan: none")
    p.add_argument("--packer-documents", type=int, default=300_000, help="0: no packer rows")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    from stores import HttpServer, free_port

    packer = packer_rows(Path(args.src), args.packer_documents) if args.packer_documents else []
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-packing-") as tmp:
        www = Path(tmp) / "www"
        (www / "csv").mkdir(parents=True)
        names, docs = write_files(www / "csv", args.files, args.tokens, args.seq_len)
        (www / "scan").mkdir()
        for name in names:  # the same token files without their .csv.gz
            os.link(www / "csv" / name, www / "scan" / name)
        token_bytes = args.files * args.tokens * 4
        print(f"{args.files} files x {args.tokens:,} uint32 tokens ({token_bytes / 2**20:,.0f} MiB, {docs:,} documents),"
              f" seq_len {args.seq_len}, groups of {args.group_size}; code: {args.src}")
        server = HttpServer(www, free_port())
        try:
            for scenario in args.scenarios.split(","):
                cache = Path(tmp) / f"cache-{scenario}"
                common = {"paths": [f"{server.url}/{scenario}/{n}" for n in names], "group": args.group_size,
                          "seq": args.seq_len, "batch": GLOBAL_BATCH, "vocab": VOCAB, "eos": EOS, "pad": PAD,
                          "cache": str(cache)}
                for when in ("first launch", "relaunch"):
                    server.server.requests.clear()
                    r = json.loads(run(Path(args.src), LAUNCH, common))
                    sent = served_bytes(server, www)
                    rows.append({"scenario": scenario, "when": when, "bytes": sent, "token_bytes": token_bytes} | r)
                    print(f"{scenario:<5} {when:<13} start-up {r['startup_s']:7.2f} s  read {sent / 2**20:9.1f} MiB "
                          f"({sent / token_bytes:7.2%} of the token bytes)  {r['instances']:,} instances")
        finally:
            server.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"time": time.time(), "args": vars(args), "documents": docs, "rows": rows,
                                "packer": packer}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
