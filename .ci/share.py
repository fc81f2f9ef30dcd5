#!/usr/bin/env python3
"""This landing's share of the tests the default suite leaves out (`-m slow`, `-m tpu`): every such test falls in one
of K shares by a hash of its pytest node id, and landing number n runs share n mod K, so every slow and tpu test runs
once in every K landings. The landing number is `.ci/landing`'s integer, which each landing raises by one in its last
commit (docs/design.md#the-test-suite).

    python .ci/share.py                  # run this checkout's share (what .ci/run does)
    python .ci/share.py --list           # print it: the landing, the share, its node ids
    python .ci/share.py --range A..B     # for each commit of a git range: its landing, its share; then every slow
                                         # and tpu test of this checkout that no commit of the range ran

Shares are drawn from this checkout's tests; --range reads each commit's `.ci/landing` (the tests themselves as this
checkout has them). Standard library only; pytest runs in a subprocess.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARES = 16
"""K: the tpu set alone took 1,528 s of CPU (docs/tpu-gpu.md#where-the-tpu-tests-run), the slow set (7B GPU compiles,
the reference harness, multi-process runs) more; a sixteenth of both is what fits beside the rest of .ci/run."""
LEFT_OUT = "(slow or tpu) and not tpu_small"
"""The tests the default suite deselects (pyproject's addopts), less the tpu_small set that .ci/run runs in full."""
ALWAYS = ("tests/test_readme_run.py::test_the_default_run_prints_the_readme_s_losses",)
"""Slow tests .ci/run runs at every landing, outside the shares."""
LANDING = ROOT / ".ci" / "landing"


def share_of(nodeid: str) -> int:
    """The share a test falls in: a hash of its node id (stable across machines and Python runs, unlike hash())."""
    return int.from_bytes(hashlib.sha256(nodeid.encode()).digest()[:8], "big") % SHARES


def left_out_tests() -> list[str]:
    """The node ids of this checkout's slow and tpu tests, as pytest collects them."""
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", LEFT_OUT], cwd=ROOT,
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"pytest could not collect the {LEFT_OUT} tests (exit {p.returncode}):\n"
                 f"{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return [line for line in p.stdout.splitlines()
            if "::" in line and not line.startswith(" ") and line not in ALWAYS]


def landing(commit: str | None = None) -> int:
    """The landing number in `.ci/landing` of `commit` (None: this checkout's file)."""
    if commit is None:
        text = LANDING.read_text()
    else:
        p = subprocess.run(["git", "show", f"{commit}:.ci/landing"], cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            return -1  # before landings were counted
        text = p.stdout
    return int(text.split()[0])


def chosen(tests: list[str], number: int) -> list[str]:
    return [t for t in tests if share_of(t) == number % SHARES]


def commits(span: str) -> list[str]:
    p = subprocess.run(["git", "rev-list", "--reverse", span], cwd=ROOT, capture_output=True, text=True, check=True)
    return p.stdout.split()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print this checkout's share instead of running it")
    parser.add_argument("--range", metavar="A..B", help="which share each commit of a git range ran, and what none ran")
    args = parser.parse_args()
    tests = left_out_tests()
    if args.range:
        ran: set[str] = set()
        for commit in commits(args.range):
            number = landing(commit)
            share = chosen(tests, number) if number >= 0 else []
            ran.update(share)
            label = f"landing {number}, share {number % SHARES}" if number >= 0 else "no .ci/landing"
            print(f"{commit[:10]}  {label}: {len(share)} tests")
        missed = sorted(set(tests) - ran)
        print(f"{len(tests) - len(missed)} of {len(tests)} slow and tpu tests ran in this range; "
              f"{len(missed)} did not" + (":" if missed else ""))
        print("\n".join(f"  {t}" for t in missed))
        return 0
    number = landing()
    share = chosen(tests, number)
    print(f"landing {number}: share {number % SHARES} of {SHARES}, {len(share)} of {len(tests)} slow and tpu tests",
          flush=True)
    if args.list:
        print("\n".join(share))
        return 0
    if not share:
        return 0
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", LEFT_OUT, "--durations=20", *share],
                          cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
