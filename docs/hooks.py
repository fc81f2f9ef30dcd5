"""MkDocs hooks (mkdocs.yml `hooks:`): the configuration reference, generated at build time from the config
dataclasses themselves (olmo3eqx.config), so the page cannot drift from the code.

Each field's doc is its attribute docstring (the string literal under the field, which tyro shows in `--help`),
read from the source with `ast`; defaults come from the dataclasses (the OLMo 3 7B stage-1 recipe); nested
dataclasses (`model.rope_scaling`) become their own sections. `reference_markdown()` is also what
tests/test_docs.py checks against the dataclasses' fields.
"""

from __future__ import annotations

import ast
import dataclasses
import html
import inspect
import re
import textwrap

MARKER = "<!-- config-reference -->"


def field_docs(cls) -> dict[str, str]:
    """{field: its attribute docstring} of dataclass `cls`, from the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:] + [None]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


PAGE_REF = re.compile(r"\bdocs/([a-z0-9-]+)\.md(#[a-z0-9-]+)?")
"""A page of this site named in a docstring, as `--help` shows it (docs/object-stores.md): a link on the site."""


def _text(text: str) -> str:
    """Docstring text as Markdown that shows what it says: outside code spans (which Markdown escapes itself),
    `<`, `>` and `&` become entities, so `runs/<name>/` is not read as an HTML tag, `*` and `_` are
    backslashed, so `c4_en/*.npy; v3_small/*.npy` does not turn into italics, and a page named as
    docs/object-stores.md becomes a link to it (its text unchanged)."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    out = []
    for p in parts:
        if p.startswith("`"):
            out.append(p)
            continue
        links = []  # page references, kept out of the escaping (their `-`s and `#`s are link targets)

        def keep(m: re.Match) -> str:
            links.append(f"[{m.group(0)}]({m.group(1)}.md{m.group(2) or ''})")
            return f"\x00{len(links) - 1}\x00"

        p = re.sub(r"([*_])", r"\\\1", html.escape(PAGE_REF.sub(keep, p), quote=False))
        out.append(re.sub(r"\x00(\d+)\x00", lambda m: links[int(m.group(1))], p))
    return "".join(out)


def _cell(text: str) -> str:
    """One table cell: whitespace collapsed, `|` escaped outside code spans (the table extension ignores pipes
    inside backticks, and a backslash there would show)."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in parts)


def _breakable(code: str) -> str:
    """A name or flag as an HTML code span that may wrap after each `.`, `_` or `-` (<wbr>), so the reference's
    name columns stay narrow enough for the descriptions beside them at 1,280 px."""
    breaks = re.sub(r"(?<=[A-Za-z0-9])([._-])(?=[A-Za-z0-9])", r"\1<wbr>", html.escape(code, quote=False))
    return f"<code>{breaks}</code>"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return _cell(f"`{value!r}`")


def _nested(config_module, f: dataclasses.Field):
    cls = getattr(config_module, str(f.type), None)
    return cls if isinstance(cls, type) and dataclasses.is_dataclass(cls) else None


def sections(config_module=None) -> list[tuple[str, type, list[dataclasses.Field]]]:
    """(dotted prefix, dataclass, its leaf fields) for TrainConfig and every dataclass nested in it."""
    if config_module is None:
        from olmo3eqx import config as config_module
    out = []

    def walk(prefix: str, cls) -> None:
        leaves = [f for f in dataclasses.fields(cls) if _nested(config_module, f) is None]
        out.append((prefix, cls, leaves))
        for f in dataclasses.fields(cls):
            sub = _nested(config_module, f)
            if sub is not None:
                walk(f"{prefix}{f.name}.", sub)

    walk("", config_module.TrainConfig)
    return out


def entry_flags(usage: str) -> list[tuple[str, str]]:
    """(flag, what) of each entry flag in train.USAGE's two-column listing (continuation lines joined)."""
    rows: list[tuple[str, str]] = []
    for line in usage.splitlines():
        if line.lstrip().startswith("-"):
            flag, _, what = line.strip().partition("  ")
            rows.append((flag, what.strip()))
        elif line.strip() and rows:
            rows[-1] = (rows[-1][0], f"{rows[-1][1]} {line.strip()}")
    return rows


def reference_markdown() -> str:
    from olmo3eqx import train

    parts = ["## Entry flags", "",
             "Read before the config (they choose the YAML, the devices and the supervisor), as `train.py --help` "
             "lists them:", "", "| flag | what |", "|---|---|"]
    parts += [f"| {_breakable(flag)} | {_cell(_text(what))} |"
              for flag, what in entry_flags(train.USAGE.split("Entry flags (before the others):\n", 1)[1])]
    parts.append("")
    for prefix, cls, leaves in sections():
        title = prefix.rstrip(".") or "top level"
        parts += [f"## `{title}`" if prefix else "## Top level", ""]
        doc = inspect.cleandoc(cls.__doc__ or "")
        if doc and not doc.startswith(cls.__name__ + "("):  # not dataclasses' generated signature
            parts += [_text(doc), ""]
        docs = field_docs(cls)
        # the field's name with its flag under it, so the description has the column's width beside them
        parts += ["| field, flag | type | default | what |", "|---|---|---|---|"]
        for f in leaves:
            name = prefix + f.name
            kind = _cell(f"`{f.type}`")
            parts.append(f"| {name_and_flag(name)} | {kind} | {_default(f)} | {_cell(_text(docs.get(f.name, '')))} |")
        parts.append("")
    return "\n".join(parts)


def flag_of(name: str) -> str:
    """The command-line flag of a config field: `model.rope_scaling.factor` -> `--model.rope-scaling.factor`."""
    return "--" + name.replace("_", "-")


def name_and_flag(name: str) -> str:
    """A reference row's first cell: the field's dotted name, and its flag below it."""
    return f"{_breakable(name)}<br>{_breakable(flag_of(name))}"


def on_config(config):
    """pymdownx.snippets finds its files under docs/snippets/ whatever directory mkdocs runs from (its base_path
    is otherwise read relative to the working directory)."""
    from pathlib import Path

    snippets = config["mdx_configs"].get("pymdownx.snippets")
    if snippets is not None:
        snippets["base_path"] = [str(Path(config["docs_dir"]) / "snippets")]
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:  # in a div the stylesheet knows (docs/stylesheets/extra.css), Markdown inside it
        reference = reference_markdown()
        return markdown.replace(MARKER, f'<div class="config-reference" markdown="1">\n\n{reference}\n\n</div>')
    return markdown
