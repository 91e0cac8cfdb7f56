# SPDX-License-Identifier: MIT
"""The A/B /usr slots: the GPT of the disk behind /usr, read with `sfdisk -J` (type, label, UUID,
size).

Slot A is the lower-numbered /usr partition on the disk, slot B the other; each carries its
verity partition and the signature of its root hash (a disk installed before that partition existed
has none: such a disk takes no update, docs/upgrades.md). A slot's version is its GPT label (`appliance_VERSION`, written by mkosi for A
and by systemd-sysupdate for B); `_empty` is a slot that holds no version (fresh, or being
written). The booted slot is the one whose partition UUID the usrhash= on the kernel command line
names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from appliance.errors import UserError
from appliance.hashing import SHA256
from appliance.run import run
from appliance.signed.bundle_index import USR_TYPE, USR_VERITY_SIG_TYPE, USR_VERITY_TYPE, partuuids_from_usrhash
from applianctl.slots.machine import Host, booted_usrhash

VERSION = r"[0-9]{1,9}(?:\.[0-9]{1,9}){0,3}"  # a version in a slot's label or a boot entry's name
_LABEL = re.compile(rf"^appliance_({VERSION})\Z")
_VERITY_LABEL = re.compile(rf"^appliance_({VERSION})_verity(?:_sig)?\Z")


@dataclass(frozen=True)
class Partition:
    number: int
    node: str
    type: str
    uuid: str
    label: str
    size_bytes: int

    @property
    def version(self) -> str | None:
        m = _LABEL.match(self.label) or _VERITY_LABEL.match(self.label)
        return m.group(1) if m else None


def usr_disk(host: Host) -> str:
    """The whole disk that holds /usr (the dm-verity device's underlying partition's disk)."""
    if host.disk:
        return host.disk
    hint = "set APPLIANCE_DISK to the disk that holds the /usr slots"
    source = run(["findmnt", "-n", "-o", "SOURCE", "/usr"], "findmnt /usr", hint).strip().splitlines()
    if not source:
        raise UserError("/usr is not a mount point", hint=hint)
    out = run(["lsblk", "-n", "-l", "-s", "-p", "-o", "NAME,TYPE", source[0]], f"lsblk {source[0]}", hint)
    for line in out.splitlines():
        name, _, kind = line.strip().rpartition(" ")
        if kind == "disk":
            return name.strip()
    raise UserError(f"no disk found under {source[0]}", hint=hint)


def partitions(host: Host) -> list[Partition]:
    disk = usr_disk(host)
    out = run([host.sfdisk, "-J", disk], f"sfdisk -J {disk}", "the disk's partition table cannot be read")
    return parse_sfdisk(out, disk)


def parse_sfdisk(out: str, disk: str) -> list[Partition]:
    """The partitions in `sfdisk -J DISK`'s output (a partition without a name has no "name")."""
    try:
        table = json.loads(out)["partitiontable"]
        sector = int(table.get("sectorsize", 512))
        parts = []
        for i, p in enumerate(table.get("partitions", [])):
            node = str(p.get("node", ""))
            m = re.search(r"(\d+)\Z", node)
            parts.append(
                Partition(
                    number=int(m.group(1)) if m else i + 1,
                    node=node,
                    type=str(p["type"]).upper(),
                    uuid=str(p.get("uuid", "")).lower(),
                    label=str(p.get("name", "")),
                    size_bytes=int(p["size"]) * sector,
                )
            )
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"sfdisk -J {disk}: unexpected output ({type(e).__name__}: {e})", hint="is this a GPT disk?") from None
    return parts


@dataclass(frozen=True)
class Slot:
    name: str  # "A" or "B"
    usr: Partition
    verity: Partition | None
    booted: bool
    signature: Partition | None = None  # usr-verity-sig

    @property
    def version(self) -> str | None:
        return self.usr.version


def slots(host: Host, running_version: str | None = None) -> list[Slot]:
    """Both slots, A first. The booted one is found by the usrhash= on the kernel command line
    (its partition UUID), else by the running version's label."""
    return usr_slots(partitions(host), host, running_version)


def usr_slots(parts: list[Partition], host: Host, running_version: str | None) -> list[Slot]:
    usr = sorted((p for p in parts if p.type == USR_TYPE), key=lambda p: p.number)
    verity = sorted((p for p in parts if p.type == USR_VERITY_TYPE), key=lambda p: p.number)
    signatures = sorted((p for p in parts if p.type == USR_VERITY_SIG_TYPE), key=lambda p: p.number)
    if not usr:
        raise UserError("no /usr partition on the disk", hint="is APPLIANCE_DISK the appliance's disk?")
    usrhash = booted_usrhash(host)
    booted_uuid = partuuids_from_usrhash(usrhash)[0] if usrhash and SHA256.match(usrhash) else None
    out = []
    for i, part in enumerate(usr[:2]):
        by_label = running_version is not None and part.version == running_version
        booted = part.uuid == booted_uuid if booted_uuid is not None else by_label
        out.append(Slot("AB"[i], part, verity[i] if i < len(verity) else None, booted,
                        signatures[i] if i < len(signatures) else None))
    return out
