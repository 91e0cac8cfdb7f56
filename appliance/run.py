"""One way to run a command on the device: `call` runs it (no stdin, output captured as text, a
timeout); `run` is `call` for commands whose failure is an error: their output, or a one-line
UserError naming what failed."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from appliance.errors import UserError


def call(argv: Sequence[str | Path], timeout: float | None = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ARGV with no stdin and its output captured; the exit status is the caller's to judge.
    FileNotFoundError (not installed) and subprocess.TimeoutExpired reach the caller."""
    args = [str(a) for a in argv]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL)


def run(argv: Sequence[str | Path], what: str, hint: str, timeout: float | None = 60.0) -> str:
    """Run ARGV (no stdin); its standard output, or a UserError naming WHAT with the last line of
    its stderr. A missing program and a timeout are reported the same way."""
    args = [str(a) for a in argv]
    try:
        proc = call(args, timeout)
    except FileNotFoundError:
        raise UserError(f"{what}: {args[0]} is not installed", hint=hint) from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{what}: {args[0]} did not finish within {timeout:g} s", hint=hint) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UserError(f"{what} failed: {last}", hint=hint)
    return proc.stdout
