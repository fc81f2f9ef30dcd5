"""Two real processes over jax.distributed (gloo on loopback) in a loop of collectives, as a training loop is: an error
on one of them (a project error or a bug, on the coordinator or not) ends both within seconds with its exit code,
each with one sentence, not by SIGABRT once JAX's heartbeat times out; an error both reach at the same step ends each
with its own sentence (olmo3eqx.peers). The storage outage of a real run: test_remote_run.py."""

import subprocess
import sys

import pytest

from olmo3eqx import exits
from test_multihost import base_env, free_port

LOOP = """
import sys, time
import numpy as np
from olmo3eqx import distributed, exits
from olmo3eqx.config import DistConfig
from olmo3eqx.errors import ConfigError


@exits.command
def main():
    distributed.initialize(DistConfig(heartbeat_timeout=100))
    import jax
    from jax.experimental import multihost_utils

    for step in range(1, 3001):
        print(f"step {step}", flush=True)
        if step == 5 and sys.argv[1] in (str(jax.process_index()), "both"):
            if sys.argv[2] == "bug":
                raise ZeroDivisionError("a bug")
            raise ConfigError(f"bad input on process {jax.process_index()}.")
        multihost_utils.process_allgather(np.int32(step))  # the other waits here for the one that failed
        time.sleep(0.02)


sys.exit(main())
"""
"""Two processes in a loop of collectives; at step 5 process argv[1] (or both) raises: a ConfigError (exit 2) or a
bug (exit 1)."""


def run_both(failing: str, kind: str) -> list[tuple[int, list[str], str]]:
    """(exit code, error lines, stderr) of each process; 60 s at most after they start."""
    port = free_port()
    procs = []
    for i in range(2):
        env = {**base_env(1), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(i)}
        procs.append(subprocess.Popen([sys.executable, "-c", LOOP, failing, kind], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    try:
        errs = [p.communicate(timeout=60)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, [l for l in err.splitlines() if l.startswith("error")], err) for p, err in zip(procs, errs)]


@pytest.mark.parametrize(("failing", "kind"), [(1, "input"), (0, "bug")])  # the coordinator failing, and not
def test_an_error_on_one_process_ends_both_with_its_code(failing, kind):
    results = run_both(str(failing), kind)
    code = exits.BAD_INPUT if kind == "input" else exits.UNEXPECTED
    report = "\n".join(f"--- process {i}: exit {c}\n{err[-3000:]}" for i, (c, _, err) in enumerate(results))
    assert [c for c, _, _ in results] == [code, code], report
    own, other = results[failing][1], results[1 - failing][1]
    if kind == "input":
        assert own == [f"error (process {failing} of 2): bad input on process {failing}."], report
        what = "exit code 2 (bad input)"
    else:
        assert own == [f"error (process {failing} of 2): the exception below stopped this process"], report
        assert "ZeroDivisionError: a bug" in results[failing][2], report
        what = f"exit code 1 (an unexpected error: its traceback is in process {failing}'s log)"
    assert other == [f"error (process {1 - failing} of 2): process {failing} stopped the run with {what}; stopping "
                     f"too."], report
    assert "Traceback" not in results[1 - failing][2] and "Terminating process" not in report, report


@pytest.mark.slow  # ~20 s, two processes: one of .ci/run's shares (.ci/share.py)
def test_an_error_every_process_reaches_ends_each_with_its_own_sentence():
    results = run_both("both", "input")
    report = "\n".join(f"--- process {i}: exit {c}\n{err[-3000:]}" for i, (c, _, err) in enumerate(results))
    assert [c for c, _, _ in results] == [exits.BAD_INPUT] * 2, report
    for i, (_, errors, _) in enumerate(results):
        assert errors == [f"error (process {i} of 2): bad input on process {i}."], report


def test_a_command_of_one_process_ends_as_without_peers_whatever_ending_is_set_to(monkeypatch, capsys):
    """With the stop hook installed but no other process to stop (jax.distributed not running: a single-process
    command in a process whose earlier work installed it), a command ends exactly as it does without it: its error's
    sentence and code, an unexpected error re-raised with its traceback (not turned into exit 1 and printed)."""
    from olmo3eqx import peers
    from olmo3eqx.errors import ConfigError

    monkeypatch.setattr(exits, "ending", peers.leave)
    monkeypatch.setattr(peers, "peers", peers.Peers(0, 2))  # watched once, but no coordination service is up

    @exits.command
    def refused():
        raise ConfigError("bad input here.")

    @exits.command
    def buggy():
        raise ZeroDivisionError("a bug")

    assert refused() == exits.BAD_INPUT
    assert capsys.readouterr().err == "error: bad input here.\n"
    with pytest.raises(ZeroDivisionError):
        buggy()
