# SPDX-License-Identifier: MIT
"""A blank server behind a BMC, on the test host: a libvirt QEMU machine (TCG, OVMF's Secure Boot
firmware in setup mode, a software TPM, one blank disk, no medium) managed by sushy-tools'
emulator through its libvirt driver (HTTPS with a test CA, an account), as `builder flash --bmc`
meets a real server's BMC. The emulator attaches the medium it downloads as the machine's CD,
powers the machine on and off, and shows its firmware's Secure Boot.

Where the emulator is not a BMC, and what this rig does about it:
- its libvirt driver records every boot override as a permanent boot device (its own note: "In
  libvirt we always set the boot device frequency to continuous"), so the machine would boot the
  installer again after each install: the rig sets SUSHY_EMULATOR_IGNORE_BOOT_DEVICE and lets the
  firmware's own BootOrder decide, which gives what `Once` gives on a server: the medium while
  the disk is blank, the appliance from the boot entry the installer put first;
- its SecureBoot resource always shows DeployedMode and offers no ResetKeys, so the fleet file
  leaves Secure Boot as it is (`secure_boot = "as-is"`) and the firmware's variables start blank,
  in setup mode, as a server put into setup mode at its console;
- the machine's NIC and TPM are passed to QEMU as arguments of its own (user networking with a
  forward to the appliance's proxy, a swtpm socket started here), which libvirt 9's domain XML has
  no plain form for.

libvirt runs here without systemd: `daemon()` starts virtlogd and libvirtd when none answers, and
stops what it started.

Nothing here is the product's: `builder/` never imports `testkit/`.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import os
import shutil
import signal
import ssl
import subprocess
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import qemu
from builder.https_server import HTTPSServer
from testkit import bmc_rig
from testkit.standin import free_port

URI = "qemu:///system"
POOL = "appliance-flash-media"
QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
START_S = 30.0


def missing() -> list[str]:
    """What this host lacks for the rig, each with the package that brings it; empty when it has all."""
    lacks = []
    if not Path("/usr/sbin/libvirtd").exists():
        lacks.append("libvirtd (libvirt-daemon-system)")
    if importlib.util.find_spec("libvirt") is None:
        lacks.append("libvirt's Python binding (python3-libvirt)")
    if not bmc_rig.EMULATOR.exists():
        lacks.append("sushy-emulator (sushy-tools, pip install -e '.[dev]')")
    if not qemu.OVMF_CODE.exists():
        lacks.append(f"{qemu.OVMF_CODE} (ovmf)")
    return lacks


def _answers() -> bool:
    import libvirt

    # the errors the rig expects (no such domain or pool yet) are handled where they come: not printed
    libvirt.registerErrorHandler(lambda *_: None, None)
    try:
        libvirt.open(URI).close()
        return True
    except libvirt.libvirtError:
        return False


@contextlib.contextmanager
def daemon(log_dir: Path) -> Iterator[None]:
    """libvirt's daemons for URI: those already running, else virtlogd and libvirtd started here
    (no systemd on a build container to start them) and stopped on leaving."""
    if _answers():
        yield
        return
    for d in ("/var/log/libvirt", "/run/libvirt", "/var/lib/libvirt/qemu"):
        os.makedirs(d, exist_ok=True)
    pids: list[Path] = []
    for prog, pidfile in (("/usr/sbin/virtlogd", Path("/run/appliance-test-virtlogd.pid")),
                          ("/usr/sbin/libvirtd", Path("/run/appliance-test-libvirtd.pid"))):
        pidfile.unlink(missing_ok=True)
        with open(log_dir / f"{Path(prog).name}.log", "ab") as log:
            subprocess.run([prog, "--daemon", "--pid-file", str(pidfile)], stdout=log, stderr=log, check=True, timeout=60)
        pids.append(pidfile)
    try:
        deadline = time.monotonic() + START_S
        while not _answers():
            if time.monotonic() > deadline:
                raise RuntimeError(f"libvirtd did not answer on {URI} within {START_S:.0f} s (/var/log/libvirt/libvirtd.log)")
            time.sleep(0.5)
        yield
    finally:
        for pidfile in reversed(pids):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)


@contextlib.contextmanager
def media_pool(path: Path) -> Iterator[str]:
    """A directory storage pool for the media the emulator downloads (its libvirt driver uploads
    each into a pool's volume); its name."""
    import libvirt

    path.mkdir(parents=True, exist_ok=True)
    conn = libvirt.open(URI)
    try:
        with contextlib.suppress(libvirt.libvirtError):
            old = conn.storagePoolLookupByName(POOL)
            with contextlib.suppress(libvirt.libvirtError):
                old.destroy()
            old.undefine()
        pool = conn.storagePoolDefineXML(f"<pool type='dir'><name>{POOL}</name><target><path>{path}</path></target></pool>")
        pool.create()
        try:
            yield POOL
        finally:
            with contextlib.suppress(libvirt.libvirtError):
                pool.destroy()
            with contextlib.suppress(libvirt.libvirtError):
                pool.undefine()
    finally:
        conn.close()


def domain_xml(name: str, machine_uuid: str, work: Path, disk: Path, serial: str, tpm_args: list[str],
               forwards: tuple[tuple[int, int], ...], credentials: dict[str, str], cdrom: Path | None = None) -> str:
    """The machine: q35 with SMM, OVMF's Secure Boot code and a blank variable store (setup mode),
    2 vCPUs and 4 GiB under TCG, DISK as a virtio disk of SERIAL, a SATA bus for the CD the
    emulator attaches, the console and the boot check's report on two serial ports (WORK/console.log,
    WORK/report.log), QEMU run as root (the test's files are root's), user networking with FORWARDS
    (host port, guest port) on 127.0.0.1, the TPM by TPM_ARGS (qemu.Tpm's), CREDENTIALS as SMBIOS strings;
    CDROM: a medium attached by hand (the direct install, no BMC)."""
    ET.register_namespace("qemu", QEMU_NS)
    dom = ET.Element("domain", {"type": "qemu"})
    ET.SubElement(dom, "name").text = name
    ET.SubElement(dom, "uuid").text = machine_uuid
    ET.SubElement(dom, "memory", {"unit": "MiB"}).text = "4096"
    ET.SubElement(dom, "vcpu").text = "2"
    os_el = ET.SubElement(dom, "os")
    ET.SubElement(os_el, "type", {"arch": "x86_64", "machine": "q35"}).text = "hvm"
    ET.SubElement(os_el, "loader", {"readonly": "yes", "secure": "yes", "type": "pflash"}).text = str(qemu.OVMF_CODE)
    ET.SubElement(os_el, "nvram", {"template": str(qemu.OVMF_VARS)}).text = str(work / "OVMF_VARS.fd")
    # No device gets a boot index: without a <boot>, libvirt gives the first disk one and starts QEMU
    # with `-boot strict=on`, which hides every other device (the CD) from the firmware. `fd` names
    # none here, as the emulator's override leaves it: the firmware's own BootOrder decides.
    ET.SubElement(os_el, "boot", {"dev": "fd"})
    features = ET.SubElement(dom, "features")
    ET.SubElement(features, "acpi")
    ET.SubElement(features, "smm", {"state": "on"})
    ET.SubElement(dom, "on_poweroff").text = "destroy"
    ET.SubElement(dom, "on_reboot").text = "restart"
    ET.SubElement(dom, "on_crash").text = "destroy"
    devices = ET.SubElement(dom, "devices")
    ET.SubElement(devices, "emulator").text = shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64"
    d = ET.SubElement(devices, "disk", {"type": "file", "device": "disk"})
    ET.SubElement(d, "driver", {"name": "qemu", "type": "raw", "cache": "unsafe", "discard": "unmap"})
    ET.SubElement(d, "source", {"file": str(disk)})
    ET.SubElement(d, "target", {"dev": "vda", "bus": "virtio"})
    ET.SubElement(d, "serial").text = serial
    ET.SubElement(devices, "controller", {"type": "sata", "index": "0"})
    if cdrom is not None:
        cd = ET.SubElement(devices, "disk", {"type": "file", "device": "cdrom"})
        ET.SubElement(cd, "driver", {"name": "qemu", "type": "raw"})
        ET.SubElement(cd, "source", {"file": str(cdrom)})
        ET.SubElement(cd, "target", {"dev": "sda", "bus": "sata"})  # controller 0, unit 0: where the firmware looks
        ET.SubElement(cd, "readonly")
    for port, log in enumerate(("console.log", "report.log")):
        s = ET.SubElement(devices, "serial", {"type": "file"})
        ET.SubElement(s, "source", {"path": str(work / log)})
        ET.SubElement(s, "target", {"port": str(port)})
    video = ET.SubElement(devices, "video")
    ET.SubElement(video, "model", {"type": "vga"})  # a console on tty1, as a server has (its BMC shows it): the installer writes there
    ET.SubElement(devices, "memballoon", {"model": "none"})
    label = ET.SubElement(dom, "seclabel", {"type": "static", "model": "dac", "relabel": "no"})
    ET.SubElement(label, "label").text = "+0:+0"
    nic = "user,id=n0" + "".join(f",hostfwd=tcp:127.0.0.1:{int(h)}-:{int(g)}" for h, g in forwards)
    args = ["-netdev", nic, "-device", "virtio-net-pci,netdev=n0,romfile=,bus=pcie.0,addr=0x10",
            *tpm_args, *qemu.credential_args(credentials)]
    cmdline = ET.SubElement(dom, f"{{{QEMU_NS}}}commandline")
    for a in args:
        ET.SubElement(cmdline, f"{{{QEMU_NS}}}arg", {"value": a})
    return ET.tostring(dom, encoding="unicode")


@dataclass
class Machine:
    name: str
    uuid: str
    work: Path
    disk: Path

    @property
    def console(self) -> str:
        p = self.work / "console.log"
        return p.read_text(errors="replace") if p.exists() else ""

    @property
    def report_log(self) -> str:
        p = self.work / "report.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def running(self) -> bool:
        import libvirt

        conn = libvirt.open(URI)
        try:
            return bool(conn.lookupByUUIDString(self.uuid).isActive())
        finally:
            conn.close()

    def power_on(self) -> None:
        """Start it by hand (the direct install: nobody's BMC)."""
        import libvirt

        conn = libvirt.open(URI)
        try:
            conn.lookupByUUIDString(self.uuid).create()
        finally:
            conn.close()


@contextlib.contextmanager
def machine(name: str, work: Path, serial: str, size_gib: int, forwards: tuple[tuple[int, int], ...],
            credentials: dict[str, str], cdrom: Path | None = None) -> Iterator[Machine]:
    """A blank machine NAME defined in libvirt (powered off, as a server in a rack before its first
    install), its TPM's swtpm listening for it; destroyed and undefined on leaving (its disk, console
    and report stay in WORK). CDROM: a medium attached by hand."""
    import libvirt

    work.mkdir(parents=True, exist_ok=True)
    disk = work / "disk.raw"
    disk.unlink(missing_ok=True)
    disk.touch()
    os.truncate(disk, size_gib << 30)  # blank and sparse
    machine_uuid = str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.flash-test"))
    with contextlib.ExitStack() as stack:
        tpm = stack.enter_context(qemu.Tpm(work / "tpm"))
        conn = libvirt.open(URI)
        stack.callback(conn.close)
        with contextlib.suppress(libvirt.libvirtError):
            _remove(conn.lookupByUUIDString(machine_uuid))
        dom = conn.defineXML(domain_xml(name, machine_uuid, work, disk, serial, tpm.qemu_args(), forwards, credentials, cdrom))
        stack.callback(_remove, dom)
        yield Machine(name, machine_uuid, work, disk)


def _remove(dom: object) -> None:
    import libvirt

    with contextlib.suppress(libvirt.libvirtError):
        dom.destroy()  # type: ignore[attr-defined]
    with contextlib.suppress(libvirt.libvirtError):
        dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_NVRAM)  # type: ignore[attr-defined]


def emulator_config(tmp: Path, port: int, crt: Path, key: Path, htpasswd: Path, machine_uuid: str, pool: str) -> Path:
    """sushy-tools with its libvirt driver for the one machine MACHINE_UUID, HTTPS with CRT and KEY,
    the account in HTPASSWD, media uploaded into POOL; the Secure Boot firmware is what UEFI means
    here, and a boot override leaves the firmware's own order alone (see the module's note)."""
    config = tmp / "libvirt-emulator.conf"
    config.write_text("\n".join([
        f"SUSHY_EMULATOR_LIBVIRT_URI = {URI!r}",
        f"SUSHY_EMULATOR_ALLOWED_INSTANCES = [{machine_uuid!r}]",
        f"SUSHY_EMULATOR_STORAGE_POOL = {pool!r}",
        f"SUSHY_EMULATOR_BOOT_LOADER_MAP = {{'UEFI': {{'x86_64': {str(qemu.OVMF_CODE)!r}}}, 'Legacy': {{'x86_64': None}}}}",
        f"SUSHY_EMULATOR_SECURE_BOOT_ENABLED_NVRAM = {str(qemu.OVMF_VARS)!r}",
        "SUSHY_EMULATOR_IGNORE_BOOT_DEVICE = True",
        "SUSHY_EMULATOR_VMEDIA_VERIFY_SSL = True",
        f"SUSHY_EMULATOR_AUTH_FILE = {str(htpasswd)!r}",
        "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'",
        f"SUSHY_EMULATOR_LISTEN_PORT = {port}",
        f"SUSHY_EMULATOR_SSL_CERT = {str(crt)!r}",
        f"SUSHY_EMULATOR_SSL_KEY = {str(key)!r}",
        f"SUSHY_EMULATOR_STATE_DIR = {str(tmp / 'emulator-state')!r}",
        ""]))
    return config


@contextlib.contextmanager
def emulator(tmp: Path, config: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """sushy-emulator with CONFIG, listening on PORT; stopped on leaving (its log: TMP/libvirt-emulator.log)."""
    with bmc_rig.emulator_process(tmp, config, port, "libvirt-emulator.log") as proc:
        yield proc


@contextlib.contextmanager
def media_server(root: Path, crt: Path, key: Path) -> Iterator[str]:
    """ROOT's files over HTTPS on loopback with CRT and KEY: the server's URL."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *args: Any) -> None:
            pass

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, key)
    server = HTTPSServer(("127.0.0.1", 0), Quiet, ctx)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Server:
    """One blank server behind its BMC, as `builder flash --bmc` meets it."""

    machine: Machine
    bmc: str
    ca: Path         # the test CA of the BMC's and the media server's certificates
    media_url: str   # the host's ISO, {name} for its name
    fleet: Path      # the fleet file of this one host: its plan, BMC, credentials, system and proxy address
    emulator_log: Path


@contextlib.contextmanager
def server_behind_bmc(work: Path, name: str, serial: str, plan: Path, iso: Path, proxy_port: int,
                      credentials: dict[str, str]) -> Iterator[Server]:
    """A blank machine NAME (disk SERIAL, 16 GiB) behind sushy-tools' libvirt driver, ISO on an HTTPS
    media server, and a fleet file naming PLAN, the BMC and the proxy at 127.0.0.1:PROXY_PORT, with
    Secure Boot as it is (the emulator cannot reset its keys: the module's note)."""
    work.mkdir(parents=True, exist_ok=True)
    ca = bmc_rig.make_ca(work, "rig-ca")
    bmc_crt, bmc_key = ca.server(work, "bmc", dns=("localhost",), ips=("127.0.0.1",))
    media_crt, media_key = ca.server(work, "media", dns=("localhost",), ips=("127.0.0.1",))
    (work / "www" / name).mkdir(parents=True, exist_ok=True)
    (work / "www" / name / "installer.iso").unlink(missing_ok=True)
    (work / "www" / name / "installer.iso").symlink_to(iso)
    port = free_port()
    with contextlib.ExitStack() as stack:
        stack.enter_context(daemon(work))
        pool = stack.enter_context(media_pool(work / "pool"))
        m = stack.enter_context(machine(name, work / "machine", serial, 16, ((proxy_port, 443),), credentials))
        media = stack.enter_context(media_server(work / "www", media_crt, media_key))
        config = emulator_config(work, port, bmc_crt, bmc_key, bmc_rig.write_htpasswd(work / "htpasswd"), m.uuid, pool)
        stack.enter_context(emulator(work, config, port))
        fleet = bmc_rig.write_fleet(work / "fleet.toml", [{
            "name": name, "plan": str(plan), "bmc": f"https://127.0.0.1:{port}",
            "credentials": str(bmc_rig.write_credentials(work / "bmc-credentials")), "bmc_ca": str(ca.pem),
            "system": f"/redfish/v1/Systems/{m.uuid}", "address": f"127.0.0.1:{proxy_port}", "secure_boot": "as-is"}])
        yield Server(m, f"https://127.0.0.1:{port}", ca.pem, f"{media}/{{name}}/installer.iso", fleet, work / "libvirt-emulator.log")


@contextlib.contextmanager
def server_with_medium(work: Path, name: str, serial: str, iso: Path, proxy_port: int,
                       credentials: dict[str, str]) -> Iterator[Machine]:
    """The same blank machine with ISO attached as its CD by hand, powered off (`power_on` starts
    it): the direct install, as the journey's, that `builder flash --bmc` is measured against."""
    work.mkdir(parents=True, exist_ok=True)
    with daemon(work), machine(name, work / "machine", serial, 16, ((proxy_port, 443),), credentials, cdrom=iso) as m:
        yield m
