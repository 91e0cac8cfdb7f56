"""Writing the inactive slot: blank it, hand the verified files to systemd-sysupdate, and let its
transfers (/usr/lib/sysupdate.d) write /usr, its verity and the kernel image last.

Only the inactive slot and a new boot entry are written, the entry last; an interrupted run leaves
the running version bootable, and running the command again starts over.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from appliance import atomic
from appliance.bundle import BundleIndex, source_names
from appliance.errors import UserError
from appliance.run import run
from applianctl import slots

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
    directory = slots.source_dir()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700, parents=True)
    for staged, linked in source_names(index).items():
        os.link(staging / staged, directory / linked)
    atomic.fsync_dir(directory)


def prepare_slot(host: slots.Host, inactive: slots.Slot, running_version: str) -> None:
    """Make the inactive slot blank before systemd-sysupdate writes it: the boot entry of the
    version it held goes first (it would boot a slot about to be erased), then the partitions are
    zeroed (the bundle's images stop at their last non-zero block), then labelled empty (last:
    relabelling makes the kernel re-read the table, and the partition nodes vanish for a moment).
    Each step leaves a state the next run starts from again, so a power cut anywhere is harmless."""
    old = inactive.version
    if old is not None and old != running_version:
        for entry in slots.entries(host):
            if entry.version == old:
                entry.path.unlink()
        if host.esp is not None:
            atomic.fsync_dir(host.esp / "EFI" / "Linux")
    parts = [p for p in (inactive.usr, inactive.verity) if p is not None]
    for part in parts:
        zero = ["blkdiscard", "--zeroout", part.node]
        run(zero, " ".join(zero), "the inactive slot cannot be written", timeout=None)
    disk = slots.usr_disk(host)
    for part in parts:
        if part.label != "_empty":
            argv = [host.sfdisk, "--part-label", disk, str(part.number), "_empty"]
            run(argv, "sfdisk --part-label", "the partition table cannot be written")


@contextmanager
def locked() -> Iterator[None]:
    slots.update_dir().mkdir(parents=True, exist_ok=True)
    with open(slots.update_dir() / "lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError("another update is running", hint="wait for it (systemctl status appliance-update.service)") from None
        yield
