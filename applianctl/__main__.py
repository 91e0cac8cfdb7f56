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
from applianctl.errors import UserError

# One module per concern; each registers its own subcommand(s).
COMMAND_MODULES = (
    "applianctl.status",
    "applianctl.smoke",
    "applianctl.verify",
    "applianctl.tls",
    "applianctl.shm",
    "applianctl.startup",
    "applianctl.units",
    "applianctl.preflight",
    "applianctl.bootcheck",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="applianctl", description="Inspect and operate the appliance.")
    parser.add_argument("--version", action="version", version=f"applianctl {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except UserError as e:
        if args.debug:
            raise
        print(f"applianctl: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
