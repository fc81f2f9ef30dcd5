"""run_until_done: relaunch policy, tested on a stand-in command whose exit codes we script; stop signals sent as
launchers send them (slurmstepd, Kubernetes, a terminal) to a supervisor process over a stand-in that records them."""

import os
import signal
import subprocess
import sys
import time

import pytest

from olmo3eqx.tools.supervise import run_until_done
from olmo3eqx.train import child_args


def scripted(tmp_path, codes: list[int]) -> list[str]:
    """A command that exits with codes[i] on its i-th launch (then 0), counting launches in a file; a negative code
    -N kills it with signal N."""
    counter = tmp_path / "launches"
    script = (f"import os, pathlib, sys; p = pathlib.Path({str(counter)!r}); "
              f"n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1)); codes = {codes!r}; "
              f"code = codes[n] if n < len(codes) else 0; os.kill(os.getpid(), -code) if code < 0 else sys.exit(code)")
    return [sys.executable, "-c", script]


def launches(tmp_path) -> int:
    return int((tmp_path / "launches").read_text())


def test_crashes_are_relaunched_after_the_backoff(tmp_path):
    sleeps = []
    assert run_until_done(scripted(tmp_path, [1, 137]), backoff_s=7, sleep=sleeps.append) == 0
    assert launches(tmp_path) == 3 and sleeps == [7, 7]


def test_preemption_relaunches_at_once_and_never_counts_toward_the_limit(tmp_path, capsys):
    sleeps = []
    assert run_until_done(scripted(tmp_path, [75] * 5), backoff_s=7, max_restarts=3, sleep=sleeps.append) == 0
    assert launches(tmp_path) == 6 and sleeps == []
    assert "exit code 75 (preempted); relaunching now (preemption 5; preemptions do not count" in \
        capsys.readouterr().err


def test_a_failed_write_is_relaunched_after_the_backoff_not_at_once(tmp_path, capsys):
    sleeps = []
    assert run_until_done(scripted(tmp_path, [74]), backoff_s=7, sleep=sleeps.append) == 0
    assert launches(tmp_path) == 2 and sleeps == [7]
    assert "exit code 74 (storage failure); relaunching in 7 s (failure 1 of at most 20 within 24 h)" in \
        capsys.readouterr().err


def test_unfixable_exits_are_not_retried(tmp_path, capsys):
    for code in (2, 3):
        (tmp_path / "launches").unlink(missing_ok=True)
        assert run_until_done(scripted(tmp_path, [code]), backoff_s=0, sleep=lambda s: None) == code
        assert launches(tmp_path) == 1
    err = capsys.readouterr().err
    assert "exit code 2 (bad input): a relaunch would fail the same way; giving up" in err
    assert "exit code 3 (non-finite loss or gradient norm, past optim.max_nonfinite): a relaunch" in err


def test_failures_are_capped_within_a_sliding_window(tmp_path, capsys):
    """Four failures an hour apart, at most two within 2 h: relaunched every time; three within 2 h: given up."""
    now = [0.0]

    def sleep(s):
        now[0] += s

    assert run_until_done(scripted(tmp_path, [1, 137, -9, 1]), backoff_s=3600, max_restarts=2, window_s=7200,
                          sleep=sleep, clock=lambda: now[0]) == 0
    assert launches(tmp_path) == 5
    err = capsys.readouterr().err
    assert "exit code 1 (an unexpected error: its traceback is above); relaunching in 3600 s (failure 1 of at " \
           "most 2 within 2 h)" in err
    assert "exit code 137 (killed by SIGKILL, as a shell reports it); relaunching in 3600 s (failure 2 of" in err
    assert "killed by SIGKILL (often the out-of-memory killer); relaunching in 3600 s (failure 2 of" in err
    (tmp_path / "launches").unlink()
    assert run_until_done(scripted(tmp_path, [1] * 10), backoff_s=10, max_restarts=2, window_s=7200, sleep=sleep,
                          clock=lambda: now[0]) == 1
    assert launches(tmp_path) == 3
    assert "3 failures within 2 h, more than --max-restarts 2; giving up" in capsys.readouterr().err


def test_child_command_drops_only_the_supervisor_flags():
    argv = ["--config", "c.yaml", "--until-done", "--retry-backoff", "5", "--max-restarts=2", "--steps", "9"]
    assert child_args(argv) == ["--config", "c.yaml", "--steps", "9"]


# --- stop signals, sent as launchers send them, to a real supervisor process over a stand-in command -------------

STAND_IN = """
import os, pathlib, signal, sys, time
here, wanted = pathlib.Path(sys.argv[1]), set(sys.argv[2].split(","))  # exit 75 once each came; none: exit 1
launches = here / "launches"
launches.write_text(str(int(launches.read_text()) + 1 if launches.exists() else 1))
got = []

def handle(signum, frame):  # another signal's handler may run inside this one
    name = signal.Signals(signum).name
    got.append(name)
    with open(here / "signals", "a") as f:
        f.write(name + "\\n")

for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, handle)
(here / "pid.tmp").write_text(str(os.getpid()))
os.replace(here / "pid.tmp", here / "pid")  # whole: the test reads it once it exists
if wanted == {""}:
    sys.exit(1)
while not wanted <= set(got):
    signal.pause()
time.sleep(0.2)  # room for a copy too many to arrive
sys.exit(75)
"""
"""A trainer's signal behaviour without JAX: records every stop signal it gets, exits 75 (preempted) once it got each
of the `wanted` ones (never, if one does not come: it then must be killed); with none wanted, exits 1 at once."""

SUPERVISOR = ("import sys; from olmo3eqx.tools.supervise import run_until_done; "
              "sys.exit(run_until_done(sys.argv[2:], backoff_s=float(sys.argv[1]), stop_timeout_s=30))")


def supervised(tmp_path, wanted: str, backoff_s: float = 0, stop_timeout_s: float = 30,
               pid_1: bool = False) -> subprocess.Popen:
    """The supervisor over the stand-in, in a session of its own (a terminal's or a step's process group), once the
    stand-in is ready for signals; `pid_1`: as a container's main process, PID 1 of its own PID namespace (the
    returned process is then `unshare`, the supervisor its child)."""
    (tmp_path / "pid").unlink(missing_ok=True)
    cmd = [sys.executable, "-c", SUPERVISOR.replace("30", str(stop_timeout_s)), str(backoff_s), sys.executable, "-c",
           STAND_IN, str(tmp_path), wanted]
    if pid_1:
        cmd = ["unshare", "--pid", "--fork", "--kill-child", *cmd]
    sup = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").is_file():
        assert sup.poll() is None and time.monotonic() < deadline, "the stand-in never started"
        time.sleep(0.01)
    return sup


def stand_in_pid(tmp_path) -> int:
    return int((tmp_path / "pid").read_text())


def received(tmp_path) -> list[str]:
    path = tmp_path / "signals"
    return sorted(path.read_text().split()) if path.is_file() else []


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def leftovers():
    """Kills (after the test) the stand-ins a test names: an unfixed supervisor leaves them running."""
    pids = []
    yield pids.append
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    kids = [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()] if alive(pid) else []
    return kids + [d for k in kids for d in descendants(k)]


def pid_namespaces() -> bool:
    """Whether this host lets a test start a process as PID 1 of a PID namespace of its own, as a container runs."""
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=60).returncode == 0
    except FileNotFoundError:
        return False


LAUNCHERS = {  # who gets which signal, and what the stand-in then receives (the supervisor passes on SIGTERM; two
    # SIGTERMs pending at once are one, as the kernel queues no copies of a standard signal)
    "kubernetes/docker: SIGTERM to the container's main process": ("supervisor", signal.SIGTERM, {"SIGTERM"}),
    "docker stop: SIGTERM to PID 1 of the container's PID namespace": ("pid 1", signal.SIGTERM, {"SIGTERM"}),
    "slurmstepd: SIGTERM to every process of the step": ("every process", signal.SIGTERM, {"SIGTERM"}),
    "a terminal's Ctrl-C: SIGINT to the foreground process group": ("group", signal.SIGINT, {"SIGINT", "SIGTERM"}),
    "a hung-up terminal: SIGHUP to the foreground process group": ("group", signal.SIGHUP, {"SIGHUP", "SIGTERM"}),
}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_stop_signal_reaches_the_command_once_as_sigterm_and_nothing_is_relaunched(tmp_path, leftovers, launcher):
    """The stand-in gets the signal sent to it plus one SIGTERM from the supervisor (never a second SIGINT, which a
    trainer reads as "stop at once"), exits 75 after its checkpoint, and the supervisor exits 75 without relaunching."""
    who, sig, expected = LAUNCHERS[launcher]
    if who == "pid 1" and not pid_namespaces():
        pytest.skip("unshare --pid is not permitted here")
    sup = supervised(tmp_path, wanted=",".join(sorted(expected)), pid_1=who == "pid 1")
    leftovers(sup.pid if who == "pid 1" else stand_in_pid(tmp_path))  # unshare --kill-child: the namespace with it
    if who == "supervisor":
        os.kill(sup.pid, sig)
    elif who == "pid 1":  # from outside the namespace, as the container runtime sends it
        os.kill(descendants(sup.pid)[0], sig)
    elif who == "group":
        os.killpg(sup.pid, sig)
    else:
        for pid in [sup.pid, *descendants(sup.pid)]:
            os.kill(pid, sig)
    _, err = sup.communicate(timeout=60)
    assert sup.returncode == 75, err
    got = received(tmp_path)
    assert set(got) == expected and got.count("SIGINT") <= 1 and launches(tmp_path) == 1, (got, err)
    assert f"{signal.Signals(sig).name} received: passing SIGTERM on" in err
    assert f"exit code 75 (preempted) after {signal.Signals(sig).name}; not relaunching" in err


def test_a_command_that_does_not_stop_is_killed_after_the_stop_timeout(tmp_path, leftovers):
    sup = supervised(tmp_path, wanted="SIGKILL", stop_timeout_s=1)
    leftovers(stand_in_pid(tmp_path))
    os.kill(sup.pid, signal.SIGTERM)
    _, err = sup.communicate(timeout=60)
    assert sup.returncode == 128 + signal.SIGKILL, err
    assert "the command did not stop within --stop-timeout 1 s of SIGTERM; killing it" in err
    assert not alive(stand_in_pid(tmp_path)) and launches(tmp_path) == 1


def test_the_command_of_a_sigkilled_supervisor_gets_sigterm(tmp_path, leftovers):
    """The supervisor SIGKILLed (the OOM killer, `kill -9`): the kernel sends the command SIGTERM, so it saves and
    exits instead of training on as an orphan."""
    sup = supervised(tmp_path, wanted="SIGTERM")
    pid = stand_in_pid(tmp_path)
    leftovers(pid)
    sup.kill()
    sup.communicate(timeout=60)  # the stand-in holds the same stderr: its end is the stand-in's end too
    deadline = time.monotonic() + 60
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert received(tmp_path) == ["SIGTERM"] and not alive(pid)


def test_a_stop_signal_in_the_backoff_ends_it_without_a_relaunch(tmp_path):
    sup = supervised(tmp_path, wanted="", backoff_s=3600)
    for line in sup.stderr:
        if "relaunching in 3600 s" in line:
            break
    os.kill(sup.pid, signal.SIGTERM)
    _, err = sup.communicate(timeout=60)
    assert sup.returncode == 1 and launches(tmp_path) == 1, err
    assert "SIGTERM received; not relaunching" in err
