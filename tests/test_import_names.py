# SPDX-License-Identifier: MIT
"""No project module is imported under another name: a module's name is the one the reader meets
everywhere, so that `grep` finds every use and a name never means two things."""

from __future__ import annotations

import ast

from repository import ROOT

PACKAGES = ("appliance", "applianctl", "builder", "installer", "standin", "testkit", "bench")


def _is_module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return dotted.split(".")[0] in PACKAGES and (path.with_suffix(".py").is_file() or (path / "__init__.py").is_file())


def renamed_imports(source: str) -> list[str]:
    """Every `import M as X` and `from P import M as X` in SOURCE where M is a project module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name} as {a.asname}" for a in node.names if a.asname and _is_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"from {node.module} import {a.name} as {a.asname}" for a in node.names
                      if a.asname and a.asname != a.name and _is_module(f"{node.module}.{a.name}")]
    return found


def test_the_scan_sees_a_renamed_project_module_and_not_a_renamed_name() -> None:
    assert renamed_imports("from appliance import paths as p\nimport applianctl.status.collect as c\n") == [
        "from appliance import paths as p", "import applianctl.status.collect as c"]
    assert renamed_imports("from appliance.paths import VAR as var\nimport json as j\nfrom appliance import paths\n") == []


def test_no_project_module_is_imported_under_another_name() -> None:
    offenders = []
    for top in (*PACKAGES, "tests", "tools", "image"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            offenders += [f"{path.relative_to(ROOT)}: {line}" for line in renamed_imports(path.read_text())]
    hint = "import the module by its own name (rename the module if its name does not say what it is):\n"
    assert offenders == [], hint + "\n".join(offenders)
