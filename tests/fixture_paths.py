# SPDX-License-Identifier: MIT
"""Where the tests' recorded inputs are: tests/fixtures/ (its README.md says where each came from).

A module of its own, not conftest.py: tests/integration/ has a conftest.py too, and which one
`import conftest` finds depends on the order pytest collected them in.
"""

from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
