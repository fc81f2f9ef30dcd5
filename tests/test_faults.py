"""Faults a long run meets, made for real: a second trainer on a run (the run-directory lock, two processes), a full
disk under a save (a tmpfs the test mounts; where mounting is not permitted, a hook that fails orbax's array writes
with ENOSPC), SIGKILL inside checkpoint writes and inside metrics.jsonl appends."""

import calendar
import contextlib
import datetime
import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmo3eqx import exits
from olmo3eqx.config import ConfigError, LogConfig
from olmo3eqx.errors import StorageError
from olmo3eqx.checkpoint.checkpointer import Checkpointer, format_bytes, tree_bytes
from olmo3eqx.checkpoint.retention import Retention
from olmo3eqx.metrics import MetricsLogger, TAIL_CHUNK, IndexLog, drop_torn_tail, read_metrics
from olmo3eqx.runlock import LOCK_FILE, RunLock, RunLocked
from test_train import CONFIG, ROOT, env

TORN = ".orbax-checkpoint-tmp"


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """The module's prepared default corpus and JAX compilation cache (a relaunch of a config compiles nothing)."""
    return tmp_path_factory.mktemp("faults-shared")


def write_config(path: Path, text: str, shared: Path) -> Path:
    path.write_text(text.replace("CACHE", str(shared / "corpus")))
    return path


def trainer_env(shared: Path) -> dict:
    return {**env(1), "JAX_COMPILATION_CACHE_DIR": str(shared / "jax-cache")}


def train_cmd(cfg: Path, run_dir: Path) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--config", str(cfg), "--run.dir", str(run_dir)]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error")]


# --- the run-directory lock --------------------------------------------------------------------------------

HOLDER = ("import sys; from olmo3eqx.runlock import RunLock; RunLock(sys.argv[1]).acquire(print); "
          "print('held', flush=True); sys.stdin.read()")


@pytest.fixture
def holder(tmp_path):
    """A real process holding the lock of tmp_path/runs/e2e (the run test_train's CONFIG names) until the test ends
    or kills it."""
    run_dir = tmp_path / "runs" / "e2e"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run_dir, proc
    proc.kill()
    proc.wait()


def test_a_second_process_is_refused_naming_the_holder(holder):
    run_dir, proc = holder
    with pytest.raises(RunLocked) as refused:
        RunLock(run_dir).acquire(warn=pytest.fail)
    message = str(refused.value)
    assert f"PID {proc.pid} on host {socket.gethostname()}" in message and str(run_dir / LOCK_FILE) in message
    started = re.search(r"started (\S+ \S+) UTC", message).group(1)
    assert abs(calendar.timegm(time.strptime(started, "%Y-%m-%d %H:%M:%S")) - time.time()) < 120


def test_the_lock_of_a_killed_holder_is_taken_over_with_a_warning(holder):
    run_dir, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    warnings = []
    lock = RunLock(run_dir).acquire(warn=warnings.append)
    assert len(warnings) == 1 and "taking over" in warnings[0] and f"PID {proc.pid} " in warnings[0]
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (run_dir / LOCK_FILE).read_text() == ""  # released, not abandoned: the next holder has nothing to say
    with RunLock(run_dir).acquire(warn=pytest.fail):
        pass


def test_train_refuses_a_run_directory_another_process_holds(holder, tmp_path, shared):
    run_dir, proc = holder
    cfg = write_config(tmp_path / "e2e.yaml", CONFIG, shared)
    p = subprocess.run(train_cmd(cfg, run_dir.parent), env=trainer_env(shared), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == exits.BAD_INPUT, p.stderr[-3000:]
    errors = error_lines(p.stderr)
    assert len(errors) == 1 and f"in use by another trainer (PID {proc.pid} on host" in errors[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert sorted(q.name for q in run_dir.iterdir()) == [LOCK_FILE]  # no config.yaml, no metrics: nothing written


def test_every_process_of_a_multiprocess_trainer_stops_when_process_0_is_refused(holder, tmp_path, shared):
    from test_multihost import finish, launch

    run_dir, proc = holder
    cfg = write_config(tmp_path / "e2e.yaml", CONFIG, shared)
    results = finish(launch(cfg, run_dir.parent, 2), timeout=300)
    assert [rc for rc, _ in results] == [exits.BAD_INPUT] * 2, [err[-2000:] for _, err in results]
    assert f"in use by another trainer (PID {proc.pid} on host" in results[0][1]
    assert "Process 0 could not lock run directory" in results[1][1]
    assert all("Traceback" not in err for _, err in results)


# --- a full disk -------------------------------------------------------------------------------------------

@contextlib.contextmanager
def tmpfs(path: Path, size: int):
    """A tmpfs of `size` bytes mounted at `path` (yields a function that resizes it), or None where mounting is not
    permitted (not root, no CAP_SYS_ADMIN, not Linux)."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                 capture_output=True).returncode == 0
    except FileNotFoundError:
        mounted = False
    if not mounted:
        yield None
        return

    def resize(new_size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={new_size}", str(path)], check=True)

    try:
        yield resize
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


FAIL_WRITES = '''
import errno
from orbax.checkpoint._src.serialization import serialization

real_write = serialization.async_serialize_from_host

async def write_or_fail(rslices, spec, *args, **kwargs):
    if "/{step}.orbax-checkpoint-tmp" in str(spec) or "/{step}/state" in str(spec):  # locally; in a bucket
        raise OSError(errno.ENOSPC, "No space left on device (test hook)")
    return await real_write(rslices, spec, *args, **kwargs)
'''
"""The fallback where no tmpfs can be mounted: orbax's array writes of checkpoint {step} fail with ENOSPC inside
orbax's background write path, as a full disk fails them (install: serialization.async_serialize_from_host =
write_or_fail). In a bucket orbax writes a step under its final name."""


def fail_writes(monkeypatch, step: int) -> None:
    from orbax.checkpoint._src.serialization import serialization

    hook = {}
    exec(FAIL_WRITES.format(step=step), hook)  # noqa: S102 - the same source the subprocess variant runs
    monkeypatch.setattr(serialization, "async_serialize_from_host", hook["write_or_fail"])


def small_state(mib: int):
    """Random float32 leaves of `mib` MiB in all, which orbax's compression barely shrinks (as trained weights)."""
    rng = np.random.default_rng(0)
    return {k: jnp.asarray(rng.standard_normal(mib * (1 << 17), dtype=np.float32)) for k in ("a", "b")}


@pytest.mark.parametrize("disk", ["tmpfs", "hook"])
def test_a_save_on_a_full_disk_is_one_storage_error_and_the_previous_checkpoint_stays(tmp_path, capfd, monkeypatch,
                                                                                     disk):
    state = small_state(2)
    size = tree_bytes(state)  # 2 MiB
    directory = tmp_path / "disk"
    with tmpfs(directory, int(1.6 * size)) if disk == "tmpfs" else contextlib.nullcontext("hook") as resize:
        if resize is None:
            pytest.skip("mounting a tmpfs is not permitted here; the hook variant runs instead")
        if disk == "hook":
            fail_writes(monkeypatch, step=2)
        ck = Checkpointer(directory / "ckpt", keep=3)
        warnings = []
        ck.check_space(size, warn=warnings.append)
        if disk == "tmpfs":  # room for one checkpoint, not for keep + 1 = 4
            assert len(warnings) == 1 and "room for 1" in warnings[0], warnings
        ck.save(1, state, {"batches_consumed": 1}, {"model": {}})
        ck.wait()
        ck.save(2, state, {"batches_consumed": 2}, {"model": {}})
        with pytest.raises(StorageError) as failed:
            ck.wait()
        ck.close()
        monkeypatch.undo()
        message = str(failed.value)
        assert f"Checkpoint 2 could not be written to {directory / 'ckpt'} (No space left on device)" in message
        assert f"a checkpoint needs about {format_bytes(size)}" in message
        assert f"the last intact checkpoint is {directory / 'ckpt' / '1'}: free space there" in message
        err = capfd.readouterr().err
        assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]

        ck = Checkpointer(directory / "ckpt", keep=3)
        assert ck.intact_steps() == [1]
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        restored, data_state = ck.restore(1, target)
        for k in state:
            np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(state[k]))
        assert data_state == {"batches_consumed": 1}
        if disk == "tmpfs":
            with pytest.raises(StorageError, match=r"free, less than the \S+ MiB the next checkpoint needs; the last "
                                                   r"intact checkpoint is .*/1"):
                ck.check_space(size, warn=pytest.fail)
            # Half a checkpoint free, and a torn step of another half: enough, as its rewrite replaces it.
            (directory / "ckpt" / f"3{TORN}").mkdir()
            resize(shutil.disk_usage(directory).used + size)  # room for it, whatever the failed write of 2 left behind
            (directory / "ckpt" / f"3{TORN}" / "d").write_bytes(bytes(size // 2))
            resize(shutil.disk_usage(directory).used + size // 2)
            warnings = []
            ck.check_space(size, warn=warnings.append)
            assert len(warnings) == 1 and "room for 1" in warnings[0], warnings
        ck.close()


FULL_DISK_CONFIG = (CONFIG.replace("eval: {every: 4, batches: 1}", "eval: {every: 0}").replace("steps: 12", "steps: 18")
                    .replace("checkpoint: {every: 4, keep: 3}", "checkpoint: {every: 6, keep: 3}"))


def test_train_on_a_full_disk_stops_with_one_sentence_and_resumes_bit_identically(tmp_path, shared):
    from olmo3eqx.config import load_yaml
    from olmo3eqx.sharding import build_layout

    cfg = write_config(tmp_path / "e2e.yaml", FULL_DISK_CONFIG, shared)
    size = tree_bytes(build_layout(load_yaml(cfg)).state_target())
    disk = tmp_path / "disk"
    ckpt = disk / "e2e" / "checkpoints"
    # Room for checkpoint 6 (a little smaller than the state: orbax compresses) and the run's small files, not for
    # checkpoint 12 beside it.
    with tmpfs(disk, int(1.2 * size) + (1 << 18)) as resize:
        first_cmd = train_cmd(cfg, disk)
        if resize is None:  # no tmpfs here: fail checkpoint 12's writes inside orbax instead
            first_cmd[1:2] = ["-c", FAIL_WRITES.format(step=12) + "serialization.async_serialize_from_host = "
                              "write_or_fail\nimport sys\nfrom olmo3eqx.train import main\nsys.exit(main(sys.argv[1:]))"]
        first = subprocess.run(first_cmd, env=trainer_env(shared), capture_output=True, text=True, timeout=600)
        assert first.returncode == exits.STORAGE, first.stderr[-3000:]
        errors = error_lines(first.stderr)
        assert len(errors) == 1, first.stderr[-3000:]
        assert "(No space left on device" in errors[0] and f"the last intact checkpoint is {ckpt / '6'}" in errors[0]
        assert "Traceback" not in first.stderr and "Event loop is closed" not in first.stderr, first.stderr[-3000:]
        before = [r for r in read_metrics(disk / "e2e") if "train/loss" in r]
        # The failure in orbax's background thread stopped the run within steps, not at the next save (18).
        assert 12 <= before[-1]["step"] < 18, before[-1]["step"]

        if resize is not None:
            resize(6 * size)
        second = subprocess.run(train_cmd(cfg, disk), env=trainer_env(shared), capture_output=True, text=True,
                                timeout=600)
        assert second.returncode == 0, second.stderr[-3000:]
        assert f"resumed from {ckpt / '6'}" in second.stderr
        after = [r for r in read_metrics(disk / "e2e") if "train/loss" in r][len(before):]
        assert committed(ckpt) == [6, 12, 18]
    replayed = {r["step"]: r["train/loss"] for r in after}
    assert sorted(replayed) == list(range(7, 19))
    lost = [r for r in before if r["step"] > 6]
    assert lost, "the failed run logged no step after its last checkpoint"
    for r in lost:
        assert replayed[r["step"]] == r["train/loss"], f"step {r['step']}"


@pytest.mark.slow
def test_every_process_of_a_multiprocess_trainer_stops_on_a_full_disk(tmp_path, shared):
    """2 processes writing their shards to one full disk: each stops with the sentence and exit 74, promptly (not
    after orbax's 300 s barrier timeout), none with a traceback."""
    from test_multihost import finish, launch

    from olmo3eqx.config import load_yaml
    from olmo3eqx.sharding import build_layout

    cfg = write_config(tmp_path / "e2e.yaml", FULL_DISK_CONFIG, shared)
    size = tree_bytes(build_layout(load_yaml(cfg)).state_target())
    disk = tmp_path / "disk"
    with tmpfs(disk, int(1.2 * size) + (1 << 18)) as resize:
        if resize is None:
            pytest.skip("mounting a tmpfs is not permitted here")
        started = time.time()
        results = finish(launch(cfg, disk, 2, "--steps", "18"), timeout=600)
        assert time.time() - started < 300
        assert [rc for rc, _ in results] == [exits.STORAGE] * 2, [err[-2000:] for _, err in results]
        for _, err in results:
            assert "Traceback" not in err and "Event loop is closed" not in err, err[-3000:]
            errors = error_lines(err)
            assert len(errors) == 1 and f"the last intact checkpoint is {disk / 'e2e' / 'checkpoints' / '6'}" in \
                errors[0], err[-3000:]


def test_a_full_disk_under_the_metrics_sinks_raises_instead_of_hanging(tmp_path):
    """metrics.jsonl and TensorBoard on a disk that fills up: an OSError naming the file (train.py turns it into a
    StorageError), not tensorboardX's writer thread dying and its full queue blocking the loop forever."""
    disk = tmp_path / "disk"
    with tmpfs(disk, 256 << 10) as resize:
        if resize is None:
            pytest.skip("mounting a tmpfs is not permitted here")
        log = MetricsLogger(disk, LogConfig(progress=False), total_steps=10**9)
        failure = []

        def fill():
            try:
                for step in range(1, 10**6):
                    log.log(step, {f"train/m{i}": float(i) for i in range(50)})
            except OSError as e:
                failure.append(e)

        writer = threading.Thread(target=fill, daemon=True)
        writer.start()
        writer.join(120)
        assert not writer.is_alive(), "logging hung on the full disk"
        assert failure and failure[0].errno == errno.ENOSPC
        assert failure[0].filename == str(disk / "metrics.jsonl") or failure[0].filename.startswith(str(disk / "tb"))
        log.close()  # the failure was raised once; closing only warns
        assert [r["step"] for r in read_metrics(disk)] == list(range(1, len(read_metrics(disk)) + 1))


# --- SIGKILL inside checkpoint writes ----------------------------------------------------------------------

KILL_CONFIG = """
run: {name: e2e, seed: 0}
steps: STEPS
model: {vocab_size: 384, hidden_size: 256, intermediate_size: 704, num_hidden_layers: 4, num_attention_heads: 4,
        num_key_value_heads: 4, head_dim: 64, sliding_window: 16, eos_token_id: 256, pad_token_id: 257,
        compute_dtype: float32}
data: {seq_len: 64, global_batch: 2, cache_dir: "CACHE"}
optim: {lr: 3.0e-3, warmup_steps: 2}
checkpoint: {every: 2, keep: 2}
eval: {every: 0}
log: {every: 1, progress: false, tensorboard: false}
"""
"""tiny.yaml's model (3.3M parameters: a 39 MiB train state, whose write takes a few tenths of a second) on batches
small enough that steps take milliseconds: the run spends its time writing checkpoints."""


def committed(ckpt: Path) -> list[int]:
    if not ckpt.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit() and (p / "commit_success.txt").is_file())


def torn_steps(ckpt: Path) -> list[str]:
    return [p.name for p in ckpt.iterdir() if TORN in p.name] if ckpt.is_dir() else []


@dataclass
class Kill:
    step: int  # the checkpoint being written
    delay_ms: float  # after its tmp directory appeared
    inside: bool  # the process died before that checkpoint committed
    committed: list[int]  # after the kill
    resumed_from_at_launch: int | None  # the step the killed launch itself had resumed from
    resumed_from: int | None = None  # the step the relaunch after this kill resumed from


def write_of(ckpt: Path, step: int) -> tuple[int, int] | None:
    """The identity (inode, mtime) of checkpoint `step`'s tmp directory, None when there is none: a new write's
    directory differs from the torn one an earlier kill left (which its relaunch removes first)."""
    for name in torn_steps(ckpt):
        if name.startswith(f"{step}{TORN}"):
            with contextlib.suppress(FileNotFoundError):
                st = (ckpt / name).stat()
                return st.st_ino, st.st_mtime_ns
    return None


def kill_inside_write(cmd: list[str], env: dict, ckpt: Path, step: int, delay_s: float) -> Kill:
    """Launch `cmd`, SIGKILL it `delay_s` after its write of checkpoint `step` starts (a tmp directory appears that
    is not one an earlier kill left)."""
    left = write_of(ckpt, step)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while write_of(ckpt, step) in (None, left):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"no write of checkpoint {step} seen (exit {proc.returncode}): "
                                 f"{proc.stderr.read()[-3000:]}")
        time.sleep(0.001)
    time.sleep(delay_s)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    after = committed(ckpt)
    return Kill(step, 1000 * delay_s, step not in after, after, resumed_step(err))


def resumed_step(stderr: str) -> int | None:
    found = re.search(r"resumed from \S+/checkpoints/(\d+)", stderr)
    return int(found.group(1)) if found else None


def resume(cmd: list[str], env: dict, ckpt: Path, kill: Kill) -> None:
    """Relaunch to the end: it must resume from the newest committed checkpoint and leave no torn step behind."""
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    kill.resumed_from = resumed_step(p.stderr)
    assert kill.resumed_from == (kill.committed[-1] if kill.committed else None), (kill, p.stderr[-2000:])
    assert "taking over the lock" in p.stderr  # the killed trainer could not release it
    assert not torn_steps(ckpt)


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in read_metrics(run_dir / "e2e") if "train/loss" in r]


def test_sigkill_inside_a_checkpoint_write_resumes_from_the_newest_committed(tmp_path, shared):
    """Fast variant: one kill, the moment checkpoint 4's write starts; every loss the two launches log agrees."""
    cfg = write_config(tmp_path / "kill.yaml", KILL_CONFIG.replace("STEPS", "6"), shared)
    run_dir = tmp_path / "run"
    cmd, ckpt = train_cmd(cfg, run_dir), run_dir / "e2e" / "checkpoints"
    kill = kill_inside_write(cmd, trainer_env(shared), ckpt, step=4, delay_s=0.0)
    assert kill.inside and kill.committed == [2], kill
    resume(cmd, trainer_env(shared), ckpt, kill)
    by_step: dict[int, set[float]] = {}
    for step, loss in logged_losses(run_dir):
        by_step.setdefault(step, set()).add(loss)
    assert sorted(by_step) == list(range(1, 7))
    assert all(len(v) == 1 for v in by_step.values()), by_step  # steps 3.. logged twice, bit-identically


def test_sigkill_after_an_ephemeral_checkpoint_resumes_from_it_into_the_same_wandb_run(tmp_path, shared):
    """checkpoint.every 4, ephemeral_every 3, keep 2, 8 steps, W&B offline: killed the moment checkpoint 8's write
    starts, when ephemeral 6 is the newest committed (3 went when 4 committed); the relaunch resumes from 6, logs
    steps 7-8 bit-identically to the killed launch, deletes 6 once 8 commits, and logs into the killed launch's W&B
    run (sending it none of the steps the killed launch logged)."""
    from test_metrics import wandb_env, wandb_records

    cfg = write_config(tmp_path / "kill.yaml", KILL_CONFIG.replace("STEPS", "8"), shared)
    run_dir = tmp_path / "run"
    cmd = [*train_cmd(cfg, run_dir), "--checkpoint.every", "4", "--checkpoint.ephemeral-every", "3", "--log.wandb"]
    ckpt, environ = run_dir / "e2e" / "checkpoints", {**trainer_env(shared), **wandb_env(tmp_path)}
    kill = kill_inside_write(cmd, environ, ckpt, step=8, delay_s=0.0)
    assert kill.inside and kill.committed == [4, 6], kill
    resume(cmd, environ, ckpt, kill)
    assert kill.resumed_from == 6 and committed(ckpt) == [4, 8]
    by_step: dict[int, list[float]] = {}
    for step, loss in logged_losses(run_dir):
        by_step.setdefault(step, []).append(loss)
    assert sorted(by_step) == list(range(1, 9))
    assert [len(by_step[s]) for s in (7, 8)] == [2, 2] and all(len(set(v)) == 1 for v in by_step.values()), by_step
    run_id = (run_dir / "e2e" / "wandb_id").read_text().strip()
    launches = sorted((run_dir / "e2e" / "wandb").glob("offline-run-*"))
    assert [d.name.rsplit("-", 1)[1] for d in launches] == [run_id] * 2
    relaunch = wandb_records(launches[1] / f"run-{run_id}.wandb")
    assert [r.run.run_id for r in relaunch if r.WhichOneof("record_type") == "run"] == [run_id]
    assert not [r for r in relaunch if r.WhichOneof("record_type") == "history"]  # steps 7-8: the killed launch's


@pytest.mark.slow
def test_sigkill_at_random_moments_inside_checkpoint_writes(tmp_path, shared):
    """Many kills at random moments of random checkpoint writes, each relaunch killed again, against an
    uninterrupted run: every relaunch resumes from the newest committed checkpoint and every loss ever logged is
    bit-identical to the reference's."""
    steps, chains, kills_per_chain = 16, 3, 4
    rng = random.Random(22)
    cfg = write_config(tmp_path / "kill.yaml", KILL_CONFIG.replace("STEPS", str(steps)), shared)
    reference = tmp_path / "reference"
    windows = write_windows(train_cmd(cfg, reference), trainer_env(shared), reference / "e2e" / "checkpoints")
    want = dict(logged_losses(reference))
    window_s = float(np.median(windows))
    stats = []
    for chain in range(chains):
        run_dir = tmp_path / f"chain{chain}"
        cmd, ckpt = train_cmd(cfg, run_dir), run_dir / "e2e" / "checkpoints"
        kill = None
        for _ in range(kills_per_chain):
            done = committed(ckpt)
            ahead = [s for s in range(2, steps, 2) if s > (done[-1] if done else 0)]
            if not ahead:
                break
            launched = kill_inside_write(cmd, trainer_env(shared), ckpt, rng.choice(ahead),
                                         rng.uniform(0, 1.2 * window_s))
            if kill is not None:  # this launch was the previous kill's relaunch
                kill.resumed_from = launched.resumed_from_at_launch
                assert kill.resumed_from == (kill.committed[-1] if kill.committed else None), kill
            kill = launched
            stats.append(kill)
        resume(cmd, trainer_env(shared), ckpt, kill)
        for step, loss in logged_losses(run_dir):
            assert loss == want[step], f"chain {chain} step {step}: {loss!r} != {want[step]!r}"
    inside = sum(k.inside for k in stats)
    print(f"\nkill-inside-write: {len(stats)} kills in {chains} chains; writes took {1000 * min(windows):.0f}-"
          f"{1000 * max(windows):.0f} ms (median {1000 * window_s:.0f}); {inside} kills inside a write, "
          f"{len(stats) - inside} just after its commit; {len(stats)} relaunches, each resumed from the newest "
          f"committed checkpoint; every logged loss bit-identical to the uninterrupted run's")
    for k in stats:
        print(f"  checkpoint {k.step:2d} +{k.delay_ms:4.0f} ms  inside={k.inside!s:5}  committed after={k.committed}"
              f"  relaunch resumed from {k.resumed_from}")
    assert inside >= len(stats) // 2  # the kills land inside writes, not only around them


def write_windows(cmd: list[str], env: dict, ckpt: Path) -> list[float]:
    """Run `cmd` uninterrupted, timing each checkpoint write (its tmp directory appearing -> its step committed)."""
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    started, windows = {}, []
    while proc.poll() is None:
        now = time.time()
        for name in [p.name for p in ckpt.iterdir()] if ckpt.is_dir() else []:
            if TORN in name:
                started.setdefault(name.split(".")[0], now)
            elif name in started:
                windows.append(now - started.pop(name))
        time.sleep(0.001)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    return windows


# --- ephemeral checkpoints ---------------------------------------------------------------------------------

def kept(policy, steps: list[int]) -> list[int]:
    """The steps an orbax preservation policy keeps of committed `steps` (oldest first, as orbax lists them)."""
    from orbax.checkpoint import checkpoint_managers

    infos = [SimpleNamespace(step=s, metrics=None, time=datetime.datetime(2026, 1, 1) + datetime.timedelta(hours=s))
             for s in steps]
    return [s for s, keep in zip(steps, policy.should_preserve(infos, context=checkpoint_managers.PreservationContext()))
            if keep]


def test_without_ephemeral_checkpoints_retention_is_orbaxs_max_to_keep_and_keep_period():
    from orbax.checkpoint import checkpoint_managers as cm

    rng = random.Random(54)
    for _ in range(300):
        keep, keep_every = rng.randint(1, 4), rng.choice([0, 2, 3, 5])
        steps = sorted(rng.sample(range(1, 40), rng.randint(1, 12)))
        orbax = cm.AnyPreservationPolicy([cm.LatestN(keep)] + ([cm.EveryNSteps(keep_every)] if keep_every else []))
        assert kept(Retention(keep, keep_every), steps) == kept(orbax, steps), (keep, keep_every, steps)


def test_ephemeral_steps_never_push_permanent_ones_out_of_keep():
    every_4 = Retention(keep=2, keep_every=8, permanent_every=4, last_step=30)
    assert kept(every_4, [3, 4, 5, 6, 7]) == [4, 7]  # one permanent step and the newest
    assert kept(every_4, [4, 8, 9, 12, 13, 14]) == [8, 12, 14]  # 4 out of keep 2; 8 a multiple of keep_every
    assert kept(every_4, [8, 12, 13, 16]) == [8, 12, 16]  # the newest is permanent: ephemeral 13 goes
    assert kept(every_4, [12, 20, 29, 30]) == [20, 30]  # the last step is permanent
    assert kept(every_4, [12, 13, 14]) == [12, 14]  # two ephemeral steps (a crash between commit and delete)


def test_ephemeral_every_must_be_below_every():
    from olmo3eqx.config import CheckpointConfig

    with pytest.raises(ConfigError, match=r"^checkpoint\.ephemeral_every \(1000\) must be below checkpoint\.every "
                                          r"\(1000\): [^.]*\.$"):
        CheckpointConfig(every=1000, ephemeral_every=1000)
    with pytest.raises(ConfigError, match=r"^checkpoint\.ephemeral_every must be non-negative, got -1\.$"):
        CheckpointConfig(ephemeral_every=-1)
    assert [s for s in range(1, 13) if CheckpointConfig(every=4, ephemeral_every=3).due(s, 11)] == [3, 4, 6, 8, 9, 11,
                                                                                                    12]


def bucket_or_local(store: str, tmp_path: Path, request) -> str | Path:
    if store == "local":
        return tmp_path / "ckpt"
    return request.getfixturevalue("stores").url(store, tmp_path.name, "ckpt")


def on_store(ck: Checkpointer) -> list[int]:
    """The committed steps as the store lists them now (no listing this process cached)."""
    from olmo3eqx import storage

    storage.forget_listings(str(ck.directory))
    return ck.intact_steps()


@pytest.mark.parametrize("store", ["local", "gs", "s3"])
def test_one_ephemeral_checkpoint_at_a_time_deleted_only_once_a_newer_one_commits(store, tmp_path, request,
                                                                                  monkeypatch):
    """checkpoint.every 4, ephemeral_every 3, keep 2, 10 steps, async saves: after each save commits the store holds
    the newest two permanent steps and the newest step; a save that fails leaves the ephemeral step before it in
    place, and the relaunch's save of that step deletes it."""
    from olmo3eqx.config import CheckpointConfig

    cfg, last = CheckpointConfig(every=4, keep=2, ephemeral_every=3), 10
    directory = bucket_or_local(store, tmp_path, request)
    state = {"a": jnp.arange(1024.0)}
    saves = [s for s in range(1, last + 1) if cfg.due(s, last)]
    assert saves == [3, 4, 6, 8, 9, 10]
    want = {3: [3], 4: [4], 6: [4, 6], 8: [4, 8], 9: [4, 8, 9], 10: [8, 10]}
    ck = Checkpointer(directory, keep=cfg.keep, permanent_every=cfg.every, last_step=last)
    for step in saves[:-1]:
        ck.save(step, state, {"batches_consumed": step}, {"model": {}})
        ck.wait()
        assert on_store(ck) == want[step], step
    fail_writes(monkeypatch, step=10)
    ck.save(10, state, {"batches_consumed": 10}, {"model": {}})
    with pytest.raises(StorageError, match="Checkpoint 10 could not be written"):
        ck.wait()
    ck.close()
    monkeypatch.undo()
    assert on_store(ck) == [4, 8, 9]  # the failed write deleted nothing
    ck = Checkpointer(directory, keep=cfg.keep, permanent_every=cfg.every, last_step=last)  # the relaunch
    ck.save(10, state, {"batches_consumed": 10}, {"model": {}})
    ck.wait()
    assert on_store(ck) == want[10]
    ck.close()


RAISED = {"every": 10, "ephemeral_every": 5, "keep": 3}
"""The issue's run: a checkpoint every 5 steps, every 10th permanent, the newest 3 permanent ones kept, 45 steps, then
relaunched with --steps 51."""


def saves(cfg, first: int, last: int) -> list[int]:
    return [s for s in range(first, last + 1) if cfg.due(s, last)]


@pytest.mark.parametrize("store", ["local", "gs", "s3"])
def test_a_checkpoint_written_permanent_stays_permanent_when_steps_is_raised(store, tmp_path, request):
    """The run of 45 steps ends with [30, 40, 45] (45 permanent: the last step); the relaunch with --steps 51 keeps 45,
    recorded permanent when it was written, so its saves of 50 and 51 push the older 30 and 40 out of keep 3, not 45
    (deciding 45 again against the new last step made it ephemeral and deleted it: [40, 50, 51])."""
    from olmo3eqx.config import CheckpointConfig

    cfg = CheckpointConfig(**RAISED)
    directory = bucket_or_local(store, tmp_path, request)
    state = {"a": jnp.arange(16.0)}
    for first, last, want in ((1, 45, [30, 40, 45]), (46, 51, [45, 50, 51])):
        ck = Checkpointer(directory, keep=cfg.keep, permanent_every=cfg.every, last_step=last)
        for step in saves(cfg, first, last):
            ck.save(step, state, {"batches_consumed": step}, {"model": {}})
        ck.close()
        assert on_store(ck) == want, last


def test_checkpoints_written_before_the_record_are_decided_as_before(tmp_path):
    """Steps written before their permanence was recorded (orbax's save of the same items without custom metadata,
    as the Checkpointer wrote them) still restore, and a launch decides their status as before, by its own
    checkpoint.every and last step: 45, relaunched with --steps 51, is ephemeral and goes once 50 commits."""
    import orbax.checkpoint as ocp

    from olmo3eqx.checkpoint.checkpointer import TRAIN_ITEMS

    directory, state = tmp_path / "ckpt", {"a": jnp.arange(16.0)}
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=True),
                               item_names=TRAIN_ITEMS) as older:
        for step in (30, 40, 45):
            older.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     data=ocp.args.JsonSave({"batches_consumed": step}),
                                                     config=ocp.args.JsonSave({"model": {}})))
    ck = Checkpointer(directory, keep=RAISED["keep"], permanent_every=RAISED["every"], last_step=51)
    restored, data = ck.restore(45, state)
    assert data == {"batches_consumed": 45} and np.array_equal(restored["a"], state["a"])
    for step in (50, 51):
        ck.save(step, state, {"batches_consumed": step}, {"model": {}})
    ck.close()
    assert on_store(ck) == [40, 50, 51]


@pytest.mark.slow  # ~30 s: the Checkpointer's two launches on local, gs and s3 above prove the row in the default suite: one of .ci/run's shares (.ci/share.py)
def test_raising_steps_keeps_the_final_checkpoint_of_a_real_run(tmp_path, shared):
    """train.py on test_train's small model: 45 steps (checkpoints every 5, every 10th permanent, keep 3), then
    --steps 51 resumes from 45 and keeps it."""
    cfg = write_config(tmp_path / "raise.yaml", CONFIG, shared)
    run_dir = tmp_path / "run"
    ckpt = run_dir / "e2e" / "checkpoints"
    cmd = [*train_cmd(cfg, run_dir), "--steps", "45", "--eval.every", "0", "--checkpoint.every", "10",
           "--checkpoint.ephemeral-every", "5", "--checkpoint.keep", "3"]
    for extra, want in (([], [30, 40, 45]), (["--steps", "51"], [45, 50, 51])):
        p = subprocess.run(cmd + extra, env=trainer_env(shared), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        assert committed(ckpt) == want, p.stderr[-2000:]
    assert resumed_step(p.stderr) == 45


# --- SIGKILL inside metrics.jsonl appends ------------------------------------------------------------------

APPENDER = """
import sys
from olmo3eqx.config import LogConfig
from olmo3eqx.metrics import MetricsLogger

log = MetricsLogger(sys.argv[1], LogConfig(tensorboard=False, progress=False), total_steps=10**9)
pad = {"pad/" + "x" * (1 << 23): 0}  # an 8 MiB line: its write copies many pages, so a kill can land inside it
print("appending", flush=True)
step = 0
while True:
    step += 1
    log.log(step, {"train/loss": float(step), **pad})
"""


def test_a_torn_last_line_is_dropped_before_appending(tmp_path):
    """The backward scan of drop_torn_tail: a torn line longer than its read chunk, and a file of one torn line."""
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1}\n' + b'{"step": 2, "x": "' + b"y" * (3 * TAIL_CHUNK))
    drop_torn_tail(path)
    assert path.read_bytes() == b'{"step": 1}\n'
    path.write_bytes(b'{"step": 1, "x": "' + b"y" * TAIL_CHUNK)
    drop_torn_tail(path)
    assert path.read_bytes() == b""
    index = tmp_path / "indices" / "process_0.jsonl"
    index.parent.mkdir()
    index.write_text('{"step": 1, "index": [0]}\n{"step": 2, "ind')
    log = IndexLog(tmp_path, 0, enabled=True)
    log.write(2, np.array([1]))
    log.close()
    assert [json.loads(line)["step"] for line in index.read_text().splitlines()] == [1, 2]


def half_written(path: Path) -> bool:
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        return end > 0 and f.seek(end - 1) >= 0 and f.read(1) != b"\n"


@pytest.mark.slow
def test_sigkill_inside_metrics_appends(tmp_path):
    """Kill a process appending 8 MiB lines at random moments, each the instant a line is seen half written:
    whatever the kill leaves, read_metrics and compare read it, and the next logger appends after the last whole
    line."""
    from olmo3eqx.tools.compare import series

    rng = random.Random(22)
    trials, torn = 12, 0
    for trial in range(trials):
        run_dir = tmp_path / f"run{trial}"
        proc = subprocess.Popen([sys.executable, "-c", APPENDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "appending"
        time.sleep(rng.uniform(0, 0.5))
        deadline = time.time() + 5
        while time.time() < deadline and not half_written(run_dir / "metrics.jsonl"):
            pass
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        data = (run_dir / "metrics.jsonl").read_bytes()
        torn += bool(data) and not data.endswith(b"\n")
        steps = [r["step"] for r in read_metrics(run_dir)]
        assert steps == list(range(1, len(steps) + 1))
        if steps:
            np.testing.assert_array_equal(series(run_dir)["train/loss"][1], np.arange(1, len(steps) + 1))
        with MetricsLogger(run_dir, LogConfig(tensorboard=False, progress=False), 10) as log:
            log.log(len(steps) + 1, {"train/loss": 0.5})
        assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, len(steps) + 2))
    print(f"\nmetrics appends: {trials} kills, {torn} left a torn last line; all read back and appended cleanly")
    assert torn > 0  # the kills did land inside writes



# --- what restoring a checkpoint raised --------------------------------------------------------------------


def test_what_a_restore_raised_is_classified_and_only_damage_skips_a_step():
    """restore_failure, on the errors orbax, tensorstore, XLA and the stores raise (their texts as seen): only a
    step whose data or metadata is verifiably incomplete or damaged is 'corrupt'; an outage, a denial, an
    out-of-memory and a bug each stop the resume."""
    import json as json_module

    import requests
    from google.api_core import exceptions as gexc

    from olmo3eqx import storage
    from olmo3eqx.checkpoint.failures import RESTORE_OUTCOMES, restore_failure

    def wrapped(cause):  # orbax re-raises tensorstore's error inside its own
        try:
            raise cause
        except Exception as e:
            try:
                raise Exception("Encountered error while reading array index: (slice(0, 100000, 1),).") from e
            except Exception as outer:
                return outer

    cases = {
        "corrupt": [wrapped(ValueError('DATA_LOSS: Error reading "a/.zarray" in OCDBT database: Error decoding '
                                       'manifest: Encoded length (0) is less than minimum length (16)')),
                    wrapped(ValueError('OUT_OF_RANGE: Error reading "a/0": Requested byte range [0, 268713) is not '
                                       'valid for value of size 134477')),
                    wrapped(ValueError("FAILED_PRECONDITION: Truncated Zstd-compressed stream; at byte 0")),
                    json_module.JSONDecodeError("Expecting value", "", 0), FileNotFoundError("12/state missing"),
                    ValueError("Found incomplete checkpoint at gs://b/r/checkpoints/12.")],
        "storage": [wrapped(OSError(errno.EIO, "Input/output error")), storage.StorageError("store away"),
                    wrapped(ValueError("UNAVAILABLE: Error reading from gs://b: Connection refused")),
                    wrapped(ValueError("DEADLINE_EXCEEDED: Error reading gs://b/x")),
                    requests.exceptions.ConnectionError("refused"), gexc.ServiceUnavailable("later"),
                    ValueError("UNKNOWN: Error reading local file: [os_error_code='5'] Input/output error")],
        "denied": [wrapped(ValueError("PERMISSION_DENIED: Error reading gs://b/x: HTTP 403")),
                   gexc.Forbidden("no")],
        "memory": [MemoryError(), RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 29.3GiB."),
                   OSError(errno.ENOMEM, "Cannot allocate memory")],
        "config": [ConfigError("The model config differs from checkpoint 12 in hidden_size")],
        "error": [ValueError("User-provided restore item and on-disk value metadata tree structures do not match"),
                  KeyError("x"), TypeError("a bug")],
    }
    assert set(cases) == set(RESTORE_OUTCOMES) - {"ok"}
    for outcome, errors in cases.items():
        got = [restore_failure(e)[0] for e in errors]
        assert got == [outcome] * len(errors), [(str(e)[:60], g) for e, g in zip(errors, got) if g != outcome]


# --- a non-finite step ---------------------------------------------------------------------------------

NAN_AT = '''
import sys
import numpy as np
from olmo3eqx import train

real_train_data = train.train_data


class NanAt:
    """The run's own batches, with every instance of the batches in {batches} weighted NaN: their loss and
    gradients are NaN, as a batch that overflows the forward pass makes them."""

    def __init__(self, data, start):
        self.data, self.drawn = data, start

    def __next__(self):
        batch = next(self.data)
        if self.drawn in {batches}:
            batch = {{**batch, "mask": np.full_like(batch["mask"], np.nan)}}
        self.drawn += 1
        return batch

    def __getattr__(self, name):
        return getattr(self.data, name)


train.train_data = lambda cfg, start, data_state: NanAt(real_train_data(cfg, start, data_state), start)
sys.exit(train.main(sys.argv[1:]))
'''
"""train.py whose data gives NaN-weighted batches at the 0-based batch numbers {batches}: a fault made in the data,
the train step untouched."""


def test_one_nonfinite_step_is_skipped_logged_and_the_run_finishes(tmp_path, shared):
    from olmo3eqx.config import load_yaml
    from olmo3eqx.sharding import build_layout

    cfg = write_config(tmp_path / "e2e.yaml", CONFIG.replace("eval: {every: 4, batches: 1}", "eval: {every: 0}"),
                       shared)
    cmd = [sys.executable, "-c", NAN_AT.format(batches={4}), *train_cmd(cfg, tmp_path)[2:], "--steps", "6",
           "--checkpoint.every", "1", "--checkpoint.keep", "6", "--log.indices"]
    p = subprocess.run(cmd, env=trainer_env(shared), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "warning: step 5 had a non-finite loss" in p.stderr and not error_lines(p.stderr), p.stderr[-3000:]
    run = tmp_path / "e2e"
    logged = {r["step"]: r for r in read_metrics(run) if "train/loss" in r}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert [logged[s]["train/skipped"] for s in range(1, 7)] == [0, 0, 0, 0, 1, 0]
    assert np.isnan(logged[5]["train/loss"]) and np.isfinite(logged[6]["train/loss"])
    (skipped,) = [json.loads(line) for line in (run / "skipped_batches.jsonl").read_text().splitlines()]
    drawn = {json.loads(line)["step"]: json.loads(line)["index"]
             for line in (run / "indices" / "process_0.jsonl").read_text().splitlines()}
    assert skipped["step"] == 5 and skipped["index"] == drawn[5] and len(skipped["index"]) == 8
    assert skipped["loss"] is None  # NaN, written as null
    # Step 5 changed nothing but the step counter and the data position; step 6 trained again.
    target = build_layout(load_yaml(cfg)).state_target()
    ck = Checkpointer(run / "checkpoints", keep=6)
    (s4, d4), (s5, d5), (s6, _) = (ck.restore(step, target) for step in (4, 5, 6))
    ck.close()
    assert (int(s4.step), int(s5.step), d4["batches_consumed"], d5["batches_consumed"]) == (4, 5, 4, 5)
    for a, b in zip(jax.tree.leaves((s4.model, s4.opt_state)), jax.tree.leaves((s5.model, s5.opt_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(s6.model.embed), np.asarray(s5.model.embed))
