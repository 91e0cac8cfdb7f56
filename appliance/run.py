"""One way to run a command on the device: its output, or a one-line UserError naming what failed."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

from appliance.errors import UserError


def run(argv: Sequence[str | Path], what: str, hint: str, timeout: float | None = 60.0) -> str:
    """Run ARGV (no stdin); its standard output, or a UserError naming WHAT with the last line of
    its stderr. A missing program and a timeout are reported the same way."""
    args = [str(a) for a in argv]
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise UserError(f"{what}: {args[0]} is not installed", hint=hint) from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{what}: {args[0]} did not finish within {timeout:g} s", hint=hint) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UserError(f"{what} failed: {last}", hint=hint)
    return proc.stdout
