"""`applianctl logs` and `applianctl restart`: journalctl and systemctl for the appliance's units,
by short name, so an operator never has to know the unit names."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from typing import Any

from applianctl import paths
from applianctl.errors import UserError

LOG_UNITS = {
    "engine": paths.ENGINE_UNIT,
    "proxy": "appliance-proxy.service",
    "verify": "appliance-verify.service",
    "shm": "appliance-shm-clean.service",
    "tls": "appliance-tls.service",
    "startup": "appliance-startup-report.service",
}
RESTART_UNITS = ("engine", "proxy")

for _unit in LOG_UNITS.values():
    assert _unit in paths.UNITS, _unit


def _exec(argv: list[str]) -> int:
    """Replace this process with ARGV (so journalctl -f owns the terminal and its signals)."""
    if shutil.which(argv[0]) is None:
        raise UserError(f"{argv[0]}: not installed", hint="run this on the appliance")
    os.execvp(argv[0], argv)


def logs_argv(args: argparse.Namespace) -> list[str]:
    argv = ["journalctl", "--no-pager", "-u", LOG_UNITS[args.part]]
    if args.follow:
        argv.append("-f")
    if args.lines is not None:
        argv += ["-n", str(args.lines)]
    return argv


def restart_argv(part: str) -> list[str]:
    if part not in RESTART_UNITS:
        raise UserError(f"cannot restart {part!r}: only {' or '.join(RESTART_UNITS)}", hint="applianctl restart engine")
    return ["systemctl", "restart", LOG_UNITS[part]]


def run_logs(args: argparse.Namespace) -> int:
    return _exec(logs_argv(args))


def run_restart(args: argparse.Namespace) -> int:
    argv = restart_argv(args.part)
    # An operator's restart is deliberate: it must not be refused because the unit's start limit
    # (five starts an hour, there to stop a crash loop) was used up by earlier failures.
    subprocess.run(["systemctl", "reset-failed", argv[-1]], check=False, capture_output=True)
    return _exec(argv)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("logs", help="show a unit's journal: " + ", ".join(LOG_UNITS))
    p.add_argument("part", nargs="?", default="engine", choices=tuple(LOG_UNITS), help="which unit (default engine)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("-n", "--lines", type=int, metavar="N", help="show the last N lines")
    p.set_defaults(func=run_logs)

    p = subparsers.add_parser("restart", help="restart the engine or the proxy")
    p.add_argument("part", help="engine or proxy")
    p.set_defaults(func=run_restart)
