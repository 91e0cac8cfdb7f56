# SPDX-License-Identifier: MIT
"""Writing the inactive slot: blank it, then systemd-sysupdate's transfers (/usr/lib/sysupdate.d)
write /usr, its verity and the kernel image last. A new engine goes first, into the chosen engine
slot, through sysupdate's engine component (/usr/lib/sysupdate.engine.d). The boot entry comes
last, so an interrupted run leaves the running version bootable and a rerun starts over.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from appliance import atomic, paths
from appliance.errors import UserError
from appliance.run import run
from appliance.signed.bundle_index import DEFAULT_ENTRY, BundleIndex, engine_short, payload_names, source_names
from applianctl.slots.engine import EngineSlot
from applianctl.slots.entries import entries
from applianctl.slots.machine import Host
from applianctl.slots.partitions import Partition, Slot, usr_disk

UKI_TRANSFER = Path("/usr/lib/sysupdate.d/90-uki.transfer")


def boot_tries(transfer: Path = UKI_TRANSFER) -> int | None:
    """The tries a new version gets: TriesLeft= of the kernel image's transfer (set at build from
    update.boot_tries); None when it cannot be read."""
    try:
        for line in transfer.read_text().splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "TriesLeft" and value.strip().isdigit():
                return int(value.strip())
    except OSError:
        pass
    return None


def sysupdate_program() -> str:
    return shutil.which("systemd-sysupdate") or "/usr/lib/systemd/systemd-sysupdate"


def sysupdate_commands(index: BundleIndex) -> list[list[str]]:
    """The systemd-sysupdate run: its transfers write /usr, its verity, and the kernel image last."""
    return [[sysupdate_program(), "--no-pager", "update", index.version]]


def link_sources(index: BundleIndex, staging: Path) -> None:
    """Fill the sysupdate source directory with exactly this bundle's verified files."""
    directory = paths.update_source_dir()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700, parents=True)
    for staged, linked in source_names(index).items():
        os.link(staging / staged, directory / linked)
    atomic.fsync_dir(directory)


def pin_default_entry(host: Host) -> bool:
    """Make the boot menu's default the kernel images' main entries (DEFAULT_ENTRY) on a disk
    installed before the images carried factory reset profiles: systemd-boot 257 sorts those before
    a version's main entry, so the new version's plain boot would be a reset. True when it wrote."""
    if host.esp is None:
        return False
    conf = host.esp / "loader" / "loader.conf"
    try:
        lines = conf.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    pin = f"default {DEFAULT_ENTRY}"
    if pin in lines:
        return False
    kept = [line for line in lines if line.split(None, 1)[:1] != ["default"]]
    # written beside and renamed into place, without atomic_write's chmod (the ESP is vfat)
    tmp = conf.with_name(".loader.conf.tmp")
    conf.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text("\n".join([*kept, pin]) + "\n")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, conf)
    atomic.fsync_dir(conf.parent)
    return True


def remove_entries(host: Host, version: str) -> None:
    """VERSION's boot entries go (before anything it needs is erased), made durable at once."""
    for entry in entries(host):
        if entry.version == version:
            entry.path.unlink()
    if host.esp is not None:
        atomic.fsync_dir(host.esp / "EFI" / "Linux")


def _blank(host: Host, parts: list[Partition], what: str) -> None:
    """Zero PARTS (the images stop at their last non-zero block), then label them empty (last:
    relabelling makes the kernel re-read the table, and the partition nodes vanish for a moment)."""
    for part in parts:
        zero = ["blkdiscard", "--zeroout", part.node]
        run(zero, " ".join(zero), f"{what} cannot be written", timeout=None)
    disk = usr_disk(host)
    for part in parts:
        if part.label != "_empty":
            argv = [host.sfdisk, "--part-label", disk, str(part.number), "_empty"]
            run(argv, "sfdisk --part-label", "the partition table cannot be written")


def prepare_slot(host: Host, inactive: Slot, running_version: str) -> None:
    """Blank the inactive slot for systemd-sysupdate: the boot entry of the version it held goes
    first (it would boot a slot about to be erased), then _blank. Each step leaves a state a rerun
    starts from, so a power cut anywhere is harmless."""
    old = inactive.version
    if old is not None and old != running_version:
        remove_entries(host, old)
    _blank(host, [p for p in (inactive.usr, inactive.verity, inactive.signature) if p is not None], "the inactive slot")


# ----------------------------------------------------------------------------------- engine slots

ENGINE_COMPONENT = "engine"  # /usr/lib/sysupdate.engine.d: its own versions, the digests' first 12 hex digits


def engine_sysupdate_commands(index: BundleIndex) -> list[list[str]]:
    """The engine component's run: its transfers write the `_empty` engine partition and its verity."""
    return [[sysupdate_program(), "--no-pager", f"--component={ENGINE_COMPONENT}", "update", engine_short(index.engine_digest)]]


def link_engine_sources(index: BundleIndex, staging: Path) -> None:
    """The sysupdate source directory with exactly this bundle's verified engine images."""
    names = payload_names(index.version, index.engine_digest, True)
    directory = paths.update_source_dir()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700, parents=True)
    for role in ("engine", "engine-verity"):
        os.link(staging / names[role], directory / names[role])
    atomic.fsync_dir(directory)


def prepare_engine_slot(host: Host, slot: EngineSlot, leaving: str | None) -> None:
    """Blank the engine SLOT that slots.engine.choose_engine_slot chose. The version LEAVING the
    inactive /usr slot loses its boot entry first: its engine may be the one erased here, and no
    bootable entry may point at an engine that is gone."""
    if leaving is not None:
        remove_entries(host, leaving)
    if slot.verity is None:
        raise UserError(f"engine slot {slot.name} has no verity partition", hint="see applianctl slots; the disk needs a re-install")
    _blank(host, [slot.data, slot.verity], f"engine slot {slot.name}")


@contextmanager
def locked() -> Iterator[None]:
    paths.update_dir().mkdir(parents=True, exist_ok=True)
    with open(paths.update_lock_path(), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError("another update is running", hint="wait for it (systemctl status appliance-update.service)") from None
        yield
