"""run_until_done: relaunch a training command after a crash or preemption until it finishes.

The run resumes from its newest checkpoint on every launch, so the supervisor only decides *whether* and *when*
to launch again: at once after a preemption (exit 75), after `backoff_s` after a crash or a failed write to the run
directory (exit 74: a full disk is not freed in a moment, and a relaunch stops before training while it stays full),
never after an exit that a relaunch cannot fix (bad input, exit 2, which includes another trainer holding the run;
a non-finite loss, exit 3), and at most `max_restarts` times.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from olmo3eqx import exits

FINAL = {exits.BAD_INPUT: "bad input", exits.NONFINITE: "non-finite loss"}
"""Exits a relaunch cannot fix."""
DELAYED = {exits.STORAGE: "a write to the run directory failed"}
"""Exits worth a relaunch after the backoff, not at once (named in the log line)."""


def log(message: str) -> None:
    print(f"[until-done {time.strftime('%Y-%m-%d %H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_until_done(command: Sequence[str], *, backoff_s: float | int = 300.0, max_restarts: int = 20,
                   sleep: Callable[[float], None] = time.sleep) -> int:
    """Run `command` until it exits 0; return the last exit code."""
    restarts = 0
    while True:
        log(f"launch {restarts + 1}: {' '.join(command)}")
        try:
            code = subprocess.call(list(command))
        except KeyboardInterrupt:
            log("interrupted; not relaunching")
            return 130
        if code == exits.OK:
            log("run finished")
            return code
        if code in FINAL:
            log(f"exit code {code} ({FINAL[code]}): a relaunch would fail the same way; giving up")
            return code
        if restarts >= max_restarts:
            log(f"exit code {code}; {max_restarts} restarts used up; giving up")
            return code
        restarts += 1
        if code == exits.PREEMPTED:
            log(f"preempted (exit {code}); relaunching now (restart {restarts}/{max_restarts})")
        else:
            why = DELAYED.get(code, "crashed")
            log(f"{why} (exit code {code}); relaunching in {backoff_s:g} s (restart {restarts}/{max_restarts})")
            sleep(backoff_s)
