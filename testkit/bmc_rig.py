# SPDX-License-Identifier: MIT
"""A rack of BMCs for `builder flash --bmc`, on the test host: sushy-tools' emulator (fake driver,
HTTPS with a test CA, an account) with one ComputerSystem per host, the installer media over HTTPS
with the same CA, and each host's appliance stood in for by a local HTTPS server (`Appliance`)
that answers /health as the plan's host, with a certificate from a test appliance CA.

The tests (tests/test_flash_bmc.py) and the benchmark (bench/flash.py) share it. Two ways for a
stand-in to come up:

- `down=N`: the first N connections are closed at once (the host is installing), then it answers;
- `install_s=S`: it is down (a blank host) until the BMC power-cycles its system, and answers S
  seconds after that, as a real host answers once its install is done. The emulator tells of the
  power cycle itself: its fake driver's external notifier PUTs a system's record to a local
  listener whenever the record changes, and a pending power action (a restart, or On from Off)
  starts that host's install.

Nothing here is the product's: `builder/` never imports `testkit/`.
"""

from __future__ import annotations

import contextlib
import datetime
import http.server
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from appliance.signed import install_plan
from builder import keys
from builder.https_server import HTTPSServer
from testkit.standin import free_port

PASSWORD = "s3cret-Pa55-for-the-BMC"
USER = "admin"
SERIAL = "1234570"  # the serial the emulator's drives show (the rig's storage below)
EMULATOR = Path(sys.executable).parent / "sushy-emulator"
START_S = 30.0  # for the emulator to listen
SYSTEM_IDS = uuid.UUID("9b7f1d0e-3c43-4d0b-9a51-6f1f0c6a2a11")  # the namespace of the systems' UUIDs


class EmulatorMissing(RuntimeError):
    """sushy-tools is not installed next to this Python."""


# ------------------------------------------------------------------------------ certificates


@dataclass
class Ca:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    pem: Path

    def server(self, directory: Path, name: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """A server certificate and key for NAME (its DNS and IP names), signed by this CA: their paths."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self.cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(self.key, hashes.SHA256()))
        crt, k = directory / f"{name}.crt", directory / f"{name}.key"
        crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        k.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        return crt, k


def make_ca(directory: Path, name: str) -> Ca:
    """A test CA, its certificate in DIRECTORY/NAME.pem."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    pem = directory / f"{name}.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Ca(key, cert, pem)


# ------------------------------------------------------------------------------ plans and files


def sign_plan(directory: Path, name: str, serial: str = SERIAL) -> Path:
    """DIRECTORY/hosts/NAME: a plan for NAME (proxy name NAME.example.net, the disk by SERIAL), signed
    with a release key made once in DIRECTORY/keys."""
    key_dir = directory / "keys"
    if not (key_dir / "release.key").exists():
        key_dir.mkdir(exist_ok=True)
        keys.generate(key_dir, "release")
    plan = install_plan.from_plain({"hostname": name, "proxy": {"hostname": f"{name}.example.net"},
                                    "target": {"serial": serial}}, name)
    data, sig = install_plan.sign(plan, key_dir / "release.key")
    out = directory / "hosts" / name
    out.mkdir(parents=True, exist_ok=True)
    (out / install_plan.PLAN_JSON).write_bytes(data)
    (out / install_plan.PLAN_SIG).write_bytes(sig)
    return out


def write_credentials(path: Path, password: str = PASSWORD, mode: int = 0o600) -> Path:
    path.write_text(f'username = "{USER}"\npassword = "{password}"\n')
    path.chmod(mode)
    return path


def write_htpasswd(path: Path) -> Path:
    """The emulator's account USER/PASSWORD, bcrypt in an htpasswd file."""
    import bcrypt

    path.write_text(f"{USER}:{bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()}\n")
    return path


def write_fleet(path: Path, hosts: list[dict[str, Any]]) -> Path:
    lines = []
    for h in hosts:
        lines.append("[[host]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in h.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


# ------------------------------------------------------------------------------ the appliance's proxy, stood in for


class Appliance:
    """An HTTPS server answering /health as the plan's host. Without INSTALL_S: the first DOWN
    connections are closed at once (the host is installing). With INSTALL_S: every connection is
    closed until `power_cycled()`, and INSTALL_S seconds after it (the install's own time); `blank()`
    makes it a blank host again. `up` False: every connection closed, whatever else."""

    def __init__(self, cert: Path, key: Path, down: int = 1, install_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.down = down
        self.up = True
        self.requests = 0
        self.install_s = install_s
        self.clock = clock
        self.lock = threading.Lock()
        self.cycles: list[float] = []  # when each power cycle was told (clock)
        self.up_at: float | None = None  # with install_s: when the install is done; None: never power-cycled
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def power_cycled(self) -> None:
        """The BMC reset this host: with install_s, it answers install_s from now."""
        with self.lock:
            now = self.clock()
            self.cycles.append(now)
            if self.install_s is not None:
                self.up_at = now + self.install_s

    def blank(self) -> None:
        """A blank host again: down until its next power cycle."""
        with self.lock:
            self.up_at = None
            self.cycles.clear()

    def answering(self) -> bool:
        with self.lock:
            if self.install_s is not None:
                return self.up and self.up_at is not None and self.clock() >= self.up_at
            if self.down > 0 or not self.up:
                self.down -= 1
                return False
            return True

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if not self.answering():
                    continue
                try:
                    with self.ctx.wrap_socket(conn, server_side=True) as tls:
                        tls.recv(4096)
                        self.requests += 1
                        tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
                except (OSError, ssl.SSLError):
                    pass

    def close(self) -> None:
        self.sock.close()


# ------------------------------------------------------------------------------ the emulator


def system_ids(names: Sequence[str]) -> dict[str, str]:
    """Each host's system UUID in the emulator, the same for the same name."""
    return {n: str(uuid.uuid5(SYSTEM_IDS, n)) for n in names}


def emulator_config(tmp: Path, port: int, crt: Path, key: Path, systems: dict[str, str], notify: str = "") -> Path:
    """The emulator's configuration: the fake driver with SYSTEMS (name -> UUID), each powered on
    with one drive of serial SERIAL, HTTPS with CRT and KEY, the account USER/PASSWORD (bcrypt in an
    htpasswd file), its state under TMP; NOTIFY: the URL its external notifier PUTs each changed
    system's record to (none when empty)."""
    htpasswd = write_htpasswd(tmp / "htpasswd")
    fake = [{"uuid": u, "name": n, "power_state": "On", "nics": [{"mac": "00:5c:52:31:3a:9c", "ip": "172.22.0.100"}],
             **({"external_notifier": True} if notify else {})} for n, u in systems.items()]
    storage = {u: [{"Id": "1", "Name": "Local Storage Controller",
                    "StorageControllers": [{"MemberId": "0", "Name": "Contoso Integrated RAID", "SpeedGbps": 12}],
                    "Drives": ["32ADF365C6C1B7BD"]}] for u in systems.values()}
    drives = {(u, "1"): [{"Id": "32ADF365C6C1B7BD", "Name": "Drive Sample", "CapacityBytes": 899527000000, "Protocol": "SAS"}]
              for u in systems.values()}
    config = tmp / "emulator.conf"
    config.write_text("\n".join([
        "SUSHY_EMULATOR_FAKE_DRIVER = True",
        f"SUSHY_EMULATOR_FAKE_SYSTEMS = {fake!r}",
        f"SUSHY_EMULATOR_STORAGE = {storage!r}",
        f"SUSHY_EMULATOR_DRIVES = {drives!r}",
        f"SUSHY_EMULATOR_AUTH_FILE = {str(htpasswd)!r}",
        "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'",
        f"SUSHY_EMULATOR_LISTEN_PORT = {port}",
        f"SUSHY_EMULATOR_SSL_CERT = {str(crt)!r}",
        f"SUSHY_EMULATOR_SSL_KEY = {str(key)!r}",
        f"SUSHY_EMULATOR_STATE_DIR = {str(tmp / 'emulator-state')!r}",  # else a shared directory keeps state between runs
        *([f"EXTERNAL_NOTIFICATION_URL = {notify!r}"] if notify else []),
        ""]))
    return config


# A pending power action that boots the host: what the emulator's fake driver records for a reset.
BOOTING = ("On", "ForceRestart", "GracefulRestart", "PowerCycle")


def power_listener(apps: dict[str, Appliance]) -> http.server.ThreadingHTTPServer:
    """A plain HTTP server for the emulator's external notifier: a PUT of a system's record with a
    pending power action that boots it tells that host's stand-in (by the system's name), once: the
    record keeps the action, and is sent again on any other change, until the action is applied."""
    told: dict[str, object] = {}
    lock = threading.Lock()

    class Notified(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            with contextlib.suppress(ValueError):
                record = json.loads(self.rfile.read(min(length, 1 << 20)) or b"{}")
                pending = record.get("pending_power") if isinstance(record, dict) else None
                name = str(record.get("name")) if isinstance(record, dict) else ""
                if name in apps and isinstance(pending, dict) and pending.get("power_state") in BOOTING:
                    action = (pending.get("power_state"), pending.get("apply_time"))
                    with lock:
                        new = told.get(name) != action
                        told[name] = action
                    if new:
                        apps[name].power_cycled()
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Notified)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@dataclass
class Rig:
    tmp: Path
    url: str
    bmc_ca: Path
    media_url: str  # {name} is each host's name
    media_ca: Path
    emulator: subprocess.Popen[bytes]
    apps: dict[str, Appliance]
    systems: dict[str, str] = field(default_factory=dict)  # name -> the emulator's system UUID

    def _get(self, path: str) -> dict[str, Any]:
        import requests

        r = requests.get(f"{self.url}{path}", verify=str(self.bmc_ca), auth=(USER, PASSWORD), timeout=10)
        return dict(r.json())

    def system(self, name: str) -> dict[str, Any]:
        return self._get(f"/redfish/v1/Systems/{self.systems[name]}")

    def slot(self, name: str) -> dict[str, Any]:
        return self._get(f"/redfish/v1/Systems/{self.systems[name]}/VirtualMedia/Cd")

    def efi_url(self, name: str) -> str:
        """NAME's installer EFI file on the media server (what a `boot = "http"` host boots)."""
        return self.media_url.replace("{name}", name).removesuffix(".iso") + ".efi"

    def fleet(self, hosts: Sequence[str] | None = None, serial: dict[str, str] | None = None, path: Path | None = None,
              **extra: Any) -> Path:
        """A fleet file for HOSTS (default: every system): the plan of each signed, one credentials file,
        each host's system and its stand-in's address, Secure Boot left as it is (the fake driver's
        cannot be reset); EXTRA: more keys for every host."""
        creds = write_credentials(self.tmp / "bmc-credentials")
        entries = []
        for name in (tuple(self.systems) if hosts is None else hosts):
            plan = sign_plan(self.tmp, name, (serial or {}).get(name, SERIAL))
            entries.append({"name": name, "plan": str(plan), "bmc": self.url, "credentials": str(creds), "bmc_ca": str(self.bmc_ca),
                            "system": f"/redfish/v1/Systems/{self.systems[name]}", "address": f"127.0.0.1:{self.apps[name].port}",
                            "secure_boot": "as-is", **extra})
        return write_fleet(path or self.tmp / "fleet.toml", entries)


def _media_handler(root: Path) -> type[http.server.SimpleHTTPRequestHandler]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *args: Any) -> None:
            pass

    return Quiet


@contextlib.contextmanager
def running(tmp: Path, names: Sequence[str] = ("gpu-07", "gpu-08"), install_s: float | None = None) -> Iterator[Rig]:
    """The rig for NAMES in TMP, taken down on leaving. INSTALL_S: each stand-in answers that long
    after its system's power cycle (the emulator's notifier tells it); else after one refused
    connection. EmulatorMissing without sushy-tools; RuntimeError when the emulator does not start."""
    if not EMULATOR.exists():
        raise EmulatorMissing(f"{EMULATOR}: sushy-tools is not installed (pip install -e '.[dev]')")
    systems = system_ids(names)
    ca = make_ca(tmp, "test-ca")
    bmc_crt, bmc_key = ca.server(tmp, "bmc", dns=("localhost",), ips=("127.0.0.1",))
    appliance_ca = make_ca(tmp, "appliance-ca")
    apps: dict[str, Appliance] = {}
    for name in systems:
        crt, key = appliance_ca.server(tmp, name, dns=(f"{name}.example.net",))
        apps[name] = Appliance(crt, key, install_s=install_s) if install_s is not None else Appliance(crt, key)
    with contextlib.ExitStack() as stack:
        for app in apps.values():
            stack.callback(app.close)
        notify = ""
        if install_s is not None:
            listener = power_listener(apps)
            stack.callback(listener.server_close)
            stack.callback(listener.shutdown)
            notify = f"http://127.0.0.1:{listener.server_address[1]}/"
        # the medium: small files over HTTPS with the same test CA, an ISO and an EFI file per host
        media_root = tmp / "media"
        for name in systems:
            (media_root / name).mkdir(parents=True)
            (media_root / name / "installer.iso").write_bytes(b"CD001" * 100)
            (media_root / name / "installer.efi").write_bytes(b"MZ" + bytes(510))
        media_crt, media_key = ca.server(tmp, "media", dns=("localhost",), ips=("127.0.0.1",))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(media_crt, media_key)
        media = HTTPSServer(("127.0.0.1", 0), _media_handler(media_root), ctx)
        threading.Thread(target=media.serve_forever, daemon=True).start()
        stack.callback(media.server_close)
        stack.callback(media.shutdown)
        port = free_port()
        config = emulator_config(tmp, port, bmc_crt, bmc_key, systems, notify)
        emulator = stack.enter_context(emulator_process(tmp, config, port))
        yield Rig(tmp, f"https://127.0.0.1:{port}", ca.pem, f"https://127.0.0.1:{media.server_address[1]}/{{name}}/installer.iso",
                  ca.pem, emulator, apps, systems)


@contextlib.contextmanager
def emulator_process(tmp: Path, config: Path, port: int, log_name: str = "emulator.log") -> Iterator[subprocess.Popen[bytes]]:
    """sushy-emulator with CONFIG, once it listens on PORT; stopped on leaving (its log: TMP/LOG_NAME).
    RuntimeError with the log's end when it does not start."""
    with open(tmp / log_name, "wb") as log:
        proc = subprocess.Popen([str(EMULATOR), "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=tmp)
        try:
            deadline = time.monotonic() + START_S
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("sushy-emulator did not start: " + (tmp / log_name).read_text()[-2000:]) from None
                    time.sleep(0.2)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
