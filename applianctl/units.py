# SPDX-License-Identifier: MIT
"""`applianctl logs` and `applianctl start|stop|restart`: journalctl and systemctl for the
appliance's units, by short name, so an operator never has to know the unit names."""

from __future__ import annotations

import argparse
import re
import shutil
from typing import Any

from appliance import cli_help, paths
from appliance.errors import UserError
from appliance.run import call, replace

# "engine" is every replica (journalctl and systemctl take the glob); one replica alone: engine@I.
LOG_UNITS = {
    "engine": paths.ENGINE_UNITS_GLOB,
    "proxy": "appliance-proxy.service",
    "verify": "appliance-verify.service",
    "shm": "appliance-shm-clean.service",
    "tls": "appliance-tls.service",
    "startup": "appliance-startup-report.service",
}
RESTART_UNITS = ("engine", "proxy")

for _unit in LOG_UNITS.values():
    assert _unit in (*paths.units(), paths.ENGINE_UNITS_GLOB), _unit
REPLICA = re.compile(r"engine@(0|[1-9][0-9]{0,2})")


def part_name(value: str) -> str:
    """argparse type of a unit's short name: refused at parse time (usage, exit status 2)."""
    if value in LOG_UNITS or REPLICA.fullmatch(value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: one of {', '.join(LOG_UNITS)} or engine@I (replica I)")


def unit_of(part: str) -> str:
    """The unit (or glob) of a short name: engine, engine@I, proxy, ..."""
    if REPLICA.fullmatch(part):
        return paths.engine_unit(int(part.partition("@")[2]))
    if part not in LOG_UNITS:
        raise UserError(f"no part {part!r}: one of {', '.join(LOG_UNITS)} or engine@I (replica I)", hint="applianctl logs engine")
    return LOG_UNITS[part]


def _exec(argv: list[str]) -> int:
    """Replace this process with ARGV (so journalctl -f owns the terminal and its signals)."""
    if shutil.which(argv[0]) is None:
        raise UserError(f"{argv[0]}: not installed", hint="run this on the appliance")
    replace(argv)


def logs_argv(args: argparse.Namespace) -> list[str]:
    argv = ["journalctl", "--no-pager", "-u", unit_of(args.part)]
    if args.follow:
        argv.append("-f")
    if args.lines is not None:
        argv += ["-n", str(args.lines)]
    if getattr(args, "since", None):
        argv += ["--since", args.since]  # journalctl's own forms: "1 hour ago", "today", "2026-08-04 10:00"
    return argv


def control_argv(verb: str, part: str, replicas: int | None = None) -> list[str]:
    """systemctl VERB on PART's units. "engine" names every replica's unit (REPLICAS, else the
    device's topology): systemctl's own globs match only units in memory, and a replica whose start
    failed at boot may not be."""
    if part not in RESTART_UNITS and not REPLICA.fullmatch(part):
        raise UserError(
            f"cannot {verb} {part!r}: only {' or '.join(RESTART_UNITS)} (or one replica, engine@I)", hint=f"applianctl {verb} engine"
        )
    if part == "engine":
        if replicas is None:
            from appliance.host_settings import load_device

            replicas = load_device().replicas
        return ["systemctl", verb, *paths.engine_units(replicas)]
    return ["systemctl", verb, unit_of(part)]


def restart_argv(part: str) -> list[str]:
    return control_argv("restart", part)


def run_logs(args: argparse.Namespace) -> int:
    return _exec(logs_argv(args))


def run_control(args: argparse.Namespace) -> int:
    argv = control_argv(args.verb, args.part)
    if args.verb in ("start", "restart"):
        # An operator's start is deliberate: it must not be refused because the unit's start limit
        # (five starts an hour, there to stop a crash loop) was used up by earlier failures.
        call(["systemctl", "reset-failed", *argv[2:]])
    return _exec(argv)


def run_restart(args: argparse.Namespace) -> int:
    args.verb = "restart"
    return run_control(args)


def add_parser(subparsers: Any) -> None:
    p = cli_help.verb_parser(
        subparsers, "logs", "show a unit's journal: " + ", ".join(LOG_UNITS),
        examples=['applianctl logs engine --since "1 hour ago"', "applianctl logs proxy -f"],
        exit_codes=[(0, "shown (journalctl's own status)"), (1, "journalctl failed"), cli_help.BAD_INPUT],
        details="Runs journalctl, which owns the terminal from then on.",
    )
    p.add_argument("part", nargs="?", default="engine", type=part_name,
                   help=f"which unit: {', '.join(LOG_UNITS)} or engine@I (default engine: every replica)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    p.add_argument("-n", "--lines", type=int, metavar="N", help="show the last N lines")
    p.add_argument("--since", metavar="WHEN", help='only lines since WHEN (journalctl: "1 hour ago", "today", "2026-08-04 10:00")')
    p.set_defaults(func=run_logs)

    for verb, what in (("start", "start"), ("stop", "stop"), ("restart", "restart (resetting its start limit)")):
        p = cli_help.verb_parser(
            subparsers, verb, f"{what} the engine or the proxy",
            examples=[f"applianctl {verb} engine", f"applianctl {verb} engine@1"],
            exit_codes=[(0, f"systemctl {verb} succeeded"), (1, f"systemctl {verb} failed (its own message)"), cli_help.BAD_INPUT],
        )
        p.add_argument("part", help="engine (every replica), engine@I (replica I) or proxy")
        p.set_defaults(func=run_control, verb=verb)
