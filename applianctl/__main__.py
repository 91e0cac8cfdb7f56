"""applianctl: the appliance's own command line, on the device.

Each subcommand lives in its own module, which defines `add_parser(subparsers)`; the parser it
adds sets `func(args) -> int`. Faults the operator can fix raise UserError: one line, a hint,
exit status 2; a traceback only with --debug.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from applianctl import __version__
from applianctl.errors import run_reporting

# One module per concern; each registers its own subcommand(s). Only the module of the command
# being run is imported: on a slow machine, importing cryptography or pydbus for `applianctl
# verify` or `shm-clean` would cost seconds before every engine start.
COMMAND_MODULES = {
    "status": "applianctl.status",
    "smoke": "applianctl.smoke",
    "verify": "applianctl.verify",
    "tls": "applianctl.tls",
    "shm-clean": "applianctl.shm",
    "startup-report": "applianctl.startup",
    "logs": "applianctl.units",
    "restart": "applianctl.units",
    "preflight": "applianctl.preflight",
    "bootcheck": "applianctl.bootcheck",
    "update": "applianctl.update",
    "assess": "applianctl.assess",
    "rollback": "applianctl.rollback",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="applianctl", description="Inspect and operate the appliance.")
    parser.add_argument("--version", action="version", version=f"applianctl {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = [COMMAND_MODULES[command]] if command in COMMAND_MODULES else COMMAND_MODULES.values()
    for name in dict.fromkeys(wanted):
        importlib.import_module(name).add_parser(sub)
    return parser


def _command(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return run_reporting(lambda: args.func(args), prefix="applianctl: ", debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
