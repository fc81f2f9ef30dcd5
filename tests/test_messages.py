"""Every `--flag` a message or docstring of the project suggests parses for the command it belongs to, with the value
it shows: the flags are collected from the string literals of the sources (ast) and each is run through its command's
own parser, as test_docs runs the documented commands (stopped once the arguments parse: nothing is built, no JAX
backend starts).

A flag belongs to the command named nearest before it in its string (`olmo3eqx-eval --ckpt`, `convert.py's --out`,
`python -m olmo3eqx.data.prepare --out`, `bench/bench_step.py --malloc`), or right after it (`--seq-len for
olmo3eqx-eval`), else to its module's command (MODULE_COMMANDS; train.py by default). Another program's flags (pip's,
TensorBoard's, lm_eval's, XLA's) and placeholders (`--name value`) are not ours to check."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from test_docs import console_scripts, parse_only, run_parse_only  # noqa: F401 - parse_only: a fixture

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "olmo3eqx"
SOURCES = [ROOT / "train.py", ROOT / "convert.py", *sorted(PACKAGE.rglob("*.py"))]

BASES = {
    "train.py": [["python", "train.py"]],
    "convert.py": [["python", "convert.py", "hf-to-orbax", "--hf-dir", "d", "--out", "o"],
                   ["python", "convert.py", "orbax-to-hf", "--ckpt", "c", "--out", "o"],
                   ["python", "convert.py", "parity", "--hf-dir", "d", "--ckpt", "c"]],
    "olmo3eqx-eval": [["olmo3eqx-eval", "--ckpt", "c"]],
    "olmo3eqx-generate": [["olmo3eqx-generate", "--ckpt", "c"]],
    "olmo3eqx-prepare": [["olmo3eqx-prepare", "--input", "i", "--tokenizer", "t", "--out", "o"]],
    "olmo3eqx-prepare chat": [["olmo3eqx-prepare", "chat", "--input", "i", "--tokenizer", "t", "--out", "o"]],
    "olmo3eqx-prepare instruct-tokenizer": [["olmo3eqx-prepare", "instruct-tokenizer", "--tokenizer", "t", "--out", "o"]],
    "olmo3eqx.data.prepare": [["python", "-m", "olmo3eqx.data.prepare", "--input", "i", "--tokenizer", "t",
                               "--out", "o"]],
    "olmo3eqx-compare": [["olmo3eqx-compare", "a", "b"]],
    "olmo3eqx-regenerate-mixes": [["olmo3eqx-regenerate-mixes"]],
}
"""Each command a flag may belong to, as argv lists that parse (a flag is the command's when one of them takes it;
convert.py's flags belong to its subcommands). A benchmark (bench/*.py) is its own base."""
FOREIGN = {"pip", "tensorboard", "lm_eval", "olmo3eqx-lm-eval"}
"""Programs whose flags the messages may show: not ours to check (olmo3eqx-lm-eval is lm-evaluation-harness's own
command line)."""
MODULE_COMMANDS = {
    "tools/convert.py": "convert.py", "hf/": "convert.py", "convert.py": "convert.py",
    "tools/evaluate.py": "olmo3eqx-eval", "olmo_tasks.py": "olmo3eqx-eval",
    "tools/generate.py": "olmo3eqx-generate", "conversation.py": "olmo3eqx-generate",
    "data/template_record.py": "olmo3eqx-generate",  # its refusals are generate --chat's and orbax-to-hf's alike
    "tools/prepare.py": "olmo3eqx-prepare", "data/prepare.py": "olmo3eqx-prepare",
    "data/chat.py": "olmo3eqx-prepare chat", "data/chat_mix.py": "olmo3eqx-prepare chat",
    "data/hub.py": "olmo3eqx-prepare chat", "data/tool_tokens.py": "olmo3eqx-prepare instruct-tokenizer",
    "tools/compare.py": "olmo3eqx-compare",
    "tools/regenerate_mixes.py": "olmo3eqx-regenerate-mixes",
    "tools/lm_eval_adapter.py": "olmo3eqx-lm-eval", "tools/lm_eval_cli.py": "olmo3eqx-lm-eval",
}
"""The command a module's messages are about, by path under src/olmo3eqx (a folder ends in /); train.py otherwise."""
ABOUT_TRAINING = {("data/chat.py", "--steps")}
"""A flag a module's message suggests for the training run, not for the module's command: `olmo3eqx-prepare chat`'s
summary gives the `--steps` of AI2's epochs."""
OTHER_PROGRAMS = {"--dataset_mixer_list"}
"""Another program's flags a message names as the origin of a format (open-instruct's mixer lists)."""
PLACEHOLDERS = {"--name", "--other", "--section.field"}
"""Flags that stand for any flag (`--section.field value`)."""
PROSE = {"a", "adds", "an", "and", "and/or", "apply", "allows", "as", "at", "by", "converts", "files", "for", "from", "in",
         "is", "must", "names", "of", "on", "or", "pattern", "planning", "the", "then", "to", "tokens", "topology",
         "value", "with", "within", "writes"}
"""Words a sentence goes on with after a flag: not the flag's value."""

FLAG = re.compile(r"(?<![\w-])(--[a-z][\w.-]*[a-z0-9])(?:[ =]([^\s]+))?")
COMMAND = re.compile(r"olmo3eqx-prepare (?:chat|instruct-tokenizer)|olmo3eqx-[a-z-]+|python -m (olmo3eqx\.[\w.]+)|bench/\w+\.py|"
                     r"\b(?:train|convert)\.py|\b(?:pip|tensorboard|lm_eval)\b")
FOLLOWING = re.compile(r"\s+for\s+(olmo3eqx-[a-z-]+|train\.py|convert\.py)")
SENTENCE_BREAK = re.compile(r"\n|[.;,] |\)")
"""Between a command and a flag: the flag is no longer on that command's line."""
PLACEHOLDER_VALUE = re.compile(r"(^|[/_.=:])[A-Z][A-Z_]*([/_.=:]|$)|^\.\.\.$")
"""A value that stands for one: `--config PATH`, `--logdir runs/NAME/profile`, `--log.profile-steps A:B`."""
ENTRY_SCRIPTS = {"olmo3eqx-train": "train.py", "olmo3eqx-convert": "convert.py"}


@dataclass(frozen=True)
class Mention:
    where: str
    command: str
    flag: str
    value: str | None


def command_key(name: str) -> str:
    """BASES' name of a command as a message names it: a module run with -m as its console script."""
    if name.startswith("python -m "):
        scripts = {target.split(":")[0]: script for script, target in console_scripts().items()}
        name = name.removeprefix("python -m ")
        name = scripts.get(name, name)
    return ENTRY_SCRIPTS.get(name, name)


def module_command(rel: str) -> str:
    return next((cmd for prefix, cmd in MODULE_COMMANDS.items() if rel == prefix or
                 (prefix.endswith("/") and rel.startswith(prefix))), "train.py")


def shown_value(token: str | None) -> str | None:
    """The value a message shows after a flag, None when it shows none (a sentence goes on, another flag, a
    placeholder)."""
    if token is None or token[0] in "(`'\"" or token.startswith("--"):
        return None
    token = token.rstrip(".,;:)`'\"]")
    if not re.search(r"\w", token) or token.lower() in PROSE or PLACEHOLDER_VALUE.search(token):
        return None
    return token


def command_of(text: str, flag: re.Match, commands: list[re.Match], rel: str) -> str:
    """The command `flag` (a match in `text`, a string of module `rel`) belongs to."""
    after = FOLLOWING.match(text, flag.end(1))
    if after:
        return after.group(1)
    before = [c for c in commands if c.end() <= flag.start() and not SENTENCE_BREAK.search(text, c.end(), flag.start())]
    if before:
        return command_key(before[-1].group(0))
    return "train.py" if (rel, flag.group(1)) in ABOUT_TRAINING else module_command(rel)


def mentions(path: Path) -> list[Mention]:
    found = []
    rel = path.relative_to(PACKAGE).as_posix() if path.is_relative_to(PACKAGE) else path.name
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        commands = list(COMMAND.finditer(node.value))
        for m in FLAG.finditer(node.value):
            if m.group(1).startswith("--xla_") or m.group(1) in PLACEHOLDERS | OTHER_PROGRAMS:
                continue
            command = command_of(node.value, m, commands, rel)
            if command not in FOREIGN:
                found.append(Mention(f"{path.relative_to(ROOT)}:{node.lineno}", command, m.group(1),
                                     shown_value(m.group(2))))
    return found


def problem(mention: Mention, capsys) -> str:
    """'' when the flag (with the value shown) parses for its command, else what the command said."""
    bases = BASES.get(mention.command)
    if bases is None:
        if not mention.command.startswith("bench/"):
            return f"belongs to {mention.command}, which BASES does not know"
        bases = [["python", mention.command]]
    said = []
    for base in bases:
        argv = [*base, mention.flag] + ([mention.value] if mention.value is not None else [])
        outcome = run_parse_only(argv)
        err = capsys.readouterr().err
        # with no value shown, a flag that wants one exists when the parser does not call it unknown (tyro:
        # "Unrecognized options", argparse: "unrecognized arguments")
        if not outcome or (mention.value is None and "nrecognized" not in err):
            return ""
        said.append(f"{' '.join(argv)}: {outcome}: {err.strip()[-300:]}")
    return "\n      ".join(said)


def all_mentions() -> list[Mention]:
    return [m for path in SOURCES for m in mentions(path)]


def test_the_collector_finds_flags_commands_and_values():
    found = all_mentions()
    assert len(found) >= 100, f"only {len(found)} flag mentions found: the collection broke"
    by_where = {(m.where.split(":")[0], m.flag): m for m in found}
    (wandb,) = [m for m in found if m.where.startswith("src/olmo3eqx/metrics.py:") and "wandb" in m.flag]
    assert wandb.command == "train.py"
    assert by_where["src/olmo3eqx/tasks.py", "--seq-len"].command == "olmo3eqx-eval"  # "--seq-len for olmo3eqx-eval"
    assert by_where["src/olmo3eqx/data/source.py", "--out"].command == "olmo3eqx.data.prepare"
    malloc = by_where["src/olmo3eqx/tools/hostmem.py", "--malloc"]
    assert (malloc.command, malloc.value) == ("bench/bench_step.py", "jemalloc")
    assert by_where["src/olmo3eqx/exits.py", "--max-kl"].command == "convert.py"
    assert by_where["src/olmo3eqx/tools/generate.py", "--temperature"].value == "0.8"
    assert not [m for m in found if m.flag in ("--index-url", "--no-deps", "--logdir", "--model_args")]
    assert {shown_value(t) for t in ("PATH", "runs/NAME/profile", "A:B`:", "or", "(a", "`--x`", "/")} == {None}


@pytest.mark.filterwarnings("ignore:'olmo3eqx.*found in sys.modules:RuntimeWarning")  # runpy of an imported module
def test_every_flag_a_message_suggests_parses(parse_only, capsys):
    failures = []
    for mention in sorted(set(all_mentions()), key=lambda m: (m.command, m.flag, m.value or "")):
        said = problem(mention, capsys)
        if said:
            shown = f"{mention.flag} {mention.value}" if mention.value is not None else mention.flag
            failures.append(f"{mention.where}: `{shown}` for {mention.command}\n      {said}")
    assert not failures, "flags that messages suggest and their command does not take:\n" + "\n".join(failures)


def test_a_wrong_flag_or_value_is_caught(parse_only, capsys):
    """The check itself: an unknown flag, a value a switch does not take and a value of the wrong type."""
    assert problem(Mention("x", "train.py", "--log.no-wandb", None), capsys) == ""
    assert problem(Mention("x", "train.py", "--log.wandb", "false"), capsys)
    assert problem(Mention("x", "train.py", "--log.no-such-field", None), capsys)
    assert problem(Mention("x", "train.py", "--steps", "many"), capsys)
    assert problem(Mention("x", "convert.py", "--max-kl", "0.1"), capsys) == ""
    assert problem(Mention("x", "olmo3eqx-compare", "--windows", "four"), capsys)
