"""resume_until_done: relaunch policy, tested on a stand-in command whose exit codes we script."""

import sys

from olmo3eqx.tools.supervise import run_until_done
from olmo3eqx.train import child_args


def scripted(tmp_path, codes: list[int]) -> list[str]:
    """A command that exits with codes[i] on its i-th launch (then 0), counting launches in a file."""
    counter = tmp_path / "launches"
    script = (f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() else 0; "
              f"p.write_text(str(n + 1)); codes = {codes!r}; sys.exit(codes[n] if n < len(codes) else 0)")
    return [sys.executable, "-c", script]


def launches(tmp_path) -> int:
    return int((tmp_path / "launches").read_text())


def test_crashes_are_relaunched_after_the_backoff(tmp_path):
    sleeps = []
    assert run_until_done(scripted(tmp_path, [1, 137]), backoff_s=7, sleep=sleeps.append) == 0
    assert launches(tmp_path) == 3 and sleeps == [7, 7]


def test_preemption_relaunches_at_once(tmp_path):
    sleeps = []
    assert run_until_done(scripted(tmp_path, [75, 75]), backoff_s=7, sleep=sleeps.append) == 0
    assert launches(tmp_path) == 3 and sleeps == []


def test_a_failed_write_is_relaunched_after_the_backoff_not_at_once(tmp_path, capsys):
    sleeps = []
    assert run_until_done(scripted(tmp_path, [74]), backoff_s=7, sleep=sleeps.append) == 0
    assert launches(tmp_path) == 2 and sleeps == [7]
    assert "a write to the run directory failed (exit code 74); relaunching in 7 s" in capsys.readouterr().err


def test_unfixable_exits_are_not_retried(tmp_path):
    for code in (2, 3):
        (tmp_path / "launches").unlink(missing_ok=True)
        assert run_until_done(scripted(tmp_path, [code]), backoff_s=0, sleep=lambda s: None) == code
        assert launches(tmp_path) == 1


def test_restarts_are_capped(tmp_path):
    assert run_until_done(scripted(tmp_path, [1] * 10), backoff_s=0, max_restarts=3, sleep=lambda s: None) == 1
    assert launches(tmp_path) == 4


def test_child_command_drops_only_the_supervisor_flags():
    argv = ["--config", "c.yaml", "--until-done", "--retry-backoff", "5", "--max-restarts=2", "--steps", "9"]
    assert child_args(argv) == ["--config", "c.yaml", "--steps", "9"]
