"""The import graph of src/olmo3eqx: no cycles, and no import from the library up into the commands.

Every `import` and `from ... import` of every module is read with `ast` (those inside functions and under
TYPE_CHECKING too: a cycle broken only by a deferred import is still a cycle a reader has to hold in their head).

The layers, bottom to top:
- STANDARD_LIBRARY_ONLY: exits, errors (what every module may import) and jaxenv (run before JAX starts) import
  nothing of the project but the modules listed beside them, and no third-party package;
- the library: every other module outside tools/, in any order the graph allows (without cycles);
- COMMANDS: tools/ and the modules pyproject's [project.scripts] names (train's cli, ...), which may import the
  library and each other, never the other way round. data/prepare is the exception: the data code and the tasks
  tokenize with its functions, and its `cli` is a thin wrapper over them (LIBRARY_WITH_CLI).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
PACKAGE = "olmo3eqx"
LIBRARY_WITH_CLI = {"olmo3eqx.data.prepare"}
STANDARD_LIBRARY_ONLY = {"olmo3eqx.exits": set(), "olmo3eqx.errors": {"olmo3eqx.exits"}, "olmo3eqx.jaxenv": set()}
"""Module -> the project modules it may import (and nothing outside the standard library)."""


def modules(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_names(module: str, path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of everything `module` imports, anywhere in it; `from a import b` gives a.b and a (b may
    be a submodule or a name defined in a)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names] + [(base, node.lineno)]
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {project module it imports: first line that does}; a name resolves to the longest module prefix
    (`from olmo3eqx.storage import path` is an edge to olmo3eqx.storage); the bare package is no edge (its __init__
    only names the version)."""
    graph = {}
    for module, path in mods.items():
        edges = {}
        for name, line in imported_names(module, path):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name not in (module, PACKAGE):
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def commands(mods: dict[str, Path]) -> set[str]:
    """tools/ and the modules of pyproject's console scripts, less LIBRARY_WITH_CLI."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    named = {target.partition(":")[0] for target in scripts.values()}
    assert named <= set(mods), f"console scripts name modules that do not exist: {sorted(named - set(mods))}"
    return ({m for m in mods if m.startswith(f"{PACKAGE}.tools")} | named) - LIBRARY_WITH_CLI


def upward_edges(graph: dict[str, dict[str, int]], top: set[str]) -> list[str]:
    return [f"{a} -> {b} (line {line})" for a, edges in sorted(graph.items()) if a not in top
            for b, line in sorted(edges.items()) if b in top]


def test_the_import_graph_has_no_cycle():
    graph = import_graph(modules())
    assert len(graph) > 50 and "olmo3eqx.storage" in graph["olmo3eqx.checkpoint.layout"]  # the reader sees packages
    found = cycles(graph)
    assert not found, "import cycles (break each by moving the shared piece down a layer): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_library_never_imports_a_command():
    mods = modules()
    top = commands(mods)
    assert {"olmo3eqx.train", "olmo3eqx.tools.evaluate"} <= top
    upward = upward_edges(import_graph(mods), top)
    assert not upward, "library modules import a command module (move what they need into the library): " + \
        "; ".join(upward)


def test_the_bottom_layer_imports_only_the_standard_library():
    mods = modules()
    graph = import_graph(mods)
    for module, allowed in STANDARD_LIBRARY_ONLY.items():
        assert set(graph[module]) <= allowed, f"{module} imports {sorted(set(graph[module]) - allowed)}"
        third_party = {name.partition(".")[0] for name, _ in imported_names(module, mods[module])} - \
            set(sys.stdlib_module_names) - {PACKAGE, "__future__"}
        assert not third_party, f"{module} imports {sorted(third_party)}, outside the standard library"


def test_the_checker_finds_a_cycle_and_an_upward_import(tmp_path):
    """The checker itself, on a made-up package: a <-> b through an import inside a function, and a library module
    importing tools/."""
    pkg = tmp_path / PACKAGE
    (pkg / "tools").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "tools" / "cmd.py").write_text("import json\n")
    (pkg / "a.py").write_text("from olmo3eqx.b import thing\n")
    (pkg / "b.py").write_text("def f():\n    from olmo3eqx import a\n\n\ndef g():\n    from .tools import cmd\n")
    graph = import_graph(modules(tmp_path))
    assert cycles(graph) == [["olmo3eqx.a", "olmo3eqx.b"]]
    assert upward_edges(graph, {"olmo3eqx.tools", "olmo3eqx.tools.cmd"}) == [
        "olmo3eqx.b -> olmo3eqx.tools (line 6)", "olmo3eqx.b -> olmo3eqx.tools.cmd (line 6)"]


def downward_only(package: str, order: list[str]) -> None:
    """Every module of `package` is placed in `order`, and imports only those before it (never the package's
    __init__, which gathers the API)."""
    mods = modules()
    graph = import_graph(mods)
    inside = {f"{PACKAGE}.{package}.{m}": i for i, m in enumerate(order)}
    assert set(inside) == {m for m in mods if m.startswith(f"{PACKAGE}.{package}.")}, \
        f"a {package} module not placed here"
    upward = [f"{a} -> {b}" for a, i in inside.items() for b in graph[a]
              if inside.get(b, -1) >= i or b == f"{PACKAGE}.{package}"]
    assert not upward, f"{package} modules importing a module at or above their own layer: " + "; ".join(upward)


def test_storage_is_a_package_whose_modules_import_downward_only():
    """paths at the bottom, then stores and retry, ranged, files, and append / versioned on top: a module of the
    package imports only those before it (the package's __init__ gathers the API)."""
    downward_only("storage", ["paths", "stores", "retry", "ranged", "files", "append", "versioned"])


def test_checkpoint_is_a_package_whose_modules_import_downward_only():
    """layout (directories, steps, the stored config) and failures (what an exception means) at the bottom, retention,
    then the model's save and load, and the training checkpointer on top."""
    downward_only("checkpoint", ["layout", "failures", "retention", "model", "checkpointer"])


def test_the_project_imports_checkpoint_names_from_the_module_that_owns_them():
    """olmo3eqx.checkpoint's __init__ keeps the names users import from it (load_model, load_any, ...); the project's
    own modules name the module that defines what they use, so a reader finds it in one step."""
    graph = import_graph(modules())
    via_init = [f"{a} (line {edges[f'{PACKAGE}.checkpoint']})" for a, edges in sorted(graph.items())
                if f"{PACKAGE}.checkpoint" in edges and a != f"{PACKAGE}.checkpoint"]
    assert not via_init, "modules importing olmo3eqx.checkpoint's __init__: " + "; ".join(via_init)
