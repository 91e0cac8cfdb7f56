# SPDX-License-Identifier: MIT
"""Installer media from a (small, synthetic) build output, inspected with the real tools: the USB
image's partition table and files, its block map, the ISO's El Torito catalogue; `flash` refuses
the build host's own system disk (its real lsblk listing)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fake_release import bundle, demo_config, make_signing

from appliance.errors import UserError
from appliance.signed import install_plan
from builder import installer_media, keys, sign_plan

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "disks"
needs = pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("mkfs.vfat", "mcopy", "mkfs.ext4", "sfdisk", "xorriso", "bmaptool", "debugfs")),
    reason="needs dosfstools, mtools, e2fsprogs, xorriso, bmap-tools (make setup)",
)


def _build_output(tmp_path: Path) -> Path:
    """A build output that is its own bundle directory too (the tests pass OUT as both): the disk
    image, and what `release --install-image` makes of it (zstd image and block map, by the real tools)."""
    out = tmp_path / "out"
    out.mkdir()
    raw = out / "appliance_1.0.0.raw"
    with open(raw, "wb") as f:  # sparse, with data at both ends, as a real image
        f.truncate(256 << 20)
        f.write(b"GPT-ish head")
        f.seek((256 << 20) - 4096)
        f.write(b"tail" * 1024)
    if shutil.which("bmaptool") and shutil.which("zstd"):
        subprocess.run(["bmaptool", "create", "-o", str(out / "appliance_1.0.0.raw.bmap"), str(raw)], check=True, capture_output=True)
        subprocess.run(["zstd", "-q", "-o", str(out / "appliance_1.0.0.raw.zst"), str(raw)], check=True)
    (out / "manifest.json").write_text("{}")
    (out / "manifest.json.sig").write_text("sig\n")
    (out / "bundle.json").write_text("{}")
    (out / "bundle.json.sig").write_text("sig\n")
    return out


def _plan(tmp_path: Path) -> Path:
    private, _ = keys.generate(tmp_path / "keys")
    toml = tmp_path / "gpu-07.toml"
    toml.write_text('hostname = "gpu-07"\n[target]\nserial = "S1"\n')
    sign_plan.write(toml, private, tmp_path / "gpu-07", demo_config("1.0.0"))
    return tmp_path / "gpu-07"


@needs
def test_usb_iso_and_efi_forms(tmp_path: Path) -> None:
    uki = tmp_path / "installer.efi"
    uki.write_bytes(b"MZ" + bytes(range(256)) * 64)
    out = _build_output(tmp_path)
    written = installer_media.make(out, "1.0.0", uki, _plan(tmp_path), tmp_path / "media", ["usb", "iso", "efi"], out)
    assert sorted(written) == ["bmap", "efi", "iso", "usb"]
    assert not [p for p in (tmp_path / "media").iterdir() if p.name.startswith(".")]  # nothing half-written left

    usb = written["usb"]
    table = json.loads(subprocess.run(["sfdisk", "-J", str(usb)], capture_output=True, text=True, check=True).stdout)["partitiontable"]
    assert table["label"] == "gpt"
    esp, payload = table["partitions"]
    assert esp["type"] == installer_media.ESP_TYPE and payload["name"] == installer_media.PAYLOAD_LABEL
    sector = 512
    esp_img, payload_img = tmp_path / "esp", tmp_path / "payload"
    subprocess.run(["dd", f"if={usb}", f"of={esp_img}", f"bs={sector}", f"skip={esp['start']}", f"count={esp['size']}",
                    "status=none"], check=True)
    subprocess.run(["dd", f"if={usb}", f"of={payload_img}", f"bs={sector}", f"skip={payload['start']}", f"count={payload['size']}",
                    "status=none"], check=True)
    boot = subprocess.run(["mtype", "-i", str(esp_img), "::EFI/BOOT/BOOTX64.EFI"], capture_output=True, check=True).stdout
    assert boot == uki.read_bytes()
    listing = subprocess.run(["debugfs", "-R", "ls -l /", str(payload_img)], capture_output=True, text=True, check=True).stdout
    assert "appliance_1.0.0.raw.zst" in listing and "manifest.json.sig" in listing and "plan" in listing
    assert "appliance_1.0.0.raw.bmap" in listing and "bundle.json.sig" in listing
    assert "appliance_1.0.0.raw " not in listing + " "  # the uncompressed image, which no signed index lists, stays off
    plan_json = subprocess.run(["debugfs", "-R", "cat /plan/plan.json", str(payload_img)], capture_output=True, check=True).stdout
    plan_sig = subprocess.run(["debugfs", "-R", "cat /plan/plan.json.sig", str(payload_img)], capture_output=True, check=True).stdout
    assert install_plan.verify(plan_json, plan_sig, _trusted(tmp_path)).hostname == "gpu-07"
    bmap = written["bmap"].read_text()
    assert "<BlockMap>" in bmap and re.search(r"<ChecksumType>\s*sha256\s*</ChecksumType>", bmap)
    mapped = int(re.findall(r"<MappedBlocksCount>\s*(\d+)", bmap)[0])
    total = int(re.findall(r"<BlocksCount>\s*(\d+)", bmap)[0])
    assert mapped < total // 2  # the image's holes stay holes: bmaptool skips them

    report = subprocess.run(["xorriso", "-indev", str(written["iso"]), "-report_el_torito", "plain"],
                            capture_output=True, text=True, check=True).stdout
    assert "El Torito boot img :   1  UEFI" in report, report
    files = subprocess.run(["xorriso", "-indev", str(written["iso"]), "-find", "/", "-type", "f"],
                           capture_output=True, text=True, check=True).stdout
    for name in ("/appliance_1.0.0.raw.zst", "/appliance_1.0.0.raw.bmap", "/bundle.json", "/plan/plan.json.sig", "/efiboot.img"):
        assert f"'{name}'" in files, files
    assert written["efi"].read_bytes() == uki.read_bytes()


def _trusted(tmp_path: Path) -> Path:
    trusted = tmp_path / "trusted"
    trusted.mkdir(exist_ok=True)
    shutil.copy(tmp_path / "keys" / "release.pub", trusted / "release.pub")
    return trusted


def test_missing_release_files_are_one_line(tmp_path: Path) -> None:
    uki = tmp_path / "installer.efi"
    uki.write_bytes(b"MZ")
    with pytest.raises(UserError, match=r"appliance_9\.9\.raw\.zst: no such file") as e:
        installer_media.make(out := _build_output(tmp_path), "9.9", uki, None, tmp_path / "media", ["usb"], out)
    assert "release --install-image" in e.value.hint


def test_a_bundle_released_without_the_install_image_is_refused_before_writing(tmp_path: Path) -> None:
    """The medium carries only what its signed index lists: without --install-image the index names
    no disk image, and the installer could not check one."""
    key, _ = make_signing(tmp_path / "signing")
    released = bundle(tmp_path, key)
    uki = tmp_path / "installer.efi"
    uki.write_bytes(b"MZ")
    with pytest.raises(UserError, match=r"appliance_2\.0\.0\.raw\.zst: no such file \(needed on the medium") as e:
        installer_media.make(tmp_path / "out-2.0.0", "2.0.0", uki, None, tmp_path / "media", ["usb"], released)
    assert "python3 -m builder release --install-image" in e.value.hint
    assert not (tmp_path / "media").exists()


def test_a_bundle_of_another_build_is_refused(tmp_path: Path) -> None:
    key, _ = make_signing(tmp_path / "signing")
    released = bundle(tmp_path, key, with_install_image=True)
    other = tmp_path / "other-build"
    shutil.copytree(tmp_path / "out-2.0.0", other)
    (other / "manifest.json").write_bytes((other / "manifest.json").read_bytes().replace(b"2026-01-01", b"2026-01-02"))
    uki = tmp_path / "installer.efi"
    uki.write_bytes(b"MZ")
    with pytest.raises(UserError, match=r"not the release of the build in .*other-build \(another manifest\.json\)"):
        installer_media.make(other, "2.0.0", uki, None, tmp_path / "media", ["usb"], released)
    assert not (tmp_path / "media").exists()


@needs
def test_the_installer_checks_the_medium_the_builder_made(tmp_path: Path) -> None:
    """A medium made from a real (small) release: every payload file the installer writes is one
    the medium's signed index lists, and the installer's own check passes on it."""
    from installer import install

    key, trusted = make_signing(tmp_path / "signing")
    released = bundle(tmp_path, key, with_install_image=True)
    uki = tmp_path / "installer.efi"
    uki.write_bytes(b"MZ" + bytes(64))
    usb = installer_media.make(tmp_path / "out-2.0.0", "2.0.0", uki, None, tmp_path / "media", ["usb"], released)["usb"]
    payload = json.loads(subprocess.run(["sfdisk", "-J", str(usb)], capture_output=True, text=True, check=True).stdout)
    part = payload["partitiontable"]["partitions"][1]
    image = tmp_path / "payload.ext4"
    subprocess.run(["dd", f"if={usb}", f"of={image}", "bs=512", f"skip={part['start']}", f"count={part['size']}", "status=none"],
                   check=True)
    medium = tmp_path / "medium"
    medium.mkdir()
    subprocess.run(["debugfs", "-R", f"rdump / {medium}", str(image)], capture_output=True, check=True)
    loaded = install.load_payload(medium, trusted)  # the block map checked against the signed index
    install.check_against_index(loaded.image, loaded.image_file)  # and the image, as before the first write
    assert loaded.image.name == "appliance_2.0.0.raw.zst" and loaded.bmap.name == "appliance_2.0.0.raw.bmap"


def test_a_medium_without_the_signed_bundle_index_is_refused_before_writing(tmp_path: Path) -> None:
    uki = tmp_path / "installer.efi"
    uki.write_bytes(b"MZ")
    out = _build_output(tmp_path)
    (out / "bundle.json").unlink()
    with pytest.raises(UserError, match=r"bundle\.json: no such file \(needed on the medium as bundle\.json\)") as e:
        installer_media.make(out, "1.0.0", uki, None, tmp_path / "media", ["usb"], out)
    assert "python3 -m builder release" in (e.value.hint or "")
    assert not (tmp_path / "media").exists()


def test_flash_refuses_the_build_hosts_system_disk() -> None:
    doc = json.loads((FIXTURES / "build-host.json").read_text())["lsblk"]
    why, node = installer_media.flash_refusal("/dev/vda", doc)
    assert why.startswith("/dev/vda is a system disk (mounted at") and node is not None
    assert installer_media.flash_refusal("/dev/sdz", doc)[0] == "/dev/sdz is not a whole disk"
    assert "256.0 GiB" in installer_media.describe(node)


def test_flash_refuses_before_writing(tmp_path: Path) -> None:
    image = tmp_path / "installer_1.0.0.raw"
    image.write_bytes(b"x")
    (tmp_path / "installer_1.0.0.raw.bmap").write_text("<bmap/>")
    doc = (FIXTURES / "build-host.json").read_text()
    lsblk = json.dumps(json.loads(doc)["lsblk"])
    with pytest.raises(UserError, match="refusing to write /dev/vda: /dev/vda is a system disk"):
        installer_media.flash(image, "/dev/vda", yes=True, lsblk_json=lsblk)
