# SPDX-License-Identifier: MIT
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


def test_no_whole_value_pattern_lets_a_trailing_newline_through() -> None:
    """`$` also matches before a final newline, so `^[0-9a-f]{64}$` accepts "<hash>\\n" and a value
    checked by it could carry a line break into a unit file, a Caddyfile or a path: whole-value
    patterns end in `\\Z`."""
    offenders = []
    for package in ("appliance", "applianctl", "builder", "installer", "testkit", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") in {"compile", "match", "fullmatch", "search"}):
                    continue
                if not node.args or "MULTILINE" in ast.dump(node) or "attr='M'" in ast.dump(node):
                    continue  # a line-by-line pattern means its `$`
                pattern = node.args[0]
                tail = pattern.values[-1] if isinstance(pattern, ast.JoinedStr) and pattern.values else pattern
                if isinstance(tail, ast.Constant) and isinstance(tail.value, str) and tail.value.endswith("$"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_core_patterns_refuse_a_trailing_newline() -> None:
    from appliance import hashing, patterns

    assert hashing.SHA256.match("a" * 64) and not hashing.SHA256.match("a" * 64 + "\n")
    assert hashing.DIGEST.match("sha256:" + "a" * 64) and not hashing.DIGEST.match("sha256:" + "a" * 64 + "\n")
    assert patterns.VERSION.match("1.2.3") and not patterns.VERSION.match("1.2.3\n")
