# SPDX-License-Identifier: MIT
"""`applianctl rollback`: boot the other slot's version next, and from then on.

systemd-boot orders entries with no tries left last and the rest newest first; it has no other
notion of "good" or "bad". So the rollback marks the running version's entry as out of tries
(`appliance_VERSION+0.efi`, the same state a failed assessment ends in): the other slot's entry
becomes the default, for good, with no EFI variable written. The other version must be whole
(its /usr slot labelled with its version and its kernel image present) and not itself out of
tries (a version that failed its assessment) unless --force, which then marks it good.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import applianctl.slots.view
from appliance import atomic, cli_help, paths
from appliance.errors import Refused, UserError
from appliance.run import run
from applianctl.records import LastRollback
from applianctl.slots import history, release
from applianctl.slots.entries import BAD
from applianctl.slots.machine import Host

OPERATOR_REASON = "operator rollback"  # last-rollback.json's reason when `applianctl rollback` made it


def rollback(host: Host | None = None, *, force: bool = False, running_version: str | None = None,
             reason: str = OPERATOR_REASON) -> str:
    host = host or Host()
    running_version = running_version or release.running_manifest().version
    view = applianctl.slots.view.read(host, running_version)
    booted, other = view.booted, view.other
    if booted is None or other is None:
        why = f" ({'; '.join(view.errors)})" if view.errors else ""
        raise UserError(f"cannot tell the booted slot from the other one{why}", hint="see applianctl slots")
    if other.version is None:
        raise Refused(f"slot {other.name} holds no version ({other.usr.label})", hint="there is nothing to roll back to")
    target = view.entry(other.version)
    if target is None:
        raise Refused(
            f"slot {other.name} ({other.version}) has no boot entry", hint="its install was interrupted; install a bundle instead"
        )
    current = view.entry(booted.version or running_version)
    if current is None:
        raise UserError(f"no boot entry for the running version {running_version}", hint="see applianctl slots")
    if target.state == BAD:
        if not force:
            raise Refused(
                f"{other.version} (slot {other.name}) used up its tries: it failed its assessment",
                hint="roll back to it anyway with --force",
            )
        target.path.rename(target.renamed(None))
    if current.state != BAD:
        current.path.rename(current.renamed(0))
    atomic.fsync_dir(current.path.parent)
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        history.write(paths.last_rollback_path(), LastRollback(running_version, other.version, reason, at))
    except UserError as e:  # the entries decide what boots; the record only says why
        print(f"{e.message}; the rollback is done, unrecorded", file=sys.stderr)
    return f"slot {other.name} ({other.version}) boots next; {running_version} is marked as out of tries"


def cmd_rollback(args: argparse.Namespace) -> int:
    print(rollback(force=args.force))
    if args.reboot:
        run(["systemctl", "reboot"], "systemctl reboot", "reboot by hand")
    return 0


def add_parser(subparsers: Any) -> None:
    p = cli_help.verb_parser(
        subparsers, "rollback", "boot the other slot's version next",
        examples=["applianctl rollback --reboot"],
        exit_codes=[(0, "the other slot's version boots next"),
                    (1, "refused: the other slot holds no version, or one that failed its assessment (without --force)"),
                    cli_help.BAD_INPUT],
    )
    p.add_argument("--force", action="store_true", help="also to a version that failed its assessment")
    p.add_argument("--reboot", action="store_true", help="reboot now")
    p.set_defaults(func=cmd_rollback)
