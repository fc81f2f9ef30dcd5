"""The default suite's budget: the README states how many tests the README's command runs and how long they take on
a quiet 2-core host, and this test fails when the suite grows without the README's count (a new test is then a
choice: the default suite, with its time, or `-m slow`, run in .ci/run's rotating shares)."""

import re
import subprocess
import sys
from pathlib import Path

from conftest import DEFAULT_SUITE

ROOT = Path(__file__).resolve().parents[1]
COUNT = re.compile(r"`(\d+) passed, (\d+) skipped, (\d+) deselected in \.\.\.` \(about (\d+) minutes on a quiet 2-core "
                   r"host")


def readme_count() -> tuple[int, int, int, int]:
    found = COUNT.search((ROOT / "README.md").read_text())
    assert found, "README.md states the default suite's count as `N passed, S skipped, D deselected in ...` (about M " \
                  "minutes on a quiet 2-core host"
    return tuple(int(g) for g in found.groups())


def collected() -> tuple[int, int]:
    """Selected and deselected tests of the default suite: from this run when it is the whole default suite, else
    collected anew."""
    if "selected" in DEFAULT_SUITE:
        return DEFAULT_SUITE["selected"], DEFAULT_SUITE.get("deselected", 0)
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    found = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", p.stdout)
    assert found, p.stdout[-2000:] + p.stderr[-2000:]
    return int(found.group(1)), int(found.group(3))


def test_the_readme_counts_the_default_suite():
    passed, skipped, deselected, _ = readme_count()
    selected, left_out = collected()
    assert passed + skipped == selected, (
        f"the default suite has {selected} tests, the README says {passed} passed + {skipped} skipped: a test was "
        f"added or removed; update the README's count and time (or mark the new test slow)")
    assert deselected == left_out, f"{left_out} tests are deselected, the README says {deselected}"
