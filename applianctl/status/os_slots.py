# SPDX-License-Identifier: MIT
"""Status parts `os` and `slots`: the running version and the A/B slots with their boot entries,
as applianctl.slots.view reads them (the model update, assess and rollback use too) plus the
updater's records; this module only judges and words them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from appliance.config import Config
from applianctl.slots.machine import Host
from applianctl.status.document import (
    BootCounting,
    BootedUsr,
    EngineSlotInfo,
    OsDetails,
    SlotInfo,
    SlotsDetails,
    load_details,
)
from applianctl.status.probes import DEGRADED, NOT_CONFIGURED, OK, Part, Sources


def read_os_release(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            out[key.strip()] = value.strip().strip("\"'")
    return out


def slots_summary(host: Host | None = None, running_version: str | None = None) -> dict[str, Any]:
    """What `applianctl status` shows about upgrades: View.to_json() plus the last update,
    assessment and rollback, whether the last update was rolled back and why, and the staged update."""
    # imported in the probe's thread: their imports cost time
    import applianctl.slots.view
    import applianctl.update.staged
    from applianctl.slots import history
    from applianctl.slots.entries import BAD

    view = applianctl.slots.view.read(host, running_version)
    out = view.to_json()
    running_version = view.running_version
    last = history.read()
    update, assessment, rollback = last.update, last.assessment, last.rollback
    rolled_back, by = False, None
    reason = None
    from applianctl.slots.rollback import OPERATOR_REASON

    if assessment is not None and not assessment.ok and assessment.version != running_version:
        rolled_back, by, reason = True, "appliance", assessment.reason or "assessment failed"
    elif (rollback is not None and rollback.reason != OPERATOR_REASON and rollback.to_version == running_version
          and rollback.from_version != running_version):
        # the crash-loop guard went back (applianctl/slots/crashloop.py): a fault
        rolled_back, by, reason = True, "appliance", f"rolled back: {rollback.reason}"
    elif (rollback is not None and update is not None and rollback.to_version == running_version
          and rollback.from_version == update.version != running_version):
        # the operator went back from the last update: a choice, not a fault
        rolled_back, by = True, "operator"
        reason = f"applianctl rollback from {rollback.from_version} at {rollback.at}"
    elif update is not None and update.version != running_version:
        bad = view.entry(update.version)
        if bad is not None and bad.state == BAD:
            rolled_back, by, reason = True, "appliance", f"rolled back: {bad.path.name} used up its tries without being judged good"
    staged = applianctl.update.staged.read()
    records = last.to_json()
    out.update(
        {
            "last_update": records["last_update"],
            "last_assessment": records["last_assessment"],
            "rolled_back": rolled_back,
            "rollback_reason": reason,
            "rolled_back_by": by,
            "last_rollback": records["last_rollback"],
            "staged": staged.to_json() if staged is not None else None,
            "crash_loop": _crash_loop(),
            "freshness": _freshness(),
        }
    )
    return out


def _freshness() -> dict[str, Any] | None:
    """The updater's replay protection (update/freshness.json) as written: the highest timestamp
    sequence accepted per timestamp key, and the bundle and time it came with; None before any."""
    from appliance.schema import plain
    from applianctl.slots import history

    record = history.freshness()
    return plain(record) if record is not None else None


def _crash_loop() -> dict[str, Any] | None:
    """This boot's count of the crash-loop guard (update/boots.json), None before it ran."""
    from appliance.schema import plain
    from applianctl.slots import crashloop

    record = crashloop.read()
    return plain(record) if record is not None else None


def slots_reader(config: Config, src: Sources) -> Callable[[], dict[str, Any]]:
    """slots_summary() read once per status run, shared by the os and slots parts (it runs
    sfdisk; both parts run side by side)."""
    lock = threading.Lock()
    cache: list[dict[str, Any]] = []

    def read() -> dict[str, Any]:
        with lock:
            if not cache:
                host = src.slots_host if src.slots_host is not None else Host()
                cache.append(slots_summary(host, config.appliance.version))
            return cache[0]

    return read


def boot_counting(summary: dict[str, Any]) -> BootCounting:
    """The schema's boot_counting: {entry, state: on trial | not counting | not configured,
    tries_left, tries_done}, from the slots model's reading of the boot loader's variables."""
    counting = summary.get("boot_counting")
    entry = summary.get("booted_entry")
    if counting and counting.get("tries_left") is not None:
        return BootCounting(entry=counting.get("entry") or entry, state="on trial", tries_left=counting["tries_left"],
                            tries_done=counting["tries_done"])
    if entry:
        return BootCounting(entry=entry, state="not counting")
    return BootCounting(entry=None, state=NOT_CONFIGURED)


def probe_os(config: Config, src: Sources, read_slots: Callable[[], dict[str, Any]]) -> Part:
    version = config.appliance.version
    problems: list[str] = []
    try:
        image_version = read_os_release(src.os_release).get("IMAGE_VERSION")
    except OSError:
        image_version = None
    if image_version and image_version != version:
        problems.append(f"image version {image_version} but appliance.json says {version}")
    summary = read_slots()
    booted = next((s for s in summary["slots"] if s["booted"]), None)
    usr = BootedUsr(slot=booted["slot"], partition=booted["partition"], label=booted["label"], version=booted["version"]) if booted \
        else BootedUsr(slot=None, partition=None, label=None, version=None)
    bc = boot_counting(summary)
    if bc.state == "on trial" and bc.tries_left == 0:
        problems.append(f"boot entry {bc.entry} has no tries left: the next failed boot falls back")
    details = OsDetails(version=version, image_version=image_version, usr=usr, boot_counting=bc)
    return Part(DEGRADED if problems else OK, "; ".join(problems), details)


def slots_details(summary: dict[str, Any]) -> SlotsDetails:
    """SUMMARY (slots_summary's) as the document's typed part, through the schema's loader: a key
    the slots model adds without a place in docs/status-schema.md is refused here."""
    details = load_details(SlotsDetails, summary, "the slots part")
    assert isinstance(details, SlotsDetails)
    return details


def probe_slots(config: Config, read_slots: Callable[[], dict[str, Any]]) -> Part:
    """Both A/B slots, their versions and boot entries, and whether the last upgrade rolled back."""
    summary = slots_details(read_slots())
    if summary.rolled_back and summary.rolled_back_by != "operator":
        return Part(DEGRADED, f"last upgrade rolled back: {summary.rollback_reason}", summary)
    if not summary.slots:
        reason = "; ".join(summary.errors) or "no A/B slots found"
        return Part(NOT_CONFIGURED, reason.splitlines()[0], summary)
    operator = f"rolled back by the operator ({summary.rollback_reason}); " if summary.rolled_back else ""
    line = operator + slots_line(summary.slots) + engines_line(summary.engine_slots) + staged_line(summary.staged)
    return Part(OK, line, summary)


def engines_line(found: Sequence[EngineSlotInfo]) -> str:
    """"; engine A e68d18b2ba50 running (1.0.0), B abababababab (2.0.0)": what each engine slot
    holds, which one runs, and the versions that use it."""
    if not found:
        return ""
    out = []
    for e in found:
        words = [e.slot, e.digest or ("empty" if e.label == "_empty" else repr(e.label))]
        if e.running:
            words.append("running")
        if e.used_by:
            words.append(f"({', '.join(e.used_by)})")
        out.append(" ".join(words))
    return "; engine " + ", ".join(out)


def staged_line(staged: dict[str, Any] | None) -> str:
    """"; staged 2.0.0 (812.4 MiB, 2026-11-30T17:40:00Z)": what `applianctl update --apply` would install."""
    if not staged:
        return ""
    if "error" in staged:
        return f"; staged update unusable: {staged['error']}"
    mib = staged["bytes"] / (1 << 20)
    return f"; staged {staged['version']} ({mib:.1f} MiB, {staged['staged_at']})"


def slots_line(found: Sequence[SlotInfo]) -> str:
    """"A 1.0.0 booted, good; B 1.0.1 on trial (2 tries left)" for the text status."""
    out = []
    for slot in found:
        words = [slot.slot, slot.version or "empty"]
        state = slot.state if slot.version else ""
        if slot.booted:
            words.append("booted" + ("," if state else ""))
        if state:
            words.append(state + (f" ({slot.tries_left} tries left)" if state == "on trial" else ""))
        out.append(" ".join(words))
    return "; ".join(out)
