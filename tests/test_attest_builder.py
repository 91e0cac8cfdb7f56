# SPDX-License-Identifier: MIT
"""`builder attest`: enrollment and quotes against a stand-in appliance (a small HTTPS server in the
test backed by a real swtpm, tpm2-tools doing what the device does), and release policies read
from a kernel image's .pcrsig in a signed bundle of a signed channel index."""

from __future__ import annotations

import base64
import datetime
import hashlib
import http.server
import ipaddress
import json
import re
import shutil
import ssl
import struct
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from appliance import efivars
from appliance.signed import release_manifest
from builder import attest, attest_store, keys, release, secureboot, sign_channel
from builder.__main__ import main
from tests import fake_release

EK = "0x81010001"
AK = "0x81010002"
LOCAL_CA = Path("/var/lib/swtpm-localca/issuercert.pem")
VERSION = "2.0.0"
PCR11_EXTEND = hashlib.sha256(b"the kernel image's sections").hexdigest()

needs_tools = pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("swtpm", "swtpm_setup", "tpm2_createak", "tpm2_makecredential", "tpm2_quote")),
    reason="swtpm and tpm2-tools are not installed (make setup)")


# ----------------------------------------------------------------------------------- the device's part


class Device:
    """What the appliance's TPM code does, with tpm2-tools against a swtpm."""

    def __init__(self, tcti: str, work: Path) -> None:
        self.tcti, self.work = tcti, work
        work.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.tpm("tpm2_readpublic", "-c", EK, "-o", str(work / "ek.pem"), "-f", "pem")
        self.tpm("tpm2_createak", "-C", EK, "-c", str(work / "ak.ctx"), "-G", "ecc", "-g", "sha256", "-s", "ecdsa",
                 "-u", str(work / "ak.pub"), "-n", str(work / "ak.name"))
        self.tpm("tpm2_evictcontrol", "-c", str(work / "ak.ctx"), AK)
        self.flush()
        cert = subprocess.run(["tpm2_nvread", "-T", tcti, "0x01c00002"], check=True, capture_output=True).stdout
        self.ek_certificate = x509.load_der_x509_certificate(cert).public_bytes(serialization.Encoding.DER)

    def tpm(self, *argv: str) -> str:
        return subprocess.run([argv[0], "-T", self.tcti, *argv[1:]], check=True, capture_output=True, text=True).stdout

    def flush(self) -> None:
        subprocess.run(["tpm2_flushcontext", "-T", self.tcti, "-t"], capture_output=True)
        subprocess.run(["tpm2_flushcontext", "-T", self.tcti, "-s"], capture_output=True)

    def identity(self) -> dict[str, Any]:
        return {"format": 1, "ek_public": (self.work / "ek.pem").read_text(),
                "ek_certificate": base64.b64encode(self.ek_certificate).decode(),
                "ak_public": base64.b64encode((self.work / "ak.pub").read_bytes()).decode(),
                "ak_name": (self.work / "ak.name").read_bytes().hex()}

    def activate(self, credential: bytes) -> bytes:
        with self.lock:
            w = self.work
            (w / "cred").write_bytes(credential)
            try:
                self.tpm("tpm2_startauthsession", "--policy-session", "-S", str(w / "s.ctx"))
                self.tpm("tpm2_policysecret", "-S", str(w / "s.ctx"), "-c", "e")
                self.tpm("tpm2_activatecredential", "-c", AK, "-C", EK, "-i", str(w / "cred"), "-o", str(w / "secret"),
                         "-P", f"session:{w / 's.ctx'}")
                self.tpm("tpm2_flushcontext", str(w / "s.ctx"))
            finally:
                self.flush()
            return (w / "secret").read_bytes()

    def extend(self, pcr: int, digest: str) -> None:
        self.tpm("tpm2_pcrextend", f"{pcr}:sha256={digest}")

    def quote(self, nonce: str, event_log: bytes) -> dict[str, Any]:
        with self.lock:
            w = self.work
            try:
                self.tpm("tpm2_quote", "-c", AK, "-l", "sha256:7,11", "-q", nonce, "-m", str(w / "q.msg"), "-s", str(w / "q.sig"),
                         "-o", str(w / "q.pcrs"), "-g", "sha256")
            finally:
                self.flush()
            read = self.tpm("tpm2_pcrread", "sha256:7,11")
            values = {int(i): v.lower() for i, v in re.findall(r"(\d+)\s*:\s*0x([0-9A-Fa-f]{64})", read)}
            assert set(values) == {7, 11}, read
            return {"format": 1, "nonce": nonce, "pcrs": [{"index": i, "sha256": values[i]} for i in (7, 11)],
                    "quote": base64.b64encode((w / "q.msg").read_bytes()).decode(),
                    "signature": base64.b64encode((w / "q.sig").read_bytes()).decode(),
                    "ak_name": (w / "ak.name").read_bytes().hex(), "event_log": base64.b64encode(event_log).decode()}


# ----------------------------------------------------------------------------------- an event log


def _event2(pcr: int, kind: int, data: bytes) -> bytes:
    digest = hashlib.sha256(data).digest()
    return struct.pack("<III", pcr, kind, 1) + struct.pack("<H", 0x000B) + digest + struct.pack("<I", len(data)) + data


def _variable(guid: str, name: str, data: bytes) -> bytes:
    return uuid.UUID(guid).bytes_le + struct.pack("<QQ", len(name), len(data)) + name.encode("utf-16-le") + data


def event_log(secure_boot_cert: bytes, secure_boot_on: bool = True) -> tuple[bytes, list[str]]:
    """A crypto-agile log of PCR 7's Secure Boot events (sha256 bank only) and their digests."""
    spec = b"Spec ID Event03\0" + struct.pack("<IBBBBI", 0, 0, 2, 0, 2, 1) + struct.pack("<HH", 0x000B, 32) + b"\0"
    head = struct.pack("<II", 0, 3) + bytes(20) + struct.pack("<I", len(spec)) + spec
    db = secureboot.signature_list([(secureboot.APPLIANCE_OWNER, secure_boot_cert)])
    events = [
        (0x80000001, _variable(efivars.GLOBAL_GUID, "SecureBoot", b"\x01" if secure_boot_on else b"\x00")),
        (0x80000001, _variable(efivars.GLOBAL_GUID, "PK", db)),
        (0x80000001, _variable(efivars.GLOBAL_GUID, "KEK", db)),
        (0x80000001, _variable(efivars.IMAGE_SECURITY_GUID, "db", db)),
        (0x80000001, _variable(efivars.IMAGE_SECURITY_GUID, "dbx", b"")),
        (0x00000004, b"\0\0\0\0"),
        (0x800000E0, _variable(efivars.IMAGE_SECURITY_GUID, "db", secureboot.APPLIANCE_OWNER.bytes_le + secure_boot_cert)),
    ]
    return head + b"".join(_event2(7, k, d) for k, d in events), [hashlib.sha256(d).hexdigest() for _, d in events]


# ----------------------------------------------------------------------------------- the stand-in appliance


def _tls(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stand-in appliance")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "site.crt", tmp / "site.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


class StandIn:
    """The appliance's metrics site's /attest/ routes over HTTPS, backed by DEVICE. MODE: "ok",
    "wrong-secret" (activation answers another secret), "replay" (quotes answer RECORDED)."""

    def __init__(self, device: Device, tmp: Path, log: bytes) -> None:
        self.device, self.log, self.mode, self.recorded = device, log, "ok", None
        self.cert, key = _tls(tmp)
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def answer(self, doc: Any, status: int = 200) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/attest/identity":
                    identity = stand_in.device.identity()
                    if stand_in.mode == "other-ak-name":
                        identity["ak_name"] = identity["ak_name"][:-2] + ("00" if identity["ak_name"][-2:] != "00" else "01")
                    return self.answer(identity)
                self.answer({"error": {"message": "no such path", "type": "not_found"}}, 404)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/attest/activate":
                    secret = stand_in.device.activate(base64.b64decode(body["credential"]))
                    if stand_in.mode == "wrong-secret":
                        secret = bytes(b ^ 1 for b in secret)
                    return self.answer({"secret": base64.b64encode(secret).decode()})
                if self.path == "/attest/quote":
                    if stand_in.mode == "replay" and stand_in.recorded is not None:
                        return self.answer(stand_in.recorded)
                    doc = stand_in.device.quote(body["nonce"], stand_in.log)
                    stand_in.recorded = doc
                    return self.answer(doc)
                self.answer({"error": {"message": "no such path", "type": "not_found"}}, 404)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.url = f"https://127.0.0.1:{self.port}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ----------------------------------------------------------------------------------- the fleet's side


def _uki_sections(version: str, pcr11: bytes, policy_key: Path) -> dict[str, bytes]:
    from appliance.attest import tpm_wire

    pubkey = secureboot.public_key_pem(policy_key)
    pkfp = attest.pcr_key_fingerprint(serialization.load_pem_public_key(pubkey))
    pol = tpm_wire.pcr_policy_digest(11, pcr11).hex()
    other = hashlib.sha256(b"another boot phase").hexdigest()
    pcrsig = {"sha256": [{"pcrs": [11], "pkfp": pkfp, "pol": p, "sig": "AAAA"} for p in (other, pol)]}
    return {
        ".osrel": f'ID=debian\nIMAGE_ID="appliance"\nIMAGE_VERSION="{version}"\n'.encode(),
        ".cmdline": f"usrhash={fake_release.usrhash_for(version)} rw".encode(),
        ".pcrsig": json.dumps(pcrsig).encode(),
        ".pcrpkey": pubkey,
    }


def make_channel(tmp: Path, key: Path, releases: dict[str, bytes | None]) -> Path:
    """A channel directory with a signed index and one bundle per release; each kernel image with a
    .pcrsig for the PCR 11 value given (None: a kernel image without one)."""
    channel = tmp / "channel"
    _, pcr_cert = key.parent / "pcr-policy.key", key.parent / "pcr-policy.crt"
    for version, pcr11 in releases.items():
        config = fake_release.demo_config(version)
        out = fake_release.fake_build(tmp / f"out-{version}", config, key)
        if pcr11 is not None:
            fake_release.make_pe(out / f"appliance_{version}.efi", _uki_sections(version, pcr11, pcr_cert))
        release.make_bundle(config, out, channel / version, key, previous_bundle_or_engine_digests=[config.engine.digest])
    toml = tmp / "channel.toml"
    toml.write_text('channel = "stable"\n' + "".join(f'[[releases]]\nversion = "{v}"\npath = "{v}/"\n' for v in releases))
    sign_channel.make(toml, channel, key, now=time.time())
    return channel


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One stand-in appliance over a swtpm (Secure Boot events and a kernel image's PCR 11 extended),
    the fleet's keys, and a channel whose release holds that PCR 11's policy."""
    if any(shutil.which(t) is None for t in ("swtpm", "swtpm_setup", "tpm2_createak", "tpm2_makecredential", "tpm2_quote")):
        pytest.skip("swtpm and tpm2-tools are not installed (make setup)")
    from testkit.swtpm import running_swtpm

    tmp = tmp_path_factory.mktemp("fleet")
    key, _ = keys.generate(tmp / "keys")
    keys.boot_keys(tmp / "keys", make=True)
    sb_cert = secureboot.der(tmp / "keys" / "secureboot.crt")
    with running_swtpm(tmp / "tpm") as tcti:
        device = Device(tcti, tmp / "device")
        log, digests = event_log(sb_cert)
        for digest in digests:
            device.extend(7, digest)
        device.extend(11, PCR11_EXTEND)
        pcr11 = bytes.fromhex(device.tpm("tpm2_pcrread", "sha256:11").split("0x")[-1].strip())
        stand_in = StandIn(device, tmp, log)
        try:
            channel = make_channel(tmp, key, {VERSION: pcr11})
            yield {"tmp": tmp, "key": key, "device": device, "stand_in": stand_in, "channel": channel, "pcr11": pcr11}
        finally:
            stand_in.stop()


def _store(tmp: Path, name: str) -> Path:
    return tmp / name


def _enroll(fleet: dict[str, Any], store: Path, host: str, *extra: str) -> int:
    return main(["--profile", "demo", "attest", "enroll", host, "--url", fleet["stand_in"].url, "--store", str(store),
                 "--signing-key", str(fleet["key"]), "--ca", str(fleet["stand_in"].cert), *extra])


def _check(fleet: dict[str, Any], store: Path, *hosts: str, extra: tuple[str, ...] = ()) -> int:
    template = f"https://{{host}}:{fleet['stand_in'].port}/"
    return main(["--profile", "demo", "attest", *hosts, "--store", str(store), "--channel", str(fleet["channel"]),
                 "--signing-key", str(fleet["key"]), "--ca", str(fleet["stand_in"].cert), "--url-template", template,
                 "--secure-boot-cert", str(fleet["tmp"] / "keys" / "secureboot.crt"), *extra])


# ----------------------------------------------------------------------------------- enrollment


@pytest.mark.programs
@needs_tools
def test_enrolled_once_and_bound_to_its_ek(fleet: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    assert _enroll(fleet, store, "gpu-07", "--ek-ca", str(LOCAL_CA)) == 0
    out = capsys.readouterr().out
    assert out.startswith("enrolled gpu-07: EK ")
    record = json.loads((store / "hosts" / "gpu-07.json").read_text())
    assert record["trust"] == "ek-ca" and record["software_tpm"] is False and "swtpm-localca" in record["ek_issuer"]
    assert record["ak_name"] == fleet["device"].identity()["ak_name"]
    assert (store / "hosts" / "gpu-07.json.sig").is_file()
    # the same EK under another name: refused, nothing written
    assert _enroll(fleet, store, "gpu-08", "--ek-ca", str(LOCAL_CA)) == 2
    err = capsys.readouterr().err
    assert "is enrolled under gpu-07" in err and "--replace gpu-07" in err
    assert not (store / "hosts" / "gpu-08.json").exists()
    # on purpose: the record moves
    assert _enroll(fleet, store, "gpu-08", "--ek-ca", str(LOCAL_CA), "--replace", "gpu-07") == 0
    assert not (store / "hosts" / "gpu-07.json").exists() and (store / "hosts" / "gpu-08.json").exists()


@pytest.mark.programs
@needs_tools
def test_a_second_ek_for_an_enrolled_host_is_refused(fleet: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from testkit.swtpm import running_swtpm

    store = tmp_path / "store"
    with running_swtpm(tmp_path / "other-tpm") as tcti:
        other = StandIn(Device(tcti, tmp_path / "other-device"), tmp_path, b"")
        try:
            assert main(["--profile", "demo", "attest", "enroll", "gpu-07", "--url", other.url, "--store", str(store),
                         "--signing-key", str(fleet["key"]), "--ca", str(other.cert), "--ek-ca", str(LOCAL_CA)]) == 0
        finally:
            other.stop()
    before = (store / "hosts" / "gpu-07.json").read_bytes()
    assert _enroll(fleet, store, "gpu-07", "--ek-ca", str(LOCAL_CA)) == 2
    err = capsys.readouterr().err
    assert "gpu-07 is enrolled with another EK" in err and "--replace gpu-07" in err
    assert (store / "hosts" / "gpu-07.json").read_bytes() == before


@pytest.mark.programs
@needs_tools
def test_an_activation_with_the_wrong_secret_is_refused(fleet: dict[str, Any], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    fleet["stand_in"].mode = "wrong-secret"
    try:
        assert _enroll(fleet, store, "gpu-07", "--ek-ca", str(LOCAL_CA)) == 1
    finally:
        fleet["stand_in"].mode = "ok"
    assert "secret is not the one sent" in capsys.readouterr().err
    assert not (store / "hosts" / "gpu-07.json").exists()


@pytest.mark.programs
@needs_tools
def test_an_ak_name_that_is_not_its_public_area_is_refused(fleet: dict[str, Any], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    fleet["stand_in"].mode = "other-ak-name"
    try:
        assert _enroll(fleet, tmp_path / "store", "gpu-07", "--ek-ca", str(LOCAL_CA)) == 1
    finally:
        fleet["stand_in"].mode = "ok"
    assert "the AK's name is not the name of its public area" in capsys.readouterr().err
    assert not (tmp_path / "store" / "hosts" / "gpu-07.json").exists()


@pytest.mark.programs
@needs_tools
def test_an_ek_no_trusted_ca_signed_needs_accept_software_tpm(fleet: dict[str, Any], tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    foreign = tmp_path / "foreign-ca.pem"
    foreign.write_bytes((fleet["tmp"] / "keys" / "secureboot.crt").read_bytes())
    assert _enroll(fleet, store, "gpu-07", "--ek-ca", str(foreign)) == 1
    assert "is not signed by a trusted EK CA" in capsys.readouterr().err
    assert not (store / "hosts" / "gpu-07.json").exists()
    assert _enroll(fleet, store, "gpu-07") == 2  # no CA at all: a usage error
    assert "--accept-software-tpm" in capsys.readouterr().err
    assert _enroll(fleet, store, "gpu-07", "--ek-ca", str(foreign), "--accept-software-tpm") == 0
    assert "software TPM" in capsys.readouterr().out
    record = json.loads((store / "hosts" / "gpu-07.json").read_text())
    assert record["software_tpm"] is True and record["trust"] == "software-tpm"


@pytest.mark.programs
@needs_tools
def test_the_plan_says_a_software_tpm_is_accepted(fleet: dict[str, Any], tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text("[attestation]\naccept_software_tpm = true\n")
    assert _enroll(fleet, tmp_path / "store", "gpu-07", "--plan", str(plan)) == 0
    plan.write_text(f'[attestation]\nek_ca = """\n{LOCAL_CA.read_text()}"""\n')
    assert _enroll(fleet, tmp_path / "store2", "gpu-07", "--plan", str(plan)) == 0
    assert json.loads((tmp_path / "store2" / "hosts" / "gpu-07.json").read_text())["trust"] == "ek-ca"


def test_ek_trust_refuses_a_certificate_for_another_key(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from appliance.errors import Refused

    key = ec.generate_private_key(ec.SECP256R1())
    other = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "EK CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(other.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    identity = SimpleNamespace(ek_public=pem, ek_certificate=base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode())
    with pytest.raises(Refused, match="for another key"):
        attest.ek_trust(identity, [cert], accept_software_tpm=True)


# ----------------------------------------------------------------------------------- checking hosts


@pytest.mark.programs
@needs_tools
def test_attest_proves_a_host_and_refuses_a_replayed_quote(fleet: dict[str, Any], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    assert _enroll(fleet, store, "127.0.0.1", "--accept-software-tpm") == 0
    capsys.readouterr()
    prom = tmp_path / "attestation.prom"
    assert _check(fleet, store, "127.0.0.1", extra=("--json", "--prometheus", str(prom))) == 0
    [doc] = json.loads(capsys.readouterr().out)
    assert doc["proven"] is True and doc["release"] == VERSION and doc["secure_boot"] == "enforcing" and doc["code"] == "ok"
    seen = json.loads((store / "seen" / "127.0.0.1.json").read_text())
    assert seen["clock_ms"] > 0
    text = prom.read_text()
    assert f'appliance_attestation_proven{{host="127.0.0.1",release="{VERSION}",secure_boot="enforcing"}} 1' in text
    assert "appliance_attestation_failed{" not in text
    # the policies are cached: a second run reads no kernel image
    uki = fleet["channel"] / VERSION / f"appliance_{VERSION}.efi"
    saved = uki.read_bytes()
    uki.write_bytes(b"gone")
    try:
        assert _check(fleet, store, "127.0.0.1") == 0
    finally:
        uki.write_bytes(saved)
    assert capsys.readouterr().out.strip() == f"127.0.0.1: release {VERSION}, Secure Boot enforcing, proven"
    # the stand-in answers the quote it made before: another nonce
    fleet["stand_in"].mode = "replay"
    try:
        assert _check(fleet, store, "127.0.0.1") == 1
    finally:
        fleet["stand_in"].mode = "ok"
    line = capsys.readouterr().out
    assert "NOT proven (nonce)" in line


@pytest.mark.programs
@needs_tools
def test_a_quote_with_an_older_tpm_clock_is_replayed(fleet: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A quote over the right nonce from a TPM whose clock went back (its state restored from a copy)."""
    store = tmp_path / "store"
    assert _enroll(fleet, store, "127.0.0.1", "--accept-software-tpm") == 0
    assert _check(fleet, store, "127.0.0.1") == 0
    capsys.readouterr()
    signing = release_manifest.load_private_key(fleet["key"])
    db = attest_store.Store(store, {}, signing)
    seen = db.seen("127.0.0.1")
    assert seen is not None
    import dataclasses

    db.write_seen(dataclasses.replace(seen, clock_ms=seen.clock_ms + 10**9))
    assert _check(fleet, store, "127.0.0.1", extra=("--json",)) == 1
    [doc] = json.loads(capsys.readouterr().out)
    assert doc["code"] == "replayed" and "not later than the last proven" in doc["reason"]


@pytest.mark.programs
@needs_tools
def test_one_unreachable_host_is_its_own_verdict(fleet: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    assert _enroll(fleet, store, "127.0.0.1", "--accept-software-tpm") == 0
    record = attest_store.Store(store, {}, release_manifest.load_private_key(fleet["key"])).host("127.0.0.1")
    assert record is not None
    import dataclasses

    signing = attest_store.Store(store, {}, release_manifest.load_private_key(fleet["key"]))
    signing.write_host(dataclasses.replace(record, host="127.0.0.2", ek_fingerprint="ab" * 32))
    capsys.readouterr()
    prom = tmp_path / "attestation.prom"
    assert _check(fleet, store, "127.0.0.1", "127.0.0.2", "not-enrolled.example", extra=("--prometheus", str(prom))) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"127.0.0.1: release {VERSION}, Secure Boot enforcing, proven"
    assert lines[1].startswith("127.0.0.2: release -, Secure Boot unknown, NOT proven (unreachable): cannot reach")
    assert lines[2].startswith("not-enrolled.example: release -, Secure Boot unknown, NOT proven (not-enrolled)")
    text = prom.read_text()
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:  # pragma: no cover
        text_string_to_metric_families = None
    if text_string_to_metric_families is not None:
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        assert samples[("appliance_attestation_proven", (("host", "127.0.0.1"), ("release", VERSION), ("secure_boot", "enforcing")))] == 1
        assert samples[("appliance_attestation_proven", (("host", "127.0.0.2"), ("release", ""), ("secure_boot", "unknown")))] == 0
        assert samples[("appliance_attestation_failed", (("code", "unreachable"), ("host", "127.0.0.2")))] == 1
        assert samples[("appliance_attestation_failed", (("code", "not-enrolled"), ("host", "not-enrolled.example")))] == 1
        stamp = samples[("appliance_attestation_checked_timestamp_seconds", (("host", "127.0.0.2"),))]
        assert abs(stamp - time.time()) < 300


@pytest.mark.programs
@needs_tools
def test_a_release_the_channel_does_not_hold_is_unknown(fleet: dict[str, Any], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    assert _enroll(fleet, store, "127.0.0.1", "--accept-software-tpm") == 0
    channel = make_channel(tmp_path, fleet["key"], {"3.0.0": hashlib.sha256(b"another kernel image").digest()})
    capsys.readouterr()
    template = f"https://{{host}}:{fleet['stand_in'].port}/"
    assert main(["--profile", "demo", "attest", "127.0.0.1", "--store", str(store), "--channel", str(channel),
                 "--signing-key", str(fleet["key"]), "--ca", str(fleet["stand_in"].cert), "--url-template", template,
                 "--secure-boot-cert", str(fleet["tmp"] / "keys" / "secureboot.crt"), "--json"]) == 1
    [doc] = json.loads(capsys.readouterr().out)
    assert doc["code"] == "unknown-release" and doc["proven"] is False


# ----------------------------------------------------------------------------------- release policies and the store


def test_policies_come_from_the_kernel_image_checked_against_its_bundle(tmp_path: Path) -> None:
    key, _ = keys.generate(tmp_path / "keys")
    keys.boot_keys(tmp_path / "keys", make=True)
    pcr11 = hashlib.sha256(b"pcr 11").digest()
    channel = make_channel(tmp_path, key, {VERSION: pcr11})
    private = release_manifest.load_private_key(key)
    public = {release_manifest.key_id(private.public_key()): private.public_key()}
    store = attest_store.Store(tmp_path / "store", public, private)
    from appliance.attest import tpm_wire

    [(version, policies)] = attest.release_policies(channel, public, store)
    assert version == VERSION and tpm_wire.pcr_policy_digest(11, pcr11) in policies and len(policies) == 2
    cached = store.release(VERSION)
    assert cached is not None and cached.uki == f"appliance_{VERSION}.efi" and len(cached.pcrpkey_sha256) == 64
    # a kernel image changed after signing: refused (no cache for it)
    cache = store.path(attest_store.RELEASES, VERSION)
    cache.unlink()
    store.sig_path(cache).unlink()
    uki = channel / VERSION / f"appliance_{VERSION}.efi"
    uki.write_bytes(uki.read_bytes() + b"x")
    with pytest.raises(Exception, match="not the kernel image the signed bundle index names"):
        attest.release_policies(channel, public, store)


def test_a_kernel_image_without_pcrsig_is_refused(tmp_path: Path) -> None:
    key, _ = keys.generate(tmp_path / "keys")
    keys.boot_keys(tmp_path / "keys", make=True)
    channel = make_channel(tmp_path, key, {VERSION: None})
    private = release_manifest.load_private_key(key)
    public = {release_manifest.key_id(private.public_key()): private.public_key()}
    with pytest.raises(Exception, match=r"no \.pcrsig section"):
        attest.release_policies(channel, public, attest_store.Store(tmp_path / "store", public, private))


def test_a_channel_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    key, _ = keys.generate(tmp_path / "keys")
    keys.boot_keys(tmp_path / "keys", make=True)
    channel = make_channel(tmp_path, key, {VERSION: hashlib.sha256(b"x").digest()})
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    stranger = Ed25519PrivateKey.generate()
    public = {release_manifest.key_id(stranger.public_key()): stranger.public_key()}
    with pytest.raises(Exception, match="signature does not match"):
        attest.release_policies(channel, public, attest_store.Store(tmp_path / "store", public, stranger))


def test_a_store_record_changed_outside_is_refused(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from appliance.errors import UserError

    private = Ed25519PrivateKey.generate()
    store = attest_store.Store(tmp_path, {}, private)
    record = attest_store.HostRecord(format=1, host="gpu-07", ek_fingerprint="ab" * 32, ek_public="-----BEGIN PUBLIC KEY-----\n",
                                     ek_certificate="", ek_issuer="", trust="software-tpm", software_tpm=True, ak_public="AA==",
                                     ak_name="000b" + "cd" * 32, enrolled_at="2026-01-01T00:00:00Z", signer=store.signer)
    store.write_host(record)
    assert store.host("gpu-07") == record
    path = store.path(attest_store.HOSTS, "gpu-07")
    path.write_bytes(path.read_bytes().replace(b"ab" * 32, b"ef" * 32))
    with pytest.raises(UserError, match="not signed by a release key"):
        store.host("gpu-07")
    with pytest.raises(UserError, match="not signed by a release key"):
        store.hosts()  # an enrollment refuses to go on over a damaged record
    path.unlink()
    with pytest.raises(UserError, match="missing"):
        store.host("gpu-07")
    with pytest.raises(UserError, match="not a host name"):
        store.host("../etc")


def test_the_clock_never_goes_back() -> None:
    seen = attest_store.SeenRecord(format=1, host="h", ek_fingerprint="ab" * 32, reset_count=3, restart_count=1, clock_ms=5000,
                                   checked_at="2026-01-01T00:00:00Z", signer="0" * 16)
    assert not attest.clock_went_back(None, 0, 0, 0)
    assert not attest.clock_went_back(seen, 3, 1, 5001)
    assert attest.clock_went_back(seen, 3, 1, 5000)  # the same quote again
    assert attest.clock_went_back(seen, 3, 1, 4000)
    assert attest.clock_went_back(seen, 3, 0, 9999)
    assert attest.clock_went_back(seen, 2, 9, 9999)
    assert not attest.clock_went_back(seen, 4, 0, 10)  # a reset: the clock may have lost time
    assert not attest.clock_went_back(seen, 3, 2, 10)


def test_prometheus_text_escapes_labels() -> None:
    result = attest.Result('a"b', False, "nonce", "x", None, "unknown", 1.5)
    text = attest.prometheus_text([result])
    assert 'appliance_attestation_failed{host="a\\"b",code="nonce"} 1' in text


def test_ek_trust_needs_the_ca_s_signature_not_its_name() -> None:
    from types import SimpleNamespace

    from appliance.errors import Refused

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "TPM maker EK CA")])
    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject_key: Any, signer: Any, subject: x509.Name) -> x509.Certificate:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(name).public_key(subject_key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now)
                .not_valid_after(now + datetime.timedelta(days=1)).sign(signer, hashes.SHA256()))

    maker, forger, ek = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    real_ca, forged_ca = certificate(maker, maker, name), certificate(forger, forger, name)
    ek_cert = certificate(ek, maker, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "EK")]))
    identity = SimpleNamespace(
        ek_public=ek.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode(),
        ek_certificate=base64.b64encode(ek_cert.public_bytes(serialization.Encoding.DER)).decode())
    assert attest.ek_trust(identity, [real_ca], accept_software_tpm=False)[0] == "ek-ca"
    with pytest.raises(Refused, match="not signed by a trusted EK CA"):
        attest.ek_trust(identity, [forged_ca], accept_software_tpm=False)
    assert attest.ek_trust(identity, [forged_ca], accept_software_tpm=True)[0] == "software-tpm"


def test_the_policy_keys_fingerprint_is_the_one_systemd_measure_writes() -> None:
    """pkfp in a real .pcrsig (recorded from systemd-measure sign, tests/fixtures/attest/) is the
    SHA-256 of the key's PKCS#1 form, not of its SubjectPublicKeyInfo: a kernel image built by mkosi
    must read as its own key's."""
    fixtures = Path(__file__).resolve().parent / "fixtures" / "attest"
    recorded = json.loads((fixtures / "pcrsig.json").read_text())
    key = serialization.load_pem_public_key((fixtures / "pcr-public.pem").read_bytes())
    assert {e["pkfp"] for e in recorded["sha256"]} == {attest.pcr_key_fingerprint(key)}
