"""Shared by the benchmarks: the machine, a clean XLA environment, the train step under test, tables, JSON."""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
TRACKED = REPO / "docs" / "results"
"""Results the docs' tables are made from, kept in git (RESULTS is ignored): the TPU plans, memory and validation."""
TEST_ONLY_FLAG = "--xla_backend_optimization_level=0"


def clean_xla_flags() -> None:
    """Drop the test suite's fast-compile flag (benchmarks measure the optimised program). Call before importing jax."""
    flags = os.environ.get("XLA_FLAGS", "")
    if TEST_ONLY_FLAG in flags:
        os.environ["XLA_FLAGS"] = flags.replace(TEST_ONLY_FLAG, "").strip()
        print(f"note: removed {TEST_ONLY_FLAG} from XLA_FLAGS (benchmarks time optimised code)")


def machine() -> dict:
    import jax

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "jax": jax.__version__, "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "load_average": os.getloadavg()}


def provenance() -> dict:
    """What a stored result needs to be redone and judged: the command that made it, when, and the versions of jax,
    jaxlib and libtpu (None where not installed)."""

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    return {"command": " ".join(["python", shlex.quote(str(shown)), *map(shlex.quote, sys.argv[1:])]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "versions": {name: version(name) for name in ("jax", "jaxlib", "libtpu")}}


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def train_config(model, seq_len: int, batch: int, packing: bool = False):
    """A TrainConfig around `model` whose whole batch is one micro-batch on one device (`packing`: batches carry
    segment ids and a label mask, as data.packing's)."""
    from olmo3eqx.config import DataConfig, MeshConfig, OptimConfig, TrainConfig

    return TrainConfig(steps=10_000, model=model, data=DataConfig(seq_len=seq_len, global_batch=batch, packing=packing),
                       optim=OptimConfig(lr=1e-3, warmup_steps=10),
                       mesh=MeshConfig(fsdp=1, max_per_device_batch=batch))


def build_run(cfg, devices=None, axis: str = "fsdp"):
    """(jitted train step, initial state, layout) for TrainConfig `cfg` on `devices` (default: the first), all of
    them on mesh axis `axis` (fsdp: parameters sharded; data: replicated, the batch split)."""
    import jax

    from olmo3eqx.sharding import build_layout
    from olmo3eqx.step import make_train_step

    devices = devices or jax.devices()[:1]
    mesh = dataclasses.replace(cfg.mesh, **{"fsdp": 1, "data": 1, axis: len(devices)})
    layout = build_layout(dataclasses.replace(cfg, mesh=mesh), devices)
    return make_train_step(cfg, layout), layout.init_state(cfg), layout


def random_batches(cfg, layout, count: int = 1, documents: int = 0, seed: int = 0) -> list[tuple]:
    """`count` different global batches of uniform random tokens as the train step takes them (a benchmark that
    repeats one batch measures a model memorising it). `documents` > 0 (packed configs): each row cut at
    documents - 1 random places into documents, segment ids 0, 1, ..., every token a target."""
    import numpy as np

    from olmo3eqx.data.packed import segment_ids

    rng = np.random.default_rng(seed)
    b, s = cfg.data.global_batch, cfg.data.seq_len
    out = []
    for _ in range(count):
        batch = {"tokens": rng.integers(0, cfg.model.vocab_size, (b, s), dtype=np.int32),
                 "mask": np.ones(b, np.float32)}
        if cfg.data.packing:
            cuts = [np.sort(rng.choice(np.arange(1, s), documents - 1, replace=False)) for _ in range(b)]
            lengths = np.stack([np.diff(np.concatenate([[0], c, [s]])) for c in cuts]).astype(np.int32)
            batch.update(segment_ids=segment_ids(lengths, s), label_mask=np.ones((b, s), bool))
        out.append(layout.put_batch(batch))
    return out


def build_step(cfg, devices=None, axis: str = "fsdp"):
    """(jitted train step, initial state, tokens, mask): build_run and one random batch (unpacked configs)."""
    step, state, layout = build_run(cfg, devices, axis)
    tokens, mask = random_batches(cfg, layout)[0]
    return step, state, tokens, mask


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Plain-text table; columns are (key, header); floats formatted by the caller."""
    cells = [[h for _, h in columns]] + [[str(r.get(k, "")) for k, _ in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(columns))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(name: str | Path, data: dict) -> Path:
    """Write `data` plus the machine to bench/results/<name> (or to `name` when it is a path with a directory)."""
    path = Path(name) if Path(name).parent != Path(".") else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine(), "unix_time": time.time(), **data}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path
