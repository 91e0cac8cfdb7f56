# SPDX-License-Identifier: MIT
"""One way to run a command, on the device and on the build host: `call` runs it (by default no
stdin, output captured as text, a timeout); `checked` is `call` for commands whose failure is an
error, reported once as a one-line UserError naming what failed; `run` is `checked`'s output.
The builder's runner (builder/run.py) adds its --debug logging and defaults on top."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from appliance.errors import UserError


def call(
    argv: Sequence[str | Path],
    timeout: float | None = 60.0,
    *,
    capture: bool = True,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ARGV; the exit status is the caller's to judge. Without CAPTURE the command shares the
    caller's terminal (mkosi build); ENV is set on top of the caller's environment.
    FileNotFoundError and subprocess.TimeoutExpired reach the caller."""
    args = [str(a) for a in argv]
    return subprocess.run(
        args,
        capture_output=capture,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL if capture else None,
        cwd=cwd,
        env={**os.environ, **env} if env is not None else None,
    )


def checked(
    argv: Sequence[str | Path],
    what: str,
    hint: str,
    timeout: float | None = 60.0,
    *,
    capture: bool = True,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    missing_hint: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`call` ARGV; a failure is a UserError naming WHAT: a missing program (with MISSING_HINT
    when given), a timeout, or a non-zero exit with the last line of its stderr (when captured)."""
    args = [str(a) for a in argv]
    try:
        proc = call(args, timeout, capture=capture, cwd=cwd, env=env)
    except FileNotFoundError:
        raise UserError(f"{what}: {args[0]} is not installed", hint=missing_hint or hint) from None
    except PermissionError:
        # A directory on PATH the user may not search makes a missing program EACCES, not ENOENT.
        if os.sep not in args[0] and shutil.which(args[0]) is None:
            raise UserError(f"{what}: {args[0]} is not installed", hint=missing_hint or hint) from None
        raise UserError(f"{what}: {args[0]}: permission denied", hint="run it as a user that may run it (root?)") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{what}: {args[0]} did not finish within {timeout:g} s", hint=hint) from None
    if proc.returncode != 0:
        last = ((proc.stderr or "").strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UserError(f"{what} failed: {last}", hint=hint)
    return proc


def run(argv: Sequence[str | Path], what: str, hint: str, timeout: float | None = 60.0) -> str:
    """Run ARGV (no stdin); its standard output, or a UserError naming WHAT with the last line of
    its stderr. A missing program and a timeout are reported the same way."""
    return checked(argv, what, hint, timeout).stdout
