# SPDX-License-Identifier: MIT
"""The two engine slots (an erofs podman image store plus its dm-verity partition): which engine
each holds, which versions use it, which runs, and which a new engine may be written to.

A slot is recognised by its GPT type (appliance-engine 344e5f5f-…, -verity e8587844-…) or, because
older images typed them `linux-generic`, by its label alone: `engine_` + the digest's first 12 hex
digits (`…-verity` for the hash partition); `_empty` holds nothing. Which engine a version uses
comes from signed data only: the running manifest, else the bundle index digest the updater
recorded in update/engines.json; an unknown one could be in any slot that holds an engine.
The invariant, decided in choose_engine_slot(): every bootable entry's engine stays present, and
the running engine's partition is never written.

A label names 12 hex digits, not an engine: a slot counts as holding digest D only when its full
digest is known (EngineSlot.digest: the running slot's from the running manifest, another's from
the one signed digest recorded for its label), and no two slots may end up with one label (the
engine-store unit refuses to open either).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from appliance import atomic, paths
from appliance.errors import UserError
from appliance.hashing import DIGEST, SHA256
from appliance.schema import load_record
from appliance.signed.bundle_index import EMPTY_LABEL, ENGINE_TYPE, ENGINE_VERITY_TYPE, USR_TYPE, USR_VERITY_TYPE, engine_short
from applianctl.records import EngineSlotOpened, EngineVersions

if TYPE_CHECKING:
    from applianctl.slots.partitions import Partition

EMPTY = EMPTY_LABEL
_LABEL = re.compile(r"^engine_([0-9a-f]{12})\Z")
_VERITY_LABEL = re.compile(r"^engine_([0-9a-f]{12})-verity\Z")
_OURS = (USR_TYPE, USR_VERITY_TYPE)  # a /usr partition is never an engine slot, whatever its label


def is_engine(p: Partition) -> bool:
    return p.type == ENGINE_TYPE or (p.type not in _OURS and p.type != ENGINE_VERITY_TYPE and bool(_LABEL.match(p.label)))


def is_engine_verity(p: Partition) -> bool:
    return p.type == ENGINE_VERITY_TYPE or (p.type not in _OURS and p.type != ENGINE_TYPE and bool(_VERITY_LABEL.match(p.label)))


@dataclass(frozen=True)
class EngineSlot:
    name: str  # "A" (the lower-numbered partition) or "B"
    data: Partition
    verity: Partition | None
    running: bool  # holds the engine the running version opened
    digest: str | None = None  # the full digest, when signed data says which engine has this label; else None

    @property
    def short(self) -> str | None:
        """The digest's first 12 hex digits, from the label; None when the slot holds nothing known."""
        m = _LABEL.match(self.data.label)
        return m.group(1) if m else None

    @property
    def empty(self) -> bool:
        return self.data.label == EMPTY

    @property
    def typed(self) -> bool:
        """Carries the appliance-engine type (else recognised by its label only: an older image)."""
        return self.data.type == ENGINE_TYPE

    def holds(self, digest: str | None) -> bool:
        """Known to hold DIGEST: its full digest, not only the 12 hex digits of its label."""
        return digest is not None and self.digest == digest

    def may_hold(self, digest: str | None) -> bool:
        """Labelled for DIGEST: it may hold that engine (or another sharing its first 12 hex digits)."""
        return digest is not None and self.short is not None and self.short == engine_short(digest)


def find(parts: list[Partition], running_digest: str | None,
         record: EngineSlotOpened | Literal[False] | None = None, known: Iterable[str] = ()) -> list[EngineSlot]:
    """The engine slots on the disk, A first. Each data partition is paired with the verity
    partition labelled after it, else (an empty slot) the next unpaired one after it on the disk.
    The running slot is the one the engine-store unit recorded opening (RECORD; None: its file in
    /run; False: none), else the first labelled for RUNNING_DIGEST. Full digests: the running
    slot's is RUNNING_DIGEST (its unit opened that label, unique on the disk, with the root hash
    the running /usr pins); another slot's is the one digest among KNOWN (signed digests: the
    updater's record) with its label's 12 hex digits; none when two share them, or two slots
    share the label."""
    data = sorted((p for p in parts if is_engine(p)), key=lambda p: p.number)
    verity = sorted((p for p in parts if is_engine_verity(p)), key=lambda p: p.number)
    paired: dict[int, Partition] = {}
    for d in data:
        match = next((v for v in verity if v.label == d.label + "-verity"), None) if _LABEL.match(d.label) else None
        if match is not None:
            paired[d.number] = match
    for d in data:
        if d.number not in paired:
            taken = {v.number for v in paired.values()}
            match = next((v for v in verity if v.number > d.number and v.number not in taken and not _VERITY_LABEL.match(v.label)), None)
            if match is not None:
                paired[d.number] = match
    # What the engine-store unit opened this boot, when it says so; else the first slot holding the
    # running digest (an image whose unit did not record it).
    record = opened() if record is None else record
    by_record = record.partition if record and any(d.node == record.partition for d in data) else None
    by_short: dict[str, set[str]] = {}
    for signed in {*known, *([running_digest] if running_digest else [])}:
        by_short.setdefault(engine_short(signed), set()).add(signed)
    labels = Counter(d.label for d in data)
    out: list[EngineSlot] = []
    running_seen = False
    for i, d in enumerate(data):
        name = "AB"[i] if i < 2 else str(i + 1)
        unnamed = EngineSlot(name, d, None, False)
        running = d.node == by_record if by_record else not running_seen and unnamed.may_hold(running_digest)
        running_seen = running_seen or running
        digest: str | None = None
        if labels[d.label] != 1:
            pass  # one label on two slots: which holds what is not known (the engine-store unit opens neither)
        elif running and unnamed.may_hold(running_digest):
            digest = running_digest
        elif unnamed.short is not None and len(by_short.get(unnamed.short, ())) == 1:
            (digest,) = by_short[unnamed.short]
        out.append(EngineSlot(name, d, paired.get(d.number), running, digest))
    return out


def users(slot: EngineSlot, engines: Mapping[str, str | None]) -> list[str]:
    """The versions among ENGINES (version -> engine digest) whose engine SLOT may hold: by its
    label, so that a slot is kept whenever it could be a bootable entry's engine."""
    return [v for v, digest in engines.items() if slot.may_hold(digest)]


@dataclass(frozen=True)
class EngineChoice:
    slot: EngineSlot
    already_present: bool  # the slot holds the digest already: nothing to write


def choose_engine_slot(slots: list[EngineSlot], entries: Mapping[str, str | None], new_digest: str) -> EngineChoice:
    """The slot to write NEW_DIGEST's engine image to. ENTRIES: every boot entry that stays
    bootable through the update, version -> its engine digest (None: not known); the version in
    the /usr slot about to be written is not among them, its entry goes first.

    A slot known to hold NEW_DIGEST (by its full digest) is used as it is. Else never the running
    engine's slot, never one a bootable entry's engine may be in (by label), and while any
    bootable entry's engine is unknown only an empty slot. An empty slot is preferred to one that
    holds an engine no entry uses; a slot already labelled for NEW_DIGEST but not known to hold it
    is the only one that may be written (its label would be on two slots). Raises UserError when
    no slot may be written."""
    present = [s for s in slots if s.holds(new_digest)]
    if present:
        return EngineChoice(present[0], True)
    short = engine_short(new_digest)
    if not slots:
        raise UserError(
            f"refused: engine {short} needs an engine slot, and this disk has none",
            hint="re-install the appliance with this image (docs/disk-layout.md); or release the new version with the engine it runs",
        )
    unknown = sorted(v for v, digest in entries.items() if digest is None)
    why: dict[str, str] = {}  # slot name -> why it may not be written
    for s in slots:
        held = s.short or s.data.label or "nothing"
        used = users(s, entries)
        if s.running:
            why[s.name] = f"slot {s.name} ({held}) runs the engine"
        elif used:
            why[s.name] = f"slot {s.name} ({held}) is the engine of {', '.join(used)}"
        elif s.verity is None:
            why[s.name] = f"slot {s.name} has no verity partition"
        elif unknown and not s.empty:
            why[s.name] = f"slot {s.name} ({held}) may be the engine of {', '.join(unknown)} (not known)"
    free = [s for s in slots if s.name not in why]
    same_label = [s for s in slots if s.short == short]
    if same_label:
        # An engine sharing the new digest's 12 hex digits: writing another slot would leave two
        # partitions with one label; only rewriting this one (when it may be written) does not.
        s = same_label[0]
        if len(same_label) == 1 and s in free:
            return EngineChoice(s, False)
        held = f"engine {s.digest.removeprefix('sha256:')}" if s.digest else "an engine not known by its full digest"
        reason = why.get(s.name) or f"{len(same_label)} slots are labelled engine_{short}"
        raise UserError(
            f"refused: engine {new_digest.removeprefix('sha256:')} would be labelled engine_{short} like engine slot "
            f"{s.name}, which holds {held} and may not be written ({reason})",
            hint="two engine digests with the same first 12 hex digits cannot be told apart on the disk; "
                 "release the new version with an engine whose digest differs in them (`applianctl slots` lists the slots)",
        )
    if not free:
        if len(slots) < 2:
            hint = "this disk has one engine slot: systemd-repart makes the second at first boot, a disk set up before needs a re-install"
        else:
            hint = ("`applianctl slots` shows which version uses each engine slot; release the new version with an engine "
                    "the appliance has, or install it from a version whose other slot is free")
        raise UserError(f"refused: no engine slot may be written for engine {short}: {'; '.join(why.values())}", hint=hint)
    free.sort(key=lambda s: (not s.empty, s.data.number))
    return EngineChoice(free[0], False)


# ----------------------------------------------------------------------------------- what the updater recorded


def recorded() -> dict[str, str]:
    """version -> engine digest, as the updater recorded them from signed bundle indexes."""
    try:
        data = load_record(EngineVersions, paths.engines_record_path(), lenient=True)
    except UserError:
        return {}
    return {v: d for v, d in data.versions.items() if DIGEST.match(d)} if data is not None else {}


def record(engines: Mapping[str, str], keep: set[str]) -> None:
    """Each version in ENGINES runs that digest (from a signed manifest or bundle index); versions
    not in KEEP (they have no boot entry any more) are forgotten."""
    versions = {v: d for v, d in recorded().items() if v in keep}
    versions.update(engines)
    atomic.write_record(paths.engines_record_path(), EngineVersions(dict(sorted(versions.items()))))


# ----------------------------------------------------------------------------------- opening the running engine
# appliance-engine-store.service: `python3 -m applianctl.slots.engine open LABEL ROOTHASH` opens the
# slot that holds the signed manifest's engine (LABEL and ROOTHASH are pinned in the unit, on the
# verified /usr). Only a partition on the disk /usr is on, with that label AND the engine type, and
# exactly one: a same-labelled partition of another type (an older image's, a decoy) or a
# second one is refused, so that nothing but this appliance's own slot is ever opened.

DM_NAME = "appliance-engine-store"


def opened_path() -> Path:
    """What the engine-store unit opened, for status ("which runs")."""
    return paths.RUN_DIR / "engine-slot.json"


def _descendants(node: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    out: list[Mapping[str, Any]] = []
    for child in node.get("children") or []:
        out += [child, *_descendants(child)]
    return out


def usr_disk_node(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """The disk in `lsblk --json -O` output DOC under whose partitions /usr is mounted."""
    for disk in doc.get("blockdevices") or []:
        for node in _descendants(disk):
            if "/usr" in (node.get("mountpoints") or [node.get("mountpoint")]):
                found: Mapping[str, Any] = disk
                return found
    raise UserError("no disk holds the mounted /usr", hint="the engine store opens on the appliance, after /usr is mounted")


def locate(doc: Mapping[str, Any], label: str) -> tuple[str, str]:
    """The data and verity partitions (device paths) of the engine slot labelled LABEL on the disk
    that holds /usr, in `lsblk --json -O -b` output DOC; UserError unless each is exactly one
    partition with the label and the engine type."""
    if not _LABEL.match(label):
        raise UserError(f"{label!r} is not an engine slot label", hint="expected engine_ and 12 hex digits, as the manifest names it")
    disk = usr_disk_node(doc)
    parts = [n for n in disk.get("children") or [] if n.get("type") == "part"]
    found = []
    for want, type_uuid in ((label, ENGINE_TYPE), (label + "-verity", ENGINE_VERITY_TYPE)):
        named = [p for p in parts if p.get("partlabel") == want]
        typed = [p for p in named if str(p.get("parttype") or "").upper() == type_uuid]
        where = f"{disk.get('path')}"
        if len(named) > 1:
            listed = ", ".join(str(p.get("path")) for p in named)
            raise UserError(f"{where}: {len(named)} partitions are labelled {want} ({listed}): refused, the engine slot is not known",
                            hint="re-install the appliance: a disk has one partition per engine label")
        if not typed:
            hint = "the engine slot is missing; roll back (`applianctl rollback`) or re-install"
            if named:
                hint = (f"the partition has type {named[0].get('parttype')}, not {type_uuid.lower()}: an image written before "
                        "engine slots had types, or not this appliance's; re-install the appliance")
            raise UserError(f"{where}: no partition labelled {want} with the engine type: refused", hint=hint)
        found.append(str(typed[0]["path"]))
    return found[0], found[1]


def open_slot(label: str, roothash: str, runner: Callable[[list[str], str, str], str] | None = None) -> dict[str, str]:
    """Open engine slot LABEL as /dev/mapper/DM_NAME with ROOTHASH pinned; record which partition.
    RUNNER(argv, what, hint) -> stdout: appliance.run.run, or a test's."""
    from appliance.run import run

    runner = runner or run
    if not SHA256.match(roothash):
        raise UserError(f"root hash {roothash!r}: invalid", hint="64 lower-case hex digits, as the build pinned it")
    doc = json.loads(runner(["lsblk", "--json", "-O", "-b"], "lsblk", "the disks cannot be listed"))
    data, verity = locate(doc, label)
    runner(["veritysetup", "open", data, DM_NAME, verity, roothash], "veritysetup open",
           f"{data} does not hold the engine the manifest pins (root hash {roothash[:16]}...): roll back or re-install")
    record = {"label": label, "partition": data, "verity_partition": verity, "roothash": roothash}
    atomic.write_record(opened_path(), EngineSlotOpened(**record))
    return record


def opened() -> EngineSlotOpened | None:
    try:
        return load_record(EngineSlotOpened, opened_path(), lenient=True)
    except UserError:
        return None


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python3 -m applianctl.slots.engine", description="Open the running engine's slot.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("open", help="open the engine slot LABEL with ROOTHASH pinned (appliance-engine-store.service)")
    p.add_argument("label")
    p.add_argument("roothash")
    p.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    try:
        record = open_slot(args.label, args.roothash)
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e.message}", file=sys.stderr)
        print(f"hint: {e.hint or 'see the journal of appliance-engine-store.service'}", file=sys.stderr)
        return 2
    print(f"engine slot {record['label']} opened: {record['partition']} (hash tree {record['verity_partition']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
