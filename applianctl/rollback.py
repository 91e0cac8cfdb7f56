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
import time
from typing import Any

from appliance import atomic as state
from appliance.errors import Refused, UserError
from appliance.run import run
from applianctl import slots


def rollback(host: slots.Host | None = None, *, force: bool = False, running_version: str | None = None) -> str:
    host = host or slots.Host()
    running_version = running_version or slots.running_manifest()["version"]
    found = slots.slots(host, running_version)
    booted = next((s for s in found if s.booted), None)
    other = next((s for s in found if not s.booted), None)
    if booted is None or other is None:
        raise UserError("cannot tell the booted slot from the other one", hint="see applianctl status")
    if other.version is None:
        raise Refused(f"slot {other.name} holds no version ({other.usr.label})", hint="there is nothing to roll back to")
    by_version = {e.version: e for e in slots.entries(host)}
    target = by_version.get(other.version)
    if target is None:
        raise Refused(
            f"slot {other.name} ({other.version}) has no boot entry", hint="its install was interrupted; install a bundle instead"
        )
    current = by_version.get(booted.version or running_version)
    if current is None:
        raise UserError(f"no boot entry for the running version {running_version}", hint="see ls /efi/EFI/Linux")
    if target.state == "bad":
        if not force:
            raise Refused(
                f"{other.version} (slot {other.name}) used up its tries: it failed its assessment",
                hint="roll back to it anyway with --force",
            )
        target.path.rename(target.path.with_name(target.id))
    if current.state != "bad":
        current.path.rename(current.path.with_name(f"appliance_{current.version}+0.efi"))
    assert host.esp is not None
    state.fsync_dir(host.esp / "EFI" / "Linux")
    state.write_json_atomic(
        slots.update_dir() / "last-rollback.json",
        {
            "from_version": running_version,
            "to_version": other.version,
            "reason": "operator rollback",
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
    return f"slot {other.name} ({other.version}) boots next; {running_version} is marked as out of tries"


def cmd_rollback(args: argparse.Namespace) -> int:
    print(rollback(force=args.force))
    if args.reboot:
        run(["systemctl", "reboot"], "systemctl reboot", "reboot by hand")
    return 0


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("rollback", help="boot the other slot's version next")
    p.add_argument("--force", action="store_true", help="also to a version that failed its assessment")
    p.add_argument("--reboot", action="store_true", help="reboot now")
    p.set_defaults(func=cmd_rollback)
