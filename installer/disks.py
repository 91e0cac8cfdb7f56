"""This machine's disks as the installer judges them, from `lsblk --json -O -b` and udev properties.

Kept: what identifies a disk (serial, WWN, model, by-path) and what makes it unsafe to write (size,
transport, removable, read-only, mounts, partitions or a signature that say it holds data).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import UserError
from appliance.run import run

# systemd-boot's record of the partition it was loaded from (Boot Loader Interface)
LOADER_DEVICE_PARTUUID = Path(
    "/sys/firmware/efi/efivars/LoaderDevicePartUUID-4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"
)
USR_TYPE = "8484680c-9521-48c6-9c11-b0720656f69e"  # usr-x86-64


@dataclass(frozen=True)
class Partition:
    path: str
    partuuid: str
    parttype: str
    partlabel: str
    fstype: str
    mountpoints: tuple[str, ...]


@dataclass(frozen=True)
class Disk:
    path: str
    model: str
    serial: str
    wwn: str
    by_path: str
    size: int
    tran: str
    removable: bool
    read_only: bool
    fstype: str  # a signature on the whole disk (a file system, LVM, RAID member), else ""
    pttype: str
    mountpoints: tuple[str, ...]  # of the disk and every partition
    partitions: tuple[Partition, ...] = field(default=())

    @property
    def holds_data(self) -> str:
        """What data the disk holds, in a few words; "" when it is blank."""
        if self.partitions:
            names = ", ".join(f"{p.path.rsplit('/', 1)[-1]} {p.partlabel or p.fstype or p.parttype}".strip() for p in self.partitions)
            return f"{len(self.partitions)} partition(s): {names}"
        if self.fstype:
            return f"a {self.fstype} signature"
        if self.pttype:
            return f"an empty {self.pttype} partition table"
        return ""

    def appliance_versions(self) -> list[str]:
        """The appliance versions in this disk's /usr slots (labels appliance_VERSION)."""
        return sorted(p.partlabel.removeprefix("appliance_") for p in self.partitions
                      if p.parttype == USR_TYPE and p.partlabel.startswith("appliance_") and "_verity" not in p.partlabel)


def _text(value: Any) -> str:
    return str(value).strip() if value is not None else ""


def _mounts(node: Mapping[str, Any]) -> tuple[str, ...]:
    points = node.get("mountpoints") or [node.get("mountpoint")]
    return tuple(p for p in points if p)


def _flag(value: Any) -> bool:
    return value is True or value in ("1", 1)


def from_lsblk(doc: Mapping[str, Any], udev: Mapping[str, Mapping[str, str]]) -> list[Disk]:
    """The whole disks in an `lsblk --json -O -b` document; UDEV: each disk's udev properties by path."""
    disks = []
    for node in doc.get("blockdevices", []):
        if node.get("type") != "disk" or _text(node.get("name")).startswith(("zram", "loop", "ram")):
            continue
        path = _text(node.get("path")) or "/dev/" + _text(node.get("name"))
        props = udev.get(path, {})
        parts = []
        mounts = list(_mounts(node))
        for child in node.get("children") or []:
            mounts += _mounts(child)
            for grandchild in child.get("children") or []:  # a device mapper or RAID above a partition
                mounts += _mounts(grandchild)
            if child.get("type") == "part":
                parts.append(Partition(
                    path=_text(child.get("path")), partuuid=_text(child.get("partuuid")).lower(),
                    parttype=_text(child.get("parttype")).lower(), partlabel=_text(child.get("partlabel")),
                    fstype=_text(child.get("fstype")), mountpoints=_mounts(child),
                ))
        wwn = _text(node.get("wwn")) or props.get("ID_WWN", "")
        disks.append(Disk(
            path=path,
            model=_text(node.get("model")) or props.get("ID_MODEL", "").replace("_", " "),
            serial=_text(node.get("serial")) or props.get("ID_SERIAL_SHORT", ""),
            wwn=wwn.lower(),
            by_path=props.get("ID_PATH", ""),
            size=int(node.get("size") or 0),
            tran=_text(node.get("tran")),
            removable=_flag(node.get("rm")) or _flag(node.get("hotplug")),
            read_only=_flag(node.get("ro")),
            fstype=_text(node.get("fstype")),
            pttype=_text(node.get("pttype")),
            mountpoints=tuple(mounts),
            partitions=tuple(parts),
        ))
    return disks


Runner = Callable[[Sequence[str]], str]


def _run(argv: Sequence[str]) -> str:
    return run(list(argv), f"reading the disks ({argv[0]})", hint="the installer needs util-linux and udev", timeout=30)


def read(runner: Runner = _run) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """This machine's `lsblk --json -O -b` and each whole disk's udev properties."""
    try:
        doc = json.loads(runner(["lsblk", "--json", "-O", "-b"]))
    except ValueError as e:
        raise UserError(f"lsblk printed no JSON ({e})", hint="the installer needs util-linux 2.37 or newer") from None
    udev: dict[str, dict[str, str]] = {}
    if shutil.which("udevadm") is None:  # lsblk still names serial, WWN and model; by_path needs udev
        return doc, udev
    for node in doc.get("blockdevices", []):
        if node.get("type") == "disk" and node.get("path"):
            text = runner(["udevadm", "info", "--query=property", f"--name={node['path']}"])
            udev[node["path"]] = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    return doc, udev


def boot_partuuid(path: Path = LOADER_DEVICE_PARTUUID) -> str:
    """The PARTUUID of the partition the firmware loaded systemd-boot from ("" when unknown).
    efivarfs files start with 4 attribute bytes; the value is UTF-16LE, NUL-terminated."""
    try:
        data = path.read_bytes()[4:]
    except OSError:
        return ""
    return data.decode("utf-16-le", errors="replace").rstrip("\0").strip().lower()
