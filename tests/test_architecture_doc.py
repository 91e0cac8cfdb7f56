# SPDX-License-Identifier: MIT
"""docs/architecture.md and the layout agree: every module of the core and of applianctl is in the
row of its package, and every module a row names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
NAMED = re.compile(r"`([a-z_]+)(?:\.py|/)?`")


def rows(package: str) -> list[tuple[str, str]]:
    """(first cell, whole row) of every table row in the doc's section of PACKAGE ("## appliance/ ..."):
    two packages may each have a subpackage of the same name."""
    found = []
    section = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].split()[0] if line[3:].strip() else ""
        if line.startswith("| `") and section == f"{package}/":
            found.append((line.split("|")[1], line))
    return found


def row_for(key: str, package: str) -> str:
    """The row of PACKAGE's section whose first cell names KEY (`status/` or `host.py`)."""
    hits = [row for first, row in rows(package) if f"`{key}`" in first]
    assert len(hits) == 1, f"docs/architecture.md: {len(hits)} rows name `{key}` in their first cell"
    return hits[0]


def modules(package: str) -> list[Path]:
    found = (ROOT / package).rglob("*.py")
    return sorted(p for p in found if p.name not in ("__init__.py", "__main__.py") and "__pycache__" not in p.parts)


@pytest.mark.parametrize("package", ["appliance", "applianctl"])
def test_every_module_is_in_its_packages_row(package: str) -> None:
    missing = []
    for path in modules(package):
        relative = path.relative_to(ROOT / package)
        key = f"{relative.parts[0]}/" if len(relative.parts) > 1 else relative.name
        names = set(NAMED.findall(row_for(key, package)))
        if path.stem not in names:
            missing.append(str(path.relative_to(ROOT)))
    assert missing == []


@pytest.mark.parametrize("package", ["appliance", "applianctl"])
def test_every_module_a_row_names_exists(package: str) -> None:
    ghosts = []
    for first, row in rows(package):
        sub = re.fullmatch(r"\s*`([a-z_]+)/`\s*", first)
        if sub and (ROOT / package / sub.group(1)).is_dir():
            directory = ROOT / package / sub.group(1)
            ghosts += [f"{directory.name}/{n}.py" for n in re.findall(r"`([a-z_]+)\.py`", row) if not (directory / f"{n}.py").is_file()]
    assert ghosts == []


def test_the_top_level_of_applianctl_is_a_handful() -> None:
    top = sorted(p.stem for p in (ROOT / "applianctl").glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 6, top
