# SPDX-License-Identifier: MIT
"""This machine's disks as the installer judges them, from `lsblk --json -O -b`, udev properties and
the kernel's holders in sysfs.

Kept: what identifies a disk (serial, WWN, model, by-path) and what makes it unsafe to write (size,
transport, removable, read-only, mounts and holders at any depth below it, partitions or a
signature that say it holds data).
"""

from __future__ import annotations

import json
import re
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
SYSFS = Path("/sys")
# a real stack (partition, LUKS, md, LVM, a partition on that) is a handful of levels: deeper or
# larger than these is a hostile or broken listing, and the disk counts as in use
MAX_STACK_DEPTH = 16
MAX_STACK_NODES = 4096
TOO_DEEP = f"devices stacked more than {MAX_STACK_DEPTH} deep or {MAX_STACK_NODES} wide (not followed)"
_KERNEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:+!-]{0,127}\Z")


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
    mountpoints: tuple[str, ...]  # of the disk and every device below it, at any depth
    partitions: tuple[Partition, ...] = field(default=())
    # the devices built on the disk or its partitions (md, LVM, LUKS, any device mapper), at any
    # depth, from lsblk and the kernel's holders/ directories: writing under them corrupts them
    holders: tuple[str, ...] = field(default=())

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
    return tuple(str(p) for p in (points if isinstance(points, list) else [points]) if p)


def _flag(value: Any) -> bool:
    return value is True or value in ("1", 1)


def _name(value: Any) -> str:
    """A kernel device name as it may be shown on the console (anything else is not a name)."""
    text = _text(value)
    return text if _KERNEL_NAME.match(text) else "?"


def _stack(node: Mapping[str, Any]) -> tuple[list[str], list[str], set[str]]:
    """The mountpoints of NODE (a whole disk) and of everything below it; the devices stacked on it
    (every child that is not one of its partitions, and everything below a partition) as shown,
    and their kernel names. Walked to any depth within MAX_STACK_DEPTH and MAX_STACK_NODES."""
    mounts, holders, names = list(_mounts(node)), list[str](), set[str]()
    todo: list[tuple[Any, int]] = [(c, 1) for c in reversed(node.get("children") or [])]
    seen = 0
    while todo:
        child, depth = todo.pop()
        seen += 1
        if depth > MAX_STACK_DEPTH or seen > MAX_STACK_NODES or not isinstance(child, Mapping):
            return mounts, [*holders, TOO_DEEP], names
        mounts += _mounts(child)
        if depth > 1 or child.get("type") != "part":
            holders.append(f"{_name(child.get('name'))} ({_name(child.get('type'))})")
            names |= {_text(child.get("name")), _text(child.get("kname"))}
        todo += [(c, depth + 1) for c in reversed(child.get("children") or [])]
    return mounts, holders, names


def sysfs_holders(names: Sequence[str], sys_root: Path) -> list[str]:
    """The devices holding any of NAMES (a disk and its partitions), from the kernel's
    SYS_ROOT/class/block/NAME/holders/ and theirs in turn: an assembled md array, an open LUKS
    volume or an active LVM volume on a member shows there even when nothing is mounted."""
    found: list[str] = []
    todo = [(n, 0) for n in names]
    seen = set(names)
    while todo:
        name, depth = todo.pop(0)
        try:
            entries = sorted(p.name for p in (sys_root / "class" / "block" / name / "holders").iterdir())
        except OSError:  # no such device, or no holders/ directory: nothing holds it
            continue
        for holder in entries:
            if holder in seen:
                continue
            if depth >= MAX_STACK_DEPTH or len(seen) >= MAX_STACK_NODES:
                return [*found, TOO_DEEP]
            seen.add(holder)
            found.append(_name(holder))
            todo.append((holder, depth + 1))
    return found


def from_lsblk(doc: Mapping[str, Any], udev: Mapping[str, Mapping[str, str]], sys_root: Path | None = None) -> list[Disk]:
    """The whole disks in an `lsblk --json -O -b` document; UDEV: each disk's udev properties by path;
    SYS_ROOT: where sysfs is (its holders counted too), None to go by lsblk alone."""
    disks = []
    for node in doc.get("blockdevices", []):
        if node.get("type") != "disk" or _text(node.get("name")).startswith(("zram", "loop", "ram")):
            continue
        path = _text(node.get("path")) or "/dev/" + _text(node.get("name"))
        props = udev.get(path, {})
        parts = []
        mounts, holders, stacked = _stack(node)
        for child in node.get("children") or []:
            if isinstance(child, Mapping) and child.get("type") == "part":
                parts.append(Partition(
                    path=_text(child.get("path")), partuuid=_text(child.get("partuuid")).lower(),
                    parttype=_text(child.get("parttype")).lower(), partlabel=_text(child.get("partlabel")),
                    fstype=_text(child.get("fstype")), mountpoints=_mounts(child),
                ))
        if sys_root is not None:
            own = [_text(node.get("kname") or node.get("name"))]
            own += [_text(c.get("kname") or c.get("name")) for c in node.get("children") or []
                    if isinstance(c, Mapping) and c.get("type") == "part"]
            holders += [h for h in sysfs_holders([n for n in own if n], sys_root) if h not in stacked]
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
            mountpoints=tuple(dict.fromkeys(mounts)),  # a RAID's volume shows under each member
            partitions=tuple(parts),
            holders=tuple(dict.fromkeys(holders)),
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
