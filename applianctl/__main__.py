# SPDX-License-Identifier: MIT
"""applianctl: the appliance's own command line, on the device.

Each subcommand lives in its own module, which defines `add_parser(subparsers)`; the parser it
adds sets `func(args) -> int`. Faults the operator can fix raise UserError: one line, a hint,
exit status 2; a traceback only with --debug.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys

from appliance import cli_help, run
from appliance.errors import UserError, run_reporting
from applianctl import __version__

# One module per concern; each registers its own subcommand(s). Only the module of the command
# being run is imported: on a slow machine, importing cryptography or pydbus for `applianctl
# verify` or `shm-clean` would cost seconds before every engine start.
COMMAND_MODULES = {
    "status": "applianctl.status.collect",
    "smoke": "applianctl.engine.smoke",
    "verify": "applianctl.slots.release_verify",
    "etc-reset": "applianctl.slots.release_verify",  # hidden: the initrd's, before systemd reads /etc
    "tls": "applianctl.tls",
    "shm-clean": "applianctl.engine.shm",
    "startup-report": "applianctl.engine.startup",
    "logs": "applianctl.units",
    "start": "applianctl.units",
    "stop": "applianctl.units",
    "restart": "applianctl.units",
    "preflight": "applianctl.engine.preflight",
    "update": "applianctl.update.command",
    "assess": "applianctl.slots.assess",
    "rollback": "applianctl.slots.rollback",
    "crashloop": "applianctl.slots.crashloop",  # hidden: appliance-crashloop.service and its timer
    "slots": "applianctl.slots.command",
    "model": "applianctl.model.command",
    "factory-reset": "applianctl.factory_reset",
    "support-bundle": "applianctl.support_bundle.tarball",
    "var-seal": "applianctl.var.tpm_seal",  # hidden: appliance-var-seal.service
    "selftest": "applianctl.selftest.command",
    "stagger": "applianctl.engine.stagger",  # hidden: each replica's wait for the previous one
    "judge": "applianctl.judge.command",  # hidden: appliance-judge.service
    "remediation": "applianctl.judge.clear",
    "attest": "applianctl.attest.command",
    "attest-serve": "applianctl.attest.service",  # hidden: appliance-attest.service
}


# Status follows the monitoring-plugin (Nagios) convention: 0 ok, 1 degraded, 2 down, 3 unknown;
# "unknown" includes a status that could not run at all, e.g. a mistyped option.
STATUS_UNKNOWN = 3


def release_version() -> str:
    """The release this image is (its configuration's appliance.version); the package's version
    when not run on an appliance."""
    from appliance import paths
    from appliance.errors import UserError
    from appliance.safe_read import MAX_RECORD_BYTES, loads_bounded, read_capped

    for path, keys in ((paths.CONFIG_JSON, ("appliance", "version")), (paths.MANIFEST, ("version",))):
        try:
            data = read_capped(path, MAX_RECORD_BYTES, what="a release file")
            value: object = loads_bounded(data) if data is not None else None
            for key in keys:
                value = value[key]  # type: ignore[index]
        except (OSError, UserError, ValueError, KeyError, TypeError):
            continue
        if isinstance(value, str) and value:
            return value
    return __version__


class _Version(argparse.Action):
    """--version, reading the image's files only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the release version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kw: object) -> None:
        print(f"applianctl {release_version()}")
        parser.exit(0)


def global_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """Options that work before or after the command: on the top parser with their defaults, on
    each command's parser with SUPPRESS so that an absent option does not reset them."""
    default = (lambda value: value) if top else (lambda value: argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true", default=default(False), help="show tracebacks")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="applianctl")
    cli_help.describe(
        parser, "Inspect and operate the appliance.",
        examples=["applianctl status", "applianctl --debug verify"],
        exit_codes=[cli_help.OK, (1, "the command found a fault, or was refused"), cli_help.BAD_INPUT],
        details="Each COMMAND's --help names its own exit statuses (status: 0 ok, 1 degraded, 2 down, 3 unknown).",
    )
    parser.add_argument("--version", action=_Version)
    global_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = [COMMAND_MODULES[command]] if command in COMMAND_MODULES else COMMAND_MODULES.values()
    for name in dict.fromkeys(wanted):
        importlib.import_module(name).add_parser(sub)
    for p in sub.choices.values():
        global_options(p, top=False)
    return parser


def _command(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def status_unknown(what: str, hint: str) -> int:
    """Status could not run: "unknown" (3), never "down" (2), which a monitor would page on as an
    outage. Stderr is what went wrong and what to do, one line each (docs/status-schema.md)."""
    print(f"applianctl status: unknown: {what}".splitlines()[0], file=sys.stderr)
    print(f"hint: {hint}".splitlines()[0], file=sys.stderr)
    return STATUS_UNKNOWN


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = _command(argv)
    parser = build_parser(command)
    said = io.StringIO()  # argparse's usage and error, for status reworded as its two lines
    try:
        with contextlib.redirect_stderr(said) if command == "status" else contextlib.nullcontext():
            args = parser.parse_args(argv)
    except SystemExit as e:
        if command == "status" and e.code not in (0, None):
            lines = said.getvalue().strip().splitlines() or ["the command line is not valid"]
            return status_unknown(lines[-1].split(": error: ", 1)[-1], "see `applianctl status --help`")
        sys.stderr.write(said.getvalue())
        raise
    sys.stderr.write(said.getvalue())
    run.set_debug(args.debug)
    if not getattr(args, "func", None):
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: a COMMAND is required (`{parser.prog} --help` lists them)", file=sys.stderr)
        return 2
    if command == "status" and not args.debug:
        try:
            return int(args.func(args))
        except UserError as e:
            return status_unknown(e.message, e.hint or "see `applianctl status --help`")
        except Exception as e:  # could not run: "unknown", never a traceback a monitor would parse as "down"
            return status_unknown(f"{type(e).__name__}: {e}", "run `applianctl --debug status` to see where it failed")
    return run_reporting(lambda: args.func(args), prefix="applianctl: ", debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
