# SPDX-License-Identifier: MIT
"""Where the slot code reads the machine, and this boot as systemd-boot recorded it.

Everything read from the machine comes through `Host`, so tests point it at a temporary tree and
fake programs; on the device the defaults apply. Environment variables move each default:

    APPLIANCE_EFIVARS_DIR   /sys/firmware/efi/efivars
    APPLIANCE_CMDLINE       /proc/cmdline
    APPLIANCE_ESP_DIR       the ESP's mount point (default: the first of /efi, /boot, /boot/efi with EFI/Linux)
    APPLIANCE_DISK          the disk behind /usr (default: findmnt + lsblk)
    APPLIANCE_SFDISK        the sfdisk program (default: sfdisk)
    APPLIANCE_BOOTCTL       the bootctl program (default: bootctl)

This boot: the EFI variables systemd-boot sets (LoaderEntrySelected, LoaderBootCountPath) and the
usrhash= on the kernel command line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

EFI_LOADER_GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"

_COUNTED = re.compile(r"\+([0-9]+)(?:-([0-9]+))?(?:\.(?:conf|efi))?\Z")


def _env_path(name: str, default: str) -> Path:
    return Path(os.environ.get(f"APPLIANCE_{name}", default))


def _default_esp() -> Path | None:
    if "APPLIANCE_ESP_DIR" in os.environ:
        return Path(os.environ["APPLIANCE_ESP_DIR"])
    for candidate in ("/efi", "/boot", "/boot/efi"):
        if Path(candidate, "EFI", "Linux").is_dir():
            return Path(candidate)
    return None


@dataclass
class Host:
    """Where the slot code looks; every field can be pointed elsewhere by tests."""

    efivars: Path = field(default_factory=lambda: _env_path("EFIVARS_DIR", "/sys/firmware/efi/efivars"))
    cmdline: Path = field(default_factory=lambda: _env_path("CMDLINE", "/proc/cmdline"))
    esp: Path | None = field(default_factory=_default_esp)
    disk: str | None = field(default_factory=lambda: os.environ.get("APPLIANCE_DISK"))
    sfdisk: str = field(default_factory=lambda: os.environ.get("APPLIANCE_SFDISK", "sfdisk"))
    bootctl: str = field(default_factory=lambda: os.environ.get("APPLIANCE_BOOTCTL", "bootctl"))


def read_efi_string(path: Path) -> str:
    """An EFI variable holding a string: 4 bytes of attributes, then NUL-terminated UTF-16LE."""
    return path.read_bytes()[4:].decode("utf-16-le").split("\0", 1)[0]


def efi_var(host: Host, name: str) -> str | None:
    try:
        return read_efi_string(host.efivars / f"{name}-{EFI_LOADER_GUID}")
    except (OSError, UnicodeDecodeError):
        return None


def booted_usrhash(host: Host) -> str | None:
    try:
        args = host.cmdline.read_text().split()
    except OSError:
        return None
    value = next((a.split("=", 1)[1] for a in args if a.startswith("usrhash=")), None)
    return value.lower() if value else None


def booted_entry(host: Host) -> str | None:
    """The booted entry's id, without the boot menu profile systemd-boot may add to it
    (`appliance_V.efi@factory-reset`): the version's entry is the kernel image file."""
    selected = efi_var(host, "LoaderEntrySelected")
    return selected.split("@", 1)[0] if selected else selected


def boot_counting(host: Host) -> dict[str, Any] | None:
    """Whether THIS boot was counted, from the EFI variables systemd-boot set at boot (they do not
    change when systemd-bless-boot renames the file later in the same boot: for "judged yet?",
    ask View.running_state()). None when the booted entry was not counted."""
    count_path = efi_var(host, "LoaderBootCountPath")
    selected = booted_entry(host)
    for name in (count_path, selected):
        if not name:
            continue
        m = _COUNTED.search(name.rsplit("/", 1)[-1].rsplit("\\", 1)[-1])
        if m:
            return {"entry": selected or name, "count_path": count_path, "tries_left": int(m.group(1)), "tries_done": int(m.group(2) or 0)}
    if count_path:
        return {"entry": selected, "count_path": count_path, "tries_left": None, "tries_done": None}
    return None
