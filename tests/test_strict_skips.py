"""conftest.py's strict skips (.ci/run): with OLMO3EQX_STRICT_SKIPS=1 a skip whose reason is not allowed fails the run,
seen by running pytest on a real test file with a package it needs made unimportable; an allowed reason does not."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ALLOWED_SKIPS, STRICT_SKIPS

TESTS = Path(__file__).resolve().parent


def pytest_run(args: list[str], cwd: Path, *, strict: bool, path: list[Path] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != STRICT_SKIPS}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), env.get("PYTHONPATH", "")])
    if strict:
        env[STRICT_SKIPS] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_missing_emulator_fails_the_strict_run_only(tmp_path):
    """moto removed (a module first on the path that raises what an absent one does): test_storage.py's bucket tests
    skip and a local one passes; exit 0 for the README's command, 1 for CI's, which names the skip."""
    (tmp_path / "moto.py").write_text("raise ModuleNotFoundError(\"No module named 'moto'\", name='moto')\n")
    args = [str(TESTS / "test_storage.py"), "-k", "redact or bucket_reads_and_writes"]
    lenient = pytest_run(args, TESTS.parent, strict=False, path=[tmp_path])
    assert lenient.returncode == 0 and re.search(r"\d+ passed, \d+ skipped", lenient.stdout), lenient.stdout[-2000:]
    strict = pytest_run(args, TESTS.parent, strict=True, path=[tmp_path])
    assert strict.returncode == 1, strict.stdout[-2000:]
    assert "skips not allowed" in strict.stdout
    assert re.search(r"moto, one of the test extra's object-store emulators, is missing: \d+ skipped "
                     r"\(tests/test_storage.py::", strict.stdout), strict.stdout[-2000:]


def test_allowed_skips_keep_the_strict_run_green(tmp_path):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    tests = [f"def test_{i}():\n    pytest.skip({reason + ' (here)'!r})\n" for i, reason in enumerate(ALLOWED_SKIPS)]
    (tmp_path / "test_allowed.py").write_text("import pytest\n\n\n" + "\n\n".join(tests))
    run = pytest_run(["-p", "no:cacheprovider"], tmp_path, strict=True)
    assert run.returncode == 0 and f"{len(ALLOWED_SKIPS)} skipped" in run.stdout, run.stdout[-2000:]
    assert "skips not allowed" not in run.stdout
