"""The core package: builder/ and applianctl/ import appliance/, never each other; appliance/
imports neither and only what the image has (the standard library, Debian's cryptography and jinja2)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE_THIRD_PARTY = {"cryptography", "jinja2"}  # python3-cryptography, python3-jinja2 in the image


def _imports(package: str) -> dict[str, set[str]]:
    """Top-level module names each file of PACKAGE imports (absolute imports, at any depth)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


@pytest.mark.parametrize(("package", "forbidden"), [("builder", "applianctl"), ("applianctl", "builder")])
def test_builder_and_applianctl_never_import_each_other(package: str, forbidden: str) -> None:
    offenders = sorted(f for f, names in _imports(package).items() if forbidden in names)
    assert offenders == [], f"{package}/ imports {forbidden}/: {offenders}"


def test_the_core_imports_only_what_the_image_has() -> None:
    allowed = set(sys.stdlib_module_names) | IMAGE_THIRD_PARTY | {"appliance"}
    for path, names in _imports("appliance").items():
        assert names <= allowed, f"{path} imports {sorted(names - allowed)}"
