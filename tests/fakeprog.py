# SPDX-License-Identifier: MIT
"""Fake programs for tests to put on PATH, each recording its whole argument vector.

`fake_program(bin_dir, name, ...)` writes BIN_DIR/NAME, a `#!/bin/sh` script (it needs neither the
venv's python nor anything on PATH but `/bin/sh`; a script body may of course call other
programs) that first appends one record of how it was called to a log, then prints STDOUT, runs
SCRIPT_BODY and exits with EXIT. `calls(log)` reads the records back as argument vectors,
`[name, arg1, ...]`, one per call and in order, each argument exactly as passed (spaces, newlines
and empty arguments kept).

A record is NUL-terminated fields: the argument count, the name, then each argument. The log path
is written into the script, so a fake works whatever environment it is run with."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

LOG = "calls.log"  # the default log, in BIN_DIR


def sh_record(log: Path, name: str, args: str = '"$@"') -> str:
    """The shell line appending one record to LOG: NAME followed by the shell words ARGS (which
    must expand to the arguments one word each, as "$@" does)."""
    return f'set -- {args}; printf \'%s\\0\' "$#" {shlex.quote(name)} "$@" >> {shlex.quote(str(log))}'


def fake_program(
    bin_dir: Path, name: str, script_body: str = "", exit: int = 0, stdout: str | None = None, log: Path | None = None
) -> Path:
    """Write BIN_DIR/NAME, executable; its calls go to LOG (default BIN_DIR/calls.log). Returns its path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = log if log is not None else bin_dir / LOG
    lines = ["#!/bin/sh", f"({sh_record(log, name)})"]
    if stdout is not None:
        lines.append(f"printf '%s' {shlex.quote(stdout)}")
    if script_body:
        lines.append(script_body.rstrip("\n"))
    lines.append(f"exit {exit}")
    path = bin_dir / name
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


def record(log: Path | str, argv: list[str]) -> None:
    """Append the call ARGV (name first) to LOG as a fake program does, for a fake written in Python."""
    data = "".join(f"{field}\0" for field in [str(len(argv) - 1), *argv]).encode("utf-8", "surrogateescape")
    with open(log, "ab") as f:
        f.write(data)


def calls(log: Path, name: str | None = None) -> list[list[str]]:
    """Every call recorded in LOG (none if it does not exist), or only NAME's: [name, arg1, ...] each."""
    if not os.path.exists(log):
        return []
    fields = Path(log).read_bytes().decode("utf-8", "surrogateescape").split("\0")
    if fields[-1] != "":
        raise ValueError(f"{log}: a record is cut short")
    fields.pop()
    found: list[list[str]] = []
    i = 0
    while i < len(fields):
        count = int(fields[i])
        argv = fields[i + 1 : i + 2 + count]
        if len(argv) != count + 1:
            raise ValueError(f"{log}: a record is cut short")
        found.append(argv)
        i += 2 + count
    return [argv for argv in found if name is None or argv[0] == name]
