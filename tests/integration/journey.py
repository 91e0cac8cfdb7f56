# SPDX-License-Identifier: MIT
"""The versions of the upgrade journey (conftest.py) and how to read its runs."""

from __future__ import annotations

from typing import Any

V1, V2, V3 = "1.0.0", "1.0.1", "1.0.2"


def reports_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every report of a QEMU run (the guest reboots within one), oldest first."""
    return [*run["earlier_boots"], run]
