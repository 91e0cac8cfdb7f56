# SPDX-License-Identifier: MIT
"""Boot an image in QEMU (TCG with OVMF: KVM does not work on these build hosts).

Every boot is sealed as a server's is: OVMF's Secure Boot firmware (SMM) and a software TPM 2.0
(swtpm, its state kept beside the disk, as a TPM keeps it across boots). The firmware's variables
either enroll the appliance's certificate (PK, KEK, db; Secure Boot enforcing) or are blank (setup
mode: the installer enrolls).
Each boot runs on a sparse copy of the image, grown so that systemd-repart has room for slot B and /var.
The guest's boot check writes JSON reports to the second serial port and may ask the host questions
there (`APPLIANCE-ASK NAME JSON`); ProbeNet gives the guest a second NIC reachable from a host namespace.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import fcntl
import ipaddress
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.errors import UserError
from appliance.paths import MODEL_SOURCE_CA_CREDENTIAL as MODEL_SOURCE_CA
from appliance.paths import MODEL_SOURCE_CREDENTIAL as MODEL_SOURCE
from appliance.run import DEVNULL, PIPE, CompletedProcess, Popen, TimeoutExpired, call, checked, start
from builder import weights_mirror

OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.secboot.fd")
OVMF_CODE_UNSEALED = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")  # no Secure Boot, no SMM: bench/image.py's baseline
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")  # blank: setup mode
DISK_SIZE = 12 * 1024**3
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
        call(["ip", "netns", "del", self.name], None)

    def run(self, cmd: list[str], timeout: float = 60) -> CompletedProcess[str]:
        """CMD inside the namespace (never raises on its exit status)."""
        return call(["ip", "netns", "exec", self.name, *cmd], timeout)

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
        proc = call(["ip", *args], None)
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


# the appliance's entries in the firmware's lists (builder/secureboot.py APPLIANCE_OWNER)
ENROLL_OWNER = "6c8a31a4-7c5e-4bd6-9c1a-5d0c3b1f0a77"


def firmware_vars(path: Path, enroll_cert: Path | None) -> Path:
    """Write a firmware variable store to PATH: ENROLL_CERT as PK, KEK and db with Secure Boot on
    (python3-virt-firmware's virt-fw-vars), or, with None, the blank store (setup mode)."""
    if enroll_cert is None:
        shutil.copyfile(OVMF_VARS, path)
        return path
    tool = Path(sys.executable).with_name("virt-fw-vars")
    proc = call([tool, "--input", OVMF_VARS, "--output", path,
                 "--set-pk", ENROLL_OWNER, enroll_cert, "--add-kek", ENROLL_OWNER, enroll_cert,
                 "--add-db", ENROLL_OWNER, enroll_cert, "--secure-boot"], None)
    if proc.returncode != 0:
        raise UserError(f"virt-fw-vars could not enroll {enroll_cert}: {proc.stderr.strip()[-300:]}",
                        hint="run `make setup` (installs virt-firmware into .venv)")
    return path


class Tpm:
    """swtpm for one boot, its state in STATE_DIR (kept between boots); a context manager."""

    def __init__(self, state_dir: Path) -> None:
        self.state = state_dir
        self.socket = state_dir / "swtpm.sock"
        self.proc: Popen[bytes] | None = None

    def __enter__(self) -> Tpm:
        if shutil.which("swtpm") is None:
            raise UserError("swtpm is not installed", hint="run `make setup` (installs swtpm)")
        self.state.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        self.proc = start(
            ["swtpm", "socket", "--tpm2", "--tpmstate", f"dir={self.state}", "--ctrl", f"type=unixio,path={self.socket}",
             "--log", f"file={self.state / 'swtpm.log'}", "--terminate"],
            stdout=DEVNULL, stderr=DEVNULL)
        # Ahead of QEMU's vCPU threads, which keep every core of a small host busy under TCG: a
        # starved swtpm answered late once and the guest kernel gave up on a command ("tpm tpm0:
        # Operation Timed out", systemd-pcrmachine.service failed). Only root may raise it.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, -10)
        deadline = time.monotonic() + 10
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise UserError(f"swtpm did not start (log: {self.state / 'swtpm.log'})", hint="run `make setup`")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def qemu_args(self) -> list[str]:
        return ["-chardev", f"socket,id=chrtpm,path={self.socket}", "-tpmdev", "emulator,id=tpm0,chardev=chrtpm",
                "-device", "tpm-crb,tpmdev=tpm0"]


def firmware_args(vars_fd: Path, sealed: bool = True) -> list[str]:
    """The machine and its firmware: Secure Boot needs SMM, and its variable store secure from the OS."""
    if not sealed:
        return ["-machine", "q35", "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE_UNSEALED}",
                "-drive", f"if=pflash,format=raw,unit=1,file={vars_fd}"]
    return ["-machine", "q35,smm=on", "-global", "driver=cfi.pflash01,property=secure,value=on",
            "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
            "-drive", f"if=pflash,format=raw,unit=1,file={vars_fd}"]


def qemu_command(disk: Path, vars_fd: Path, credentials: dict[str, str], tpm: Tpm | None = None,
                 sealed: bool = True, forwards: tuple[tuple[int, int], ...] = ()) -> list[str]:
    """QEMU for one sealed boot of DISK: Secure Boot firmware (SMM, its variables secure), TPM.
    SEALED false: the plain firmware without SMM (the benchmark's baseline; give no TPM then).
    FORWARDS: (host port, guest port) pairs, the host's side on 127.0.0.1 only."""
    nic = "user,model=virtio-net-pci" + "".join(f",hostfwd=tcp:127.0.0.1:{int(h)}-:{int(g)}" for h, g in forwards)
    cmd = [
        "qemu-system-x86_64", "-accel", "tcg", "-smp", str(min(4, os.cpu_count() or 2)), "-m", "4096",
        *firmware_args(vars_fd, sealed),
        "-drive", f"if=virtio,format=raw,file={disk},cache=unsafe,discard=unmap",
        "-nic", nic,
        "-device", "virtio-rng-pci",
        "-device", "i6300esb",  # a hardware watchdog, as servers have (systemd.watchdog_sec= arms it)
        "-display", "none", "-monitor", "none",
        *(tpm.qemu_args() if tpm else []),
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
    """One boot of a copy of DISK; the copy, its firmware variables and its TPM's state live in a
    temporary directory. ENROLL_CERT: the variables trust it (Secure Boot enforcing); None: setup mode."""

    def __init__(self, disk: Path, workdir: Path | None = None, enroll_cert: Path | None = None) -> None:
        if not OVMF_CODE.exists():
            raise UserError(f"{OVMF_CODE} is missing", hint="run `make setup` (installs ovmf and qemu-system-x86)")
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="appliance-qemu-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.disk = self.dir / "disk.raw"
        if not self.disk.exists():
            checked(["cp", "--sparse=always", disk, self.disk], f"copying {disk}", "check the free space in the work directory",
                    None)
        if self.disk.stat().st_size < DISK_SIZE:
            os.truncate(self.disk, DISK_SIZE)
        self.vars = self.dir / "OVMF_VARS.fd"
        if not self.vars.exists():
            firmware_vars(self.vars, enroll_cert)
        self.tpm_state = self.dir / "tpm"
        self.console_log = self.dir / "console.log"
        self.report_log = self.dir / "report.log"

    def boot(
        self,
        timeout: float,
        credentials: dict[str, str] | None = None,
        cut_power: tuple[str, float] | None = None,
        answer: dict[str, Answerer] | None = None,
        probe_net: ProbeNet | None = None,
        forwards: tuple[tuple[int, int], ...] = (),
    ) -> dict[str, Any]:
        """Boot until the guest powers off (or TIMEOUT); return its last report, earlier boots' in "earlier_boots".

        CUT_POWER (TEXT, SECONDS): kill QEMU that long after TEXT appears on the console, like a power cut.
        ANSWER: {NAME: function} for the guest's questions; questions and answers go into "asked"."""
        for path in (self.console_log, self.report_log):
            path.unlink(missing_ok=True)
        creds = {"appliance.bootcheck": "poweroff", **(credentials or {}), **(probe_net.credentials() if probe_net else {})}
        with contextlib.ExitStack() as stack:
            # Demo images fetch their weights at first boot (appliance-model-fetch.service) from the
            # source handed over: the build host's mirror of the demo's weights, unless the caller
            # gives another, or "" for none.
            if MODEL_SOURCE not in creds:
                url, ca = stack.enter_context(weights_mirror.demo())
                creds.update({MODEL_SOURCE: url, MODEL_SOURCE_CA: ca})
            elif not creds[MODEL_SOURCE]:
                del creds[MODEL_SOURCE]
            return self._boot(creds, timeout, cut_power, answer, probe_net, forwards)

    def _boot(self, creds: dict[str, str], timeout: float, cut_power: tuple[str, float] | None,
              answer: dict[str, Answerer] | None, probe_net: ProbeNet | None, forwards: tuple[tuple[int, int], ...]) -> dict[str, Any]:
        with Tpm(self.tpm_state) as tpm:
            cmd = [
                *qemu_command(self.disk, self.vars, creds, tpm, forwards=forwards),
                *(probe_net.qemu_args() if probe_net else []),
                "-serial", f"file:{self.console_log}", "-serial", f"file:{self.report_log}",
            ]
            return self._run(cmd, timeout, cut_power, answer, probe_net)

    def _run(self, cmd: list[str], timeout: float, cut_power: tuple[str, float] | None,
             answer: dict[str, Answerer] | None, probe_net: ProbeNet | None) -> dict[str, Any]:
        started = time.monotonic()
        cut_at: float | None = None
        timed_out = False
        asked: list[dict[str, Any]] = []
        pass_fds = (probe_net.fd,) if probe_net and probe_net.fd is not None else ()
        proc = start(cmd, stdout=DEVNULL, stderr=PIPE, pass_fds=pass_fds)
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


def boot_and_report(disk: Path, enroll_cert: Path | None, timeout: float = 900,
                    scrape: tuple[str, int, Path] | None = None) -> dict[str, Any]:
    """One boot of DISK to its report. SCRAPE (VERSION, METRICS PORT, OUT): the guest's boot check
    has the host scrape its metrics through the proxy (a forwarded port, as a scraper on the
    appliance's network would) into OUT while it serves."""
    if scrape is None:
        return Guest(disk, enroll_cert=enroll_cert).boot(timeout)
    version, guest_port, out = scrape
    port = free_port()
    plan = {"appliance.plan": json.dumps({version: [{"do": "scrape"}]})}
    return Guest(disk, enroll_cert=enroll_cert).boot(timeout, credentials=plan, answer={"scrape": scrape_answerer(port, out)},
                                                     forwards=((port, guest_port),))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_answerer(port: int, out: Path) -> Answerer:
    """The host's side of the boot check's scrape step: GET /metrics of the proxy's metrics site on
    PORT (forwarded to the guest) into OUT, written whole; then a request to the question's
    done_path, which the waiting guest sees in the proxy's log."""
    import requests
    import urllib3

    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # the appliance CA is the guest's own

    def scrape(question: dict[str, Any]) -> dict[str, Any]:
        base = f"https://127.0.0.1:{port}"
        try:
            got = requests.get(f"{base}/metrics", verify=False, timeout=120)
            answer: dict[str, Any] = {"http_code": got.status_code, "bytes": len(got.content)}
            if got.status_code == 200:
                tmp = out.with_name(out.name + ".tmp")
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(got.content)
                tmp.rename(out)
        except requests.RequestException as e:
            answer = {"error": str(e)[:300]}
        with contextlib.suppress(requests.RequestException):
            requests.get(base + str(question.get("done_path", "/")), verify=False, timeout=60)
        return answer

    return scrape


def interactive(disk: Path, enroll_cert: Path | None) -> int:
    guest = Guest(disk, enroll_cert=enroll_cert)
    with Tpm(guest.tpm_state) as tpm:
        cmd = [*qemu_command(guest.disk, guest.vars, {}, tpm), "-serial", "mon:stdio", "-serial", f"file:{guest.report_log}"]
        print(f"booting a copy of {disk} in {guest.dir}; leave with Ctrl-a x")
        return call(cmd, None, capture=False).returncode
