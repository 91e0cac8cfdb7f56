# SPDX-License-Identifier: MIT
"""The boot check's way of asking the guest: a command's output (never an exception: a fact that
could not be read is reported as such), JSON from a tool, a unit's property, a bounded wait, the
credentials the test host passed. Shared by the boot check's modules (demo images only)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_text(cmd: list[str], timeout: float = 20) -> str:
    """CMD's standard output, or "error: ..." when it could not run or ran out of time."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"error: {e}"


def run_json(cmd: list[str], timeout: float = 20) -> Any:
    """CMD's standard output as JSON; None when it is not JSON."""
    try:
        return json.loads(run_text(cmd, timeout=timeout))
    except json.JSONDecodeError:
        return None


def tail(text: str, limit: int) -> str:
    """The end of TEXT, at most LIMIT characters, from the start of a line."""
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    return cut.split("\n", 1)[1] if "\n" in cut else cut


def credential(name: str) -> str | None:
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return None
    path = Path(directory) / name
    return path.read_text().strip() if path.exists() else None


def unit_property(unit: str, name: str) -> str:
    return run_text(["systemctl", "show", "-P", name, unit]).strip()


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(2)
    return False


def ppid(pid: str) -> str | None:
    try:
        # the command name (field 2) is in parentheses and may hold spaces
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1]
    except (OSError, IndexError):
        return None


def proc_state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "gone"


def children_of(pid: str) -> list[str]:
    """The processes whose parent is PID, oldest (lowest PID) first."""
    return sorted((p.name for p in Path("/proc").iterdir() if p.name.isdigit() and ppid(p.name) == pid), key=int)
