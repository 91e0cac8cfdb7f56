# SPDX-License-Identifier: MIT
"""Records the attestation fixtures (tests/fixtures/attest/) from a software TPM, as a device would
make them: `python3 -m testkit.attest_record OUT`.

For each Secure Boot state (enforcing, off), a fresh swtpm (testkit/swtpm.py) gets:
- the firmware's PCR 0-7 events as OVMF logs them (crypto-agile TCG log, the banks the TPM has
  active): the SecureBoot variable, PK, KEK, db (the fleet's certificate and a third-party CA),
  dbx, the boot variables, the separators, and with Secure Boot on the db certificate that allowed
  the boot loader (EV_EFI_VARIABLE_AUTHORITY); each event's digest extended with tpm2_pcrextend;
- PCR 11 extended as systemd-stub and systemd-pcrphase extend it for a small UKI (each section's
  name and contents, then the boot phases up to "ready"), checked against `systemd-measure
  calculate`;
- an AK made under the EK (tpm2_createak, persisted at 0x81010002), and a quote of sha256:7,11 over
  a random nonce (for enforcing also of 7 alone and of 7,11,14).
The UKI's signed PCR 11 policies (`systemd-measure sign`, what a UKI's .pcrsig holds) go to
OUT/pcrsig.json. Nothing is signed with a key that is kept: the PCR key's private half is thrown away.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from appliance.attest import event_log
from appliance.attest.evidence import FORMAT, PCRS, Evidence, Identity, Pcr, dump
from testkit.swtpm import EK_HANDLE, running_swtpm

AK_HANDLE = "0x81010002"
EK_CERT_NV = "0x01c00002"
SYSTEMD_MEASURE = "/usr/lib/systemd/systemd-measure"
PHASES = ("enter-initrd", "leave-initrd", "sysinit", "ready")
UKI_SECTIONS = ((".linux", "linux"), (".osrel", "osrel"), (".cmdline", "cmdline"))
UKI_FILES = {"linux": b"MZ a stand-in kernel image\n", "osrel": b"ID=appliance\nVERSION_ID=1.0\n",
             "cmdline": b"console=ttyS0 quiet\n"}

ALG_IDS = {"sha1": 0x0004, "sha256": 0x000B, "sha384": 0x000C, "sha512": 0x000D}
GLOBAL = uuid.UUID("8be4df61-93ca-11d2-aa0d-00e098032b8c")
IMAGE_SECURITY = uuid.UUID("d719b2cb-3d3a-4596-a3bc-dad00e67656f")
CERT_X509 = uuid.UUID("a5c059a1-94e4-4aa7-87b5-ab155c2bf072")
CERT_SHA256 = uuid.UUID("c1c41626-504c-4092-aca9-41f936934328")
APPLIANCE_OWNER = uuid.UUID("6c8a31a4-7c5e-4bd6-9c1a-5d0c3b1f0a77")  # builder/secureboot.py's owner
THIRD_PARTY_OWNER = uuid.UUID("77fa9abd-0359-4d32-bd60-28f4e78f784b")


# ----------------------------------------------------------------------------------- the firmware's log


def digest(alg: str, data: bytes) -> bytes:
    return hashlib.new(alg, data).digest()


def spec_id_event(banks: Sequence[str]) -> bytes:
    """The log's first event (SHA1 format): EV_NO_ACTION in PCR 0 with the Spec ID event."""
    table = b"".join(struct.pack("<HH", ALG_IDS[b], hashlib.new(b).digest_size) for b in banks)
    spec = struct.pack("<16sIBBBBI", b"Spec ID Event03\0", 0, 0, 2, 0, 2, len(banks)) + table + b"\0"
    return struct.pack("<II20sI", 0, event_log.EV_NO_ACTION, bytes(20), len(spec)) + spec


def event2(pcr: int, kind: int, data: bytes, digests: dict[str, bytes]) -> bytes:
    """A TCG_PCR_EVENT2 with DIGESTS (bank -> digest), in their order."""
    body = b"".join(struct.pack("<H", ALG_IDS[b]) + d for b, d in digests.items())
    return struct.pack("<III", pcr, kind, len(digests)) + body + struct.pack("<I", len(data)) + data


def variable_data(guid: uuid.UUID, name: str, data: bytes) -> bytes:
    """A UEFI_VARIABLE_DATA."""
    return struct.pack("<16sQQ", guid.bytes_le, len(name), len(data)) + name.encode("utf-16-le") + data


def signature_list(kind: uuid.UUID, entries: Sequence[tuple[uuid.UUID, bytes]]) -> bytes:
    """EFI_SIGNATURE_LISTs of ENTRIES (owner, data): one list per certificate (their sizes differ),
    one list for hashes of one kind."""
    if kind == CERT_X509 and len(entries) > 1:
        return b"".join(signature_list(kind, [e]) for e in entries)
    size = 16 + len(entries[0][1])
    return (struct.pack("<16sIII", kind.bytes_le, 28 + size * len(entries), 0, size)
            + b"".join(owner.bytes_le + data for owner, data in entries))


@dataclass(frozen=True)
class LogEvent:
    pcr: int
    kind: int
    data: bytes
    measured: bytes  # what the digest is over (the data itself for most events)


def firmware_events(*, secure_boot: bool, db_cert: bytes, third_party: bytes) -> list[LogEvent]:
    """PCR 0-7 as OVMF measures a boot of systemd-boot then a UKI (data of PCR 0-6 abridged)."""
    events: list[LogEvent] = []

    def add(pcr: int, kind: int, data: bytes, measured: bytes | None = None) -> None:
        events.append(LogEvent(pcr, kind, data, data if measured is None else measured))

    add(0, event_log.EV_S_CRTM_VERSION, "1.00\0".encode("utf-16-le"))
    add(0, event_log.EV_EFI_PLATFORM_FIRMWARE_BLOB, struct.pack("<QQ", 0xFFC84000, 0x348000), b"the firmware volume")
    own = [(APPLIANCE_OWNER, db_cert)]
    variables = (
        (GLOBAL, "SecureBoot", b"\x01" if secure_boot else b"\x00"),
        (GLOBAL, "PK", signature_list(CERT_X509, own)),
        (GLOBAL, "KEK", signature_list(CERT_X509, own)),
        (IMAGE_SECURITY, "db", signature_list(CERT_X509, [*own, (THIRD_PARTY_OWNER, third_party)])),
        (IMAGE_SECURITY, "dbx", signature_list(CERT_SHA256, [(THIRD_PARTY_OWNER, digest("sha256", b"a revoked image"))])),
    )
    for guid, name, value in variables:
        add(7, event_log.EV_EFI_VARIABLE_DRIVER_CONFIG, variable_data(guid, name, value))
    boot0001 = struct.pack("<IH", 1, 0) + "appliance\0".encode("utf-16-le")
    add(1, event_log.EV_EFI_VARIABLE_BOOT, variable_data(GLOBAL, "BootOrder", struct.pack("<H", 1)))
    add(1, event_log.EV_EFI_VARIABLE_BOOT, variable_data(GLOBAL, "Boot0001", boot0001))
    add(4, event_log.EV_EFI_ACTION, b"Calling EFI Application from Boot Option")
    for pcr in range(8):
        add(pcr, event_log.EV_SEPARATOR, bytes(4))
    if secure_boot:  # the db certificate that allowed systemd-boot: an EFI_SIGNATURE_DATA
        add(7, event_log.EV_EFI_VARIABLE_AUTHORITY, variable_data(IMAGE_SECURITY, "db", APPLIANCE_OWNER.bytes_le + db_cert))
    image_load = struct.pack("<QQQQ", 0x7E000000, 0x20000, 0, 0)  # UEFI_IMAGE_LOAD_EVENT without a device path
    add(4, event_log.EV_EFI_BOOT_SERVICES_APPLICATION, image_load, b"systemd-boot's Authenticode digest")
    add(4, event_log.EV_EFI_BOOT_SERVICES_APPLICATION, image_load, b"the UKI's Authenticode digest")
    add(5, event_log.EV_EFI_ACTION, b"Exit Boot Services Invocation")
    add(5, event_log.EV_EFI_ACTION, b"Exit Boot Services Returned with Success")
    return events


def write_log(events: Sequence[LogEvent], banks: Sequence[str]) -> bytes:
    return spec_id_event(banks) + b"".join(
        event2(e.pcr, e.kind, e.data, {b: digest(b, e.measured) for b in banks}) for e in events)


def uki_measurements(files: dict[str, bytes], phases: Sequence[str] = PHASES) -> list[bytes]:
    """What systemd-stub (each UKI section: its name with its NUL, then its contents) and
    systemd-pcrphase (each phase's word) measure into PCR 11, as data to hash."""
    data = []
    for section, key in UKI_SECTIONS:
        data += [section.encode() + b"\0", files[key]]
    return data + [p.encode() for p in phases]


# ----------------------------------------------------------------------------------- certificates


def certificate(common_name: str) -> bytes:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.DER)


def pem(der: bytes) -> bytes:
    return x509.load_der_x509_certificate(der).public_bytes(serialization.Encoding.PEM)


# ----------------------------------------------------------------------------------- the TPM


class Tpm:
    def __init__(self, tcti: str, work: Path) -> None:
        self.env = dict(os.environ, TPM2TOOLS_TCTI=tcti)
        self.tcti = tcti
        self.work = work

    def run(self, *argv: str) -> str:
        done = subprocess.run(argv, env=self.env, cwd=self.work, capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()[-400:]}")
        if argv[0].startswith("tpm2_"):  # no resource manager in front of swtpm
            subprocess.run(["tpm2_flushcontext", "-t"], env=self.env, capture_output=True, timeout=60, check=True)
            subprocess.run(["tpm2_flushcontext", "-s"], env=self.env, capture_output=True, timeout=60, check=True)
        return done.stdout

    def banks(self) -> list[str]:
        """The PCR banks with PCRs allocated, in tpm2_getcap's order."""
        out = self.run("tpm2_getcap", "pcrs")
        return [m.group(1) for m in re.finditer(r"^\s*- (sha1|sha256|sha384|sha512): \[ *(\d)", out, re.M)]

    def extend(self, pcr: int, data: bytes, banks: Sequence[str]) -> None:
        self.run("tpm2_pcrextend", f"{pcr}:" + ",".join(f"{b}={digest(b, data).hex()}" for b in banks))

    def identity(self) -> tuple[Identity, bytes]:
        """The EK (persisted by swtpm_setup) and a new AK made under it and persisted; with ak.pub."""
        self.run("tpm2_readpublic", "-c", EK_HANDLE, "-o", "ek.pem", "-f", "pem")
        self.run("tpm2_nvread", "-C", "o", EK_CERT_NV, "-o", "ek.der")
        self.run("tpm2_createak", "-C", EK_HANDLE, "-c", "ak.ctx", "-G", "ecc", "-g", "sha256", "-s", "ecdsa",
                 "-u", "ak.pub", "-n", "ak.name")
        self.run("tpm2_evictcontrol", "-c", "ak.ctx", AK_HANDLE)
        ak_pub = (self.work / "ak.pub").read_bytes()
        return Identity(format=FORMAT, ek_public=(self.work / "ek.pem").read_text(),
                        ek_certificate=base64.b64encode((self.work / "ek.der").read_bytes()).decode(),
                        ak_public=base64.b64encode(ak_pub).decode(),
                        ak_name=(self.work / "ak.name").read_bytes().hex()), ak_pub

    def quote(self, pcrs: Sequence[int], nonce: bytes, log: bytes, stem: str) -> tuple[Evidence, str]:
        """A quote of sha256:PCRS over NONCE as Evidence (with LOG), and tpm2_quote's report."""
        report = self.run("tpm2_quote", "-c", AK_HANDLE, "-l", "sha256:" + ",".join(map(str, pcrs)), "-q", nonce.hex(),
                          "-m", f"{stem}.msg", "-s", f"{stem}.sig", "-o", f"{stem}.pcrs", "-g", "sha256")
        values = {int(m.group(1)): m.group(2).lower() for m in re.finditer(r"^\s+(\d+)\s*:\s*0x([0-9A-Fa-f]{64})$", report, re.M)}
        assert sorted(values) == sorted(pcrs), report
        return Evidence(format=FORMAT, nonce=nonce.hex(), pcrs=tuple(Pcr(i, values[i]) for i in sorted(values)),
                        quote=base64.b64encode((self.work / f"{stem}.msg").read_bytes()).decode(),
                        signature=base64.b64encode((self.work / f"{stem}.sig").read_bytes()).decode(),
                        ak_name=(self.work / "ak.name").read_bytes().hex(),
                        event_log=base64.b64encode(log).decode()), report


def _json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def uki_files(out: Path) -> dict[str, bytes]:
    (out / "uki").mkdir(parents=True, exist_ok=True)
    for name, data in UKI_FILES.items():
        (out / "uki" / name).write_bytes(data)
    return dict(UKI_FILES)


def measure(argv: Sequence[str], uki: Path, tcti: str | None = None) -> str:
    """systemd-measure with the UKI's sections from UKI (and the TPM at TCTI for `sign`)."""
    extra = [f"--tpm2-device={tcti}"] if tcti else []
    sections = [f"--{key}={uki / key}" for _, key in UKI_SECTIONS]
    done = subprocess.run([SYSTEMD_MEASURE, *argv, *sections, "--bank=sha256", *extra],
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise RuntimeError(f"systemd-measure {argv[0]}: exit {done.returncode}: {done.stderr.strip()[-400:]}")
    return done.stdout


def record_variant(out: Path, work: Path, *, secure_boot: bool, db_cert: bytes, third_party: bytes,
                   uki: dict[str, bytes], calculate: str, extra_quotes: bool, sign: Path | None = None) -> None:
    """One swtpm, one boot's measurements, one identity and its quotes, into OUT."""
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    with running_swtpm(work) as tcti:
        tpm = Tpm(tcti, work)
        banks = tpm.banks()
        events = firmware_events(secure_boot=secure_boot, db_cert=db_cert, third_party=third_party)
        log = write_log(events, banks)
        for e in events:
            tpm.extend(e.pcr, e.measured, banks)
        for data in uki_measurements(uki):
            tpm.extend(11, data, banks)
        identity, ak_pub = tpm.identity()
        if sign is not None:  # the release's signed PCR 11 policies; the TPM only computes them
            key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            private = work / "pcr-private.pem"
            private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
            public = out.parent / "pcr-public.pem"
            public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                             serialization.PublicFormat.SubjectPublicKeyInfo))
            signed = measure(["sign", f"--private-key={private}", f"--public-key={public}"], sign, tcti)
            private.unlink()
            _json(out.parent / "pcrsig.json", json.loads(signed))
        (out / "ak.pub").write_bytes(ak_pub)
        (out / "event_log.bin").write_bytes(log)
        _json(out / "identity.json", dump(identity))
        quotes: list[tuple[tuple[int, ...], str, str]] = [(PCRS, "quote", "evidence.json")]
        if extra_quotes:
            quotes += [((7,), "quote-pcr7", "evidence-pcr7.json"), ((7, 11, 14), "quote-pcr7-11-14", "evidence-pcr7-11-14.json")]
        expected_pcr11 = calculate.strip().splitlines()[-1].rpartition("=")[2]
        for pcrs, stem, name in quotes:
            evidence, report = tpm.quote(pcrs, os.urandom(32), log, stem)
            for suffix in ("msg", "sig"):
                (out / f"{stem}.{suffix}").write_bytes((work / f"{stem}.{suffix}").read_bytes())
            (out / f"{stem}.yaml").write_text(report)
            pcr11 = [p.sha256 for p in evidence.pcrs if p.index == 11]
            if pcr11 and pcr11 != [expected_pcr11]:
                raise RuntimeError(f"PCR 11 is {pcr11[0]}, systemd-measure calculate says {expected_pcr11}")
            _json(out / name, dump(evidence))


def record(out: Path) -> None:
    """Every fixture into OUT (tests/fixtures/attest/ keeps them)."""
    out.mkdir(parents=True, exist_ok=True)
    db_cert = certificate("Appliance Secure Boot")
    third_party = certificate("Example Third-Party UEFI CA")
    (out / "db.pem").write_bytes(pem(db_cert))
    (out / "third-party.pem").write_bytes(pem(third_party))
    uki = uki_files(out)
    calculate = measure(["calculate"], out / "uki")
    (out / "calculate.txt").write_text(calculate)
    with tempfile.TemporaryDirectory(prefix="attest-record-") as tmp:
        for name, on in (("enforcing", True), ("off", False)):
            record_variant(out / name, Path(tmp) / name, secure_boot=on, db_cert=db_cert, third_party=third_party,
                           uki=uki, calculate=calculate, extra_quotes=on, sign=out / "uki" if on else None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m testkit.attest_record", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the directory to write (tests/fixtures/attest)")
    args = parser.parse_args(argv)
    record(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
