"""Target selection against real disk listings: the chosen disk is always the one the plan names,
or nothing (with every candidate listed). Inputs are recorded `lsblk --json -O -b` and udev
outputs (tests/fixtures/disks/): the build host's own, and the QEMU decoy matrix recorded by
tests/integration/record_disks.py (sets not recorded yet are skipped, and say so)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from appliance.plan import Target
from installer import disks, select

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "disks"
GIB = 1 << 30
REQUIRED = 10 * GIB  # about what the demo's layout needs (slots A and B, root, /var's minimum)
VERSION = "1.0.0"


def _load(name: str) -> tuple[list[disks.Disk], str]:
    path = FIXTURES / f"{name}.json"
    if not path.exists():
        pytest.skip(f"{path.name} not recorded yet (run tests/integration/record_disks.py when QEMU may run)")
    data: dict[str, Any] = json.loads(path.read_text())
    return disks.from_lsblk(data["lsblk"], data.get("udev", {})), data.get("boot_partuuid", "")


def _choose(name: str, **target: Any) -> select.Choice:
    found, boot = _load(name)
    return select.choose(found, Target(**target), boot_partuuid=boot, required_bytes=REQUIRED, version=VERSION)


# (disk set, target, the serial chosen or the words of the refusal)
MATRIX: list[tuple[str, dict[str, Any], str]] = [
    ("one-nvme", {"serial": "NV-A1"}, "=NV-A1"),
    ("one-nvme", {"serial": "NV-A9"}, "no disk matches"),
    ("two-nvme-same-model", {"model": "QEMU NVMe Ctrl"}, "2 disks match"),
    ("two-nvme-same-model", {"serial": "NV-A2"}, "=NV-A2"),
    ("two-nvme-same-model", {"model": "QEMU NVMe Ctrl", "serial": "NV-A1"}, "=NV-A1"),
    ("four-nvme", {"serial": "NV-B1"}, "holds data"),
    ("four-nvme", {"serial": "NV-B1", "wipe_existing_data": True}, "=NV-B1"),
    ("four-nvme", {"model": "QEMU NVMe Ctrl", "min_size_gib": 20}, "=NV-C1"),
    ("four-nvme", {"model": "QEMU NVMe Ctrl", "max_size_gib": 20}, "3 disks match"),
    ("nvme-and-usb", {"serial": "USB-1"}, "removable"),
    ("nvme-and-usb", {"serial": "NV-A1"}, "=NV-A1"),
    ("usb-only", {"serial": "USB-1", "wipe_existing_data": True}, "removable"),
    ("small-nvme", {"serial": "NV-SMALL"}, "too small"),
    ("small-nvme", {"model": "QEMU NVMe Ctrl", "min_size_gib": 10}, "=NV-A1"),
    ("nvme-with-fs", {"serial": "NV-FS"}, "holds data (a ext4 signature)"),
    ("nvme-with-gpt", {"serial": "NV-GPT"}, "holds data (2 partition(s)"),
    ("nvme-with-gpt", {"serial": "NV-GPT", "wipe_existing_data": True}, "=NV-GPT"),
    ("sata-and-nvme", {"wwn": "0x5000c500a1b2c3d4"}, "=SATA-1"),
    ("virtio-decoys", {"serial": "NV-A1"}, "=NV-A1"),
    ("scsi-disks", {"serial": "SCSI-2"}, "=SCSI-2"),
    ("installer-usb", {"serial": "TARGET-0001"}, "=TARGET-0001"),
    ("installer-usb", {"model": "QEMU NVMe Ctrl"}, "2 disks match"),
    ("installer-usb", {"serial": "MEDIUM-0005", "wipe_existing_data": True}, "removable"),
    ("installer-usb", {"serial": "SMALL-0004"}, "too small"),
    ("installer-usb", {"serial": "DATA-0003"}, "holds data"),
]


@pytest.mark.parametrize(("name", "target", "expected"), MATRIX, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(MATRIX)])
def test_decoy_matrix(name: str, target: dict[str, Any], expected: str) -> None:
    if expected.startswith("="):
        choice = _choose(name, **target)
        assert choice.disk.serial == expected[1:]
        assert [c.disk.path for c in choice.candidates if c.matched] == [choice.disk.path]
        return
    with pytest.raises(select.NoSafeChoice) as e:
        _choose(name, **target)
    assert expected in e.value.message, e.value.message
    assert "nothing written" in e.value.message
    assert e.value.candidates  # every disk is listed for the operator


def test_the_boot_medium_is_never_chosen() -> None:
    """In every recorded set, the disk holding the partition the firmware booted from is refused
    whatever the plan says, even with wipe_existing_data."""
    recorded = sorted(p.stem for p in FIXTURES.glob("*.json") if p.stem != "build-host")
    if not recorded:
        pytest.skip("no QEMU disk set recorded yet")
    for name in recorded:
        found, boot = _load(name)
        assert boot, f"{name}: no LoaderDevicePartUUID recorded"
        (medium,) = [d for d in found if any(p.partuuid == boot for p in d.partitions)]
        target = Target(by_path=medium.by_path or "x", wipe_existing_data=True)
        assert "boot medium" in select.refusal(medium, target, boot, REQUIRED, VERSION)


def test_at_least_twelve_disk_sets_are_recorded() -> None:
    recorded = [p for p in FIXTURES.glob("*.json") if p.stem != "build-host"]
    if not recorded:
        pytest.skip("the QEMU decoy matrix is not recorded yet (tests/integration/record_disks.py)")
    assert len(recorded) >= 12


# ------------------------------------------------------------------ the build host's real disks


def test_build_host_listing_is_read_and_its_mounted_disk_refused() -> None:
    found, _ = _load("build-host")
    assert [d.path for d in found] == ["/dev/vda"]  # zram is not a candidate
    (vda,) = found
    assert vda.size == 256 * GIB and "/" in vda.mountpoints
    assert select.refusal(vda, Target(serial="x", wipe_existing_data=True), "", REQUIRED, VERSION).startswith("in use (mounted at")
    with pytest.raises(select.NoSafeChoice, match="no disk matches") as e:
        select.choose(found, Target(serial="S64ANS0T512345"), boot_partuuid="", required_bytes=REQUIRED, version=VERSION)
    listing = json.loads(select.dumps(e.value.candidates, None))
    assert listing["chosen"] is None and listing["candidates"][0]["refused"].startswith("in use")
    assert "/dev/vda" in select.table(e.value.candidates, None)
