# SPDX-License-Identifier: MIT
"""`python3 -m builder recovery-key`: the operator's side of /var's recovery key sealed in the
installer's report (appliance/recovery_seal.py).

`new --out DIR` makes the X25519 key pair (DIR/recovery.key, 0600, and DIR/recovery.pub) and prints
the line each plan's [report] takes (`recovery_recipient`); `open --key PATH REPORT.json` opens the
sealed key of one report kept by `builder flash --bmc` (OUTPUT/reports/NAME.json) and prints it,
on stdout only. The private key belongs off the machine that builds images and runs the flash: a
report is kept there, and whoever holds both holds every host's /var.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from appliance import cli_help, luks, recovery_seal
from appliance.errors import UserError
from appliance.safe_read import loads_bounded, read_capped
from builder import flash_report, keys

PRIVATE_NAME = "recovery.key"
PUBLIC_NAME = "recovery.pub"


def new(directory: Path) -> tuple[Path, Path, str]:
    """Write a new key pair into DIRECTORY (never over one); (private, public, the plan's line)."""
    private_path, public_path = directory / PRIVATE_NAME, directory / PUBLIC_NAME
    for path in (private_path, public_path):
        if path.exists() or path.is_symlink():
            raise UserError(f"{path}: a recovery key already exists",
                            hint="keep it (the plans name its public key), or give another --out to make a new one")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    private, public = recovery_seal.new_keypair()
    keys._write_new(private_path, private, 0o600)
    try:
        keys._write_new(public_path, public, 0o644)
    except BaseException:
        private_path.unlink(missing_ok=True)
        raise
    return private_path, public_path, plan_line(public.decode("ascii"))


def plan_line(public_pem: str) -> str:
    """The one TOML line that names PUBLIC_PEM as a plan's [report] recovery_recipient."""
    return 'recovery_recipient = """' + public_pem.replace("\n", "\\n") + '"""'


def open_report(key: Path, report: Path) -> str:
    """The recovery key sealed in REPORT (an installer's report), opened with the private key KEY."""
    hint = f"give the report `builder flash --bmc` kept for the host (OUTPUT/reports/NAME.json), not {report}"
    raw = read_capped(report, 4 * flash_report.MAX_REPORT_BYTES, what="an installer's report", hint=hint)
    if raw is None:
        raise UserError(f"{report}: no such file", hint=hint)
    try:
        doc = loads_bounded(raw)
    except ValueError:
        doc = None
    if wrong := flash_report.problem(doc):
        raise UserError(f"{report}: not an installer's report ({wrong})", hint=hint)
    assert isinstance(doc, dict)
    if flash_report.SEALED_KEY not in doc:
        raise UserError(f"{report}: holds no sealed recovery key" + (" (a re-install makes no new key)" if doc["reinstalled"] else ""),
                        hint="the key of the host's first install opens /var; a plan without [report] recovery_recipient "
                             "leaves the key on the console only")
    key_hint = f"give the private key `builder recovery-key new` wrote (mode 0600, yours): chmod 600 {key}"
    fd = flash_report.open_secret(key, f"--key {key}", key_hint, recovery_seal.MAX_PEM_BYTES)
    try:
        pem = os.read(fd, recovery_seal.MAX_PEM_BYTES + 1)
    finally:
        os.close(fd)
    try:
        plain = recovery_seal.open_sealed(pem, doc[flash_report.SEALED_KEY],
                                          recovery_seal.report_context(doc["host"], doc["plan_sha256"]))
    except ValueError as e:
        raise UserError(f"{report}: the recovery key of {doc['host']} does not open with {key}: {e}",
                        hint="give the private key whose public key the host's plan names as report.recovery_recipient; "
                             "a report changed after it arrived opens with no key") from None
    text = plain.decode("ascii", "replace")
    if not luks.RECOVERY_KEY.match(text):  # sealed by whoever holds the public key: only a key's form is printed
        raise UserError(f"{report}: what is sealed for {doc['host']} is not a recovery key",
                        hint="the report was not its installer's: read the key on the host's console, or install it again")
    return text


def cmd_recovery_key(args: argparse.Namespace) -> int:
    if args.recovery_command == "new":
        private, public, line = new(Path(args.out))
        print(f"private key {private} (mode 0600: keep it off the machine that builds images and runs the flash, "
              "offline, with a copy; it opens every host's sealed recovery key)", file=sys.stderr)
        print(f"public key  {public} (each plan's [report] recovery_recipient: the line below)", file=sys.stderr)
        print(line)
        return 0
    print(open_report(Path(args.key), Path(args.report)))
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = cli_help.verb_parser(
        sub, "recovery-key", "the key pair that /var's recovery key is sealed to in the installer's report, and opening it",
        examples=["python3 -m builder recovery-key new --out /secure/recovery",
                  "python3 -m builder recovery-key open --key /secure/recovery/recovery.key out/flash/fleet/reports/gpu-07.json"],
        exit_codes=[cli_help.OK, cli_help.BAD_INPUT],
        details="A plan whose [report] names recovery_recipient has its installer seal a fresh install's recovery key to it "
                "in the report that `builder flash --bmc` keeps. docs/install.md, \"The installer's report\".",
    )
    sub_p = p.add_subparsers(dest="recovery_command", metavar="ACTION", required=True)
    made = cli_help.verb_parser(
        sub_p, "new", "make the X25519 key pair and print the plans' recovery_recipient line",
        examples=["python3 -m builder recovery-key new --out /secure/recovery"],
        exit_codes=[(0, "written: the paths on stderr, the plan's line on stdout"),
                    (2, "bad input, or a key already there (never overwritten; one line and a hint)")],
    )
    made.add_argument("--out", required=True, metavar="DIR",
                      help=f"where to write {PRIVATE_NAME} (0600) and {PUBLIC_NAME}: a directory off the build machine")
    made.set_defaults(func=cmd_recovery_key)
    opened = cli_help.verb_parser(
        sub_p, "open", "print the recovery key sealed in one installer's report (stdout only)",
        examples=["python3 -m builder recovery-key open --key /secure/recovery/recovery.key out/flash/fleet/reports/gpu-07.json"],
        exit_codes=[(0, "the recovery key on stdout, one line"),
                    (2, "bad input: not a report, no sealed key in it, another key, a changed report, a key file others "
                        "can read (one line and a hint)")],
    )
    opened.add_argument("--key", required=True, metavar="PATH", help=f"the private key ({PRIVATE_NAME}: mode 0600, yours, not a link)")
    opened.add_argument("report", metavar="REPORT.json",
                        help="the host's report as `builder flash --bmc` kept it (OUTPUT/reports/NAME.json)")
    opened.set_defaults(func=cmd_recovery_key)
    return p
