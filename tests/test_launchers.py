"""What real launchers do to a supervised run (`train.py --until-done`), with their real signals sent to the real
processes they reach: slurmstepd (SIGTERM to every process of the step, then SIGKILL to whatever is left once the
task's main process has exited), Kubernetes and `docker stop` (SIGTERM to the container's main process, SIGKILL to
everything after the grace period), a terminal or SSH session that hangs up (SIGHUP to its foreground process group),
the supervisor SIGKILLed. The supervisor's decisions are tested over a stand-in command in test_supervise."""

import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import termios
import time

import pytest

from test_faults import KILL_CONFIG, committed, resumed_step, shared, train_cmd, trainer_env, write_config  # noqa: F401
from test_supervise import STAND_IN, alive, descendants, leftovers, received  # noqa: F401
from test_train import ROOT, logged_step, losses, wait_for

STEPS = 100
CONFIG = KILL_CONFIG.replace("STEPS", str(STEPS)).replace("{every: 2, keep: 2}", "{every: 100000, keep: 2}")
"""test_faults' small model (steps of milliseconds), no periodic checkpoint: the only one is the preemption's."""
GRACE_S = 120
"""How long a test waits for the stopped run, as a launcher's grace period before its SIGKILL."""


def supervised(tmp_path, shared, run_dir, *extra: str) -> subprocess.Popen:
    """`train.py --until-done` in a session of its own (a step's or a terminal's process group), once it trains."""
    cfg = write_config(tmp_path / "run.yaml", CONFIG, shared)
    sup = subprocess.Popen([*train_cmd(cfg, run_dir), "--until-done", "--retry-backoff", "0", *extra],
                           env=trainer_env(shared), stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(lambda: logged_step(run_dir) >= 2, sup)
    return sup


def checkpoints(run_dir) -> list[int]:
    return committed(run_dir / "e2e" / "checkpoints")


def slurmstepd_stop(task: subprocess.Popen) -> list[int]:
    """What slurmstepd does on scancel, preemption or the time limit: SIGTERM to every process of the step (the cgroup
    holds the task and all it started, whatever their process groups), then, once the task's main process has exited
    (`_wait_for_all_tasks`), SIGKILL to whatever is left (`proctrack_g_signal(..., SIGKILL)`). Returns the
    processes that SIGKILL found."""
    step = {task.pid, *descendants(task.pid)}
    for pid in sorted(step):
        os.kill(pid, signal.SIGTERM)
    try:
        task.wait(timeout=GRACE_S)  # SLURM's KillWait would SIGKILL everything after this
    except subprocess.TimeoutExpired:
        pass
    left = [pid for pid in step | set(descendants(task.pid)) if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_slurmstepd_preemption_checkpoints_and_the_requeued_run_resumes_bit_identically(tmp_path, shared, leftovers):
    """`srun python train.py ... --until-done` preempted: the trainer writes its checkpoint before the supervisor
    exits (nothing is left for slurmstepd's SIGKILL), nothing is relaunched, and the requeued command resumes from
    that checkpoint and logs the same losses as an uninterrupted run."""
    run_dir = tmp_path / "preempted"
    task = supervised(tmp_path, shared, run_dir)
    for pid in descendants(task.pid):
        leftovers(pid)
    killed = slurmstepd_stop(task)
    err = task.stderr.read()
    assert checkpoints(run_dir), f"no checkpoint; SIGKILLed: {killed}\n{err[-3000:]}"
    (saved,) = checkpoints(run_dir)
    assert task.returncode == 75 and not killed and saved < STEPS, err[-3000:]
    assert f"SIGTERM received: checkpoint {saved} written" in err and "launch 2" not in err
    requeued = subprocess.run(task.args, env=trainer_env(shared), capture_output=True, text=True, timeout=600)
    assert requeued.returncode == 0 and resumed_step(requeued.stderr) == saved, requeued.stderr[-3000:]
    reference = tmp_path / "uninterrupted"
    plain = subprocess.run(train_cmd(tmp_path / "run.yaml", reference), env=trainer_env(shared), capture_output=True,
                           text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert losses(run_dir) == losses(reference) and sorted(losses(reference)) == list(range(1, STEPS + 1))


def test_sigterm_to_the_supervisor_alone_leaves_a_checkpoint_and_no_process(tmp_path, shared, leftovers):
    """Kubernetes or `docker stop` stops the container's main process, the supervisor: the trainer gets SIGTERM from
    it, saves and exits, and the supervisor exits 75 after it, before the grace period's SIGKILL."""
    run_dir = tmp_path / "pod"
    sup = supervised(tmp_path, shared, run_dir, "--steps", "100000")  # hours of steps: only a stop ends it
    trainer = descendants(sup.pid)
    for pid in trainer:
        leftovers(pid)
    os.kill(sup.pid, signal.SIGTERM)
    sup.wait(timeout=GRACE_S)
    outlived = [pid for pid in trainer if alive(pid)]
    for pid in outlived:  # the grace period's SIGKILL
        os.kill(pid, signal.SIGKILL)
    err = sup.stderr.read()
    assert not outlived, f"the trainer outlived its supervisor\n{err[-3000:]}"
    assert sup.returncode == 75 and len(checkpoints(run_dir)) == 1, err[-3000:]
    assert "SIGTERM received: passing SIGTERM on" in err and "not relaunching" in err


def test_a_hangup_checkpoints_and_exits_75(tmp_path, shared, leftovers):
    """The terminal or SSH session of a run in its foreground goes away: the kernel sends SIGHUP to the foreground
    process group, the supervisor and the trainer; the trainer saves and exits 75, as on SIGTERM."""
    run_dir = tmp_path / "hangup"
    sup = supervised(tmp_path, shared, run_dir, "--steps", "100000")
    for pid in descendants(sup.pid):
        leftovers(pid)
    os.killpg(sup.pid, signal.SIGHUP)
    _, err = sup.communicate(timeout=GRACE_S)
    assert sup.returncode == 75 and len(checkpoints(run_dir)) == 1, err[-3000:]
    assert f"SIGHUP received: checkpoint {checkpoints(run_dir)[0]} written" in err and "not relaunching" in err


def test_the_trainer_of_a_sigkilled_supervisor_saves_and_exits(tmp_path, shared, leftovers):
    """The supervisor SIGKILLed (the OOM killer, `kill -9`): the kernel sends the trainer SIGTERM (across its
    host-allocator re-exec), so it saves and exits instead of training on as an orphan."""
    run_dir = tmp_path / "orphan"
    sup = supervised(tmp_path, shared, run_dir, "--steps", "100000")
    for pid in descendants(sup.pid):
        leftovers(pid)
    sup.kill()
    _, err = sup.communicate(timeout=GRACE_S)  # the trainer holds the same stderr: it ends when the trainer does
    assert len(checkpoints(run_dir)) == 1, err[-3000:]
    assert f"SIGTERM received: checkpoint {checkpoints(run_dir)[0]} written; exiting to be resumed." in err


# --- the gcloud recipes of docs/multi-host.md and docs/tpu-pod.md, run as `tpu-vm ssh --command` runs them -------

def gcloud_train_commands() -> list[tuple[str, str]]:
    """(page, the command `tpu-vm ssh --worker=all` runs on every worker) of each page's gcloud block that trains."""
    found = []
    for page in ("multi-host.md", "tpu-pod.md"):
        for block in re.findall(r"^```bash\n(.*?)^```", (ROOT / "docs" / page).read_text(), re.S | re.M):
            words = shlex.split(block.replace("\\\n", " "))
            if words[:4] == ["gcloud", "compute", "tpus", "tpu-vm"] and "--command" in words:
                remote = words[words.index("--command") + 1]
                if "train.py" in remote:
                    found.append((page, remote))
    return found


def session_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[3])


@pytest.mark.parametrize("page, remote", gcloud_train_commands(), ids=lambda v: v if v.endswith(".md") else "")
def test_the_gcloud_recipe_keeps_training_when_the_ssh_session_drops(tmp_path, page, remote, leftovers):
    """The page's command run as sshd runs it, in a session of its own on a terminal, with `.venv/bin/python` a
    stand-in that records the signals it gets: the run is detached from that session (the session's hangup, the
    kernel's SIGHUP to its leader and foreground process group, cannot reach it), and a hangup of its own terminal
    (`tmux kill-session`) reaches it as SIGHUP."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    venv = tmp_path / "olmo3eqx" / ".venv" / "bin"
    venv.mkdir(parents=True)
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    (venv / "python").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\n'
                                 f'exec {sys.executable} {tmp_path}/stand_in.py {tmp_path} SIGHUP\n')
    (venv / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    env["TMUX_TMPDIR"] = str(tmp_path)  # a tmux server of this test's own
    master, terminal = os.openpty()

    def login_session():  # sshd: a new session whose controlling terminal is the pty
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    ssh = subprocess.Popen(["bash", "-c", remote], cwd=tmp_path, env=env, stdin=terminal, stdout=terminal,
                           stderr=terminal, start_new_session=True, preexec_fn=login_session)
    os.close(terminal)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pid").is_file():
            assert time.monotonic() < deadline, f"{page}: the command never started the trainer"
            time.sleep(0.05)
        trainer = int((tmp_path / "pid").read_text())
        leftovers(trainer)
        assert "train.py" in (tmp_path / "argv").read_text() and "--until-done" in (tmp_path / "argv").read_text()
        assert session_of(trainer) != ssh.pid, f"{page}: the trainer runs in the SSH session, which a drop hangs up"
        os.close(master)  # the connection drops: the session's terminal hangs up
        master = None
        ssh.wait(timeout=60)
        assert alive(trainer) and not received(tmp_path), f"{page}: the dropped session reached the trainer"
        subprocess.run(["tmux", "kill-session", "-t", "train"], env=env, check=True, timeout=60)
        deadline = time.monotonic() + 60
        while alive(trainer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert received(tmp_path) == ["SIGHUP"] and not alive(trainer)
    finally:
        if master is not None:
            os.close(master)
        if ssh.poll() is None:
            ssh.kill()
        subprocess.run(["tmux", "kill-server"], env=env, capture_output=True, timeout=60)


def test_a_hangup_of_one_process_of_two_stops_both_at_one_step(tmp_path, shared):
    """Two jax.distributed processes, SIGHUP to one (the SSH session of one worker dropped): it becomes the SIGTERM
    JAX's preemption notifier takes, the coordination service picks one step, and both write that checkpoint and
    exit 75."""
    from test_multihost import finish, launch

    cfg = write_config(tmp_path / "run.yaml", CONFIG, shared)
    run_dir = tmp_path / "two"
    procs = launch(cfg, run_dir, 2, "--steps", "100000", "--data.global-batch", "4")
    wait_for(lambda: logged_step(run_dir) >= 2, procs[0])
    procs[1].send_signal(signal.SIGHUP)
    (code0, err0), (code1, err1) = finish(procs, timeout=GRACE_S)
    assert (code0, code1) == (75, 75), err0[-2000:] + err1[-2000:]
    (saved,) = checkpoints(run_dir)
    assert f"SIGTERM received: checkpoint {saved} written" in err0  # process 0 logs, for both


def test_the_trainer_takes_sigterm_and_sighup_any_number_of_times_and_stops_at_once_on_a_second_sigint():
    """A trainer's signals arrive in copies (slurmstepd's beside the supervisor's): SIGTERMs and one Ctrl-C ask for
    one checkpoint; only a second SIGINT (Ctrl-C twice) stops at once; SIGHUP is a preemption as SIGTERM is."""
    from olmo3eqx.train import Preemption

    with Preemption(multiprocess=False) as preemption:
        try:
            for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
                os.kill(os.getpid(), sig)
        except KeyboardInterrupt:
            pytest.fail(f"{signal.Signals(sig).name} after the SIGTERMs stopped the trainer at once")
        assert preemption.check(1) == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    with Preemption(multiprocess=False) as preemption:
        os.kill(os.getpid(), signal.SIGHUP)
        assert preemption.check(1) == "SIGHUP"
