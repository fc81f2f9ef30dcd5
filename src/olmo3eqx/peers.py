"""With several processes, one that stops on an error stops every other, within seconds and with its exit code.

A process that ends alone (its own write to a store that went away, a bug) leaves the others waiting for it in a
collective, and JAX's shutdown at its own exit waits for them (CoordinationServiceAgent::Shutdown) until the
heartbeat timeout ends every process by SIGABRT, minutes later, which `--until-done` counts as crashes. Instead:

- the failing process claims the stop in JAX's coordination key-value store (`STOP_KEY`: "process code"; the first
  claim wins) as soon as its error starts to unwind (`leaving`), before its cleanup, so the others stop even when the
  cleanup waits on them;
- every process runs a watcher thread (`watch`, started by olmo3eqx.distributed once `jax.distributed` is up) that
  polls the key; on another process's claim it prints one sentence and exits with that code. A process whose own error
  is unwinding meanwhile (a stop every process reaches at the same step: the lease's, a refused lock) is left to end
  with its own sentence; one that is merely slower to reach it gets GRACE_S;
- a process that stops this way exits with os._exit, not through JAX's shutdown (which waits for every process and
  would wait for the ones already gone). The key-value store lives in process 0, and a process whose coordinator goes
  away aborts (the agent's error polling): so each process says it is leaving (`LEFT_KEY`) as its last word, and
  process 0, like the process that claimed the stop, exits only once every other one has (at most ACK_S).

A run that ends cleanly (finished, or preempted at the step every process agreed on) claims nothing: it goes through
JAX's shutdown as before, the watcher returning once jax.distributed is shut down. Only the standard library is
imported here; JAX's client is reached through the running `jax.distributed`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import NoReturn

STOP_KEY = "olmo3eqx/peers/stop"
LEFT_KEY = "olmo3eqx/peers/left/"
POLL_S = 1.0
"""How often the watcher reads STOP_KEY (one small request to process 0 per process)."""
GRACE_S = 5.0
"""How long a watcher that sees another process's stop leaves this process to reach an error of its own (a stop
every process reaches at the same step, or the same outage failing this process's own writes a little later) before
it stops it with the other's code."""
CLEANUP_S = 20.0
"""How long a failing process's cleanup (the last flushes, the checkpointer's last write) may take before its watcher
ends it with its error's sentence and code: with the others gone, a cleanup can wait on them for good."""
ACK_S = CLEANUP_S + 10.0
"""How long process 0 and the process that claimed the stop wait for every other process to leave (longer than a
cleanup may take)."""


class Peers:
    """This process's part in a stop: its index, the process count, and what it is doing about a stop."""

    def __init__(self, process: int, count: int):
        self.process, self.count = process, count
        self.lock = threading.Lock()
        self.ending = False
        """True once a thread has started to end the process (any other then leaves it to that one)."""
        self.failing: tuple[int, str] | None = None
        """(exit code, what to print) of this process's own error once it unwinds (`leaving`)."""
        self.failing_since = 0.0

    @staticmethod
    def client():
        """JAX's key-value store client; None once jax.distributed is shut down (a clean exit)."""
        from jax._src.distributed import global_state

        return global_state.client

    def claim(self, code: int) -> int:
        """Claim the stop for this process with `code` unless another process did first: the claimer."""
        try:
            self.client().key_value_set(STOP_KEY, f"{self.process} {code}")
        except Exception:  # noqa: BLE001 - ALREADY_EXISTS: another process claimed it first
            claimed = self.claimed()
            return claimed[0] if claimed is not None else self.process
        return self.process

    def claimed(self) -> tuple[int, int] | None:
        """(process, exit code) of the stop claimed so far; None when none is (or the store cannot say)."""
        client = self.client()
        if client is None:
            return None
        try:
            process, code = client.key_value_try_get(STOP_KEY).split()
        except Exception:  # noqa: BLE001 - NOT_FOUND: nobody stopped the run
            return None
        return int(process), int(code)

    def others_left(self) -> int:
        """How many other processes have said they are leaving."""
        try:
            return len([k for k, _ in self.client().key_value_dir_get(LEFT_KEY) if k != f"{LEFT_KEY}{self.process}"])
        except Exception:  # noqa: BLE001 - the store went away with process 0: nobody is left to wait for
            return self.count - 1

    def say_left(self, code: int) -> None:
        try:
            self.client().key_value_set(f"{LEFT_KEY}{self.process}", str(code))
        except Exception:  # noqa: BLE001 - the store went away with process 0: nobody waits for this one
            pass

    def end(self, code: int, follow: bool = False) -> NoReturn:
        """Exit with `code` without JAX's shutdown, after claiming the stop (unless `follow`ing another's), saying
        so, and waiting for the others to leave where this process must outlive them (process 0 holds the store;
        the claimer's exit would break the collectives of those still reading its claim)."""
        claimer = None if follow else self.claim(code)
        if self.process == 0:
            self.say_left(code)
        if self.process == 0 or claimer == self.process:
            deadline = time.monotonic() + ACK_S
            while self.others_left() < self.count - 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.process != 0:
            self.say_left(code)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def take_ending(self) -> bool:
        """Whether the calling thread may end the process (no other thread has started to)."""
        with self.lock:
            taken, self.ending = self.ending, True
        return not taken

    def watch(self) -> None:
        """The watcher thread: until jax.distributed shuts down, end this process when another process claims a stop
        (after GRACE_S, unless this one's own error starts to unwind meanwhile), or when this one's own cleanup runs
        past CLEANUP_S."""
        seen_at = None
        while self.client() is not None:
            time.sleep(POLL_S)
            if self.failing is not None:
                if time.monotonic() - self.failing_since > CLEANUP_S and self.take_ending():
                    print(self.failing[1], file=sys.stderr, flush=True)
                    self.end(self.failing[0])
                continue
            claimed = self.claimed()
            if claimed is None or claimed[0] == self.process:
                continue
            seen_at = seen_at or time.monotonic()
            if time.monotonic() - seen_at >= GRACE_S and self.take_ending():
                print(stopped_by(*claimed), file=sys.stderr, flush=True)
                self.end(claimed[1], follow=True)


def stopped_by(process: int, code: int) -> str:
    """The sentence of a process that stops because process `process` stopped the run with `code`."""
    from olmo3eqx import exits

    what = exits.WHAT.get(code, "a crash")
    if code == exits.UNEXPECTED:
        what += f": its traceback is in process {process}'s log"
    return (f"error{exits.process_tag()}: process {process} stopped the run with exit code {code} ({what}); "
            f"stopping too.")


peers: Peers | None = None
"""This process's Peers once `watch` ran (several processes); None otherwise."""


def watch(process: int, count: int) -> None:
    """Start the watcher thread of process `process` of `count` (once jax.distributed is initialised), and end
    every command's error through `leave` (exits.ending)."""
    from olmo3eqx import exits

    global peers
    peers = Peers(process, count)
    exits.ending = leave
    threading.Thread(target=peers.watch, name="olmo3eqx-peers", daemon=True).start()


def watching() -> bool:
    """Whether this process is one of several that stop together (jax.distributed up, `watch` started)."""
    return peers is not None and peers.client() is not None


def leaving(error: Exception) -> None:
    """This process's own `error` has started to unwind (train.py calls it before its cleanup): claim the stop now, so
    the others stop while this one cleans up; if the cleanup runs past CLEANUP_S, the watcher prints what
    exits.command would and ends the process with the error's code. A no-op unless `watching`."""
    from olmo3eqx import exits

    if not watching():
        return
    peers.failing, peers.failing_since = exits.outcome(error), time.monotonic()
    peers.claim(peers.failing[0])


def leave(code: int, text: str) -> None:
    """End this process with the `code` of the error it stopped on, printing `text` (exits.outcome's) on stderr:
    when `watching`, through the stop (never returns), and silently when the watcher is already ending the process
    (the main thread's error is then the echo of the stop, e.g. a collective broken by a peer that left); else
    return, and exits.command ends the command as it does with one process (an unexpected error re-raised)."""
    if not watching():
        return
    if not peers.take_ending():
        threading.Event().wait()  # the watcher is ending the process
    print(text, file=sys.stderr, flush=True)
    peers.end(code)
