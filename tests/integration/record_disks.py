# SPDX-License-Identifier: MIT
"""Record the decoy matrix's inputs: real `lsblk --json -O -b` and udev outputs from a QEMU guest
(the demo image) with each disk set attached. Run once by hand when QEMU may run:

    .venv/bin/python -m tests.integration.record_disks out/demo/appliance_1.0.0.raw

Each set is one boot: the recording unit arrives as a systemd credential
(`systemd.extra-unit.*`, systemd 256 and newer), is pulled in by a drop-in credential, prints the
outputs between markers on the third serial port and powers the guest off. The outputs land in
tests/fixtures/disks/SET.json, which tests/test_select.py reads.
"""

from __future__ import annotations

# ruff: noqa: E501  (the disk sets read best one per line)
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from appliance import config
from builder import build, qemu

ROOT = Path(__file__).resolve().parents[2]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "disks"
BEGIN, END = "H8-DISKS-BEGIN", "H8-DISKS-END"

# The recording itself, in Python (a shell line inside a unit file loses its quotes to systemd's
# own unquoting); it arrives as the credential appliance.record-disks.py.
RECORD_SCRIPT = f"""
import glob, json, subprocess
subprocess.run(["udevadm", "settle"], check=False)
lsblk = json.loads(subprocess.run(["lsblk", "--json", "-O", "-b"], capture_output=True, text=True, check=True).stdout)
udev = {{}}
for disk in subprocess.run(["lsblk", "-dn", "-o", "PATH"], capture_output=True, text=True, check=True).stdout.split():
    out = subprocess.run(["udevadm", "info", "--query=property", f"--name={{disk}}"], capture_output=True, text=True).stdout
    udev[disk] = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
boot = ""
for path in glob.glob("/sys/firmware/efi/efivars/LoaderDevicePartUUID-4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"):
    boot = open(path, "rb").read()[4:].decode("utf-16-le").rstrip("\\0").lower()
with open("/dev/ttyS2", "w") as tty:
    tty.write("{BEGIN}\\n" + json.dumps({{"lsblk": lsblk, "udev": udev, "boot_partuuid": boot}}) + "\\n{END}\\n")
"""
RECORD_UNIT = """[Unit]
Description=Record lsblk and udev outputs for the installer's decoy matrix
After=systemd-udev-settle.service local-fs.target
[Service]
Type=oneshot
LoadCredential=record.py:appliance.record-disks.py
ExecStart=/usr/bin/python3 ${CREDENTIALS_DIRECTORY}/record.py
ExecStartPost=/bin/systemctl --no-block poweroff
"""
WANTS = "[Unit]\nWants=appliance-record-disks.service\n"

GIB = 1 << 30

# name -> (description, extra disks: (size in GiB, QEMU device options, content))
# content: "blank", "ext4" (a file system on the whole disk), "gpt" (a partition table with data)
SETS: dict[str, tuple[str, list[tuple[int, str, str]]]] = {
    "one-nvme": ("one blank NVMe beside the boot disk", [(16, "nvme,serial=NV-A1", "blank")]),
    "two-nvme-same-model": ("two NVMe of the same model, serials differ", [(16, "nvme,serial=NV-A1", "blank"), (16, "nvme,serial=NV-A2", "blank")]),
    "four-nvme": ("four NVMe, one of them holding a GPT with data", [(16, "nvme,serial=NV-A1", "blank"), (16, "nvme,serial=NV-A2", "blank"),
                                                                      (16, "nvme,serial=NV-B1", "gpt"), (32, "nvme,serial=NV-C1", "blank")]),
    "nvme-and-usb": ("an NVMe and a USB stick", [(16, "nvme,serial=NV-A1", "blank"), (16, "usb-storage,serial=USB-1", "blank")]),
    "usb-only": ("only a USB stick besides the boot disk", [(16, "usb-storage,serial=USB-1", "blank")]),
    "small-nvme": ("an NVMe too small for the layout and a large one", [(4, "nvme,serial=NV-SMALL", "blank"), (16, "nvme,serial=NV-A1", "blank")]),
    "nvme-with-fs": ("an NVMe with an ext4 file system on the whole disk", [(16, "nvme,serial=NV-FS", "ext4"), (16, "nvme,serial=NV-A1", "blank")]),
    "nvme-with-gpt": ("an NVMe holding a partition table", [(16, "nvme,serial=NV-GPT", "gpt")]),
    "sata-and-nvme": ("a SATA disk with a WWN and an NVMe", [(16, "ide-hd,bus=ahci0.0,serial=SATA-1,wwn=0x5000c500a1b2c3d4", "blank"),
                                                             (16, "nvme,serial=NV-A1", "blank")]),
    "virtio-decoys": ("virtio disks without serials beside an NVMe", [(16, "virtio-blk-pci", "blank"), (16, "virtio-blk-pci", "blank"),
                                                                       (16, "nvme,serial=NV-A1", "blank")]),
    "scsi-disks": ("two SCSI disks with serials", [(16, "scsi-hd,bus=scsi0.0,serial=SCSI-1", "blank"), (16, "scsi-hd,bus=scsi0.0,serial=SCSI-2", "blank")]),
    "installer-usb": ("the journey's machine: target NVMe, decoy NVMe, a disk with a file system, a small disk, the medium on USB",
                      [(16, "nvme,serial=TARGET-0001", "blank"), (16, "nvme,serial=DECOY-0002", "blank"),
                       (16, "virtio-blk-pci,serial=DATA-0003", "ext4"), (2, "virtio-blk-pci,serial=SMALL-0004", "blank"),
                       (4, "usb-storage,serial=MEDIUM-0005", "gpt")]),
}


def _disk(path: Path, gib: int, content: str) -> None:
    subprocess.run(["truncate", "-s", f"{gib}G", str(path)], check=True)
    if content == "ext4":
        subprocess.run(["mkfs.ext4", "-q", "-L", "data", str(path)], check=True)
    elif content == "gpt":
        subprocess.run(["sfdisk", "-q", str(path)], input="label: gpt\n,1G,L,\n,1G,L,\n", text=True, check=True)


def record(image: Path, name: str, timeout: float = 900) -> Path:
    description, extra = SETS[name]
    work = Path(tempfile.mkdtemp(prefix=f"record-{name}-"))
    guest = qemu.Guest(image, work, enroll_cert=build.secure_boot_certificate(config.load(ROOT / "appliance.toml", "demo")))
    creds = {"systemd.extra-unit.appliance-record-disks.service": RECORD_UNIT,
             "systemd.unit-dropin.multi-user.target": WANTS, "appliance.bootcheck": "report",
             "appliance.record-disks.py": RECORD_SCRIPT}
    cmd = qemu.qemu_command(guest.disk, guest.vars, creds)  # no TPM: the disks are what it records
    cmd += ["-device", "qemu-xhci,id=xhci", "-device", "ahci,id=ahci0", "-device", "virtio-scsi-pci,id=scsi0"]
    for i, (gib, device, content) in enumerate(extra):
        path = work / f"extra{i}.raw"
        _disk(path, gib, content)
        cmd += ["-drive", f"if=none,id=x{i},format=raw,file={path}"]
        kind, _, opts = device.partition(",")
        cmd += ["-device", f"{kind},drive=x{i}" + (f",{opts}" if opts else "") + (",bus=xhci.0" if kind == "usb-storage" else "")]
    log = work / "ttyS2.log"
    cmd += ["-serial", f"file:{work}/console.log", "-serial", f"file:{work}/ttyS1.log", "-serial", f"file:{log}"]
    started = time.monotonic()
    subprocess.run(cmd, stdin=subprocess.DEVNULL, timeout=timeout, check=False)
    text = log.read_text(errors="replace")
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    data = json.loads(body)
    out = {"recorded_on": f"QEMU guest, demo image {image.name}, {time.strftime('%Y-%m-%d')}",
           "description": description, "qemu_devices": [d for _, d, _ in extra],
           "commands": ["lsblk --json -O -b", "udevadm info --query=property --name=DISK", "LoaderDevicePartUUID"],
           "seconds": round(time.monotonic() - started), **data}
    FIXTURES.mkdir(parents=True, exist_ok=True)
    target = FIXTURES / f"{name}.json"
    target.write_text(json.dumps(out, indent=1) + "\n")
    return target


def main() -> int:
    image = Path(sys.argv[1])
    for name in sys.argv[2:] or SETS:
        print(record(image, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
