# SPDX-License-Identifier: MIT
"""The crash-loop guard: a version judged good that then ends boot after boot uncleanly goes back
to the other slot's version by itself.

Boot counting ends when systemd-bless-boot marks a version good at boot-complete.target; a
version that is blessed and *then* crashes (a kernel panic under load, a hardware watchdog reset,
the machine freezing an hour in) would boot, be killed and boot again forever, since nothing
counts its boots any more. So every boot of a version judged good is counted here
(update/boots.json), from early in the boot (appliance-crashloop.service, before the engine):

- a boot that ends cleanly (the unit's stop, at an orderly shutdown or reboot) or that served for
  STABLE_AFTER_S (the smoke completion through the proxy, as the assessment asks it:
  appliance-crashloop-stable.timer) resets the count;
- any other end (crash, reset, power cut) adds one; after CRASH_LOOP_BOOTS such boots in a row
  the version is marked out of tries, as `applianctl rollback` does, the reason recorded in
  update/last-rollback.json, and the machine reboots into the other slot's version, if that one
  is whole and not itself out of tries; otherwise it stays, and says so.

Boots on trial are not counted here: systemd-boot counts them. A version that crashes before
/var is mounted cannot be counted by anything that writes to /var; the count then stays where it
was (docs/upgrades.md).

A damaged record (not JSON, wrong types, a negative count, a directory, a FIFO or a link in its
place) counts as one unclean boot of the running version: what it counted is lost, and counting
from zero instead would let a crash that damages the record reset the count, boot after boot. One
damaged record alone never rolls a version back (that takes CRASH_LOOP_BOOTS - 1 unclean boots
more). The damage is one line in the journal; a record that is no regular file is renamed to
boots.json.damaged (never through a link), so the new count can be written in its place.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import applianctl.slots.view
from appliance import cli_help, paths
from appliance.errors import UserError
from appliance.safe_read import read_capped
from appliance.schema import load_record
from applianctl.records import BootRecord
from applianctl.slots import history, release
from applianctl.slots.entries import BAD, GOOD
from applianctl.slots.machine import Host

CRASH_LOOP_BOOTS = 3  # unclean boots in a row, after the version was judged good
STABLE_AFTER_S = 15 * 60  # served this long on one boot: that boot counts as good (the timer's OnBootSec=)
SMOKE_DEADLINE_S = 120.0


_BOOT_ID = re.compile(r"[0-9A-Za-z-]{1,64}")  # the kernel's is a UUID


def _boot_id() -> str:
    hint = "the kernel gives every boot an id there: check that /proc is mounted as usual"
    raw = read_capped(paths.BOOT_ID, 128, what="the kernel's boot id", hint=hint)
    text = raw.decode("ascii", "replace").strip() if raw is not None else ""
    if not _BOOT_ID.fullmatch(text):
        raise UserError(f"{paths.BOOT_ID}: no boot id in it", hint=hint)
    return text


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _load() -> tuple[BootRecord | None, str | None]:
    """The boot record (None when there is none or it is damaged), and what is wrong with it."""
    try:
        return load_record(BootRecord, paths.boots_record_path(), lenient=True), None
    except UserError as e:
        return None, e.message


def read() -> BootRecord | None:
    """The boot record; None when there is none or it is damaged (one line on stderr)."""
    record, damage = _load()
    if damage is not None:
        print(f"crashloop: {damage}", file=sys.stderr)
    return record


def begin(host: Host | None = None, *, running_version: str | None = None,
          reboot: Callable[[], None] | None = None) -> str:
    """This boot's count (written before anything that could crash), and the rollback when the
    count reached CRASH_LOOP_BOOTS. Returns what it did, in one line."""
    host = host or Host()
    running_version = running_version or release.running_manifest().version
    boot_id = _boot_id()
    view = applianctl.slots.view.read(host, running_version)
    entry = view.entry(running_version)
    judged_good = entry is not None and entry.state == GOOD
    prev, damage = _load()
    if prev is not None and prev.boot_id == boot_id:
        return f"this boot is counted already ({prev.unclean_in_a_row} unclean boots of {prev.version} before it)"
    if damage is not None:
        count = 1 if judged_good else 0  # one unclean boot, never zero (module docstring)
        print(f"crashloop: {damage}; counted as {count} unclean boot(s) of {running_version}", file=sys.stderr)
    else:
        ended_badly = prev is not None and prev.version == running_version and not (prev.clean or prev.stable)
        count = prev.unclean_in_a_row + 1 if judged_good and ended_badly and prev is not None else 0
    try:
        history.write(paths.boots_record_path(), BootRecord(version=running_version, boot_id=boot_id,
                                                            unclean_in_a_row=count, started_at=_now()))
    except UserError as e:  # this boot goes uncounted, and the count so far still decides
        print(f"crashloop: {e.message}; this boot is not counted", file=sys.stderr)
    if not judged_good:
        return f"{running_version} is not judged good yet: systemd-boot counts its tries"
    if count < CRASH_LOOP_BOOTS:
        return f"{running_version}: {count} unclean boot(s) in a row before this one (at {CRASH_LOOP_BOOTS} it is rolled back)"
    why = (f"{running_version} ended {count} boots in a row uncleanly (a crash, a reset or a power cut) before "
           f"{STABLE_AFTER_S // 60} minutes of service, after it was judged good")
    other = view.other
    target = view.entry(other.version) if other is not None and other.version else None
    if other is None or target is None or target.state == BAD:
        return f"{why}; the other slot has no version to go back to ({_no_way_back(view)}), so it stays"
    from applianctl.slots.rollback import rollback

    done = rollback(host, running_version=running_version, reason=why)
    print(f"crashloop: {why}: {done}; rebooting", file=sys.stderr)
    (reboot or _reboot)()
    return f"{why}: {done}"


def _no_way_back(view: applianctl.slots.view.View) -> str:
    """Why VIEW offers no version to go back to, in a few words: the operator needs to tell an empty
    or spent slot from slots the guard could not read."""
    if view.other is None:
        found = ", ".join(f"{s.name} {s.version or 'empty'}" for s in view.slots) or "none"
        return f"slots read: {found}" + (f"; {view.errors[0]}" if view.errors else "")
    version = view.other.version
    if not version:
        return f"slot {view.other.name} is empty"
    target = view.entry(version)
    return f"{version} has no boot entry ({view.entries_source})" if target is None else f"{version} is out of tries"


def _reboot() -> None:
    from appliance.run import run

    run(["systemctl", "reboot"], "systemctl reboot", "reboot by hand: the other slot's version boots")


def _mark(**change: Any) -> str:
    prev = read()
    if prev is None or prev.boot_id != _boot_id():
        return "this boot was not counted (appliance-crashloop.service did not run): nothing to mark"
    history.write(paths.boots_record_path(), dataclasses.replace(prev, **change))
    return f"{prev.version}: this boot is marked " + ", ".join(change)


def end() -> str:
    """At an orderly shutdown or reboot (the unit's stop): this boot ended cleanly."""
    return _mark(clean=True)


def stable(serving: Callable[[], tuple[bool, str]] | None = None) -> str:
    """STABLE_AFTER_S into the boot (the timer): this boot counts as good once it serves."""
    prev = read()
    if prev is not None and prev.boot_id == _boot_id() and prev.stable:
        return "this boot was marked stable already"
    ok, why = (serving or _serving)()
    if not ok:
        return f"not serving yet ({why}); asked again later"
    return _mark(stable=True)


def _serving() -> tuple[bool, str]:
    from appliance.host_settings import load_device
    from applianctl.slots.assess import client_target, wait_serving

    config = load_device()
    return wait_serving(client_target(config), config.served_model, SMOKE_DEADLINE_S)


def add_parser(subparsers: Any) -> None:
    # hidden (not listed): run by appliance-crashloop.service (begin, end) and its timer (stable)
    p = cli_help.verb_parser(
        subparsers, "crashloop", "the crash-loop guard's steps (appliance-crashloop.service and its timer)",
        examples=["applianctl crashloop begin", "applianctl crashloop stable"],
        exit_codes=[(0, "the step is done (what it did on stdout)"), cli_help.BAD_INPUT],
        hidden=True,
    )
    p.add_argument("step", choices=("begin", "end", "stable"),
                   help="begin: count this boot (and roll back after three unclean ones); end: it ended cleanly; stable: it served")
    p.set_defaults(func=cmd_crashloop)


def cmd_crashloop(args: argparse.Namespace) -> int:
    print({"begin": begin, "end": end, "stable": stable}[args.step]())
    return 0
