"""The two engine slots: which partitions they are, which engine each holds, which versions use
it, which one runs, and which one a new engine image may be written to.

An engine slot is an erofs partition (the podman image store of one engine image) with its
dm-verity partition (docs/disk-layout.md). It is recognised by its GPT type, appliance-engine
344e5f5f-… / appliance-engine-verity e8587844-…, or, since images built before those types
label the engine partitions with `linux-generic`, by its label alone: `engine_` + the image
digest's first 12 hex digits (`engine_D12-verity` for the hash partition). `_empty` is a slot
that holds nothing; without the engine type it cannot be told from any other empty partition.

Which engine a version uses comes from signed data only: the running version's manifest (on
its verified /usr), and for other versions the engine digest of the signed bundle index they
were installed from, recorded by the updater in update/engines.json when it wrote them. A
bootable version whose engine is not known could be using any slot that holds an engine.

The invariant (issue 15): every bootable entry's engine is present, and the running engine's
partition is never written. choose_engine_slot() is where it is decided.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance import atomic, paths
from appliance.bundle import USR_TYPE, USR_VERITY_TYPE, engine_short
from appliance.errors import UserError
from appliance.hashing import DIGEST

if TYPE_CHECKING:
    from applianctl.slots import Partition

ENGINE_TYPE = "344E5F5F-F1EA-455D-9D71-C82214F17CF1"
ENGINE_VERITY_TYPE = "E8587844-5270-4B6E-B69C-E9E0C63B1823"
EMPTY = "_empty"
_LABEL = re.compile(r"^engine_([0-9a-f]{12})$")
_VERITY_LABEL = re.compile(r"^engine_([0-9a-f]{12})-verity$")
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
        return digest is not None and self.short is not None and self.short == engine_short(digest)


def find(parts: list[Partition], running_digest: str | None) -> list[EngineSlot]:
    """The engine slots on the disk, A first. Each data partition is paired with the verity
    partition labelled after it, else (an empty slot) the next unpaired one after it on the disk.
    The running slot is the first that holds RUNNING_DIGEST (the engine-store unit opens the one
    whose label the running manifest names)."""
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
    out: list[EngineSlot] = []
    running_seen = False
    for i, d in enumerate(data):
        name = "AB"[i] if i < 2 else str(i + 1)
        slot = EngineSlot(name, d, paired.get(d.number), False)
        if not running_seen and slot.holds(running_digest):
            slot, running_seen = EngineSlot(name, d, slot.verity, True), True
        out.append(slot)
    return out


def users(slot: EngineSlot, engines: Mapping[str, str | None]) -> list[str]:
    """The versions among ENGINES (version -> engine digest) whose engine SLOT holds."""
    return [v for v, digest in engines.items() if slot.holds(digest)]


@dataclass(frozen=True)
class EngineChoice:
    slot: EngineSlot
    already_present: bool  # the slot holds the digest already: nothing to write


def choose_engine_slot(slots: list[EngineSlot], entries: Mapping[str, str | None], new_digest: str) -> EngineChoice:
    """The slot to write NEW_DIGEST's engine image to. ENTRIES: every boot entry that stays
    bootable through the update, version -> its engine digest (None: not known); the version in
    the /usr slot about to be written is not among them, its entry goes first.

    Never the running engine's slot, never one a bootable entry's engine is in, and while any
    bootable entry's engine is unknown only an empty slot. An empty slot is preferred to one
    that holds an engine no entry uses. Raises UserError when no slot may be written."""
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
    why: list[str] = []
    free: list[EngineSlot] = []
    for s in slots:
        held = s.short or s.data.label or "nothing"
        used = users(s, entries)
        if s.running:
            why.append(f"slot {s.name} ({held}) runs the engine")
        elif used:
            why.append(f"slot {s.name} ({held}) is the engine of {', '.join(used)}")
        elif s.verity is None:
            why.append(f"slot {s.name} has no verity partition")
        elif unknown and not s.empty:
            why.append(f"slot {s.name} ({held}) may be the engine of {', '.join(unknown)} (not known)")
        else:
            free.append(s)
    if not free:
        if len(slots) < 2:
            hint = "this disk has one engine slot: systemd-repart makes the second at first boot, a disk set up before needs a re-install"
        else:
            hint = ("`applianctl slots` shows which version uses each engine slot; release the new version with an engine "
                    "the appliance has, or install it from a version whose other slot is free")
        raise UserError(f"refused: no engine slot may be written for engine {short}: {'; '.join(why)}", hint=hint)
    free.sort(key=lambda s: (not s.empty, s.data.number))
    return EngineChoice(free[0], False)


# ----------------------------------------------------------------------------------- what the updater recorded


def record_path() -> Path:
    return paths.update_dir() / "engines.json"


def recorded() -> dict[str, str]:
    """version -> engine digest, as the updater recorded them from signed bundle indexes."""
    try:
        data: Any = json.loads(record_path().read_text())
    except (OSError, ValueError):
        return {}
    versions = data.get("versions") if isinstance(data, dict) else None
    if not isinstance(versions, dict):
        return {}
    return {str(v): d for v, d in versions.items() if isinstance(d, str) and DIGEST.match(d)}


def record(engines: Mapping[str, str], keep: set[str]) -> None:
    """Each version in ENGINES runs that digest (from a signed manifest or bundle index); versions
    not in KEEP (they have no boot entry any more) are forgotten."""
    versions = {v: d for v, d in recorded().items() if v in keep}
    versions.update(engines)
    atomic.write_json_atomic(record_path(), {"versions": dict(sorted(versions.items()))})
