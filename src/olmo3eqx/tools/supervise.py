"""run_until_done: relaunch a training command after a crash or preemption until it finishes.

The run resumes from its newest checkpoint on every launch, so the supervisor only decides *whether* and *when*
to launch again, and logs why:
- at once after a preemption (exit 75); preemptions never count toward the limit (preemptible capacity may preempt a
  months-long run thousands of times);
- after `backoff_s` after a crash or a storage failure (exit 74: a full disk or a store that is away is not back in a
  moment, and a relaunch stops before training while it stays so); these count toward `max_restarts`, over a sliding
  window of RESTART_WINDOW_S (24 h): the supervisor gives up when more than `max_restarts` of them fall within one
  window (a crash loop: with the default 300 s backoff, 21 failures take about two hours), while a run that fails now
  and then over months is relaunched every time;
- never after an exit that a relaunch cannot fix: bad input (exit 2, which includes another trainer holding the run)
  and a non-finite loss (exit 3: the trainer already skipped optim.max_nonfinite non-finite steps in a row; resuming
  is bit-identical, so a relaunch would replay the same batches on the same weights and fail the same way).

A stop signal the supervisor receives (SIGTERM, SIGINT, SIGHUP: a scheduler, `docker stop`, Ctrl-C, a dropped SSH
session) is the run's, not the command's: it is passed on as SIGTERM, the supervisor waits up to `stop_timeout_s` for
the command's preemption checkpoint (then SIGKILLs it), exits with the command's code and relaunches nothing. If the
supervisor itself is SIGKILLed, the kernel sends the command SIGTERM (Linux's PR_SET_PDEATHSIG), so it saves and
exits instead of training on as an orphan nobody relaunches.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from olmo3eqx import exits
from olmo3eqx.errors import ConfigError

RESTART_WINDOW_S = 24 * 3600.0
"""Failures (not preemptions) count toward --max-restarts within this sliding window."""
STOP_TIMEOUT_S = 600.0
"""How long the supervisor waits for the command's preemption checkpoint after a stop signal before it SIGKILLs it
(--stop-timeout). A launcher's own SIGKILL (SLURM's KillWait, Kubernetes' terminationGracePeriodSeconds) comes first
when it is shorter; this bounds a stop nobody else enforces (a `kill` by hand, `docker stop -t` with a long grace)."""
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
"""What launchers, terminals and SSH stop a run with; each is passed on to the command as SIGTERM."""
PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h): the signal the kernel sends this process when its parent dies."""
FINAL = {code: exits.WHAT[code] for code in (exits.BAD_INPUT, exits.NONFINITE)}
"""Exits a relaunch cannot fix."""
MEANING = {**exits.WHAT, exits.UNEXPECTED: f"{exits.WHAT[exits.UNEXPECTED]}: its traceback is above"}
"""What each exit code says, for the log line of each relaunch."""


def log(message: str) -> None:
    print(f"[until-done {time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def meaning(code: int) -> str:
    """'exit code C (what it means)'; a negative code is the signal that ended the command."""
    if code < 0:
        return f"killed by {signal_name(-code)}" + (" (often the out-of-memory killer)" if -code == signal.SIGKILL
                                                     else "")
    what = MEANING.get(code)
    if what is None and 128 < code < 128 + signal.NSIG:
        what = f"killed by {signal_name(code - 128)}, as a shell reports it"
    return f"exit code {code} ({what or 'a crash'})"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_status(code: int) -> int:
    """The supervisor's own exit status for the command's exit code: a command killed by signal N is 128 + N, as a
    shell reports it (sys.exit of a negative number would wrap around)."""
    return 128 - code if code < 0 else code


@contextlib.contextmanager
def held_signals():
    """Block the stop signals and SIGCHLD while the supervisor runs, and yield the mask to give back to the command.

    The supervisor takes them one at a time with sigtimedwait where it is ready for them (waiting on the command, in
    the backoff): no handler runs in the middle of a launch or a log line, and a command's exit (SIGCHLD) wakes the
    same wait, so nothing polls. One that arrives after the last wait is taken here too: the supervisor is exiting,
    which is what it asks for."""
    if not hasattr(signal, "sigtimedwait"):
        raise ConfigError("The supervisor (--until-done) needs Linux: it waits for signals with sigtimedwait and "
                          "has the kernel stop the trainer when the supervisor dies; run train.py without it here.")
    held = STOP_SIGNALS | {signal.SIGCHLD}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield before
    finally:
        while signal.sigtimedwait(held, 0) is not None:
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def wait_for_stop(seconds: float | int) -> int | None:
    """Wait up to `seconds` for a stop signal; the signal, or None when none came."""
    info = signal.sigtimedwait(STOP_SIGNALS, max(0.0, seconds))
    return None if info is None else info.si_signo


def start(command: Sequence[str], mask) -> subprocess.Popen:
    """Launch `command` with the signal mask the supervisor had, dying with the supervisor.

    The command stays in the supervisor's process group (a terminal's Ctrl-C and Ctrl-Z reach both, the progress bar
    keeps the terminal's size): a signal a terminal or SLURM's slurmstepd (which signals every process of the step)
    sends the command directly arrives beside the one passed on, so the supervisor passes every stop signal on as
    SIGTERM, which the trainer takes any number of times, never a second SIGINT, which it reads as "stop at once"."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
    return subprocess.Popen(list(command), preexec_fn=functools.partial(in_child, mask, prctl, os.getpid()))


def in_child(mask, prctl, parent: int) -> None:
    """Between fork and exec: the supervisor's signal mask back, and SIGTERM from the kernel when the supervisor
    dies (PR_SET_PDEATHSIG, kept across exec): the trainer then saves and exits 75 instead of training on as an
    orphan that nothing relaunches (a supervisor SIGKILLed by the OOM killer or by hand)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before the prctl
            os.kill(os.getpid(), signal.SIGTERM)


def wait_for_command(child: subprocess.Popen, stop_timeout_s: float | int) -> tuple[int, int | None]:
    """(the command's exit code, the stop signal the supervisor received while it ran, or None): a stop signal is
    passed on as SIGTERM, and a command still running `stop_timeout_s` after the first is SIGKILLed."""
    held = STOP_SIGNALS | {signal.SIGCHLD}
    received = deadline = None
    while (code := child.poll()) is None:
        info = (signal.sigwaitinfo(held) if deadline is None else
                signal.sigtimedwait(held, max(0.0, deadline - time.monotonic())))
        if info is None:
            log(f"the command did not stop within --stop-timeout {stop_timeout_s:g} s of {signal_name(received)}; "
                f"killing it")
            child.kill()
            deadline = None
        elif info.si_signo in STOP_SIGNALS:
            child.send_signal(signal.SIGTERM)
            if received is None:
                received, deadline = info.si_signo, time.monotonic() + stop_timeout_s
                log(f"{signal_name(received)} received: passing SIGTERM on and waiting up to {stop_timeout_s:g} s "
                    f"for the command's checkpoint")
    return code, received


def run_until_done(command: Sequence[str], *, backoff_s: float | int = 300.0, max_restarts: int = 20,
                   stop_timeout_s: float | int = STOP_TIMEOUT_S, window_s: float | int = RESTART_WINDOW_S,
                   sleep: Callable[[float | int], int | None] = wait_for_stop,
                   clock: Callable[[], float] = time.monotonic) -> int:
    """Run `command` until it exits 0 or a stop signal arrives; return the exit status (the last exit code, 128 + N
    for a command killed by signal N). `sleep` waits out the backoff and returns a stop signal that ended it early."""
    failures: collections.deque[float] = collections.deque()  # when each counted failure happened
    launch = preemptions = 0
    code = None
    with held_signals() as mask:
        while (stop := wait_for_stop(0)) is None:  # none came between launches
            launch += 1
            log(f"launch {launch}: {' '.join(command)}")
            code, stop = wait_for_command(start(command, mask), stop_timeout_s)
            why = meaning(code)
            if stop is not None:
                log(f"{why} after {signal_name(stop)}; not relaunching")
                return exit_status(code)
            if code == exits.OK:
                log("run finished")
                return code
            if code in FINAL:
                log(f"{why}: a relaunch would fail the same way; giving up")
                return code
            if code == exits.PREEMPTED:
                preemptions += 1
                log(f"{why}; relaunching now (preemption {preemptions}; preemptions do not count toward "
                    f"--max-restarts)")
                continue
            now = clock()
            failures.append(now)
            while failures and failures[0] <= now - window_s:
                failures.popleft()
            hours = f"{window_s / 3600:g} h"
            if len(failures) > max_restarts:
                log(f"{why}; {len(failures)} failures within {hours}, more than --max-restarts {max_restarts}; "
                    f"giving up")
                return exit_status(code)
            log(f"{why}; relaunching in {backoff_s:g} s (failure {len(failures)} of at most {max_restarts} within "
                f"{hours})")
            if (stop := sleep(backoff_s)) is not None:
                break
    log(f"{signal_name(stop)} received; not relaunching")
    return 128 + stop if code is None else exit_status(code)
