# SPDX-License-Identifier: MIT
"""Every source file says its licence in its first lines (SPDX), as LICENSE gives it. Exempt: the
overlays, pinned by hash (SHA256SUMS), which patch upstream vLLM files; and the stand-in engine's
modules, whose bytes make the demo engine image and so its pinned digest."""

from __future__ import annotations

from pathlib import Path

import pytest
from repository import repository_files

ROOT = Path(__file__).resolve().parents[1]
SPDX = "SPDX-License-Identifier: MIT"
EXEMPT = ("overlays/", "tests/fixtures/", "standin/")

pytestmark = pytest.mark.programs  # git ls-files


def sources() -> list[str]:
    return [f for f in repository_files() if not f.startswith(EXEMPT) and (ROOT / f).is_file()
            and (f.endswith((".py", ".sh")) or f.startswith("tools/") or f in ("Makefile", ".ci/run"))]


def head_says_licence(text: str) -> bool:
    return any(SPDX in line for line in text.splitlines()[:3])


def test_every_source_file_names_its_licence() -> None:
    missing = [f for f in sources() if not head_says_licence((ROOT / f).read_text(errors="replace"))]
    assert missing == [], f"add '# {SPDX}' at the top of: {missing}"


def test_the_licence_file_is_mit() -> None:
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_a_file_without_the_line_is_found() -> None:
    assert not head_says_licence('"""A module."""\nimport os\n')
    assert head_says_licence(f"#!/usr/bin/env python3\n# {SPDX}\n")
