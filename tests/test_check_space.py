"""tools/check-space: `make test` stops in two lines, before building anything, on a disk too full."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_too_little_space_is_two_lines_and_exit_2() -> None:
    proc = subprocess.run([ROOT / "tools/check-space", "1000000", "the integration tests"], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    error, hint = proc.stderr.splitlines()
    assert error.startswith("error: the integration tests: /") and "about 1000000 GiB are needed" in error
    assert hint.startswith("hint: free space there")


def test_enough_space_says_nothing() -> None:
    proc = subprocess.run([ROOT / "tools/check-space", "0", "the integration tests"], capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
