# SPDX-License-Identifier: MIT
"""The repository stands alone: no file of it reads, or sends a reader to, anything beside it.

The recorded tool outputs the tests read are in tests/fixtures/ (README.md there says where each
came from); the production stack the appliance reproduces is docs/reference-stack.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from repository import FIXTURES, repository_files

pytestmark = pytest.mark.programs  # runs git (make unit, not make check)

ROOT = Path(__file__).resolve().parents[1]
# The changelog tells the project's history, which may name where things used to be.
EXEMPT = {"CHANGELOG.md", "tests/test_stands_alone.py"}
OUTSIDE = re.compile(
    rb"\.\./shared"  # a path beside the repository
    rb"|shared/fixtures"
    rb"|REFERENCE-STACK"
    rb"""|\.parents?(\[\d+\])?\s*/\s*["']shared["']"""  # the same path built in code
)
RECORDED = ("gpu", "vllm", "tuning")




def test_no_file_points_outside_the_repository() -> None:
    found = []
    for name in repository_files(EXEMPT):
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, or a dangling link
            continue
        for number, line in enumerate(path.read_bytes().splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{name}:{number}: {line.decode(errors='replace').strip()[:120]}")
    assert not found, "\n".join(found)


def test_every_recording_has_its_provenance() -> None:
    readme = (FIXTURES / "README.md").read_text()
    recordings = sorted(p for d in RECORDED for p in (FIXTURES / d).iterdir() if p.is_file())
    assert recordings
    missing = [str(p.relative_to(FIXTURES)) for p in recordings if f"`{p.name}`" not in readme]
    assert not missing, f"not described in tests/fixtures/README.md: {missing}"
