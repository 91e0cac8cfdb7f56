# SPDX-License-Identifier: MIT
"""Which disk receives the appliance: exactly one disk matches the plan's target, and it is safe.

Refused: the boot medium, anything mounted or held (at any depth: a partition, md, LVM or LUKS
above it), removable or hot-plugged disks (USB sticks, BMC virtual media), read-only or too small
ones, and one holding data unless the plan sets wipe_existing_data. A disk already holding this
version is re-installed: only the new plan is written (unless the plan sets wipe_existing_data:
then it is written whole). Otherwise nothing is written and every candidate is listed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.errors import UserError
from appliance.signed.install_plan import Target
from installer.disks import Disk

GIB = 1 << 30


@dataclass(frozen=True)
class Candidate:
    disk: Disk
    matched: bool  # every selector of the plan fits this disk
    refused: str  # why it may not be written ("" when it may)


@dataclass(frozen=True)
class Choice:
    disk: Disk
    installed: bool  # it already holds this version and may not be wiped: only the plan is written
    candidates: tuple[Candidate, ...]


class NoSafeChoice(UserError):

    def __init__(self, message: str, hint: str, candidates: Sequence[Candidate]) -> None:
        super().__init__(message, hint)
        self.candidates = tuple(candidates)


def _norm_path(value: str) -> str:
    return value.removeprefix("/dev/disk/by-path/")


def matches(disk: Disk, target: Target) -> bool:
    if target.serial and disk.serial != target.serial:
        return False
    if target.wwn and disk.wwn != target.wwn.lower():
        return False
    if target.model and disk.model != target.model:
        return False
    if target.by_path and _norm_path(disk.by_path) != _norm_path(target.by_path):
        return False
    if target.min_size_gib and disk.size < target.min_size_gib * GIB:
        return False
    return not (target.max_size_gib and disk.size > target.max_size_gib * GIB)


def refusal(disk: Disk, target: Target, boot_partuuid: str, required_bytes: int, version: str) -> str:
    """Why DISK may not be written ("" when it may)."""
    if boot_partuuid and any(p.partuuid == boot_partuuid for p in disk.partitions):
        return "the boot medium (the installer was loaded from it)"
    if disk.mountpoints:
        return "in use (mounted at " + ", ".join(disk.mountpoints) + ")"
    if disk.holders:
        return "in use (held by " + ", ".join(disk.holders) + ")"
    if disk.removable or disk.tran == "usb":
        return "removable or hot-plugged (" + (disk.tran or "rm") + ")"
    if disk.read_only:
        return "read-only"
    if disk.size < required_bytes:
        return f"too small ({disk.size / GIB:.1f} GiB, the appliance needs {required_bytes / GIB:.1f} GiB)"
    if version in disk.appliance_versions():
        return ""
    if disk.holds_data and not target.wipe_existing_data:
        return f"holds data ({disk.holds_data}); the plan does not set target.wipe_existing_data"
    return ""


_HINTS = {
    "holds data": "name another disk, or set target.wipe_existing_data = true to overwrite its data",
    "in use": "name another disk, or stop what uses this one first (umount, swapoff, vgchange -an, mdadm --stop, "
              "cryptsetup close)",
}


def choose(disks: Sequence[Disk], target: Target, *, boot_partuuid: str, required_bytes: int, version: str) -> Choice:
    """The one disk to write, or NoSafeChoice listing every candidate."""
    candidates = [Candidate(d, matches(d, target), refusal(d, target, boot_partuuid, required_bytes, version)) for d in disks]
    matched = [c for c in candidates if c.matched]
    wanted = ", ".join(f"{k}={v!r}" for k, v in target.selectors.items())
    if target.min_size_gib or target.max_size_gib:
        wanted += f", size {target.min_size_gib}..{target.max_size_gib or 'any'} GiB"
    if not matched:
        raise NoSafeChoice(f"no disk matches the plan's target ({wanted}); nothing written",
                           "fix target in the install plan: the disks are listed above", candidates)
    if len(matched) > 1:
        names = ", ".join(c.disk.path for c in matched)
        raise NoSafeChoice(f"{len(matched)} disks match the plan's target ({wanted}): {names}; nothing written",
                           "name the disk unambiguously (target.serial or target.wwn)", candidates)
    (only,) = matched
    if only.refused:
        raise NoSafeChoice(f"the disk the plan names, {only.disk.path}, is {only.refused}; nothing written",
                           _HINTS.get(only.refused.split(" (", 1)[0], "name another disk in the install plan"), candidates)
    reinstall = version in only.disk.appliance_versions() and not target.wipe_existing_data
    return Choice(only.disk, reinstall, tuple(candidates))


def to_json(candidates: Sequence[Candidate], chosen: Disk | None) -> list[dict[str, object]]:
    return [
        {"path": c.disk.path, "model": c.disk.model, "serial": c.disk.serial, "wwn": c.disk.wwn, "by_path": c.disk.by_path,
         "size_bytes": c.disk.size, "transport": c.disk.tran, "removable": c.disk.removable, "holds_data": c.disk.holds_data,
         "appliance_versions": c.disk.appliance_versions(), "holders": list(c.disk.holders),
         "matches_plan": c.matched, "refused": c.refused,
         "chosen": chosen is not None and c.disk.path == chosen.path}
        for c in candidates
    ]


def table(candidates: Sequence[Candidate], chosen: Disk | None) -> str:
    """The candidates as a table an operator reads on the console."""
    rows = [("", "DISK", "SIZE", "TRAN", "MODEL", "SERIAL", "WWN", "MATCH", "VERDICT")]
    for c in candidates:
        mark = "=>" if chosen is not None and c.disk.path == chosen.path else ""
        rows.append((mark, c.disk.path, f"{c.disk.size / GIB:.1f}G", c.disk.tran or "-", c.disk.model or "-",
                     c.disk.serial or "-", c.disk.wwn or "-", "yes" if c.matched else "no", c.refused or "may be written"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r[:-1], widths, strict=False)) + "  " + r[-1] for r in rows)


def dumps(candidates: Sequence[Candidate], chosen: Disk | None) -> str:
    return json.dumps({"chosen": chosen.path if chosen else None, "candidates": to_json(candidates, chosen)}, indent=2)
