# SPDX-License-Identifier: MIT
"""Target selection against real disk listings: the chosen disk is always the one the plan names,
or nothing (with every candidate listed). Inputs are recorded `lsblk --json -O -b` and udev
outputs (tests/fixtures/disks/): the build host's own, and the QEMU decoy matrix recorded by
tests/integration/record_disks.py (sets not recorded yet are skipped, and say so). The md, LVM
and LUKS stacks (nvme-md-*.json, nvme-luks-lvm.json) are written by hand in the recorded sets'
shape, with their sysfs holders trees (tests/fixtures/sysfs/): the host has no device mapper."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from appliance.signed.install_plan import Target
from installer import disks, select

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "disks"
SYSFS = Path(__file__).resolve().parent / "fixtures" / "sysfs"
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
    # a mount three levels below the disk: partition -> md RAID1 -> LVM volume at /srv
    ("nvme-md-lvm", {"serial": "NV-R1", "wipe_existing_data": True}, "in use (mounted at /srv)"),
    ("nvme-md-lvm", {"serial": "NV-R2", "wipe_existing_data": True}, "in use (mounted at /srv)"),
    ("nvme-md-lvm", {"serial": "NV-A1"}, "=NV-A1"),
    # partition -> LUKS -> LVM, swap active on a volume
    ("nvme-luks-lvm", {"serial": "NV-L1", "wipe_existing_data": True}, "in use (mounted at [SWAP])"),
    ("nvme-luks-lvm", {"model": "QEMU NVMe Ctrl", "max_size_gib": 16}, "2 disks match"),
    # an assembled array nothing mounts: held all the same
    ("nvme-md-idle", {"serial": "NV-M1", "wipe_existing_data": True}, "in use (held by md0 (raid1))"),
    ("nvme-md-idle", {"serial": "NV-A1", "wipe_existing_data": True}, "=NV-A1"),
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


# ------------------------------------------------------------------ holders at any depth


def _listing(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())  # type: ignore[no-any-return]


def _without_stacks(doc: dict[str, Any]) -> dict[str, Any]:
    """DOC as an lsblk that lists each disk's partitions but nothing built on them."""
    doc = copy.deepcopy(doc)
    for disk in doc["lsblk"]["blockdevices"]:
        for part in disk.get("children") or []:
            part.pop("children", None)
    return doc


def test_an_in_use_disk_says_what_to_stop() -> None:
    with pytest.raises(select.NoSafeChoice) as e:
        _choose("nvme-md-idle", serial="NV-M2", wipe_existing_data=True)
    assert "mdadm --stop" in e.value.hint and "vgchange -an" in e.value.hint
    assert "wipe_existing_data" not in e.value.hint  # wiping does not help a disk that is in use


def test_the_kernels_holders_count_when_lsblk_lists_nothing_above_a_member() -> None:
    """sysfs' holders/ directories, followed to any depth: an assembled array or an active volume on
    a member holds the disk even when lsblk lists nothing above the partition."""
    doc = _without_stacks(_listing("nvme-md-lvm"))
    target = Target(serial="NV-R1", wipe_existing_data=True)
    bare = {d.serial: d for d in disks.from_lsblk(doc["lsblk"], doc["udev"])}
    assert select.refusal(bare["NV-R1"], target, "", REQUIRED, VERSION) == ""  # lsblk alone no longer sees it
    found = {d.serial: d for d in disks.from_lsblk(doc["lsblk"], doc["udev"], SYSFS / "nvme-md-lvm")}
    assert found["NV-R1"].holders == ("md127", "dm-0")  # the array, and the LVM volume on the array
    assert select.refusal(found["NV-R1"], target, "", REQUIRED, VERSION) == "in use (held by md127, dm-0)"
    assert found["NV-A1"].holders == ()
    idle = _without_stacks(_listing("nvme-md-idle"))
    found = {d.serial: d for d in disks.from_lsblk(idle["lsblk"], idle["udev"], SYSFS / "nvme-md-idle")}
    assert found["NV-M1"].holders == found["NV-M2"].holders == ("md0",)
    with pytest.raises(select.NoSafeChoice, match=r"is in use \(held by md0\)"):
        select.choose(list(found.values()), Target(serial="NV-M1", wipe_existing_data=True), boot_partuuid="",
                      required_bytes=REQUIRED, version=VERSION)


def test_lsblk_and_sysfs_name_a_holder_once() -> None:
    doc = _listing("nvme-md-lvm")
    found = {d.serial: d for d in disks.from_lsblk(doc["lsblk"], doc["udev"], SYSFS / "nvme-md-lvm")}
    assert found["NV-R1"].holders == ("md127 (raid1)", "vg0-data (lvm)")  # dm-0 is vg0-data's kernel name
    assert found["NV-R1"].mountpoints == ("/srv",)


def _nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"name": f"dm-{depth}", "type": "lvm"}
    for level in range(depth - 1, 0, -1):
        node = {"name": f"dm-{level}", "type": "lvm", "children": [node]}
    disk = {"name": "nvme9n1", "path": "/dev/nvme9n1", "type": "disk", "serial": "NV-X", "size": 100 * GIB,
            "children": [{"name": "nvme9n1p1", "path": "/dev/nvme9n1p1", "type": "part", "children": [node]}]}
    return {"blockdevices": [disk]}


def test_a_listing_deeper_or_wider_than_any_real_stack_counts_as_in_use() -> None:
    """A hostile or broken listing (a stack of 100, a node that holds itself) ends the walk, and
    the disk is refused rather than believed free."""
    (ok,) = disks.from_lsblk(_nested(disks.MAX_STACK_DEPTH - 1), {})
    assert disks.TOO_DEEP not in ok.holders and len(ok.holders) == disks.MAX_STACK_DEPTH - 1
    (deep,) = disks.from_lsblk(_nested(100), {})
    assert deep.holders[-1] == disks.TOO_DEEP and len(deep.holders) <= disks.MAX_STACK_DEPTH
    assert select.refusal(deep, Target(serial="NV-X", wipe_existing_data=True), "", REQUIRED, VERSION).startswith("in use (held by")
    cyclic = _nested(1)
    node = cyclic["blockdevices"][0]["children"][0]["children"][0]
    node["children"] = [node]
    (loop,) = disks.from_lsblk(cyclic, {})
    assert loop.holders[-1] == disks.TOO_DEEP
    wide = _nested(1)
    wide["blockdevices"][0]["children"][0]["children"] = [{"name": f"dm-{i}", "type": "crypt"} for i in range(10_000)]
    (many,) = disks.from_lsblk(wide, {})
    assert many.holders[-1] == disks.TOO_DEEP and len(many.holders) <= disks.MAX_STACK_NODES


def test_a_cyclic_or_endless_sysfs_tree_ends(tmp_path: Path) -> None:
    block = tmp_path / "class" / "block"
    for name, holder in (("nvme9n1p1", "dm-0"), ("dm-0", "dm-1"), ("dm-1", "dm-0")):  # dm-0 and dm-1 hold each other
        (block / name / "holders").mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../{holder}", block / name / "holders" / holder)
    assert disks.sysfs_holders(["nvme9n1", "nvme9n1p1"], tmp_path) == ["dm-0", "dm-1"]
    chain = tmp_path / "chain"
    for i in range(100):
        (chain / "class" / "block" / f"dm-{i}" / "holders").mkdir(parents=True)
        (chain / "class" / "block" / f"dm-{i}" / "holders" / f"dm-{i + 1}").touch()
    found = disks.sysfs_holders(["dm-0"], chain)
    assert found[-1] == disks.TOO_DEEP and len(found) == disks.MAX_STACK_DEPTH + 1
