"""Boot an image in QEMU (TCG with OVMF: KVM does not work on these build hosts).

The guest's boot-check unit writes a JSON report to its second serial port and powers off;
the host reads that report. The image itself is never modified: each boot runs on a sparse
copy grown to a disk size where systemd-repart has room for slot B and /var.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from appliance.errors import UserError

OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
DISK_SIZE = 12 * 1024**3
REPORT_BEGIN = "APPLIANCE-REPORT-BEGIN"
REPORT_END = "APPLIANCE-REPORT-END"


def _qemu_command(disk: Path, vars_fd: Path, credentials: dict[str, str]) -> list[str]:
    cmd = [
        "qemu-system-x86_64",
        "-machine", "q35", "-accel", "tcg", "-smp", str(min(4, os.cpu_count() or 2)), "-m", "4096",
        "-drive", f"if=pflash,format=raw,readonly=on,file={OVMF_CODE}",
        "-drive", f"if=pflash,format=raw,file={vars_fd}",
        "-drive", f"if=virtio,format=raw,file={disk},cache=unsafe,discard=unmap",
        "-nic", "user,model=virtio-net-pci",
        "-device", "virtio-rng-pci",
        "-display", "none", "-monitor", "none",
    ]
    for name, value in credentials.items():
        # binary form: values such as a PEM certificate carry newlines
        encoded = base64.b64encode(value.encode()).decode()
        cmd += ["-smbios", f"type=11,value=io.systemd.credential.binary:{name}={encoded}"]
    return cmd


class Guest:
    """One boot of a copy of DISK; the copy and its firmware variables live in a temporary directory."""

    def __init__(self, disk: Path, workdir: Path | None = None) -> None:
        if not OVMF_CODE.exists():
            raise UserError(f"{OVMF_CODE} is missing", hint="run `make setup` (installs ovmf and qemu-system-x86)")
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="appliance-qemu-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.disk = self.dir / "disk.raw"
        if not self.disk.exists():
            subprocess.run(["cp", "--sparse=always", str(disk), str(self.disk)], check=True)
        if self.disk.stat().st_size < DISK_SIZE:
            os.truncate(self.disk, DISK_SIZE)
        self.vars = self.dir / "OVMF_VARS.fd"
        if not self.vars.exists():
            shutil.copyfile(OVMF_VARS, self.vars)
        self.console_log = self.dir / "console.log"
        self.report_log = self.dir / "report.log"

    def boot(
        self, timeout: float, credentials: dict[str, str] | None = None, cut_power: tuple[str, float] | None = None
    ) -> dict[str, Any]:
        """Boot until the guest powers off (or TIMEOUT); return the guest's last report, with the
        reports of earlier boots of this run (the guest may reboot) in "earlier_boots".

        CUT_POWER (TEXT, SECONDS): kill QEMU that many seconds after TEXT appears on the console,
        as a power cut would; the report is then the last one written before the cut."""
        for path in (self.console_log, self.report_log):
            path.unlink(missing_ok=True)
        creds = {"appliance.bootcheck": "poweroff", **(credentials or {})}
        cmd = [
            *_qemu_command(self.disk, self.vars, creds),
            "-serial", f"file:{self.console_log}", "-serial", f"file:{self.report_log}",
        ]
        started = time.monotonic()
        cut_at: float | None = None
        timed_out = False
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now - started > timeout:
                    timed_out = True
                    break
                if cut_power and cut_at is None and cut_power[0] in self._console():
                    cut_at = now + cut_power[1]
                if cut_at is not None and now >= cut_at:
                    proc.kill()
                    break
                time.sleep(1)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        reports = parse_reports(self.report_log.read_text(errors="replace") if self.report_log.exists() else "")
        if not reports:
            what = f"did not report within {timeout:.0f} s" if timed_out else "powered off without a report"
            raise UserError(
                f"the guest {what} (console log: {self.console_log})",
                hint="boot it interactively with `make qemu` and look at the console",
            )
        report = reports[-1]
        report["boot_seconds"] = round(time.monotonic() - started, 1)
        report["earlier_boots"] = reports[:-1]
        report["power_cut"] = cut_at is not None
        report["timed_out"] = timed_out  # the reports written before the timeout are still worth reading
        return report

    def _console(self) -> str:
        return self.console_log.read_text(errors="replace") if self.console_log.exists() else ""


def parse_reports(text: str) -> list[dict[str, Any]]:
    """Every complete report block written by `applianctl bootcheck`, in order (one per boot)."""
    reports = []
    for block in text.split(REPORT_BEGIN)[1:]:
        body, end, _ = block.partition(REPORT_END)
        if not end:
            continue
        try:
            reports.append(json.loads(body))
        except json.JSONDecodeError:
            continue
    return reports


def boot_and_report(disk: Path, timeout: float = 900) -> dict[str, Any]:
    return Guest(disk).boot(timeout)


def interactive(disk: Path) -> int:
    guest = Guest(disk)
    cmd = [*_qemu_command(guest.disk, guest.vars, {}), "-serial", "mon:stdio", "-serial", f"file:{guest.report_log}"]
    print(f"booting a copy of {disk} in {guest.dir}; leave with Ctrl-a x")
    return subprocess.call(cmd)
