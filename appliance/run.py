# SPDX-License-Identifier: MIT
"""The one way the product runs another program, on the device, the build host and the installer:
`call` runs it (by default no stdin, output captured as text, a timeout; INPUT as its stdin;
without CAPTURE it shares the terminal, as mkosi's long build does); `call_bytes` is `call` for
binary output; `checked` is `call` for commands whose failure is an error, reported once as a
one-line UserError naming what failed; `run` is `checked`'s output; `start` leaves a program
running (a daemon, QEMU, a stream read line by line); `replace` becomes the program (exec).

Under --debug (`set_debug(True)`, from each command line's --debug) each command line is printed,
shell-quoted, to stderr before it runs: the arguments only, never the environment or the input,
which is where a secret belongs (none goes into argv: a process's arguments are public in /proc).

Nothing else in appliance/, applianctl/, builder/ or installer/ imports subprocess or calls
os.exec* (tests/test_run.py); the few names of subprocess that callers need are here."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from appliance.errors import UserError

# subprocess's names a caller needs (to catch, to annotate, to connect a stream), so that it need not import it
CompletedProcess = subprocess.CompletedProcess
Popen = subprocess.Popen
TimeoutExpired = subprocess.TimeoutExpired
SubprocessError = subprocess.SubprocessError
DEVNULL = subprocess.DEVNULL
PIPE = subprocess.PIPE

_debug = False


def set_debug(on: bool) -> None:
    """Print each command line before it runs (--debug), or stop."""
    global _debug
    _debug = on


def _announce(args: Sequence[str]) -> None:
    if _debug:
        print(f"+ {shlex.join(args)}", file=sys.stderr, flush=True)


def _environment(env: Mapping[str, str] | None) -> dict[str, str] | None:
    return {**os.environ, **env} if env is not None else None


def call(
    argv: Sequence[str | Path],
    timeout: float | None = 60.0,
    *,
    capture: bool = True,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ARGV; the exit status is the caller's to judge. Without CAPTURE the command shares the
    caller's terminal (mkosi build); ENV is set on top of the caller's environment; INPUT is its
    stdin (else none, or the terminal's without CAPTURE).
    FileNotFoundError and subprocess.TimeoutExpired reach the caller."""
    args = [str(a) for a in argv]
    _announce(args)
    return subprocess.run(
        args,
        capture_output=capture,
        text=True,
        timeout=timeout,
        check=False,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL if capture else None,
        cwd=cwd,
        env=_environment(env),
    )


def call_bytes(argv: Sequence[str | Path], timeout: float | None = 60.0) -> subprocess.CompletedProcess[bytes]:
    """`call` ARGV for its binary output (stdout and stderr as bytes, no stdin)."""
    args = [str(a) for a in argv]
    _announce(args)
    return subprocess.run(args, capture_output=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL)


def checked(
    argv: Sequence[str | Path],
    what: str,
    hint: str,
    timeout: float | None = 60.0,
    *,
    capture: bool = True,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    missing_hint: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """`call` ARGV; a failure is a UserError naming WHAT: a missing program (with MISSING_HINT
    when given), a timeout, or a non-zero exit with the last line of its stderr (when captured)."""
    args = [str(a) for a in argv]
    try:
        proc = call(args, timeout, capture=capture, cwd=cwd, env=env, input=input)
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


def run(
    argv: Sequence[str | Path], what: str, hint: str, timeout: float | None = 60.0, *, input: str | None = None
) -> str:
    """Run ARGV (no stdin but INPUT); its standard output, or a UserError naming WHAT with the last
    line of its stderr. A missing program and a timeout are reported the same way."""
    return checked(argv, what, hint, timeout, input=input).stdout


def start(
    argv: Sequence[str | Path],
    *,
    stdout: int | None = DEVNULL,
    stderr: int | None = DEVNULL,
    pass_fds: Collection[int] = (),
) -> subprocess.Popen[bytes]:
    """Start ARGV and leave it running (no stdin; STDOUT and STDERR: DEVNULL, PIPE or None for
    ours; PASS_FDS kept open in it); waiting for it, and ending it, is the caller's."""
    args = [str(a) for a in argv]
    _announce(args)
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, pass_fds=tuple(pass_fds))


def replace(argv: Sequence[str | Path]) -> NoReturn:
    """Become ARGV (exec, found on PATH): it gets this process's terminal and signals."""
    args = [str(a) for a in argv]
    _announce(args)
    os.execvp(args[0], args)
