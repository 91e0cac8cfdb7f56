# SPDX-License-Identifier: MIT
"""The A/B slots and boot entries as the device sees them, read once: the one model for status,
update, assess, rollback and `applianctl slots`.

Each fact comes from the module that reads it: partitions (the GPT behind /usr), entries (the boot
entries), machine (this boot's EFI variables), release (the running manifest), engine (the engine
slots), sysupdate (optional: what systemd-sysupdate sees).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.errors import UserError
from applianctl.slots import engine, release
from applianctl.slots.entries import BAD, GOOD, ON_TRIAL, Entry, read_entries
from applianctl.slots.machine import Host, boot_counting, booted_entry
from applianctl.slots.partitions import Partition, Slot, partitions, usr_slots
from applianctl.slots.sysupdate import sysupdate_list


@dataclass
class View:
    """Both slots, the boot entries and this boot, read once."""

    running_version: str | None
    slots: list[Slot]
    entries: list[Entry]
    entries_source: str
    booted_entry: str | None
    counting: dict[str, Any] | None
    errors: list[str] = field(default_factory=list)
    sysupdate: dict[str, Any] | None = None
    engine_slots: list[engine.EngineSlot] = field(default_factory=list)
    # version -> engine digest, from signed data: the running manifest, the updater's record
    engines: dict[str, str] = field(default_factory=dict)
    running_engine: str | None = None

    def entry(self, version: str | None) -> Entry | None:
        return next((e for e in self.entries if e.version == version), None) if version else None

    @property
    def booted(self) -> Slot | None:
        return next((s for s in self.slots if s.booted), None)

    @property
    def other(self) -> Slot | None:
        return next((s for s in self.slots if not s.booted), None) if len(self.slots) == 2 and self.booted else None

    def running_entry(self) -> Entry | None:
        """The entry booted now: bootctl's isSelected, else the running version's."""
        selected = [e for e in self.entries if e.is_selected]
        if len(selected) == 1 and (self.running_version is None or selected[0].version == self.running_version):
            return selected[0]
        return self.entry(self.running_version)

    def running_state(self) -> tuple[str, str]:
        """(GOOD | ON_TRIAL | BAD | "unknown", one line why) for the running version, from its
        entry's name as it is NOW (systemd-bless-boot drops the counter once it is judged good)."""
        entry = self.running_entry()
        if entry is None:
            return "unknown", f"no boot entry for the running version {self.running_version} ({self.entries_source})"
        if entry.state == ON_TRIAL:
            return ON_TRIAL, f"{entry.path.name}: {entry.tries_left} tries left, not yet judged by its boot assessment"
        if entry.state == BAD:
            return BAD, f"{entry.path.name}: out of tries (failed its assessment or was rolled back)"
        return GOOD, f"{entry.path.name}: judged good"

    def bootable_engines(self, leaving: str | None = None) -> dict[str, str | None]:
        """Every version with a bootable entry (good or on trial) but LEAVING -> its engine digest
        (None: not known)."""
        return {e.version: self.engines.get(e.version) for e in self.entries if e.state != BAD and e.version != leaving}

    def engine_slot_for(self, new_digest: str) -> engine.EngineChoice:
        """Where an update to a version running NEW_DIGEST writes its engine: the version in the
        inactive /usr slot leaves (its entry is removed before anything is written)."""
        leaving = self.other.version if self.other is not None and self.other.version != self.running_version else None
        return engine.choose_engine_slot(self.engine_slots, self.bootable_engines(leaving), new_digest)

    def slot_state(self, slot: Slot) -> str:
        entry = self.entry(slot.version)
        if slot.version is None:
            return "empty" if slot.usr.label == "_empty" else f"unknown label {slot.usr.label!r}"
        if entry is None:
            return "no boot entry"
        return entry.state

    def to_json(self) -> dict[str, Any]:
        state, why = self.running_state()
        out_slots = []
        for slot in self.slots:
            entry = self.entry(slot.version)
            out_slots.append(
                {
                    "slot": slot.name,
                    "partition": slot.usr.node,
                    "label": slot.usr.label,
                    "version": slot.version,
                    "booted": slot.booted,
                    "entry": entry.path.name if entry else None,
                    "tries_left": entry.tries_left if entry else None,
                    "tries_done": entry.tries_done if entry else None,
                    "default": entry.is_default if entry else None,
                    "state": self.slot_state(slot),
                }
            )
        return {
            "running_version": self.running_version,
            "running_state": state,
            "running_state_reason": why,
            "booted_slot": self.booted.name if self.booted else None,
            "booted_entry": self.booted_entry,
            "boot_counting": self.counting,
            "slots": out_slots,
            "entries": [
                {"path": str(e.path), "version": e.version, "state": e.state, "tries_left": e.tries_left, "tries_done": e.tries_done,
                 "default": e.is_default, "selected": e.is_selected}
                for e in self.entries
            ],
            "entries_source": self.entries_source,
            "sysupdate": self.sysupdate,
            "errors": self.errors,
            "running_engine": self.running_engine,
            "engine_slots": [
                {
                    "slot": e.name,
                    "partition": e.data.node,
                    "label": e.data.label,
                    "typed": e.typed,
                    "verity_partition": e.verity.node if e.verity else None,
                    "digest": e.short,
                    "full_digest": e.digest,  # None: the label's 12 hex digits are all that is known
                    "running": e.running,
                    "used_by": engine.users(e, {x.version: self.engines.get(x.version) for x in self.entries}),
                }
                for e in self.engine_slots
            ],
        }


def read(
    host: Host | None = None, running_version: str | None = None, *, with_sysupdate: bool = False, running_engine: str | None = None
) -> View:
    """Everything about the slots, read once. Never raises: what cannot be read is in .errors.
    RUNNING_ENGINE: the running version's engine digest when the caller holds its manifest (else
    read from /usr)."""
    host = host or Host()
    errors: list[str] = []
    if running_version is None:
        try:
            running_version = release.running_manifest().version
        except UserError as e:
            errors.append(e.message)
    found: list[Slot] = []
    parts: list[Partition] = []
    try:
        parts = partitions(host)
        found = usr_slots(parts, host, running_version)
    except UserError as e:
        errors.append(e.message)
    running_engine = running_engine or release.running_engine_digest(running_version)
    engines = engine.recorded()
    if running_version is not None and running_engine is not None:
        engines[running_version] = running_engine
    listed, source = read_entries(host)
    view = View(running_version, found, listed, source, booted_entry(host), boot_counting(host), errors,
                engine_slots=engine.find(parts, running_engine, known=engines.values()), engines=engines,
                running_engine=running_engine)
    if with_sysupdate:
        try:
            view.sysupdate = sysupdate_list()
        except UserError as e:
            view.sysupdate = {"error": e.message}
    return view
