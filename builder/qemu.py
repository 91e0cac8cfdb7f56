"""Boot an image in QEMU (TCG with OVMF: KVM does not work on these build hosts).

Each boot runs on a sparse copy of the image, grown so that systemd-repart has room for slot B and /var.
The guest's boot check writes JSON reports to the second serial port and may ask the host questions
there (`APPLIANCE-ASK NAME JSON`); ProbeNet gives the guest a second NIC reachable from a host namespace.
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import ipaddress
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.errors import UserError

OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
DISK_SIZE = 12 * 1024**3
DEVICE_TIMEOUT_S = 600
REPORT_BEGIN = "APPLIANCE-REPORT-BEGIN"
REPORT_END = "APPLIANCE-REPORT-END"
ASK = "APPLIANCE-ASK"

# A question from the guest (its JSON payload) -> the host's answer (JSON-able).
Answerer = Callable[[dict[str, Any]], dict[str, Any]]

_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000


class ProbeNet:
    """A host network namespace joined to the guest's second NIC by a tap device, to reach the guest
    as a machine on its network would (QEMU's user network reaches it only through forwarded ports).
    The namespace has SUBNET's first address, the guest the second, and routes to ROUTES via the guest.
    A context manager: the namespace is removed on exit, the tap device when QEMU exits."""

    MAC = "52:54:00:a9:0e:02"

    def __init__(self, name: str, subnet: str = "198.51.100.0/24", routes: tuple[str, ...] = ()) -> None:
        net = ipaddress.ip_network(subnet)
        self.name, self.prefix = name, net.prefixlen
        self.host_address, self.guest_address = str(net[1]), str(net[2])
        self.routes = routes
        self.tap = "probe0"
        self.fd: int | None = None

    def __enter__(self) -> ProbeNet:
        self._ip("netns", "add", self.name)
        try:
            self.fd = self._open_tap()
            for args in (
                ("link", "set", "lo", "up"),
                ("addr", "add", f"{self.host_address}/{self.prefix}", "dev", self.tap),
                ("link", "set", self.tap, "up"),
                *(("route", "add", route, "via", self.guest_address) for route in self.routes),
            ):
                self._ip("-n", self.name, *args)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)

    def run(self, cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """CMD inside the namespace (never raises on its exit status)."""
        return subprocess.run(["ip", "netns", "exec", self.name, *cmd], capture_output=True, text=True,
                              timeout=timeout, check=False)

    def credentials(self) -> dict[str, str]:
        """The guest's address as a systemd-network-generator credential; its file sorts before the
        image's DHCP-on-every-ethernet one. Not required for online: the boot must not wait for this link."""
        network = (
            f"[Match]\nMACAddress={self.MAC}\n\n[Link]\nRequiredForOnline=no\n\n"
            f"[Network]\nAddress={self.guest_address}/{self.prefix}\nLinkLocalAddressing=no\nIPv6AcceptRA=no\n"
        )
        return {"network.network.10-appliance-probe": network}

    def qemu_args(self) -> list[str]:
        assert self.fd is not None, "ProbeNet is used as a context manager"
        # A fixed PCI address: the firmware's boot entry finds the disk by PCI path, which this NIC must not move.
        return ["-netdev", f"tap,id=probe,fd={self.fd}", "-device", f"virtio-net-pci,netdev=probe,mac={self.MAC},addr=0x10"]

    def _ip(self, *args: str) -> None:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise UserError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}",
                            hint="network namespaces and tap devices need root and /dev/net/tun")

    def _open_tap(self) -> int:
        """Create the tap device inside the namespace (setns for this thread, then back), so that QEMU
        stays in the host's namespace, where its user network reaches the host's loopback."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{self.name}") as target:
            if libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.name}")
            try:
                fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", self.tap.encode(), _IFF_TAP | _IFF_NO_PI))
                except OSError:
                    os.close(fd)
                    raise
            finally:
                if libc.setns(home.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back into the host's network namespace")
        return fd


def _qemu_command(disk: Path, vars_fd: Path, credentials: dict[str, str]) -> list[str]:
    cmd = [
        "qemu-system-x86_64",
        "-machine", "q35", "-accel", "tcg", "-smp", str(min(4, os.cpu_count() or 2)), "-m", "4096",
        "-drive", f"if=pflash,format=raw,readonly=on,file={OVMF_CODE}",
        "-drive", f"if=pflash,format=raw,file={vars_fd}",
        "-drive", f"if=virtio,format=raw,file={disk},cache=unsafe,discard=unmap",
        "-nic", "user,model=virtio-net-pci",
        "-device", "virtio-rng-pci",
        "-device", "i6300esb",  # a hardware watchdog, as servers have (systemd.watchdog_sec= arms it)
        "-display", "none", "-monitor", "none",
        # Emulated on a busy host, the disk can appear after systemd's 90 s device wait (seen: 148 s);
        # emergency mode would reboot and use up a try of a version on trial. systemd-stub appends
        # this only without Secure Boot, as here; the image keeps the default.
        "-smbios", f"type=11,value=io.systemd.stub.kernel-cmdline-extra=systemd.default_device_timeout_sec={DEVICE_TIMEOUT_S}",
    ]
    return cmd + credential_args(credentials)


def credential_args(credentials: dict[str, str]) -> list[str]:
    """QEMU options that hand CREDENTIALS to the guest's systemd (SMBIOS type 11)."""
    args = []
    for name, value in credentials.items():
        # binary form: QEMU's option syntax would split values' newlines (PEM) and commas (JSON)
        encoded = base64.b64encode(value.encode()).decode()
        args += ["-smbios", f"type=11,value=io.systemd.credential.binary:{name}={encoded}"]
    return args


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
        self,
        timeout: float,
        credentials: dict[str, str] | None = None,
        cut_power: tuple[str, float] | None = None,
        answer: dict[str, Answerer] | None = None,
        probe_net: ProbeNet | None = None,
    ) -> dict[str, Any]:
        """Boot until the guest powers off (or TIMEOUT); return its last report, earlier boots' in "earlier_boots".

        CUT_POWER (TEXT, SECONDS): kill QEMU that long after TEXT appears on the console, like a power cut.
        ANSWER: {NAME: function} for the guest's questions; questions and answers go into "asked"."""
        for path in (self.console_log, self.report_log):
            path.unlink(missing_ok=True)
        creds = {"appliance.bootcheck": "poweroff", **(credentials or {}), **(probe_net.credentials() if probe_net else {})}
        cmd = [
            *_qemu_command(self.disk, self.vars, creds),
            *(probe_net.qemu_args() if probe_net else []),
            "-serial", f"file:{self.console_log}", "-serial", f"file:{self.report_log}",
        ]
        started = time.monotonic()
        cut_at: float | None = None
        timed_out = False
        asked: list[dict[str, Any]] = []
        pass_fds = (probe_net.fd,) if probe_net and probe_net.fd is not None else ()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                pass_fds=pass_fds)
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
                if answer:
                    self._answer(answer, asked)
                # poll often while waiting for the cut's text, so that the cut lands within a short write
                time.sleep(0.1 if cut_power and cut_at is None else 1)
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
        report["asked"] = asked
        return report

    def _console(self) -> str:
        return self.console_log.read_text(errors="replace") if self.console_log.exists() else ""

    def _answer(self, answer: dict[str, Answerer], asked: list[dict[str, Any]]) -> None:
        """Answer each question not answered yet."""
        text = self.report_log.read_text(errors="replace") if self.report_log.exists() else ""
        for question in parse_questions(text)[len(asked):]:
            handler = answer.get(question["name"])
            try:
                reply = handler(question["payload"]) if handler else {"error": f"no answer for {question['name']}"}
            except Exception as e:  # the test asserts on the answer; a crash is an answer too
                reply = {"error": f"{type(e).__name__}: {e}"}
            asked.append({**question, "answer": reply})


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


def parse_questions(text: str) -> list[dict[str, Any]]:
    """Every complete line `APPLIANCE-ASK NAME JSON` the guest wrote, in order."""
    questions = []
    for line in text.splitlines(keepends=True):
        if not line.startswith(ASK + " ") or not line.endswith("\n"):
            continue
        name, _, payload = line[len(ASK) + 1 :].strip().partition(" ")
        try:
            data = json.loads(payload or "{}")
        except json.JSONDecodeError:
            data = {"unreadable": payload}
        questions.append({"name": name, "payload": data if isinstance(data, dict) else {"value": data}})
    return questions


def boot_and_report(disk: Path, timeout: float = 900) -> dict[str, Any]:
    return Guest(disk).boot(timeout)


def interactive(disk: Path) -> int:
    guest = Guest(disk)
    cmd = [*_qemu_command(guest.disk, guest.vars, {}), "-serial", "mon:stdio", "-serial", f"file:{guest.report_log}"]
    print(f"booting a copy of {disk} in {guest.dir}; leave with Ctrl-a x")
    return subprocess.call(cmd)
