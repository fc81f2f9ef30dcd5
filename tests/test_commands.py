"""One command-line contract: every console script of pyproject.toml, run as its installed stub runs it (`from M
import F; sys.exit(F())`), and `python train.py` / `python convert.py` end bad input -- a URL whose scheme nothing
reaches, a missing file, an optional extra that is not installed -- with one `error:` line on stderr, no traceback,
and the documented exit code (olmo3eqx.exits). A missing extra is simulated by `sys.modules[name] = None`, which makes
importing it raise ImportError as when it is not installed.

The default test runs a representative set of these checks inside one process (a start-up costs seconds here);
the whole matrix, each check in a process of its own, is `-m slow`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from olmo3eqx import exits

ROOT = Path(__file__).resolve().parents[1]

SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
MISSING = "/nonexistent-i43a"

CASES = {
    # script: {case: (modules made missing, arguments)}; a case a script has no way to meet is left out (prepare
    # reads and writes local files only, so no extra; regenerate-mixes reads no file)
    "olmo3eqx-train": {"scheme": ((), ["--config", "az://c/config.yaml"]),
                       "missing": ((), ["--config", f"{MISSING}/config.yaml"]),
                       "extra": (("gcsfs",), ["--config", "gs://b/config.yaml"])},
    "olmo3eqx-convert": {"scheme": ((), ["orbax-to-hf", "--ckpt", "az://c/ckpt", "--out", "OUT"]),
                         "missing": ((), ["orbax-to-hf", "--ckpt", MISSING, "--out", "OUT"]),
                         "extra": (("torch",), ["demo", "--out", "OUT"])},
    "olmo3eqx-prepare": {"scheme": ((), ["--input", "az://c/a.txt", "--out", "OUT"]),
                         "missing": ((), ["--input", f"{MISSING}/a.txt", "--out", "OUT"])},
    "olmo3eqx-eval": {"scheme": ((), ["--ckpt", "az://c/run"]), "missing": ((), ["--ckpt", MISSING]),
                      "extra": (("gcsfs",), ["--ckpt", "gs://b/run"])},
    "olmo3eqx-compare": {"scheme": ((), ["az://c/a", "az://c/b"]), "missing": ((), [f"{MISSING}/a", f"{MISSING}/b"]),
                         "extra": (("gcsfs",), ["gs://b/a", "gs://b/b"])},
    "olmo3eqx-generate": {"scheme": ((), ["--ckpt", "az://c/run", "hi"]),
                          "scheme-out": ((), ["--ckpt", MISSING, "--file", "F", "--out", "az://c/out.jsonl"]),
                          "missing": ((), ["--ckpt", MISSING, "hi"]),
                          "extra": (("gcsfs",), ["--ckpt", "gs://b/run", "hi"])},
    "olmo3eqx-lm-eval": {"scheme": ((), ["--model", "olmo3eqx", "--model_args", "ckpt=az://c/run", "--tasks",
                                         "hellaswag"]),
                         "missing": ((), ["--model", "olmo3eqx", "--model_args", f"ckpt={MISSING}", "--tasks",
                                          "hellaswag"]),
                         "extra": (("lm_eval",), ["--help"])},
    "olmo3eqx-regenerate-mixes": {"scheme": ((), ["--out", "az://c/mixes"]),
                                  "extra": (("olmo_core",), ["--out", "OUT"])},
}
"""Every console script's checks."""

SAYS = {"scheme": "uses az://, which olmo3eqx cannot reach", "missing": MISSING,
        "extra": "which is not installed: pip install"}
"""What each kind of case's sentence says (a missing file's names it); `scheme-out` is generate's --out, checked
before the checkpoint (missing here) is even looked at."""

DEFAULT = [("olmo3eqx-lm-eval", "extra"), ("olmo3eqx-convert", "extra"), ("olmo3eqx-generate", "extra"),
           ("olmo3eqx-generate", "scheme"), ("olmo3eqx-generate", "scheme-out"), ("olmo3eqx-train", "scheme"),
           ("olmo3eqx-eval", "missing"), ("olmo3eqx-compare", "missing"), ("olmo3eqx-prepare", "missing"),
           ("olmo3eqx-regenerate-mixes", "scheme")]
"""The default test's checks, in one process: the extras first (a module imported by an earlier check could not be
made missing), every kind of check, the commands the issue found ending in tracebacks."""

HARNESS = """
import contextlib, io, json, sys, traceback
from importlib import import_module

results = []
for target, prog, blocked, args in json.loads(sys.argv[1]):
    saved = {name: sys.modules.pop(name, None) for name in blocked}
    sys.modules.update(dict.fromkeys(blocked))  # importing these raises ImportError, as when not installed
    sys.argv = [prog, *args]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:  # what the console script's stub does: from M import F; sys.exit(F())
            module, func = target.split(":")
            code = getattr(import_module(module), func)()
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc()  # what the interpreter prints for an exception the command let out
            code = 1
    for name, module in saved.items():
        del sys.modules[name]
        if module is not None:
            sys.modules[name] = module
    results.append({"code": code, "stderr": err.getvalue()})
print(json.dumps(results))
"""
"""Runs [target, prog, modules made missing, arguments] checks in this one process, as a console script's stub
would run each; prints each one's exit code and stderr."""


def command_env() -> dict:
    # no host-allocator re-exec (train's cli would exec the harness anew); no accelerator to look for
    return {**os.environ, "OLMO3EQX_MALLOC": "system", "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1"}


def check(script: str, case: str, code: int, stderr: str) -> None:
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error")]
    assert code == exits.BAD_INPUT and "Traceback" not in stderr, (script, case, code, stderr[-2000:])
    assert len(errors) == 1 and SAYS[case.split("-")[0]] in errors[0], (script, case, stderr[-2000:])
    if script != "olmo3eqx-lm-eval":  # the harness's CLI logs its own INFO lines
        assert len(lines) == 1, (script, case, stderr[-2000:])


def arguments(args: list[str], tmp_path) -> list[str]:
    return [str(tmp_path / "out") if a == "OUT" else a for a in args]


def test_every_console_script_has_its_checks():
    assert set(CASES) == set(SCRIPTS)
    assert all({"scheme", "missing"} & set(cases) for cases in CASES.values())
    assert {case for _, case in DEFAULT} == {"scheme", "scheme-out", "missing", "extra"}


def test_bad_input_to_the_commands_is_one_sentence_and_its_exit_code(tmp_path):
    checks = [[SCRIPTS[script], script, list(CASES[script][case][0]), arguments(CASES[script][case][1], tmp_path)]
              for script, case in DEFAULT]
    p = subprocess.run([sys.executable, "-c", HARNESS, json.dumps(checks)], env=command_env(), capture_output=True,
                       text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    for (script, case), result in zip(DEFAULT, json.loads(p.stdout.strip().splitlines()[-1])):
        check(script, case, result["code"], result["stderr"])
    assert not (tmp_path / "out").exists() and not (tmp_path / "az:").exists()  # nothing written, no URL as folder


@pytest.mark.parametrize("entry", ["train.py", "convert.py"])
def test_the_checkout_scripts_keep_the_contract(entry, tmp_path):
    """`python train.py` and `python convert.py` themselves (a start-up each, without JAX: about a second)."""
    args = ["--config", "az://c/config.yaml"] if entry == "train.py" else ["demo", "--out", str(tmp_path / "out")]
    code = (f"import runpy, sys; sys.modules['torch'] = None; sys.argv = [{entry!r}, *{args!r}]; "
            f"runpy.run_path({str(ROOT / entry)!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], env=command_env(), capture_output=True, text=True, timeout=300)
    check(entry, "scheme" if entry == "train.py" else "extra", p.returncode, p.stderr)
    assert p.stderr.startswith("error: Config file az://" if entry == "train.py" else "error: convert.py needs torch")


@pytest.mark.slow  # ~20 processes; lm-eval's two take ~90 s each (the harness indexes its tasks first)
@pytest.mark.parametrize("script,case", [(s, c) for s, cases in CASES.items() for c in cases])
def test_every_console_script_in_a_process_of_its_own(script, case, tmp_path):
    blocked, args = CASES[script][case]
    module, func = SCRIPTS[script].split(":")
    code = (f"import sys; sys.modules.update(dict.fromkeys({list(blocked)!r})); "
            f"sys.argv = [{script!r}, *{arguments(args, tmp_path)!r}]; "
            f"from {module} import {func}; sys.exit({func}())")
    p = subprocess.run([sys.executable, "-c", code], env=command_env(), capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    check(script, case, p.returncode, p.stderr)
