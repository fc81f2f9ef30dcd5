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
"""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from olmo3eqx import exits

RESTART_WINDOW_S = 24 * 3600.0
"""Failures (not preemptions) count toward --max-restarts within this sliding window."""
FINAL = {exits.BAD_INPUT: "bad input", exits.NONFINITE: "non-finite loss or gradient norm, past optim.max_nonfinite"}
"""Exits a relaunch cannot fix."""
MEANING = {exits.PARITY_FAILED: "an unexpected error: its traceback is above", exits.STORAGE: "storage failure",
           exits.PREEMPTED: "preempted"}
"""What the other exit codes say, for the log line of each relaunch."""


def log(message: str) -> None:
    print(f"[until-done {time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def meaning(code: int) -> str:
    """'exit code C (what it means)'; a negative code is the signal that ended the command."""
    if code < 0:
        return f"killed by {signal_name(-code)}" + (" (often the out-of-memory killer)" if -code == signal.SIGKILL
                                                     else "")
    what = FINAL.get(code) or MEANING.get(code)
    if what is None and 128 < code < 128 + signal.NSIG:
        what = f"killed by {signal_name(code - 128)}, as a shell reports it"
    return f"exit code {code} ({what or 'a crash'})"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_until_done(command: Sequence[str], *, backoff_s: float | int = 300.0, max_restarts: int = 20,
                   window_s: float | int = RESTART_WINDOW_S, sleep: Callable[[float], None] = time.sleep,
                   clock: Callable[[], float] = time.monotonic) -> int:
    """Run `command` until it exits 0; return the last exit code."""
    failures: collections.deque[float] = collections.deque()  # when each counted failure happened
    launch = preemptions = 0
    while True:
        launch += 1
        log(f"launch {launch}: {' '.join(command)}")
        try:
            code = subprocess.call(list(command))
        except KeyboardInterrupt:
            log("interrupted; not relaunching")
            return 130
        if code == exits.OK:
            log("run finished")
            return code
        why = meaning(code)
        if code in FINAL:
            log(f"{why}: a relaunch would fail the same way; giving up")
            return code
        if code == exits.PREEMPTED:
            preemptions += 1
            log(f"{why}; relaunching now (preemption {preemptions}; preemptions do not count toward --max-restarts)")
            continue
        now = clock()
        failures.append(now)
        while failures and failures[0] <= now - window_s:
            failures.popleft()
        hours = f"{window_s / 3600:g} h"
        if len(failures) > max_restarts:
            log(f"{why}; {len(failures)} failures within {hours}, more than --max-restarts {max_restarts}; giving up")
            return code
        log(f"{why}; relaunching in {backoff_s:g} s (failure {len(failures)} of at most {max_restarts} within "
            f"{hours})")
        sleep(backoff_s)
