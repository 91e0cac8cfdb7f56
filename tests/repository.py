# SPDX-License-Identifier: MIT
"""The repository as the tests see it: its root, where the recorded inputs are (tests/fixtures/,
whose README.md says where each came from), and the files git tracks or would track.

A module of its own, not conftest.py: tests/integration/ has a conftest.py too, and which one
`import conftest` finds depends on the order pytest collected them in.
"""

from __future__ import annotations

import subprocess
from collections.abc import Collection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def repository_files(exempt: Collection[str] = ()) -> list[str]:
    """Every file git tracks or would track (new files not yet added included), but EXEMPT."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and name not in exempt})
