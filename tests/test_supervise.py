"""resume_until_done: relaunch policy, tested on a stand-in command whose exit codes we script."""

import sys

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
