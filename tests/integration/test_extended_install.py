# SPDX-License-Identifier: MIT
"""Extended QEMU scenario (make test-extended): flashing a bare-metal host from a blank disk.

    boot 1  the installer (installer_VERSION.raw as a USB stick) on a machine with a blank target
            NVMe (serial TARGET-0001) beside decoys: another NVMe, a disk holding an ext4 file
            system, a disk too small; first an ambiguous plan (any QEMU NVMe) must stop with the
            candidates and write nothing, then the medium's plan installs onto TARGET-0001 and the
            installer reboots (QEMU exits: -no-reboot)
    host    the decoys hashed before and after: unchanged; the target holds the release's layout
    boot 2  without the medium, from the target through the firmware boot entry the installer
            made (same OVMF variable store): the demo's boot check reports; status part `host`
            shows the plan applied, its static address and its SSH key

    https   the installer kernel image alone (the UEFI HTTP boot form, here the only file of a
            GPT medium's ESP) on a machine with one blank NVMe: no payload, so the release comes
            over HTTPS from the signed plan's [update] url (a bundle released with
            --install-image, its CA as credential appliance.install-ca); the installed disk then
            boots with the plan's host name

    iso     the ISO form (BMC virtual media) as a USB CD-ROM on a machine with one blank NVMe: the
            installer boots from its El Torito image, installs the ISO's payload with the ISO's
            plan, and the installed disk boots with the plan's host name

The installer kernel image is built here by `python3 -m builder installer-uki` (installer/mkosi/).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from appliance import config
from builder import build, installer_media, installer_uki, keys, qemu, release, sign_plan

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.extended]

GIB = 1 << 30
MAC = "52:54:00:12:34:56"  # QEMU's first NIC
# name, GiB, QEMU device, content
DISKS = [
    ("target", 16, "nvme,serial=TARGET-0001", "blank"),
    ("decoy-nvme", 16, "nvme,serial=DECOY-0002", "blank"),
    ("decoy-data", 16, "virtio-blk-pci,serial=DATA-0003", "ext4"),
    ("decoy-small", 2, "virtio-blk-pci,serial=SMALL-0004", "blank"),
]
AMBIGUOUS_UNIT = """[Unit]
Description=Install with an ambiguous plan first: it must write nothing
Before=appliance-installer.service
[Service]
Type=oneshot
ExecStart=/bin/sh -c 'mkdir -p /run/ambiguous && cp $CREDENTIALS_DIRECTORY/plan.json $CREDENTIALS_DIRECTORY/plan.json.sig /run/ambiguous/; \
python3 -m installer --json --no-reboot --plan /run/ambiguous > /dev/ttyS1 2>&1; echo "AMBIGUOUS-EXIT $?" > /dev/ttyS1'
LoadCredential=plan.json:ambiguous.plan.json
LoadCredential=plan.json.sig:ambiguous.plan.json.sig
"""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _sign(tmp: Path, name: str, text: str, key: Path) -> Path:
    toml = tmp / f"{name}.toml"
    toml.write_text(text)
    sign_plan.write(toml, key, tmp / name, config.load(ROOT / "appliance.toml", "demo"))
    return tmp / name


@pytest.fixture(scope="module")
def release_parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("release")
    demo = config.load(ROOT / "appliance.toml", "demo")
    result = build.build(demo, output=work / "build")
    uki = installer_uki.build_uki(demo, output=work / "installer" / installer_uki.UKI_NAME)
    return {"demo": demo, "build": result.disk_image.parent, "uki": uki, "key": build.signing_key_for(demo, None)}


@pytest.fixture(scope="module")
def install_run(release_parts: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("install")
    demo, uki, key = release_parts["demo"], release_parts["uki"], release_parts["key"]
    bundle = work / "bundle"
    release.make_bundle(demo, release_parts["build"], bundle, key, None, None, with_install_image=True)  # what the medium carries
    _, ssh_pub = keys.generate(work / "ssh")  # an Ed25519 key; its OpenSSH form below
    from cryptography.hazmat.primitives import serialization

    pub = serialization.load_pem_public_key(ssh_pub.read_bytes())
    ssh_line = pub.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode() + " journey@test"
    real = _sign(work, "real", f"""hostname = "gpu-07"
[network]
interfaces = ["{MAC}"]
addresses = ["10.0.2.15/24"]
gateways = ["10.0.2.2"]
dns = ["10.0.2.3"]
[ssh]
authorized_keys = ["{ssh_line}"]
[target]
serial = "TARGET-0001"
""", key)
    ambiguous = _sign(work, "ambiguous", '[target]\nmodel = "QEMU NVMe Ctrl"\n', key)
    media = installer_media.make(release_parts["build"], demo.appliance.version, uki, real, work / "media", ["usb"], bundle)

    disks = {}
    for name, gib, _, content in DISKS:
        path = work / f"{name}.raw"
        subprocess.run(["truncate", "-s", f"{gib}G", str(path)], check=True)
        if content == "ext4":
            subprocess.run(["mkfs.ext4", "-q", "-L", "data", str(path)], check=True)
        disks[name] = path
    before = {name: _sha256(p) for name, p in disks.items() if name != "target"}

    vars_fd = qemu.firmware_vars(work / "OVMF_VARS.fd", None)  # setup mode: the installer enrolls
    base = ["qemu-system-x86_64", "-accel", "tcg", "-smp", "2", "-m", "4096", "-no-reboot", *qemu.firmware_args(vars_fd),
            "-nic", "user,model=virtio-net-pci", "-display", "none", "-monitor", "none", "-device", "qemu-xhci,id=xhci"]
    for i, (name, _, device, _) in enumerate(DISKS):
        kind, _, opts = device.partition(",")
        base += ["-drive", f"if=none,id=d{i},format=raw,file={disks[name]}", "-device", f"{kind},drive=d{i},{opts}"]
    creds = {"systemd.extra-unit.appliance-ambiguous.service": AMBIGUOUS_UNIT,
             "systemd.unit-dropin.appliance-installer.service":
                 "[Unit]\nAfter=appliance-ambiguous.service\nWants=appliance-ambiguous.service\n"
                 # its summary on the first serial port too (install-console.log), besides tty1
                 "[Service]\nStandardOutput=journal+console\nStandardError=journal+console\n",
             "ambiguous.plan.json": (ambiguous / "plan.json").read_text(),
             "ambiguous.plan.json.sig": (ambiguous / "plan.json.sig").read_text()}
    cmd1 = [*base, "-drive", f"if=none,id=medium,format=raw,readonly=on,file={media['usb']}",
            "-device", "usb-storage,drive=medium,serial=MEDIUM-0005,bus=xhci.0",
            *qemu.credential_args(creds),
            "-serial", f"file:{work}/install-console.log", "-serial", f"file:{work}/install-report.log"]
    # the installed guest's TPM (qemu.Guest keeps its state in DIR/tpm): the installer seals /var to
    # it and refuses a machine without one
    with qemu.Tpm(work / "boot2" / "tpm") as tpm:
        proc = subprocess.run([*cmd1, *tpm.qemu_args()], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=3600, check=False)
    assert proc.returncode == 0, f"QEMU: {proc.stderr[-2000:]}"
    after = {name: _sha256(p) for name, p in disks.items() if name != "target"}
    table = json.loads(subprocess.run(["sfdisk", "-J", str(disks["target"])], capture_output=True, text=True, check=True).stdout)

    guest = qemu.Guest(disks["target"], work / "boot2")
    shutil.copyfile(vars_fd, guest.vars)  # the boot entry the installer made
    report = guest.boot(timeout=1800)
    return {"exit": proc.returncode, "before": before, "after": after, "table": table, "report": report,
            "install_log": (work / "install-report.log").read_text(errors="replace"),
            "console": (work / "install-console.log").read_text(errors="replace"), "ssh_line": ssh_line}


def test_an_ambiguous_plan_writes_nothing(install_run: dict[str, Any]) -> None:
    log = install_run["install_log"]
    assert "AMBIGUOUS-EXIT 2" in log, log[-3000:]
    assert '"chosen": null' in log


def test_only_the_target_changed(install_run: dict[str, Any]) -> None:
    assert install_run["before"] == install_run["after"]
    names = [p.get("name") for p in install_run["table"]["partitiontable"]["partitions"]]
    assert "appliance-var" in names and any(n and n.startswith("appliance_") for n in names), names


def test_the_installed_appliance_boots_with_the_plans_address_and_key(install_run: dict[str, Any]) -> None:
    report = install_run["report"]
    host = report["status"]["parts"]["host"]
    assert host["source"] == "plan", host
    assert "10.0.2.15/24" in (host["addresses"] or [])
    assert host["settings"]["ssh_authorized_keys"] == [install_run["ssh_line"]]
    assert host["settings"]["hostname"] == "gpu-07"
    assert report["failed_units"] == []


@pytest.fixture(scope="module")
def https_install_run(release_parts: dict[str, Any], https_root: tuple[Path, str, str],
                      tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("https-install")
    demo, key = release_parts["demo"], release_parts["key"]
    root, url, ca = https_root
    release.make_bundle(demo, release_parts["build"], root / "install-v1", key, None, None, with_install_image=True)
    plan = _sign(work, "plan", f'hostname = "gpu-08"\n[update]\nurl = "{url}/install-v1/"\n[target]\nserial = "TARGET-0001"\n', key)
    # the .efi form, booted as the only file of a removable medium's ESP (what UEFI HTTP boot loads)
    esp = work / "esp.img"
    installer_media.esp_image(release_parts["uki"], esp)
    medium = work / "efi-only.raw"
    esp_mib = esp.stat().st_size >> 20
    with open(medium, "wb") as f:
        f.truncate((esp_mib + 2) << 20)
    subprocess.run(["sfdisk", "-q", str(medium)], input=f"label: gpt\nstart=2048, size={esp_mib * 2048}, type={installer_media.ESP_TYPE}\n",
                   text=True, check=True)
    subprocess.run(["dd", f"if={esp}", f"of={medium}", "bs=1M", "seek=1", "conv=notrunc", "status=none"], check=True)
    creds = {"appliance.install-plan": (plan / "plan.json").read_text(), "appliance.install-plan.sig": (plan / "plan.json.sig").read_text(),
             "appliance.install-ca": ca}
    medium_args = ["-drive", f"if=none,id=medium,format=raw,readonly=on,file={medium}", "-device", "usb-storage,drive=medium,bus=xhci.0"]
    return _install_then_boot(work, medium_args, creds)


def _install_then_boot(work: Path, medium_args: list[str], creds: dict[str, str]) -> dict[str, Any]:
    """Boot the installer from MEDIUM_ARGS on a machine with one blank 16 GiB NVMe (TARGET-0001),
    its output on the second serial port; then boot the installed disk through the firmware entry
    the installer made. The installer's output, its console and the boot check's report."""
    target = work / "target.raw"
    subprocess.run(["truncate", "-s", "16G", str(target)], check=True)
    vars_fd = qemu.firmware_vars(work / "OVMF_VARS.fd", None)  # setup mode: the installer enrolls
    creds = {**creds, "systemd.unit-dropin.appliance-installer.service":
             "[Service]\nStandardOutput=file:/dev/ttyS1\nStandardError=file:/dev/ttyS1\n"}
    cmd = ["qemu-system-x86_64", "-accel", "tcg", "-smp", "2", "-m", "4096", "-no-reboot", *qemu.firmware_args(vars_fd),
           "-nic", "user,model=virtio-net-pci", "-display", "none", "-monitor", "none", "-device", "qemu-xhci,id=xhci",
           "-drive", f"if=none,id=t,format=raw,file={target}", "-device", "nvme,drive=t,serial=TARGET-0001",
           *medium_args, *qemu.credential_args(creds),
           "-serial", f"file:{work}/console.log", "-serial", f"file:{work}/output.log"]
    with qemu.Tpm(work / "boot2" / "tpm") as tpm:  # the installed guest's (see install_run)
        proc = subprocess.run([*cmd, *tpm.qemu_args()], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=3600, check=False)
    assert proc.returncode == 0, f"QEMU: {proc.stderr[-2000:]}"
    output = (work / "output.log").read_text(errors="replace")
    guest = qemu.Guest(target, work / "boot2")
    shutil.copyfile(vars_fd, guest.vars)
    return {"output": output, "console": (work / "console.log").read_text(errors="replace"), "report": guest.boot(timeout=1800)}


def test_the_efi_form_installs_from_the_plans_https_url_and_the_disk_boots(https_install_run: dict[str, Any]) -> None:
    output = https_install_run["output"]
    assert "downloading release 1.0.0 from https://10.0.2.2:" in output, (output + https_install_run["console"])[-4000:]
    assert "Appliance 1.0.0 installed" in output and "/usr /dev/" in output, output[-3000:]
    report = https_install_run["report"]
    host = report["status"]["parts"]["host"]
    assert host["source"] == "plan" and host["settings"]["hostname"] == "gpu-08", host
    assert report["failed_units"] == []


@pytest.fixture(scope="module")
def iso_install_run(release_parts: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("iso-install")
    demo, key = release_parts["demo"], release_parts["key"]
    plan = _sign(work, "plan", 'hostname = "gpu-09"\n[target]\nserial = "TARGET-0001"\n', key)
    bundle = work / "bundle"
    release.make_bundle(demo, release_parts["build"], bundle, key, None, None, with_install_image=True)  # what the medium carries
    iso = installer_media.make(release_parts["build"], demo.appliance.version, release_parts["uki"], plan, work / "media", ["iso"],
                               bundle)["iso"]
    # a BMC's virtual media is a USB CD-ROM: a SCSI CD behind USB mass storage (bulk-only)
    medium_args = ["-drive", f"if=none,id=cd,media=cdrom,readonly=on,format=raw,file={iso}",
                   "-device", "usb-bot,id=vmedia,bus=xhci.0", "-device", "scsi-cd,drive=cd,bus=vmedia.0"]
    return _install_then_boot(work, medium_args, {})


def test_the_iso_form_boots_as_virtual_media_installs_and_the_disk_boots(iso_install_run: dict[str, Any]) -> None:
    output = iso_install_run["output"]
    assert "Appliance 1.0.0 installed" in output and "/usr /dev/" in output, (output + iso_install_run["console"])[-4000:]
    report = iso_install_run["report"]
    host = report["status"]["parts"]["host"]
    assert host["source"] == "plan" and host["settings"]["hostname"] == "gpu-09", host
    assert report["failed_units"] == []
