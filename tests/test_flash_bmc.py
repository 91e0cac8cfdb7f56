# SPDX-License-Identifier: MIT
"""`builder flash --bmc`: the flash sequence against sushy-tools' emulator (fake driver, HTTPS, an
account), and every refusal against recorded Redfish responses (tests/fixtures/redfish/, as the
vendor-differences tests read them) answered by a fake that records what it was sent. The
appliance's proxy is a local HTTPS server with a test CA that drops its first connection (the host
is down while it installs). The BMC password is searched for in the children's command lines,
the logs, the progress lines and the state files."""

from __future__ import annotations

import contextlib
import copy
import datetime
import http.server
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from appliance.errors import UserError
from appliance.signed import install_plan
from builder import flash_bmc, keys
from builder.flash_bmc import Answer, BmcError, Options
from builder.https_server import HTTPSServer
from tests.repository import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "redfish"
PASSWORD = "s3cret-Pa55-for-the-BMC"
USER = "admin"
SERIAL = "1234570"  # the serial sushy-tools' drives show
SYSTEM = "/redfish/v1/Systems/437XR1138R2"


# ------------------------------------------------------------------------------ certificates, plans, files


@dataclass
class Ca:
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    pem: Path

    def server(self, directory: Path, name: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> tuple[Path, Path]:
        import ipaddress

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


def sign_plan(directory: Path, name: str, serial: str = SERIAL) -> Path:
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


def write_fleet(path: Path, hosts: list[dict[str, Any]]) -> Path:
    lines = []
    for h in hosts:
        lines.append("[[host]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in h.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------ the appliance's proxy, stubbed


class Appliance:
    """An HTTPS server answering /health as the plan's host; the first DOWN connections are closed at
    once (the host is installing); `up` False: every connection closed."""

    def __init__(self, cert: Path, key: Path, down: int = 1) -> None:
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.down = down
        self.up = True
        self.requests = 0
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if self.down > 0 or not self.up:
                    self.down -= 1
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


# ------------------------------------------------------------------------------ unit: input and credentials


def test_credentials_file_must_be_private_and_not_a_link(tmp_path: Path) -> None:
    creds = write_credentials(tmp_path / "bmc", mode=0o644)
    with pytest.raises(UserError) as e:
        flash_bmc.read_credentials(creds, "gpu-07")
    assert "can be read by others" in e.value.message and PASSWORD not in e.value.message + e.value.hint
    creds.chmod(0o600)
    assert flash_bmc.read_credentials(creds, "gpu-07").password == PASSWORD
    assert PASSWORD not in repr(flash_bmc.read_credentials(creds, "gpu-07"))
    link = tmp_path / "link"
    link.symlink_to(creds)
    with pytest.raises(UserError) as e:
        flash_bmc.read_credentials(link, "gpu-07")
    assert PASSWORD not in e.value.message


def test_credentials_file_faults_never_show_its_text(tmp_path: Path) -> None:
    bad = tmp_path / "bmc"
    bad.write_text(f'username = "{USER}"\npassword = {PASSWORD}\n')  # not TOML: the decoder's message would quote it
    bad.chmod(0o600)
    with pytest.raises(UserError) as e:
        flash_bmc.read_credentials(bad, "gpu-07")
    assert PASSWORD not in e.value.message + e.value.hint
    bad.write_text(f'user = "{USER}"\npassword = "{PASSWORD}"\n')
    with pytest.raises(UserError) as e:
        flash_bmc.read_credentials(bad, "gpu-07")
    assert "exactly username and password" in e.value.message and PASSWORD not in e.value.message


def test_fleet_refusals_are_bad_input(tmp_path: Path) -> None:
    plan = sign_plan(tmp_path, "gpu-07")
    creds = write_credentials(tmp_path / "bmc")
    base = {"name": "gpu-07", "plan": str(plan), "bmc": "https://bmc.example.net", "credentials": str(creds)}
    for change, words in [({"bmc": "http://bmc.example.net"}, "not an https:// URL"),
                          ({"bmc": f"https://{USER}:{PASSWORD}@bmc.example.net"}, "without credentials"),
                          ({"password": PASSWORD}, "unknown key"),
                          ({"secure_boot": "off"}, "secure_boot"),
                          ({"plan": str(tmp_path / "none")}, "no signed plan")]:
        fleet = write_fleet(tmp_path / "fleet.toml", [{**base, **change}])
        with pytest.raises(UserError) as e:
            flash_bmc.prepare(fleet, "https://media.example.net/{name}.iso")
        assert words in e.value.message, (change, e.value.message)
        assert PASSWORD not in e.value.message + e.value.hint
    fleet = write_fleet(tmp_path / "fleet.toml", [base, base])
    with pytest.raises(UserError, match="listed twice"):
        flash_bmc.prepare(fleet, "https://media.example.net/{name}.iso")
    fleet = write_fleet(tmp_path / "fleet.toml", [base])
    with pytest.raises(UserError, match="no installer medium"):
        flash_bmc.prepare(fleet, "")
    [job] = flash_bmc.prepare(fleet, "https://media.example.net/{name}/installer.iso")
    assert job.media_url == "https://media.example.net/gpu-07/installer.iso"
    assert job.target.proxy_name == "gpu-07.example.net" and job.target.serial == SERIAL


# ------------------------------------------------------------------------------ recorded responses


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


class Recorded:
    """A BMC answering recorded JSON by path; POST and PATCH recorded, and answered with FAIL[path] (a
    BmcError) when set. Actions change the documents as a BMC would (insert, eject, reset)."""

    def __init__(self, docs: dict[str, dict[str, Any]]) -> None:
        self.docs = copy.deepcopy(docs)
        self.sent: list[tuple[str, str, dict[str, Any]]] = []
        self.fail: dict[tuple[str, str], BmcError] = {}

    def get(self, path: str) -> dict[str, Any]:
        if ("GET", path) in self.fail:
            raise self.fail["GET", path]
        if path not in self.docs:
            raise BmcError(404, f"HTTP 404: {path} not found")
        return copy.deepcopy(self.docs[path])

    def _send(self, method: str, path: str, body: dict[str, Any]) -> None:
        self.sent.append((method, path, body))
        if (method, path) in self.fail:
            raise self.fail[method, path]
        if path.endswith("/Actions/VirtualMedia.InsertMedia"):
            slot = self.docs[path.split("/Actions/")[0]]
            slot.update(Image=body["Image"], ImageName=body["Image"].rsplit("/", 1)[-1], Inserted=True, ConnectedVia="URI")
        elif path.endswith("/Actions/VirtualMedia.EjectMedia"):
            self.docs[path.split("/Actions/")[0]].update(Image=None, ImageName=None, Inserted=False, ConnectedVia="NotConnected")

    def post(self, path: str, body: dict[str, Any]) -> None:
        self._send("POST", path, body)

    def patch(self, path: str, body: dict[str, Any]) -> None:
        self._send("PATCH", path, body)

    def close(self) -> None:
        pass


def rackmount() -> dict[str, dict[str, Any]]:
    """DMTF's public-rackmount1 mockup as recorded; a Systems collection naming its one system (the
    recording leaves it out) and its CD1 slot free (recorded in use by an applet; a free slot is
    DMTF's `Inserted` false with no image)."""
    docs = {d["@odata.id"]: d for d in (fixture(f"dmtf-rackmount1-{n}.json") for n in (
        "serviceroot", "manager", "system", "virtualmedia", "virtualmedia-cd1", "virtualmedia-floppy1", "secureboot",
        "secureboot-databases", "secureboot-db", "secureboot-db-certificates"))}
    docs["/redfish/v1/Systems"] = {"Members": [{"@odata.id": SYSTEM}]}
    docs[f"{SYSTEM}/VirtualMedia/CD1"].update(Image=None, ImageName=None, Inserted=False, ConnectedVia="NotConnected")
    # the mockup's drives are not recorded: its SimpleStorage link answers 404, which is "lists none"
    return docs


def recorded_job(tmp_path: Path, **host: Any) -> flash_bmc.Job:
    plan = sign_plan(tmp_path, "gpu-07")
    target = flash_bmc.read_target(plan, "gpu-07")
    h = flash_bmc.Host(name="gpu-07", plan_dir=plan, bmc="https://bmc.example.net", credentials=tmp_path / "bmc", **host)
    return flash_bmc.Job(h, target, "https://media.example.net/gpu-07/installer.iso", flash_bmc.Credentials(USER, PASSWORD))


def run_recorded(tmp_path: Path, bmc: Recorded, probe: Any = None, options: Options | None = None,
                 **host: Any) -> tuple[flash_bmc.Outcome, list[str]]:
    job = recorded_job(tmp_path, **host)
    lines: list[str] = []
    options = options or Options(output=tmp_path / "out", poll_interval=0, install_timeout=5)
    (tmp_path / "out").mkdir(exist_ok=True)
    answers = iter([None, Answer(200, True, ("gpu-07.example.net",))])
    outcome = flash_bmc.flash_host(job, options, lines.append, lambda h, c: bmc, probe or (lambda h, t: next(answers)))
    for line in lines:
        assert PASSWORD not in line
    return outcome, lines


def test_recorded_rackmount_whole_sequence(tmp_path: Path) -> None:
    bmc = Recorded(rackmount())
    outcome, lines = run_recorded(tmp_path, bmc)
    assert outcome.status == "installed", lines
    sent = [(m, p.removeprefix(SYSTEM), b) for m, p, b in bmc.sent]
    assert sent == [
        ("POST", "/SecureBoot/Actions/SecureBoot.ResetKeys", {"ResetKeysType": "DeletePK"}),  # UserMode, DeletePK offered
        ("PATCH", "/SecureBoot", {"SecureBootEnable": True}),  # recorded disabled
        ("POST", "/VirtualMedia/CD1/Actions/VirtualMedia.InsertMedia",
         {"Image": "https://media.example.net/gpu-07/installer.iso", "Inserted": True, "WriteProtected": True}),
        ("PATCH", "", {"Boot": {"BootSourceOverrideTarget": "Cd", "BootSourceOverrideEnabled": "Once", "BootSourceOverrideMode": "UEFI"}}),
        ("POST", "/Actions/ComputerSystem.Reset", {"ResetType": "ForceRestart"}),  # recorded On
        ("POST", "/VirtualMedia/CD1/Actions/VirtualMedia.EjectMedia", {}),
    ]
    steps = [line.removeprefix("gpu-07: ") for line in lines]
    for a, b in zip(flash_bmc.STEPS, flash_bmc.STEPS[1:], strict=False):
        assert steps.index(a) < steps.index(b)
    state = json.loads((tmp_path / "out" / "state" / "gpu-07.json").read_text())
    assert state["status"] == "installed" and state["done"] == list(flash_bmc.STEPS)
    assert (tmp_path / "out" / "state" / "gpu-07.json").stat().st_mode & 0o077 == 0


def _line(outcome: flash_bmc.Outcome) -> str:
    assert outcome.status == "failed"
    assert "\n" not in outcome.line and PASSWORD not in outcome.line
    return outcome.line


def _bmc_error(message: str, status: int = 400) -> BmcError:
    """As sushy reports a refusal: its @Message.ExtendedInfo message (bmc_answer)."""
    error = Exception()
    error.status_code = status  # type: ignore[attr-defined]
    error.extended_info = [{"MessageId": "Base.1.8.ActionParameterNotSupported", "Message": message}]  # type: ignore[attr-defined]
    error.detail = "general error"  # type: ignore[attr-defined]
    return BmcError(status, flash_bmc.bmc_answer(error))


REFUSALS: list[tuple[str, Any, str, str]] = [
    ("login", None, flash_bmc.STEP_BMC, "could not log in"),
    ("power", lambda d: d[SYSTEM].update(PowerState="PoweringOn"), flash_bmc.STEP_SYSTEM, "power state is PoweringOn"),
    ("legacy", lambda d: d[SYSTEM]["Boot"].update(BootSourceOverrideMode="Legacy"), flash_bmc.STEP_SYSTEM, "Legacy mode, not UEFI"),
    ("no secure boot", lambda d: d[SYSTEM].pop("SecureBoot"), flash_bmc.STEP_SECURE_BOOT, "no SecureBoot resource"),
    ("no reset keys", lambda d: d[f"{SYSTEM}/SecureBoot"].update(Actions={}), flash_bmc.STEP_SECURE_BOOT,
     "offers no way into setup mode (ResetKeys: no ResetKeys action)"),
    ("reset keys refused", "POST:/SecureBoot/Actions/SecureBoot.ResetKeys", flash_bmc.STEP_SECURE_BOOT,
     "the BMC answered: HTTP 400: The action parameter is not supported"),
    ("slot in use", lambda d: d[f"{SYSTEM}/VirtualMedia/CD1"].update(fixture("dmtf-rackmount1-virtualmedia-cd1.json")),
     flash_bmc.STEP_INSERT, "no free CD/DVD virtual media slot"),
    ("no virtual media", lambda d: d[SYSTEM].pop("VirtualMedia"), flash_bmc.STEP_INSERT, "no VirtualMedia collection"),
    ("insert refused", "POST:/VirtualMedia/CD1/Actions/VirtualMedia.InsertMedia", flash_bmc.STEP_INSERT,
     "refused to insert https://media.example.net/gpu-07/installer.iso; the BMC answered: HTTP 400"),
    ("no cd boot", lambda d: d[SYSTEM]["Boot"].update({"BootSourceOverrideTarget@Redfish.AllowableValues": ["Pxe", "Hdd"]}),
     flash_bmc.STEP_BOOT, "does not offer boot target Cd"),
    ("boot refused", "PATCH:", flash_bmc.STEP_BOOT, "refused the one-time boot"),
    ("reset not offered", lambda d: d[SYSTEM]["Actions"]["#ComputerSystem.Reset"].update(
        {"ResetType@Redfish.AllowableValues": ["On", "ForceOff"]}), flash_bmc.STEP_RESET, "offers none of ForceRestart, PowerCycle"),
    ("reset refused", "POST:/Actions/ComputerSystem.Reset", flash_bmc.STEP_RESET, "refused the reset (ForceRestart)"),
    ("eject refused", "POST:/VirtualMedia/CD1/Actions/VirtualMedia.EjectMedia", flash_bmc.STEP_EJECT, "refused to eject"),
]


@pytest.mark.parametrize(("case", "change", "step", "words"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_every_refusal_is_one_line_with_host_step_answer_and_hint(tmp_path: Path, case: str, change: Any, step: str,
                                                                  words: str) -> None:
    docs = rackmount()
    bmc = Recorded(docs)
    if callable(change):
        change(bmc.docs)
    elif isinstance(change, str):
        method, path = change.split(":", 1)
        bmc.fail[method, SYSTEM + path] = _bmc_error("The action parameter is not supported")
    if case == "login":
        job = recorded_job(tmp_path)
        (tmp_path / "out").mkdir()
        lines: list[str] = []

        def refuse(h: Any, c: Any) -> Recorded:
            raise _bmc_error("Invalid username or password", 401)
        outcome = flash_bmc.flash_host(job, Options(output=tmp_path / "out"), lines.append, refuse, lambda h, t: None)
    else:
        outcome, lines = run_recorded(tmp_path, bmc)
    line = _line(outcome)
    assert line.startswith(f"gpu-07: refused at {step}: "), line
    assert words in line, line
    assert "; do: " in line
    state = json.loads((tmp_path / "out" / "state" / "gpu-07.json").read_text())
    assert state["status"] == "failed" and state["failed_step"] == step


def test_secure_boot_setup_mode_and_db_enrollment(tmp_path: Path) -> None:
    docs = rackmount()
    docs[f"{SYSTEM}/SecureBoot"].update(SecureBootMode="SetupMode")
    bmc = Recorded(docs)
    outcome, lines = run_recorded(tmp_path / "a", bmc) if (tmp_path / "a").mkdir() is None else (None, [])
    assert outcome is not None and outcome.status == "installed"
    assert not any("SecureBoot" in p for _, p, _ in bmc.sent)
    assert "gpu-07: Secure Boot in setup mode: the installer enrolls the appliance's keys" in lines
    # enforcing, no ResetKeys, a db that takes certificates: the appliance's certificate goes there
    docs = rackmount()
    docs[f"{SYSTEM}/SecureBoot"].update(Actions={}, SecureBootEnable=True)
    bmc = Recorded(docs)
    (tmp_path / "b").mkdir()
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    outcome, lines = run_recorded(tmp_path / "b", bmc, options=Options(output=tmp_path / "b" / "out", poll_interval=0,
                                                                         secure_boot_cert=pem))
    assert outcome.status == "installed", lines
    assert ("POST", f"{SYSTEM}/SecureBoot/SecureBootDatabases/db/Certificates",
            {"CertificateString": pem, "CertificateType": "PEM"}) in bmc.sent


def test_wait_needs_the_host_down_first_and_the_plan_host_answering(tmp_path: Path) -> None:
    bmc = Recorded(rackmount())
    up = Answer(200, True, ("gpu-07.example.net",))
    answers = iter([up, up, None, up])  # an appliance already running answers before the reset takes hold
    outcome, _ = run_recorded(tmp_path, bmc, probe=lambda h, t: next(answers))
    assert outcome.status == "installed"
    assert next(answers, "spent") == "spent"
    bmc = Recorded(rackmount())
    (tmp_path / "b").mkdir()
    wrong = iter([None, Answer(0, False, (), "its certificate is not chained to ca.pem for gpu-07.example.net")])
    outcome, _ = run_recorded(tmp_path / "b", bmc, probe=lambda h, t: next(wrong))
    assert "refused at waiting for the appliance: the appliance answers, but its certificate is not chained" in _line(outcome)
    bmc = Recorded(rackmount())
    (tmp_path / "c").mkdir()
    outcome, _ = run_recorded(tmp_path / "c", bmc, probe=lambda h, t: None,
                              options=Options(output=tmp_path / "c" / "out", poll_interval=0.01, install_timeout=0.05))
    assert "did not answer on its proxy as gpu-07.example.net" in _line(outcome)
    # run again: it goes on waiting, and nothing is sent to the BMC until the appliance answers
    before = len(bmc.sent)
    outcome, lines = run_recorded(tmp_path / "c", bmc, options=Options(output=tmp_path / "c" / "out", poll_interval=0))
    assert outcome.status == "installed" and "gpu-07: resuming after power-cycling" in lines
    assert [p.rsplit("/", 1)[-1] for _, p, _ in bmc.sent[before:]] == ["VirtualMedia.EjectMedia"]


def test_probe_checks_the_chain_and_the_name(tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "appliance-ca")
    crt, key = ca.server(tmp_path, "gpu-07", dns=("gpu-07.example.net",))
    app = Appliance(crt, key, down=0)
    try:
        host = flash_bmc.Host("gpu-07", tmp_path, "https://b", tmp_path / "c", appliance_ca=ca.pem, address=f"127.0.0.1:{app.port}")
        target = flash_bmc.Target("0", "gpu-07.example.net", SERIAL, "", 0, 0)
        assert flash_bmc.probe_proxy(host, target) == Answer(200, True, ("gpu-07.example.net",))
        other = make_ca(tmp_path, "another-ca")
        wrong = flash_bmc.probe_proxy(flash_bmc.Host("gpu-07", tmp_path, "https://b", tmp_path / "c", appliance_ca=other.pem,
                                                     address=f"127.0.0.1:{app.port}"), target)
        assert wrong is not None and "not chained" in wrong.problem
        unverified = flash_bmc.probe_proxy(flash_bmc.Host("gpu-07", tmp_path, "https://b", tmp_path / "c",
                                                          address=f"127.0.0.1:{app.port}"), target)
        assert unverified == Answer(200, False, ("gpu-07.example.net",))
        elsewhere = flash_bmc.probe_proxy(host, flash_bmc.Target("0", "gpu-08.example.net", SERIAL, "", 0, 0))
        assert elsewhere is not None and "not chained" in elsewhere.problem
    finally:
        app.close()


# ------------------------------------------------------------------------------ sushy-tools' emulator


SYSTEMS = {"gpu-07": "27946b59-9e44-4fa7-8e91-f3527a1ef094", "gpu-08": "48295861-2522-3561-6729-621118518810"}


@dataclass
class Rig:
    tmp: Path
    url: str
    bmc_ca: Path
    media_url: str
    media_ca: Path
    emulator: subprocess.Popen[bytes]
    apps: dict[str, Appliance]

    def system(self, name: str) -> dict[str, Any]:
        import requests

        r = requests.get(f"{self.url}/redfish/v1/Systems/{SYSTEMS[name]}", verify=str(self.bmc_ca), auth=(USER, PASSWORD), timeout=10)
        return dict(r.json())

    def slot(self, name: str) -> dict[str, Any]:
        import requests

        r = requests.get(f"{self.url}/redfish/v1/Systems/{SYSTEMS[name]}/VirtualMedia/Cd", verify=str(self.bmc_ca),
                         auth=(USER, PASSWORD), timeout=10)
        return dict(r.json())

    def fleet(self, hosts: tuple[str, ...] = ("gpu-07", "gpu-08"), serial: dict[str, str] | None = None, **extra: Any) -> Path:
        creds = write_credentials(self.tmp / "bmc-credentials")
        entries = []
        for name in hosts:
            plan = sign_plan(self.tmp, name, (serial or {}).get(name, SERIAL))
            entries.append({"name": name, "plan": str(plan), "bmc": self.url, "credentials": str(creds), "bmc_ca": str(self.bmc_ca),
                            "system": f"/redfish/v1/Systems/{SYSTEMS[name]}", "address": f"127.0.0.1:{self.apps[name].port}",
                            "secure_boot": "as-is", **extra})
        return write_fleet(self.tmp / "fleet.toml", entries)


def _emulator_config(tmp: Path, port: int, crt: Path, key: Path) -> Path:
    import bcrypt

    htpasswd = tmp / "htpasswd"
    htpasswd.write_text(f"{USER}:{bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()}\n")
    systems = [{"uuid": u, "name": n, "power_state": "On", "nics": [{"mac": "00:5c:52:31:3a:9c", "ip": "172.22.0.100"}]}
               for n, u in SYSTEMS.items()]
    storage = {u: [{"Id": "1", "Name": "Local Storage Controller",
                    "StorageControllers": [{"MemberId": "0", "Name": "Contoso Integrated RAID", "SpeedGbps": 12}],
                    "Drives": ["32ADF365C6C1B7BD"]}] for u in SYSTEMS.values()}
    drives = {(u, "1"): [{"Id": "32ADF365C6C1B7BD", "Name": "Drive Sample", "CapacityBytes": 899527000000, "Protocol": "SAS"}]
              for u in SYSTEMS.values()}
    config = tmp / "emulator.conf"
    config.write_text("\n".join([
        "SUSHY_EMULATOR_FAKE_DRIVER = True",
        f"SUSHY_EMULATOR_FAKE_SYSTEMS = {systems!r}",
        f"SUSHY_EMULATOR_STORAGE = {storage!r}",
        f"SUSHY_EMULATOR_DRIVES = {drives!r}",
        f"SUSHY_EMULATOR_AUTH_FILE = {str(htpasswd)!r}",
        "SUSHY_EMULATOR_LISTEN_IP = '127.0.0.1'",
        f"SUSHY_EMULATOR_LISTEN_PORT = {port}",
        f"SUSHY_EMULATOR_SSL_CERT = {str(crt)!r}",
        f"SUSHY_EMULATOR_SSL_KEY = {str(key)!r}",
        f"SUSHY_EMULATOR_STATE_DIR = {str(tmp / 'emulator-state')!r}",  # else a shared directory keeps state between runs
        ""]))
    return config


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    emulator_bin = Path(sys.executable).parent / "sushy-emulator"
    if not emulator_bin.exists():
        pytest.skip("sushy-tools is not installed (pip install -e '.[dev]')")
    ca = make_ca(tmp_path, "test-ca")
    bmc_crt, bmc_key = ca.server(tmp_path, "bmc", dns=("localhost",), ips=("127.0.0.1",))
    port = _free_port()
    config = _emulator_config(tmp_path, port, bmc_crt, bmc_key)
    log = open(tmp_path / "emulator.log", "wb")  # noqa: SIM115 - closed below
    emulator = subprocess.Popen([str(emulator_bin), "--config", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=tmp_path)
    # the medium: a small file over HTTPS with the same test CA
    media_root = tmp_path / "media"
    for name in SYSTEMS:
        (media_root / name).mkdir(parents=True)
        (media_root / name / "installer.iso").write_bytes(b"CD001" * 100)
    media_crt, media_key = ca.server(tmp_path, "media", dns=("localhost",), ips=("127.0.0.1",))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(media_root), **kw)

        def log_message(self, *args: Any) -> None:
            pass

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(media_crt, media_key)
    media = HTTPSServer(("127.0.0.1", 0), Quiet, ctx)
    threading.Thread(target=media.serve_forever, daemon=True).start()
    appliance_ca = make_ca(tmp_path, "appliance-ca")
    apps = {}
    for name in SYSTEMS:
        crt, key = appliance_ca.server(tmp_path, name, dns=(f"{name}.example.net",))
        apps[name] = Appliance(crt, key)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if emulator.poll() is not None or time.monotonic() > deadline:
                pytest.fail("sushy-emulator did not start: " + (tmp_path / "emulator.log").read_text()[-2000:])
            time.sleep(0.2)
    try:
        yield Rig(tmp_path, f"https://127.0.0.1:{port}", ca.pem, f"https://127.0.0.1:{media.server_address[1]}/{{name}}/installer.iso",
                  ca.pem, emulator, apps)
    finally:
        emulator.terminate()
        emulator.wait(10)
        log.close()
        media.shutdown()
        for app in apps.values():
            app.close()


def _flash(rig: Rig, fleet: Path, **kw: Any) -> tuple[int, list[str]]:
    lines: list[str] = []
    options = Options(output=rig.tmp / "out", poll_interval=0.05, install_timeout=kw.pop("install_timeout", 30),
                      media_ca=rig.media_ca.read_text())
    status = flash_bmc.flash_fleet(fleet, rig.media_url, options, echo=lines.append, **kw)
    return status, lines


def _secret_nowhere(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file() and path.name not in ("bmc-credentials",):
            assert PASSWORD.encode() not in path.read_bytes(), path


@pytest.mark.programs
def test_emulator_two_hosts_then_already_installed(rig: Rig) -> None:
    status, lines = _flash(rig, rig.fleet())
    assert status == 0, "\n".join(lines)
    for name in SYSTEMS:
        mine = [line.removeprefix(f"{name}: ") for line in lines if line.startswith(f"{name}: ")]
        for step in flash_bmc.STEPS:
            assert step in mine, (step, mine)
        assert mine[-1].startswith("installed: answers on its proxy as"), mine
        assert "certificate NOT verified" in mine[-1]  # no appliance_ca in this fleet
        system = rig.system(name)
        assert system["Boot"]["BootSourceOverrideTarget"] == "Cd"  # the emulator keeps the override
        slot = rig.slot(name)
        assert slot["Inserted"] is False and not slot["Image"]  # ejected
        assert slot["VerifyCertificate"] is True  # the medium's CA was given to the BMC
    assert any("BMC standard" in line for line in lines)
    assert "summary:" in lines
    state_dir = rig.tmp / "out" / "state"
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in state_dir.iterdir()}
    emulator_log = (rig.tmp / "emulator.log").stat().st_size

    def never(h: Any, c: Any) -> Any:
        raise AssertionError("an installed host's BMC was asked again")
    status, lines = _flash(rig, rig.fleet(), connect=never)
    assert status == 0
    assert {line for line in lines if "already installed" in line and ": " in line and not line.startswith(" ")} == {
        f"{n}: already installed with this plan (state {state_dir / (n + '.json')}): nothing done" for n in SYSTEMS}
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in state_dir.iterdir()} == before
    assert (rig.tmp / "emulator.log").stat().st_size == emulator_log
    _secret_nowhere(rig.tmp / "out")


@pytest.mark.programs
def test_emulator_one_host_fails_the_other_goes_on(rig: Rig) -> None:
    status, lines = _flash(rig, rig.fleet(serial={"gpu-08": "NOT-THIS-ONE"}))
    assert status == 1
    [refusal] = [line for line in lines if line.startswith("gpu-08: refused")]
    assert refusal.startswith("gpu-08: refused at checking the system: the plan's disk (serial NOT-THIS-ONE) is not among")
    assert "serial 1234570" in refusal and "; do: " in refusal
    assert any(line.startswith("gpu-07: installed") for line in lines)
    assert not any(line.startswith("gpu-08: inserting") for line in lines)
    assert rig.slot("gpu-08")["Inserted"] is False
    _secret_nowhere(rig.tmp / "out")


@pytest.mark.programs
def test_emulator_resumes_where_each_host_stands(rig: Rig) -> None:
    rig.apps["gpu-07"].up = False  # it does not come back: the run stops at waiting
    status, lines = _flash(rig, rig.fleet(hosts=("gpu-07",)), install_timeout=0.5)
    assert status == 1
    assert lines[-1].startswith("  gpu-07  failed")
    assert rig.slot("gpu-07")["Inserted"] is True  # still in: the install may still need it
    rig.apps["gpu-07"].up = True
    status, lines = _flash(rig, rig.fleet(hosts=("gpu-07",)))
    assert status == 0, lines
    assert "gpu-07: resuming after power-cycling" in lines
    assert f"gpu-07: {flash_bmc.STEP_INSERT}" not in lines and f"gpu-07: {flash_bmc.STEP_RESET}" not in lines
    assert rig.slot("gpu-07")["Inserted"] is False


@pytest.mark.programs
def test_emulator_refusals(rig: Rig) -> None:
    # the emulator's Secure Boot is off in deployed mode with no ResetKeys: the appliance policy refuses
    status, lines = _flash(rig, rig.fleet(hosts=("gpu-07",), secure_boot="appliance"))
    assert status == 1
    [line] = [x for x in lines if x.startswith("gpu-07: refused")]
    assert line.startswith("gpu-07: refused at preparing Secure Boot: Secure Boot is disabled, DeployedMode (off: ")
    shutil.rmtree(rig.tmp / "out")
    # a wrong password: the BMC's answer, and the password appears nowhere
    fleet = rig.fleet(hosts=("gpu-07",))
    write_credentials(rig.tmp / "bmc-credentials", password="not-the-" + PASSWORD[:4])
    status, lines = _flash(rig, fleet)
    assert status == 1
    [line] = [x for x in lines if x.startswith("gpu-07: refused")]
    assert line.startswith("gpu-07: refused at checking the BMC: ") and "401" in line, line


@pytest.mark.programs
def test_cli_password_never_in_argv_logs_or_state(rig: Rig) -> None:
    fleet = rig.fleet()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "builder", "flash", "--bmc", str(fleet), "--media-url", rig.media_url,
                             "--media-ca", str(rig.media_ca), "--output", str(rig.tmp / "out"), "--poll-interval", "0.2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen: set[int] = set()
    while proc.poll() is None:
        for pid in [proc.pid, *_children(proc.pid)]:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            seen.add(pid)
            assert PASSWORD.encode() not in cmdline and PASSWORD.encode() not in environ
        time.sleep(0.05)
    out, err = proc.communicate()
    assert proc.returncode == 0, (out.decode(), err.decode())
    assert proc.pid in seen
    assert PASSWORD.encode() not in out + err
    assert PASSWORD.encode() not in Path(f"/proc/{rig.emulator.pid}/cmdline").read_bytes()
    log = (rig.tmp / "out" / "flash.log").read_text()
    assert all(f" {name}: installed: answers on its proxy" in log for name in SYSTEMS)
    assert "Systems" in (rig.tmp / "out" / "sushy.log").read_text()  # sushy's own log is there, and masked
    _secret_nowhere(rig.tmp / "out")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found + [g for c in found for g in _children(c)]
