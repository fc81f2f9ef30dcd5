"""The documentation: the site builds with `mkdocs build --strict` (a broken link, anchor or page fails it), the
configuration reference covers every config field, and every command the README and docs/ show in a shell block
parses with the real command's own parser, so no documented flag or subcommand can disappear unnoticed.

A documented command is run in this process up to the point where its arguments are parsed (tyro or argparse,
and for train.py the YAML preset and the config's validation) and stopped there; nothing is trained, converted or
downloaded. A program the docs show that is neither ours nor on the list of other tools fails the test, so a new
kind of command cannot slip past unchecked.
"""

from __future__ import annotations

import argparse
import functools
import html.parser
import importlib
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
OTHER_TOOLS = {"pip", "hf", "tmux", "cd", "mkdocs", "tensorboard", "wait", "sudo", "apt", "git", "export", "source", ".", "srun",
               "gcloud", "mpirun", "sbatch", "curl", "sh", "uv"}
"""Programs the docs may show that are not ours (their flags are their authors' business)."""
SHELL_WORDS = {"do", "then", "else", "{", "}", "(", ")"}
SEPARATORS = {";", "&&", "||", "|", "&", ";;"}


class Parsed(Exception):
    """Raised by the patched parsers once a command's arguments parsed: the command stops there."""


def shell_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of every fenced shell block in a Markdown file."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w+)", lines[i])
        if m:
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            if m.group(1) in SHELL_LANGS:
                out.append((start + 1, "\n".join(body)))
        i += 1
    return out


def simple_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell snippet: continuations joined, comments dropped, split at ; && || | &,
    leading VAR=value assignments and shell keywords removed, `for` headers skipped, gcloud's --command and
    srun's, mpirun's and `tmux new-session`'s payloads unpacked."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        cur = []
        for tok in list(lex) + [";"]:
            if tok in SEPARATORS:
                if cur:
                    commands.append(cur)
                cur = []
            else:
                cur.append(tok)
    out = []
    for cmd in commands:
        while cmd and (cmd[0] in SHELL_WORDS or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0])):
            cmd = cmd[1:]
        if not cmd or cmd[0] in ("for", "done", "while", "if", "fi"):
            continue
        if cmd[0] == "gcloud" and "--command" in cmd:
            out += simple_commands(cmd[cmd.index("--command") + 1])
            continue
        if cmd[0] == "tmux" and cmd[1:2] == ["new-session"]:
            out += simple_commands(cmd[-1])
            continue
        if cmd[0] in ("srun", "mpirun"):
            starts = [i for i, t in enumerate(cmd) if t == "python" or t.startswith("olmo3eqx-")]
            if starts:
                out.append(cmd[starts[0]:])
                continue
        out.append(cmd)
    return out


def documented_commands() -> list[tuple[str, list[str]]]:
    cmds = []
    for path in DOC_FILES:
        for line, text in shell_blocks(path):
            for cmd in simple_commands(text):
                cmds.append((f"{path.relative_to(ROOT)}:{line}", cmd))
    return cmds


def console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def entry(cmd: list[str]):
    """(callable that runs the command, its argv) for one of our commands; None for another program's; raises
    for a program nobody accounted for."""
    prog = cmd[0]
    if prog in console_scripts():
        module, func = console_scripts()[prog].split(":")
        return (lambda: getattr(importlib.import_module(module), func)()), cmd
    if prog in ("python", "python3") or prog.endswith("/python"):
        if cmd[1] == "-m":
            module = cmd[2]
            if module in ("venv", "pytest", "http.server"):
                return None
            assert module.startswith("olmo3eqx"), f"python -m {module} is neither ours nor a known tool"
            return (lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)), [module, *cmd[3:]]
        script = ROOT / cmd[1]
        assert script.is_file(), f"{cmd[1]} is not a file of this repository"
        return (lambda: runpy.run_path(str(script), run_name="__main__")), [str(script), *cmd[2:]]
    if prog in OTHER_TOOLS or Path(prog).name in OTHER_TOOLS:  # ~/.local/bin/uv too
        return None
    raise AssertionError(f"{prog!r} is neither one of our commands nor in OTHER_TOOLS")


@pytest.fixture
def parse_only(monkeypatch):
    """tyro and argparse patched to stop a command with Parsed right after its arguments parse (a tyro config
    class is constructed first, so its validation runs; a tyro subcommand function is replaced by a stub with its
    signature, so it never runs)."""
    import tyro
    import tyro.extras

    real_cli, real_sub = tyro.cli, tyro.extras.subcommand_cli_from_dict
    real_parse = argparse.ArgumentParser.parse_args
    real_known = argparse.ArgumentParser.parse_known_args
    depth = {"tyro": 0, "argparse": 0}

    def stub(f):
        @functools.wraps(f)
        def stopped(*args, **kwargs):
            raise Parsed(f.__name__)
        return stopped

    def cli(f, *args, **kwargs):
        depth["tyro"] += 1
        try:
            result = real_cli(stub(f) if callable(f) and not isinstance(f, type) else f, *args, **kwargs)
        finally:
            depth["tyro"] -= 1
        raise Parsed(result)

    def sub(commands, *args, **kwargs):
        depth["tyro"] += 1
        try:
            real_sub({name: stub(f) for name, f in commands.items()}, *args, **kwargs)
        finally:
            depth["tyro"] -= 1
        raise AssertionError("a subcommand stub always raises Parsed")

    def parse_args(self, args=None, namespace=None):
        depth["argparse"] += 1  # argparse's parse_args calls parse_known_args, then refuses what is left
        try:
            result = real_parse(self, args, namespace)
        finally:
            depth["argparse"] -= 1
        if depth["tyro"]:
            return result
        raise Parsed(result)

    def parse_known_args(self, args=None, namespace=None):
        # train.py's entry flags are read by parse_known_args before tyro reads the rest
        result = real_known(self, args, namespace)
        if depth["tyro"] or depth["argparse"] or any(a.dest == "config" for a in self._actions):
            return result
        raise Parsed(result)

    monkeypatch.setattr(tyro, "cli", cli)
    monkeypatch.setattr(tyro.extras, "subcommand_cli_from_dict", sub)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    monkeypatch.setenv("OLMO3EQX_MALLOC", "system")  # no host-allocator re-exec of the test process
    monkeypatch.chdir(ROOT)


def run_parse_only(cmd: list[str]) -> str:
    """'' when the command parsed, else what it said (its exit code and stderr)."""
    target = entry(cmd)
    if target is None:
        return ""
    run, argv = target
    env, saved_argv = dict(os.environ), sys.argv
    sys.argv = list(argv)
    try:
        run()
        return "ran to the end without parsing arguments through tyro or argparse"
    except Parsed:
        return ""
    except SystemExit as e:
        return "" if e.code in (0, None) else f"exit {e.code}"
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(env)


@pytest.mark.filterwarnings("ignore:'olmo3eqx.*found in sys.modules:RuntimeWarning")  # runpy of an imported module
def test_documented_commands_parse(parse_only, capsys):
    cmds = documented_commands()
    ours = [(where, cmd) for where, cmd in cmds if entry(cmd) is not None]
    assert len(ours) >= 40, f"only {len(ours)} of our commands found in the docs: the extraction broke"
    failures = []
    for where, cmd in ours:
        problem = run_parse_only(cmd)
        err = capsys.readouterr().err
        if problem:
            failures.append(f"{where}: {shlex.join(cmd)}\n    {problem}: {err.strip()[-600:]}")
    assert not failures, "documented commands that no longer parse:\n" + "\n".join(failures)


def test_a_removed_flag_is_caught(parse_only, capsys):
    """The check itself: a flag that does not exist, a subcommand that does not exist and a config that fails
    validation are each reported, for a tyro config, a tyro subcommand and an argparse script."""
    assert run_parse_only(["python", "train.py", "--steps", "3"]) == ""
    assert run_parse_only(["python", "train.py", "--optim.no-such-field", "3"])
    assert run_parse_only(["python", "train.py", "--steps", "-1"])  # validation (__post_init__)
    assert run_parse_only(["python", "convert.py", "parity", "--hf-dir", "d", "--ckpt", "c"]) == ""
    assert run_parse_only(["python", "convert.py", "parity", "--hf-dir", "d", "--ckpt", "c", "--no-such-flag"])
    assert run_parse_only(["python", "convert.py", "no-such-subcommand"])
    assert run_parse_only(["olmo3eqx-eval", "--ckpt", "runs/x", "--no-such-flag"])
    assert run_parse_only(["python", "bench/bench_data.py", "--no-such-flag"])
    capsys.readouterr()
    with pytest.raises(AssertionError, match="neither one of our commands"):
        entry(["frobnicate", "--x"])


def test_shell_parsing_of_the_docs_forms():
    script = """python train.py --a 1 \\
  --b 2   # a comment
pip install -e ".[tpu]"      # libtpu
for i in 0 1; do
  JAX_PROCESS_ID=$i XLA_FLAGS=--x=2 python train.py --steps 20 &
done; wait
gcloud compute tpus tpu-vm ssh v --worker=all --command "cd d && .venv/bin/python train.py --run.dir gs://b/r"
srun --nodes=16 --gpus-per-node=8 python train.py --config c.yaml
mpirun -np 2 -x A=b python train.py --config m.yaml
gcloud x --command "cd d && tmux new-session -d -s t '.venv/bin/python train.py --run.dir gs://b/r --until-done'\""""
    assert simple_commands(script) == [
        ["python", "train.py", "--a", "1", "--b", "2"], ["pip", "install", "-e", ".[tpu]"],
        ["python", "train.py", "--steps", "20"], ["wait"], ["cd", "d"],
        [".venv/bin/python", "train.py", "--run.dir", "gs://b/r"], ["python", "train.py", "--config", "c.yaml"],
        ["python", "train.py", "--config", "m.yaml"], ["cd", "d"], [".venv/bin/python", "train.py", "--run.dir", "gs://b/r", "--until-done"]]


def test_config_reference_covers_every_field():
    """The generated reference has one documented row per config field, at every nesting level."""
    import dataclasses

    from olmo3eqx import config

    sys.path.insert(0, str(ROOT / "docs"))
    try:
        hooks = importlib.import_module("hooks")
    finally:
        sys.path.remove(str(ROOT / "docs"))

    def leaves(cls, prefix=""):
        for f in dataclasses.fields(cls):
            sub = getattr(config, str(f.type), None)
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                yield from leaves(sub, f"{prefix}{f.name}.")
            else:
                yield prefix + f.name

    expected = set(leaves(config.TrainConfig))
    assert {"model.rope_scaling.factor", "data.mix_root", "steps", "init_from"} <= expected
    documented = {prefix + f.name: hooks.field_docs(cls).get(f.name, "") for prefix, cls, fs in hooks.sections()
                  for f in fs}
    assert set(documented) == expected
    assert not [name for name, doc in documented.items() if not doc], "config fields without a docstring"
    page = hooks.reference_markdown()
    for name in expected:
        assert f"| {hooks.name_and_flag(name)} |" in page
        assert hooks.flag_of(name) == f"--{name.replace('_', '-')}"


def _build(docs_root: Path, site: Path) -> subprocess.CompletedProcess:
    # no -q: mkdocs then logs errors only, and --strict counts no warnings (a broken link would pass)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(docs_root / "mkdocs.yml"), "-d", str(site)], cwd=docs_root, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built from this checkout, once for the tests that read it."""
    out = tmp_path_factory.mktemp("built") / "site"
    p = _build(ROOT, out)
    assert p.returncode == 0, p.stdout + p.stderr
    return out


def test_site_builds_strict(site):
    reference = (site / "config-reference" / "index.html").read_text().replace("<wbr>", "")
    assert "model.rope_scaling.factor" in reference and "--data.mix-root" in reference
    api = (site / "api" / "index.html").read_text()
    assert "load_hf" in api and "segment_ids" in api  # mkdocstrings rendered the docstrings


class _Text(html.parser.HTMLParser):
    """The text of a page's article and the tags in it, as a browser reads them."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth, self.text, self.tags = 0, [], set()

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
    """Elements with no end tag: they open no level of nesting."""

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.depth += tag == "article" or bool(self.depth)
        if self.depth:
            self.tags.add(tag)

    def handle_endtag(self, tag):
        self.depth -= bool(self.depth)

    def handle_data(self, data):
        if self.depth:
            self.text.append(data)


def run_on_lists(page: str) -> list[str]:
    """Lines of rendered paragraphs that begin like a list item: a list glued to the paragraph before it (Python-
    Markdown, unlike GitHub, needs a blank line before a list, or the items run on as one paragraph)."""
    return [line.strip()[:80] for para in re.findall(r"<p>(.*?)</p>", page, re.S)
            for line in para.splitlines()[1:] if re.match(r"\s*([-*+]|\d+\.)\s", line)]


def test_built_pages_have_no_run_on_lists(site):
    glued = {str(f.relative_to(site)): found for f in sorted(site.rglob("index.html"))
             if (found := run_on_lists(f.read_text()))}
    assert not glued, f"lists rendered as paragraphs (put a blank line before the list): {glued}"


def heading_faults(page: str) -> list[str]:
    """A page's article without a level-2 heading (its table of contents is empty) or stepping down more than one
    level at once (H1 to H3)."""
    article = page[page.find("<article"):page.rfind("</article>")]
    levels = [int(n) for n in re.findall(r"<h([1-6])[ >]", article)]
    faults = [] if 2 in levels else ["no level-2 heading"]
    return faults + [f"H{a} to H{b}" for a, b in zip(levels, levels[1:]) if b > a + 1]


def test_built_pages_have_a_table_of_contents_and_no_skipped_heading_level(site):
    assert heading_faults("<article><h1>A</h1><h3>B</h3></article>") == ["no level-2 heading", "H1 to H3"]
    faults = {str(f.relative_to(site)): found for f in sorted(site.rglob("index.html"))
              if f.parent != site and (found := heading_faults(f.read_text()))}
    assert not faults, f"pages whose headings need fixing: {faults}"


def test_config_reference_shows_the_docstrings_as_written(site):
    """Docstring text is escaped, not passed as raw HTML: `runs/<name>/` shows as written (not `runs//`), `<set>`
    does not vanish, and the page holds no tag Markdown did not make."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        hooks = importlib.import_module("hooks")
    finally:
        sys.path.remove(str(ROOT / "docs"))
    parser = _Text()
    parser.feed((site / "config-reference" / "index.html").read_text())
    shown = " ".join("".join(parser.text).split())
    docs = [hooks.field_docs(cls)[f.name] for _, cls, leaves in hooks.sections() for f in leaves]
    missing = [doc for doc in docs if " ".join(doc.replace("`", "").split()) not in shown]
    assert not missing, f"docstrings not shown as written: {missing[:3]}"
    assert "runs/<name>/" in shown and "eval/<set>/loss" in shown
    made = {"a", "code", "div", "em", "h1", "h2", "p", "pre", "span", "strong", "table", "tbody", "td", "th",
            "thead", "tr", "article", "button", "svg", "path", "nav", "wbr", "br"}
    assert parser.tags <= made, f"raw HTML in the reference: <{'>, <'.join(sorted(parser.tags - made))}>"


def test_a_broken_link_fails_the_build(tmp_path):
    """The strict build is a real gate: an anchor that does not exist fails it."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "src").symlink_to(ROOT / "src")
    with open(copy / "docs" / "index.md", "a") as f:
        f.write("\n[gone](data.md#no-such-section)\n")
    p = _build(copy, tmp_path / "site")
    assert p.returncode != 0 and "no-such-section" in p.stdout + p.stderr


def _hooks():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        return importlib.import_module("hooks")
    finally:
        sys.path.remove(str(ROOT / "docs"))


def test_config_reference_links_the_pages_its_docstrings_name(site):
    """A docstring's "(docs/object-stores.md)", as `--help` prints it, is a link to that page on the site."""
    hooks = _hooks()
    assert hooks._text("goes to (docs/object-stores.md#buckets), not docs_x") == (
        "goes to ([docs/object-stores.md#buckets](object-stores.md#buckets)), not docs\\_x")
    reference = (site / "config-reference" / "index.html").read_text()
    assert '<a href="../object-stores/">docs/object-stores.md</a>' in reference
    assert "\\|" not in reference  # `int | None`, not `int \\| None`
    assert "<code>int | None</code>" in reference


CONTENT_PX = 690
"""The article's width in a 1,280 px window (mkdocs-material with both sidebars; measured in Chromium)."""
CODE_CHAR_PX = 6.6
"""One character of code in a table: Roboto Mono (0.6 em wide) at the table's code size, .64rem x .85em of 20 px."""
CELL_PAD_PX = 24
"""A table cell's left and right padding (.9375em each at the table's 12.8 px)."""
FIRST_COLUMN_PX = 180
"""The reference's name-and-flag column's floor (9rem, docs/stylesheets/extra.css)."""
DESCRIPTION_PX = 200
"""The room the description column must keep beside the others (about 30 characters a line)."""


class _Cells(html.parser.HTMLParser):
    """The cells of the tables inside <div class="config-reference">, as text in which NUL marks a <wbr> or <br>
    (the places a browser may break a token)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.inside, self.tables, self.cell = 0, [], None

    def handle_starttag(self, tag, attrs):
        if tag == "div":
            self.inside += bool(self.inside) or ("class", "config-reference") in attrs
        if not self.inside:
            return
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self.cell = []
        elif tag in ("wbr", "br") and self.cell is not None:
            self.cell.append("\0")

    def handle_endtag(self, tag):
        if tag == "div" and self.inside:
            self.inside -= 1
        elif tag in ("td", "th") and self.cell is not None:
            self.tables[-1][-1].append("".join(self.cell))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def reference_widths(page: str) -> list[tuple[float, list[str]]]:
    """Per table of the built reference: the narrowest width its columns before the description can take (each
    column's longest unbreakable token as code characters, plus padding) and those tokens."""
    parser = _Cells()
    parser.feed(page)
    out = []
    for rows in parser.tables:
        widest, tokens = 0.0, []
        for col in range(len(rows[0]) - 1):
            token = max((t for row in rows[1:] for t in re.split(r"[\s\0]+", row[col])), key=len)
            px = len(token) * CODE_CHAR_PX + CELL_PAD_PX
            widest += max(px, FIRST_COLUMN_PX) if col == 0 else px
            tokens.append(token)
        out.append((widest, tokens))
    return out


def test_config_reference_shows_every_description_at_1280_px(site):
    """Every table of the reference fits the article at 1,280 px with room for its descriptions: no name, flag,
    type or default is an unbreakable token wide enough to push the description off-screen (names and flags break
    at their <wbr>s; docs/hooks.py)."""
    widths = reference_widths((site / "config-reference" / "index.html").read_text())
    assert len(widths) >= 10, "the reference's tables were not found in their <div class=config-reference>"
    too_wide = [(round(px), tokens) for px, tokens in widths if px + DESCRIPTION_PX > CONTENT_PX]
    assert not too_wide, f"reference tables wider than a 1,280 px page allows: {too_wide}"
    page = (site / "config-reference" / "index.html").read_text()
    unbroken = reference_widths(page.replace("<wbr>", ""))  # the check sees names that cannot break
    assert max(px for px, _ in unbroken) + DESCRIPTION_PX > CONTENT_PX


CODE_SELECTOR = re.compile(r"\b(pre|code|kbd|samp)\b")
WRAPS_MID_TOKEN = re.compile(r"overflow-wrap\s*:\s*anywhere|word-break\s*:\s*break-(all|word)|"
                             r"word-wrap\s*:\s*(anywhere|break-word)|"
                             r"white-space\s*:\s*(pre-wrap|pre-line|break-spaces)")


def code_wrapping_rules(css: str) -> list[str]:
    """The rules of a stylesheet that make code wrap (mid-token, or a code block's lines at all)."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    return [f"{sel.strip()} {{{body.strip()}}}" for sel, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css)
            if CODE_SELECTOR.search(sel) and WRAPS_MID_TOKEN.search(body)]


def test_no_stylesheet_wraps_code_mid_token():
    """Code blocks scroll sideways and code never breaks inside a token: a rule such as `overflow-wrap: anywhere`
    on code split flags ("--dry-⏎run")."""
    assert code_wrapping_rules(".md-typeset pre > code { white-space: pre-wrap; overflow-wrap: anywhere; }")
    assert not code_wrapping_rules(".x td code { word-break: normal; } pre { white-space: pre; }")
    sheets = sorted((ROOT / "docs" / "stylesheets").glob("*.css"))
    assert sheets
    found = {sheet.name: rules for sheet in sheets if (rules := code_wrapping_rules(sheet.read_text()))}
    assert not found, f"stylesheet rules that wrap code: {found}"


PROCESS_WORDS = [r"\bshared/", r"\bissues? #?\d+", r"\bthe issue\b",
                 r"(?<![\w-])(?<!SSH )(?<!tmux )sessions?\b(?![\w.-])", r"\ban earlier (\w+ )?host\b"]
"""How the project's own work was organised (its tracker's numbers, its working notes' folder, which working
session measured what): nothing a reader of the manual can follow."""


def process_words(text: str) -> list[str]:
    return [m.group(0) for pattern in PROCESS_WORDS for m in re.finditer(pattern, text)]


def test_no_page_speaks_of_the_working_process():
    assert process_words("as issue 46 measured on an earlier session (shared/seeds/) the issue proposed") == [
        "shared/", "issue 46", "the issue", "session"]
    assert not process_words("tmux new-session -d; your SSH session ends; bench/gpu_session.py")
    pages = [*DOC_FILES, *sorted((ROOT / "docs" / "snippets").glob("*.md"))]  # the snippets are parts of pages
    found = {str(p.relative_to(ROOT)): words for p in pages if (words := process_words(p.read_text()))}
    assert not found, f"pages that speak of the working process: {found}"


def test_measured_where_is_the_readmes_wording():
    """The home page's "What has been measured where" (docs/snippets/measured-where.md, included by
    pymdownx.snippets) is the README's section word for word, its links made relative to docs/."""
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## What has been measured where\n\n(.*?)\n+^## ", readme, re.S | re.M).group(1)
    snippet = (ROOT / "docs" / "snippets" / "measured-where.md").read_text()
    snippet = re.sub(r"\A<!--.*?-->\n+", "", snippet, flags=re.S).strip()
    assert snippet == section.replace("](docs/", "](").strip()


def test_pages_about_what_was_never_run_say_so(site):
    """Every page that describes a run this project has not made (multi-node GPU, a TPU pod, the 7B) opens that
    part with the one "Measured where" note (docs/snippets/not-run.md), and the home page carries the section."""
    note = "Not run: multi-GPU and multi-node GPU training"
    for page in ("multi-host", "tpu-pod", "stages", "getting-started", "tpu-gpu"):
        assert note in (site / page / "index.html").read_text(), page
    assert "one H200 only" in (site / "index.html").read_text()
