# SPDX-License-Identifier: MIT
"""No import cycle among the project's modules, counting imports inside functions: a cycle hidden
by a late import still ties two modules together (and breaks when someone hoists the import)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("appliance", "builder", "applianctl", "installer", "standin", "demo", "bench", "testkit")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else ():
            found[module_name(path)] = path
    return found


def imported(tree: ast.AST, this: str, is_package: bool, known: set[str]) -> set[str]:
    """The project modules THIS imports anywhere in its text. `from P import n` counts P.n when
    that is a module, else P; a package's __init__ counts as its own node."""
    base = this if is_package else this.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
                source = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in known:
                    out.add(f"{source}.{alias.name}")
                elif source in known:
                    out.add(source)
    # Importing a.b.c runs a/__init__ and a/b/__init__ first; a package that `this` lives in is
    # already being imported, so only other packages count.
    own = {".".join(this.split(".")[:i]) for i in range(1, this.count(".") + 1)}
    for target in list(out):
        parts = target.split(".")
        out.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in known and p not in own)
    out.discard(this)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    known = set(modules)
    return {
        name: imported(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py", known)
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycle_anywhere() -> None:
    assert cycles(import_graph()) == []


def test_the_graph_sees_imports_inside_functions(tmp_path: Path) -> None:
    late = ast.parse("def f():\n    from applianctl.slots import view\n")
    assert imported(late, "applianctl.update.staged", False, {"applianctl.slots.view", "applianctl.slots"}) == {
        "applianctl.slots.view",
        "applianctl.slots",
    }


def test_importing_a_submodule_runs_its_package() -> None:
    # host_settings -> appliance.config.checks also runs appliance/config/__init__.py
    tree = ast.parse("from appliance.config import checks\n")
    known = {"appliance", "appliance.config", "appliance.config.checks"}
    assert imported(tree, "appliance.host_settings", False, known) == {"appliance.config", "appliance.config.checks"}
    assert imported(tree, "appliance.config.model", False, known) == {"appliance.config.checks"}


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set()}, []),
    ],
)
def test_cycles_are_found(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected


def test_the_graph_knows_the_modules() -> None:
    graph = import_graph()
    assert "applianctl.slots.view" in graph
    assert "appliance.errors" in graph["appliance.schema"]
    assert "appliance.errors" in graph["applianctl.__main__"]
