# SPDX-License-Identifier: MIT
"""`applianctl slots [--json]`: both /usr slots, both engine slots, the boot entries, and whether
the running version is judged yet (the one model in applianctl.slots.view; `systemd-sysupdate list` added when it runs)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import applianctl.slots.view
from appliance import cli_help


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n // (1 << 20)} MiB"


def render(view: applianctl.slots.view.View) -> list[str]:
    state, why = view.running_state()
    lines = [f"running {view.running_version or '?'}: {state} ({why})"]
    for slot in view.slots:
        entry = view.entry(slot.version)
        marks = [m for m, on in (("booted", slot.booted), ("default", bool(entry and entry.is_default))) if on]
        name = entry.path.name if entry else "no entry"
        lines.append(
            f"slot {slot.name} {slot.usr.node}: {slot.version or slot.usr.label} [{view.slot_state(slot)}] {name}"
            + (f" ({', '.join(marks)})" if marks else "")
        )
    for e, found in zip(view.to_json()["engine_slots"], view.engine_slots, strict=True):
        marks = [m for m, on in (("running", e["running"]), ("untyped: labelled by an older image", not e["typed"])) if on]
        users = f" used by {', '.join(e['used_by'])}" if e["used_by"] else ""
        size = _size(found.data.size_bytes)
        lines.append(
            f"engine slot {e['slot']} {e['partition']} ({size}): {e['digest'] or e['label']}{users}"
            + (f" ({', '.join(marks)})" if marks else "")
        )
    stray = [e for e in view.entries if e.version not in {s.version for s in view.slots}]
    for entry in stray:
        lines.append(f"entry without a slot: {entry.path.name} [{entry.state}]")
    if view.sysupdate:
        if "error" in view.sysupdate:
            lines.append(f"systemd-sysupdate: {view.sysupdate['error']}")
        else:
            pending = " (pending)" if view.sysupdate.get("pending") else ""
            versions = ", ".join(view.sysupdate["all"]) or "none"
            lines.append(f"systemd-sysupdate: current {view.sysupdate.get('current')}{pending}, versions {versions}")
    lines.append(f"boot entries read by {view.entries_source}")
    lines.extend(f"error: {e}" for e in view.errors)
    return lines


def cmd_slots(args: argparse.Namespace) -> int:
    view = applianctl.slots.view.read(with_sysupdate=not args.no_sysupdate)
    if args.json:
        print(json.dumps(view.to_json(), indent=2, sort_keys=True))
    else:
        print("\n".join(render(view)))
    return 1 if view.errors else 0


def add_parser(subparsers: Any) -> None:
    p = cli_help.verb_parser(
        subparsers, "slots",
        "show both /usr slots, both engine slots, the boot entries and whether the running version is judged",
        examples=["applianctl slots", "applianctl slots --json --no-sysupdate"],
        exit_codes=[(0, "everything could be read"), (1, "something could not be read (named in the output)"), cli_help.BAD_INPUT],
    )
    p.add_argument("--json", action="store_true", help="print the model as JSON")
    p.add_argument("--no-sysupdate", action="store_true", help="do not run systemd-sysupdate list (faster; no network)")
    p.set_defaults(func=cmd_slots)
