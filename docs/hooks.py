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


def _text(text: str) -> str:
    """Docstring text as Markdown that shows what it says: outside code spans (which Markdown escapes itself),
    `<`, `>` and `&` become entities, so `runs/<name>/` is not read as an HTML tag, and `*` and `_` are
    backslashed, so `c4_en/*.npy; v3_small/*.npy` does not turn into italics."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(p if p.startswith("`") else re.sub(r"([*_])", r"\\\1", html.escape(p, quote=False))
                   for p in parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return f"`{_cell(repr(value))}`"


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


def reference_markdown() -> str:
    from olmo3eqx import train

    parts = ["## Entry flags", "",
             "Read before the config (they choose the YAML, the devices and the supervisor), as `train.py --help` "
             "lists them:", "", "```", train.USAGE.split("Entry flags (before the others):\n", 1)[1].rstrip(), "```",
             ""]
    for prefix, cls, leaves in sections():
        title = prefix.rstrip(".") or "top level"
        parts += [f"## `{title}`" if prefix else "## Top level", ""]
        doc = inspect.cleandoc(cls.__doc__ or "")
        if doc and not doc.startswith(cls.__name__ + "("):  # not dataclasses' generated signature
            parts += [_text(doc), ""]
        docs = field_docs(cls)
        parts += ["| field | flag | type | default | what |", "|---|---|---|---|---|"]
        for f in leaves:
            name = prefix + f.name
            flag = "--" + name.replace("_", "-")
            parts.append(f"| `{name}` | `{flag}` | `{_cell(str(f.type))}` | {_default(f)} | "
                         f"{_cell(_text(docs.get(f.name, '')))} |")
        parts.append("")
    return "\n".join(parts)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, reference_markdown())
    return markdown
