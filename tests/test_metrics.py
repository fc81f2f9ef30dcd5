"""metrics.py: metrics.jsonl lines, resume appends, TensorBoard scalars read back, NaN handling."""

import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from olmo3eqx.config import LogConfig
from olmo3eqx.metrics import MetricsLogger, PendingMetrics, fetch, read_metrics

QUIET = LogConfig(tensorboard=False, progress=False)


def tb_scalars(tb_dir):
    """{tag: [(step, value)]} from every TFRecord event file under tb_dir (length, crc, data, crc)."""
    out = {}
    files = sorted(tb_dir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {tb_dir}"
    for path in files:
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_jsonl_lines_have_step_time_and_plain_values(tmp_path):
    with MetricsLogger(tmp_path, QUIET, total_steps=10) as log:
        log.log(1, {"train/loss": jnp.float32(2.5), "train/tokens": np.int64(4096), "perf/mfu": 0.4})
        log.log(2, {"train": {"loss": jnp.array(2.25, jnp.bfloat16)}})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["step"] == 1 and isinstance(first["step"], int)
    assert isinstance(first["time"], float) and abs(first["time"] - time.time()) < 60
    assert first["train/loss"] == 2.5 and first["train/tokens"] == 4096 and first["perf/mfu"] == 0.4
    assert isinstance(first["train/tokens"], int)
    assert second == {"step": 2, "time": second["time"], "train/loss": 2.25}


def test_resume_appends_and_keeps_old_lines(tmp_path):
    with MetricsLogger(tmp_path, QUIET, total_steps=10) as log:
        log.log(1, {"train/loss": 3.0})
        log.log(2, {"train/loss": 2.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train/lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]  # the torn line is ignored
    with MetricsLogger(tmp_path, QUIET, total_steps=10) as log:
        log.log(3, {"train/loss": 1.0})
    records = read_metrics(tmp_path)
    assert [(r["step"], r["train/loss"]) for r in records] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\n{"step"\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(bad)


def test_nan_and_inf_are_written_as_null(tmp_path):
    with MetricsLogger(tmp_path, QUIET, total_steps=10) as log:
        log.log(5, {"train/loss": jnp.float32(jnp.nan), "train/grad_norm": float("inf"), "train/lr": 1e-4})
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    rec = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert rec["train/loss"] is None and rec["train/grad_norm"] is None and rec["train/lr"] == 1e-4
    back = read_metrics(tmp_path)[0]
    assert math.isnan(back["train/loss"]) and back["train/lr"] == 1e-4


def test_tensorboard_holds_the_scalars(tmp_path):
    cfg = LogConfig(tensorboard=True, progress=False)
    with MetricsLogger(tmp_path, cfg, total_steps=10, config_dict={"optim": {"lr": 3e-4}}) as log:
        log.log(1, {"train/loss": 3.5})
        log.log(2, {"train/loss": 3.25, "eval/heldout/loss": 3.75})
    scalars = tb_scalars(tmp_path / "tb")
    assert scalars["train/loss"] == [(1, 3.5), (2, 3.25)]
    assert scalars["eval/heldout/loss"] == [(2, 3.75)]


def test_disabled_logger_writes_nothing(tmp_path):
    with MetricsLogger(tmp_path / "run", LogConfig(), total_steps=10, enabled=False) as log:
        log.log(1, {"train/loss": 1.0})
        log.print("hello")
    assert not (tmp_path / "run").exists()


def test_wandb_missing_warns(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, installed or not
    with pytest.warns(UserWarning, match="wandb"):
        MetricsLogger(tmp_path, LogConfig(tensorboard=False, progress=False, wandb=True), total_steps=10).close()


WANDB_LAUNCH = """
import sys, time
from olmo3eqx.config import LogConfig
from olmo3eqx.metrics import MetricsLogger

first, last, then = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
log = MetricsLogger(sys.argv[1], LogConfig(tensorboard=False, progress=False, wandb=True, wandb_group="g"),
                    total_steps=100)
for step in range(first, last + 1):
    log.log(step, {"train/loss": 1.0 / step})
log.flush()  # a run directory in a bucket: what train.py does before each checkpoint, and every 30 s
print("logged", flush=True)
if then == "hang":
    time.sleep(600)
log.close()
"""
"""One launch of a run as the logger sees it: steps first..last logged, then closed, or left hanging to be killed."""


def wandb_env(tmp_path) -> dict:
    """The environment variables for W&B offline, every file of it under tmp_path (no network, nothing in the home
    directory)."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
            "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data")}


def wandb_records(path: Path) -> list:
    """The protobuf records of a W&B transaction log (run-<id>.wandb): a 7-byte header (":W&B", magic, version),
    then LevelDB's log format (32 KiB blocks of chunks: crc32c, length, type; a record is one FULL chunk or
    FIRST, MIDDLE..., LAST), each record a wandb_internal_pb2.Record. A torn tail (a killed writer) ends the list."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    pos, records, parts = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        if kind == 0 or len(chunk) < length:
            break
        pos, parts = pos + 7 + length, parts + chunk
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


@pytest.mark.parametrize("where", ["local", pytest.param("gs", marks=pytest.mark.slow)])  # gs: 8 s more
def test_a_killed_and_relaunched_run_logs_into_one_wandb_run_whose_steps_never_go_back(where, tmp_path, request):
    """Two launches of one run directory (local, or in a bucket: the id stored there, W&B's files in this host's
    cache), W&B offline: the first killed after logging steps 1-8 (its last checkpoint was step 6), the second
    resumed from 6, logging 7-10. Both write into the W&B run whose id the first stored, and the relaunch sends W&B
    only the steps past the ones already logged (offline W&B cannot know what an earlier launch sent; online it
    would drop the older steps, with a warning each)."""
    from olmo3eqx import storage

    if where == "local":
        run_dir, wandb_dir = str(tmp_path / "run"), tmp_path / "run" / "wandb"
    else:
        run_dir = request.getfixturevalue("stores").url(where, tmp_path.name, "run")
        wandb_dir = tmp_path / "home" / ".cache" / "olmo3eqx" / "wandb" / "wandb"  # storage.local_cache_dir()
    env = {**os.environ, **wandb_env(tmp_path), "HOME": str(tmp_path / "home")}
    killed = subprocess.Popen([sys.executable, "-c", WANDB_LAUNCH, run_dir, "1", "8", "hang"], env=env,
                              stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline().strip() == "logged"
    killed.kill()
    killed.wait()
    run_id = storage.read_text(storage.join(run_dir, "wandb_id")).strip()
    p = subprocess.run([sys.executable, "-c", WANDB_LAUNCH, run_dir, "7", "10", "close"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"W&B: resumed run {run_id}, which has steps up to 8" in p.stderr
    launches = sorted(wandb_dir.glob("offline-run-*"))  # named by start time, then the run id
    assert [d.name.rsplit("-", 1)[1] for d in launches] == [run_id] * 2
    records = wandb_records(launches[1] / f"run-{run_id}.wandb")
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert [(r.run_id, r.run_group) for r in runs] == [(run_id, "g")]
    assert [r.history.step.num for r in records if r.WhichOneof("record_type") == "history"] == [9, 10]
    assert [r["step"] for r in read_metrics(run_dir)] == [*range(1, 9), *range(7, 11)]  # metrics.jsonl keeps all


def test_progress_bar_shows_loss_throughput_and_mfu(tmp_path, capsys):
    cfg = LogConfig(tensorboard=False, progress=True)
    with MetricsLogger(tmp_path, cfg, total_steps=100) as log:
        log.log(10, {"train/loss": 2.0, "perf/tokens_per_s": 12345.0, "perf/mfu": 0.42})
        log.log(20, {"train/loss": 1.5, "perf/tokens_per_s": 12345.0, "perf/mfu": 0.42})
    err = capsys.readouterr().err
    assert "20/100" in err and "loss=1.5000" in err and "tok/s=12,345" in err and "mfu=42.0%" in err


def test_fetch_and_pending_metrics():
    metrics = {"train": {"loss": jnp.float32(1.5), "tokens": jnp.int32(7)}}
    assert fetch(metrics) == {"train/loss": 1.5, "train/tokens": 7}
    pending = PendingMetrics(3, metrics)
    assert pending.step == 3 and pending.result() == {"train/loss": 1.5, "train/tokens": 7}
    with pytest.raises(ValueError, match="scalars"):
        fetch({"x": jnp.ones(2)})


def test_progress_bar_names_the_cpu_mfu_by_its_peak(tmp_path, capsys):
    """On the CPU the peak is a measured matmul, not the hardware's: the bar says so (flops.mfu_label)."""
    import jax

    from olmo3eqx import flops

    label = flops.mfu_label(jax.devices("cpu")[0])
    assert label == "mfu_vs_matmul"
    with MetricsLogger(tmp_path, LogConfig(tensorboard=False, progress=True), total_steps=10, mfu_label=label) as log:
        log.log(10, {"train/loss": 2.0, "perf/mfu": 0.5})
    err = capsys.readouterr().err
    assert "mfu_vs_matmul=50.0%" in err and " mfu=" not in err
