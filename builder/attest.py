# SPDX-License-Identifier: MIT
"""`python3 -m builder attest`: the fleet's verifier on the build host (docs/fleet.md, "Proving
what each appliance booted").

`attest enroll HOST --url URL`: the appliance's TPM identity read from its metrics site (EK, its
certificate, the AK), the EK certificate checked against the fleet's EK CAs, the AK proven to live
in the same TPM as the EK (MakeCredential here with tpm2_makecredential, ActivateCredential on the
device), and only then the host recorded in the verifier store, bound to that EK for good.

`attest HOST...`: each host quotes PCRs 7 and 11 over a fresh nonce; the quote is checked
(appliance/attest/verify.py) against the enrolled AK, the PCR 11 policies of the releases of the
signed channel index (read from each release's kernel image, once) and the fleet's Secure Boot
certificates; then the TPM's clock against the last quote proven for that host.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import concurrent.futures
import hashlib
import hmac
import json
import os
import re
import secrets
import struct
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from appliance import cli_help, rollout, schema
from appliance.atomic import atomic_write
from appliance.errors import Refused, UserError
from appliance.run import checked
from appliance.safe_read import loads_bounded, read_capped
from appliance.signed import bundle_index, release_manifest, timestamp
from builder import attest_store
from builder.attest_store import HostRecord, ReleaseRecord, SeenRecord, Store

ENROLL = "enroll"
SECRET_BYTES = 32
NONCE_BYTES = 32
MAX_ANSWER_BYTES = 4 << 20  # an evidence document: a 1 MiB event log in base64 and the quote
MAX_UKI_SECTIONS = 96
MAX_PCRSIG_BYTES = 1 << 20
MAX_PCRPKEY_BYTES = 16 << 10
MAX_POLICIES = 4096
DEFAULT_TEMPLATE = "https://{host}:9443/"
DEFAULT_PARALLEL = 8
TIMEOUT_S = 30.0
STORE_HINT = "enroll it first: python3 -m builder attest enroll HOST --url https://HOST:9443/ --store DIR"
MAKECREDENTIAL_HINT = "install tpm2-tools (make setup) on the build host"


class Unreachable(Exception):
    """The appliance could not be asked: no connection, TLS, a timeout, or an error answer."""


# ----------------------------------------------------------------------------------- the device's site


@dataclass(frozen=True)
class Site:
    """How to reach an appliance's metrics site: its base URL and TLS (as a scraper's)."""

    url: str
    ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    timeout: float = TIMEOUT_S

    def _session(self) -> Any:
        import requests

        session = requests.Session()
        session.trust_env = False  # no proxy from the environment between the verifier and the TPM
        session.verify = self.ca if self.ca else True
        if self.client_cert:
            session.cert = (self.client_cert, self.client_key) if self.client_key else self.client_cert
        return session

    def ask(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """GET (BODY None) or POST BODY as JSON to PATH; the parsed answer. Unreachable on any
        network or TLS failure and on an error answer (its message, shortened); never the body."""
        import requests

        url = self.url.rstrip("/") + path
        try:
            with self._session() as session:
                if body is None:
                    response = session.get(url, timeout=self.timeout, stream=True, allow_redirects=False)
                else:
                    response = session.post(url, json=dict(body), timeout=self.timeout, stream=True, allow_redirects=False)
                with response:
                    data = _read_bounded(response)
                    status = response.status_code
        except requests.exceptions.SSLError as e:
            raise Unreachable(f"TLS to {self.url} failed ({_short(e)})") from None
        except requests.exceptions.Timeout:
            raise Unreachable(f"{url} did not answer within {self.timeout:g} s") from None
        except (requests.exceptions.RequestException, OSError) as e:
            raise Unreachable(f"cannot reach {url} ({_short(e)})") from None
        try:
            doc = loads_bounded(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            doc = None
        if status != 200:
            message = ""
            if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
                message = str(doc["error"].get("message", ""))
            raise Unreachable(f"{url} answered {status}" + (f": {_printable(message)}" if message else ""))
        if doc is None:
            raise Unreachable(f"{url} answered with something else than JSON")
        return doc


def _read_bounded(response: Any) -> bytes:
    chunks, have = [], 0
    for chunk in response.iter_content(65536):
        have += len(chunk)
        if have > MAX_ANSWER_BYTES:
            raise Unreachable(f"the answer is larger than {MAX_ANSWER_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _printable(text: str, limit: int = 160) -> str:
    text = re.sub(r"[\x00-\x1f\x7f-\x9f]", " ", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(error: BaseException) -> str:
    """An exception's text in one short printable line: the reason at the end of urllib3's chain."""
    text = str(error)
    m = re.search(r"\(Caused by [A-Za-z]+\((.*)\)\)\s*\Z", text)
    return _printable(m.group(1) if m else text, 200)


# ----------------------------------------------------------------------------------- enrollment


def _attest_modules() -> tuple[Any, Any, Any]:
    from appliance.attest import evidence, tpm_wire, verify

    return evidence, tpm_wire, verify


def ek_fingerprint(ek_public_pem: str) -> tuple[str, bytes]:
    """(SHA-256 hex of the EK's DER SubjectPublicKeyInfo, that DER); Refused when not a PEM key."""
    try:
        key = serialization.load_pem_public_key(ek_public_pem.encode())
    except (ValueError, TypeError, UnicodeEncodeError):
        raise Refused("the identity's ek_public is not a PEM public key",
                      hint="the appliance answered something else than its EK") from None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest(), der


def load_cas(paths: Sequence[Path]) -> list[x509.Certificate]:
    """The EK CAs in the PEM files PATHS (each may hold several certificates)."""
    out: list[x509.Certificate] = []
    for path in paths:
        data = read_capped(path, 1 << 20, what="an EK CA certificate file")
        if data is None:
            raise UserError(f"--ek-ca {path}: no such file", hint="give the PEM of the TPM maker's EK CA")
        try:
            out.extend(pem_certificates(data))
        except ValueError:
            raise UserError(f"--ek-ca {path}: not PEM certificates", hint="give the PEM of the TPM maker's EK CA") from None
    return out


_PEM_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n[A-Za-z0-9+/=\r\n]+-----END CERTIFICATE-----")


def pem_certificates(data: bytes) -> list[x509.Certificate]:
    """Every certificate of a PEM bundle; ValueError when it holds none or one does not load."""
    blocks = _PEM_BLOCK.findall(data)
    if not blocks:
        raise ValueError("no PEM certificate")
    return [x509.load_pem_x509_certificate(block) for block in blocks]


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """Whether CA's key made CERT's signature (PKCS#1 v1.5 RSA, ECDSA or Ed25519)."""
    key = ca.public_key()
    try:
        algorithm = cert.signature_hash_algorithm
        if isinstance(key, rsa.RSAPublicKey) and algorithm is not None:
            key.verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), algorithm)
        elif isinstance(key, ec.EllipticCurvePublicKey) and algorithm is not None:
            key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(algorithm))
        elif isinstance(key, Ed25519PublicKey):
            key.verify(cert.signature, cert.tbs_certificate_bytes)
        else:
            return False
    except (InvalidSignature, UnsupportedAlgorithm, ValueError, TypeError):
        return False
    return True


def ek_trust(identity: Any, cas: Sequence[x509.Certificate], accept_software_tpm: bool) -> tuple[str, str]:
    """(trust, issuer) of the identity's EK: "ek-ca" when a trusted EK CA signed its certificate,
    "software-tpm" when not but ACCEPT_SOFTWARE_TPM; Refused otherwise, and whenever the
    certificate's public key is not the EK's."""
    _, ek_der = ek_fingerprint(identity.ek_public)
    hint = ("give the TPM maker's EK CA with --ek-ca PEM (or in the plan's [attestation] ek_ca); "
            "a software TPM (tests, a VM) only with --accept-software-tpm")
    if not identity.ek_certificate:
        if accept_software_tpm:
            return "software-tpm", ""
        raise Refused("the TPM has no EK certificate: nothing vouches that its EK is a TPM's", hint=hint)
    try:
        cert = x509.load_der_x509_certificate(base64.b64decode(identity.ek_certificate, validate=True))
    except (ValueError, binascii.Error):
        raise Refused("the EK certificate is not a DER X.509 certificate", hint="the appliance's TPM answered something else") from None
    cert_der = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if not hmac.compare_digest(cert_der, ek_der):
        raise Refused("the EK certificate is for another key than the EK the appliance showed",
                      hint="the identity does not come from one TPM: do not enroll this host")
    issuer = _printable(cert.issuer.rfc4514_string(), 200)
    for ca in cas:
        if ca.subject != cert.issuer:
            continue
        if issued_by(cert, ca):
            return "ek-ca", issuer
    if accept_software_tpm:
        return "software-tpm", issuer
    raise Refused(f"the EK certificate (issuer {issuer}) is not signed by a trusted EK CA", hint=hint)


def _ak_checks(identity: Any, tpm_wire: Any) -> None:
    """The AK's name recomputed from its public area equals the identity's ak_name, and the AK is
    a restricted signing key (it signs only what the TPM made: quotes, not chosen data)."""
    try:
        raw = base64.b64decode(identity.ak_public, validate=True)
    except (ValueError, binascii.Error):
        raise Refused("the identity's ak_public is not base64", hint="the appliance answered something else") from None
    ak = tpm_wire.parse_public(raw)
    name = ak.name.hex() if isinstance(ak.name, bytes | bytearray) else str(ak.name)
    if not hmac.compare_digest(name.lower(), identity.ak_name.lower()):
        raise Refused("the AK's name is not the name of its public area", hint="the identity is inconsistent: do not enroll this host")
    restricted = ak.restricted_signing_key
    if not (restricted() if callable(restricted) else restricted):
        raise Refused("the AK is not a restricted signing key", hint="the appliance's AK could sign anything: make it again on the device")


def make_credential(ek_public_pem: str, ak_name: str, secret: bytes) -> bytes:
    """tpm2_makecredential (software, no TPM here): SECRET wrapped for the TPM that holds the EK and
    a loaded object named AK_NAME. The secret sits in a 0600 file only while the tool runs."""
    if not re.fullmatch(r"([0-9a-f]{2}){2,66}", ak_name):
        raise Refused(f"ak_name {schema.shown(ak_name, 40)}: not hex", hint="the appliance answered something else")
    with tempfile.TemporaryDirectory(prefix="appliance-attest-") as tmp:
        work = Path(tmp)
        ek, secret_file, out = work / "ek.pem", work / "secret", work / "credential"
        ek.write_text(ek_public_pem)
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
        checked(["tpm2_makecredential", "-T", "none", "-u", ek, "-G", "rsa", "-n", ak_name, "-s", secret_file, "-o", out],
                what="tpm2_makecredential", hint="the EK is not an RSA key tpm2-tools reads, or tpm2-tools is too old",
                missing_hint=MAKECREDENTIAL_HINT)
        data = read_capped(out, 1 << 16, what="a credential")
        if not data:
            raise UserError("tpm2_makecredential wrote no credential", hint=MAKECREDENTIAL_HINT)
        return data


def enroll(host: str, site: Site, store: Store, *, cas: Sequence[x509.Certificate], accept_software_tpm: bool,
           replace: Sequence[str] = (), now: float | None = None) -> HostRecord:
    """Prove HOST's AK and record it; every check passes before the store is written."""
    evidence, tpm_wire, _ = _attest_modules()
    attest_store.check_host(host)
    for name in replace:
        attest_store.check_host(name)
    try:
        identity = evidence.load_identity(site.ask("/attest/identity"))
    except Unreachable as e:
        raise UserError(f"{host}: {e}", hint="check --url, the appliance's metrics allowlist and --ca/--client-cert") from None
    fingerprint, _ = ek_fingerprint(identity.ek_public)
    _conflicts(host, fingerprint, store, replace)
    trust, issuer = ek_trust(identity, cas, accept_software_tpm)
    _ak_checks(identity, tpm_wire)
    secret = secrets.token_bytes(SECRET_BYTES)
    credential = make_credential(identity.ek_public, identity.ak_name.lower(), secret)
    try:
        answer = site.ask("/attest/activate", {"credential": base64.b64encode(credential).decode()})
    except Unreachable as e:
        raise Refused(f"{host}: the credential was not activated: {e}", hint="the AK is not in the TPM that holds the EK") from None
    got = answer.get("secret") if isinstance(answer, dict) and set(answer) == {"secret"} else None
    try:
        returned = base64.b64decode(got, validate=True) if isinstance(got, str) else b""
    except (ValueError, binascii.Error):
        returned = b""
    if not hmac.compare_digest(returned, secret):
        raise Refused(f"{host}: the activated credential's secret is not the one sent",
                      hint="the AK does not live in the TPM that holds the EK: do not enroll this host")
    record = HostRecord(format=attest_store.FORMAT, host=host, ek_fingerprint=fingerprint, ek_public=identity.ek_public,
                        ek_certificate=identity.ek_certificate, ek_issuer=issuer, trust=trust,
                        software_tpm=trust == "software-tpm", ak_public=identity.ak_public, ak_name=identity.ak_name.lower(),
                        enrolled_at=timestamp.utc(time.time() if now is None else now), signer=store.signer)
    _conflicts(host, fingerprint, store, replace)  # again: another run may have enrolled meanwhile
    for name in replace:
        if name != host:
            store.remove_host(name)
    previous = store.host(host)
    store.write_host(record)
    if previous is None or previous.ek_fingerprint != fingerprint or host in replace:
        store.forget_seen(host)
    return record


def _conflicts(host: str, fingerprint: str, store: Store, replace: Sequence[str]) -> None:
    """One host, one EK for good (keylime/keylime#1820): HOST enrolled with another EK, or this EK
    enrolled under another host, is refused unless that record is named by --replace."""
    for record in store.hosts():
        if record.host in replace:
            continue
        if record.host == host and record.ek_fingerprint != fingerprint:
            raise UserError(f"{host} is enrolled with another EK ({record.ek_fingerprint[:16]}...) than its TPM shows now "
                            f"({fingerprint[:16]}...)",
                            hint=f"a new TPM or a swapped board: if you know why, enroll again with --replace {host}")
        if record.host != host and record.ek_fingerprint == fingerprint:
            raise UserError(f"this TPM's EK ({fingerprint[:16]}...) is enrolled under {record.host}",
                            hint=f"one TPM is one host: if {record.host} was renamed {host}, enroll with --replace {record.host}")


# ----------------------------------------------------------------------------------- release policies


def pe_sections(path: Path, wanted: Sequence[str]) -> dict[str, list[bytes]]:
    """Every section of the PE file PATH named in WANTED (a kernel image with boot menu profiles
    repeats its sections per profile), bounded; ValueError (one line) when PATH is no PE file."""
    limits = {".pcrsig": MAX_PCRSIG_BYTES, ".pcrpkey": MAX_PCRPKEY_BYTES}
    out: dict[str, list[bytes]] = {name: [] for name in wanted}
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(64)
        if len(head) < 64 or head[:2] != b"MZ":
            raise ValueError("not a PE file")
        pe = struct.unpack_from("<I", head, 0x3C)[0]
        f.seek(pe)
        coff = f.read(24)
        if len(coff) < 24 or coff[:4] != b"PE\0\0":
            raise ValueError("not a PE file")
        count, opt_size = struct.unpack_from("<H", coff, 6)[0], struct.unpack_from("<H", coff, 20)[0]
        if count > MAX_UKI_SECTIONS:
            raise ValueError(f"{count} sections, more than {MAX_UKI_SECTIONS}")
        f.seek(pe + 24 + opt_size)
        table = f.read(40 * count)
        if len(table) < 40 * count:
            raise ValueError("its section table is cut short")
        for i in range(count):
            raw = table[40 * i : 40 * (i + 1)]
            name = raw[:8].rstrip(b"\0").decode("ascii", "replace")
            if name not in out:
                continue
            vsize, _, rsize, rptr = struct.unpack_from("<IIII", raw, 8)
            length = min(vsize, rsize) if vsize else rsize
            if length > limits.get(name, 1 << 16) or rptr + length > size:
                raise ValueError(f"its {name} section is larger than allowed or past the file's end")
            f.seek(rptr)
            out[name].append(f.read(length))
    return out


def pcr_key_fingerprint(key: Any) -> str:
    """A PCR policy key's fingerprint as systemd-measure writes it in each .pcrsig entry (`pkfp`):
    the SHA-256 of OpenSSL's i2d_PublicKey form, PKCS#1 for RSA, the uncompressed point for EC
    (not of the SubjectPublicKeyInfo)."""
    if isinstance(key, rsa.RSAPublicKey):
        data = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.PKCS1)
    elif isinstance(key, ec.EllipticCurvePublicKey):
        data = key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    else:
        raise TypeError("a PCR policy key is RSA or EC")
    return hashlib.sha256(data).hexdigest()


def policies_from_uki(path: Path) -> tuple[frozenset[str], str]:
    """(the sha256 bank's PCR 11 `pol` values of every .pcrsig section, SHA-256 of .pcrpkey or "")."""
    try:
        sections = pe_sections(path, (".pcrsig", ".pcrpkey"))
    except (OSError, ValueError, struct.error) as e:
        raise UserError(f"{path.name}: not a unified kernel image ({e})", hint="the bundle is damaged: release it again") from None
    if not sections[".pcrsig"]:
        raise UserError(f"{path.name}: the kernel image has no .pcrsig section (no signed PCR 11 policy)",
                        hint="build the release with the PCR policy key (builder/secureboot.py signs it)")
    pcrpkey = sections[".pcrpkey"][0] if sections[".pcrpkey"] else b""
    pcrpkey_fp = ""
    if pcrpkey:
        try:
            pcrpkey_fp = pcr_key_fingerprint(serialization.load_pem_public_key(pcrpkey.rstrip(b"\0")))
        except (ValueError, TypeError):
            raise UserError(f"{path.name}: its .pcrpkey is not a PEM public key", hint="the bundle is damaged: release it again") from None
    out: set[str] = set()
    for data in sections[".pcrsig"]:
        try:
            doc = loads_bounded(data.rstrip(b"\0").decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise UserError(f"{path.name}: its .pcrsig is not JSON", hint="the bundle is damaged: release it again") from None
        entries = doc.get("sha256") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise UserError(f"{path.name}: its .pcrsig has no sha256 bank", hint="the bundle is damaged: release it again")
        for entry in entries:
            pol = entry.get("pol") if isinstance(entry, dict) else None
            pcrs = entry.get("pcrs") if isinstance(entry, dict) else None
            pkfp = entry.get("pkfp") if isinstance(entry, dict) else None
            if not isinstance(pol, str) or not re.fullmatch(r"[0-9a-f]{64}", pol) or pcrs != [11]:
                raise UserError(f"{path.name}: a .pcrsig entry is not a PCR 11 policy of the sha256 bank",
                                hint="the bundle is damaged: release it again")
            if pcrpkey_fp and isinstance(pkfp, str) and pkfp.lower() != pcrpkey_fp:
                raise UserError(f"{path.name}: a .pcrsig entry names another key than its .pcrpkey",
                                hint="the bundle is damaged: release it again")
            out.add(pol)
    if len(out) > MAX_POLICIES:
        raise UserError(f"{path.name}: more than {MAX_POLICIES} PCR 11 policies", hint="the bundle is damaged")
    return frozenset(out), pcrpkey_fp


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def release_policies(channel_dir: Path, keys: Mapping[str, Ed25519PublicKey], store: Store) -> list[tuple[str, frozenset[bytes]]]:
    """(version, PCR 11 policies) of each release of the signed channel index in CHANNEL_DIR: the
    index and each bundle index verified against KEYS, each kernel image's SHA-256 checked against
    its bundle index before its .pcrsig is read; cached in the store by that SHA-256."""
    hint = "point --channel at the update server's directory of the channel (channel.json beside the bundles)"
    data = read_capped(channel_dir / rollout.CHANNEL, rollout.MAX_CHANNEL_BYTES, what="a channel index")
    sig = read_capped(channel_dir / rollout.CHANNEL_SIG, bundle_index.MAX_SIG_BYTES, what="a channel index's signature")
    if data is None or sig is None:
        raise UserError(f"{channel_dir}: no signed channel index ({rollout.CHANNEL} and {rollout.CHANNEL_SIG})", hint=hint)
    channel = rollout.verify(data, sig, dict(keys))
    out = []
    with tempfile.TemporaryDirectory(prefix="appliance-keys-") as tmp:
        keys_dir = Path(tmp)
        for kid, key in keys.items():
            (keys_dir / f"{kid}.pub").write_bytes(key.public_bytes(serialization.Encoding.PEM,
                                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
        for release in channel.releases:
            out.append((release.version, _release(channel_dir / release.path, release.version, keys_dir, store)))
    return out


def _release(bundle: Path, version: str, keys_dir: Path, store: Store) -> frozenset[bytes]:
    data = read_capped(bundle / bundle_index.BUNDLE_INDEX, bundle_index.MAX_INDEX_BYTES, what="a bundle index")
    sig = read_capped(bundle / bundle_index.BUNDLE_SIG, bundle_index.MAX_SIG_BYTES, what="a bundle index's signature")
    if data is None or sig is None:
        raise UserError(f"release {version}: no signed bundle index in {bundle}", hint="the channel names a bundle that is not there")
    index = bundle_index.verify_index(data, sig, keys_dir)
    if index.version != version:
        raise Refused(f"release {version}: {bundle} holds version {index.version}", hint="the channel index names the wrong bundle")
    uki_name = bundle_index.payload_names(index.version, index.engine_digest, False)["uki"]
    entry = next((f for f in index.files if f.name == uki_name), None)
    if entry is None:
        raise Refused(f"release {version}: the bundle index names no kernel image", hint="the bundle is damaged")
    cached = store.release(version)
    if cached is not None and cached.uki_sha256 == entry.sha256 and cached.uki == uki_name:
        return frozenset(bytes.fromhex(p) for p in cached.pcr11_policies)
    uki = bundle / uki_name
    if not uki.is_file() or uki.is_symlink():
        raise UserError(f"release {version}: no kernel image {uki}", hint="the bundle is incomplete: copy it again")
    if _sha256_file(uki) != entry.sha256:
        raise Refused(f"release {version}: {uki_name} is not the kernel image the signed bundle index names",
                      hint="the bundle was changed after it was signed: copy it again from the build")
    policies, pcrpkey_fp = policies_from_uki(uki)
    if store.private is not None:
        store.write_release(ReleaseRecord(format=attest_store.FORMAT, version=version, uki=uki_name, uki_sha256=entry.sha256,
                                          pcrpkey_sha256=pcrpkey_fp, pcr11_policies=tuple(sorted(policies)), signer=store.signer))
    return frozenset(bytes.fromhex(p) for p in policies)


# ----------------------------------------------------------------------------------- checking hosts


@dataclass(frozen=True)
class Result:
    host: str
    proven: bool
    code: str
    reason: str
    release: str | None
    secure_boot: str
    checked_at: float

    def line(self) -> str:
        verdict = "proven" if self.proven else f"NOT proven ({self.code}): {self.reason}"
        return f"{self.host}: release {self.release or '-'}, Secure Boot {self.secure_boot}, {verdict}"

    def document(self) -> dict[str, Any]:
        return {"host": self.host, "proven": self.proven, "code": self.code, "reason": self.reason, "release": self.release,
                "secure_boot": self.secure_boot, "checked_at": timestamp.utc(self.checked_at)}


def clock_went_back(seen: SeenRecord | None, reset_count: int, restart_count: int, clock_ms: int) -> bool:
    """Whether a quote's TPM clock is not later than the last one proven: the counters never go
    down, and with both equal the clock moves on (a new boot counts resets or restarts up)."""
    if seen is None:
        return False
    now = (reset_count, restart_count)
    before = (seen.reset_count, seen.restart_count)
    if now != before:
        return now < before
    return clock_ms <= seen.clock_ms


def check_host(host: str, site: Site, store: Store, releases: Sequence[Any], trust: Any, *, now: float | None = None) -> Result:
    """One host's verdict; never raises for what the host or the network does."""
    evidence, _, verify = _attest_modules()

    def result(proven: bool, code: str, reason: str, release: str | None = None, secure_boot: str = "unknown") -> Result:
        return Result(host, proven, code, reason, release, secure_boot, time.time() if now is None else now)

    record = store.host(host)
    if record is None:
        return result(False, "not-enrolled", f"{host} is not enrolled in {store.root}")
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        answer = site.ask("/attest/quote", {"nonce": nonce.hex()})
    except Unreachable as e:
        return result(False, "unreachable", str(e))
    try:
        proof = evidence.load_evidence(answer)
    except UserError as e:
        return result(False, "format", _printable(e.message, 200))
    verdict = verify.check(proof, nonce=nonce, ak_public=base64.b64decode(record.ak_public), releases=releases, secure_boot=trust)
    if not verdict.proven:
        return result(False, verdict.code, verdict.reason, verdict.release, verdict.secure_boot)
    clock = (verdict.reset_count, verdict.restart_count, verdict.clock_ms)
    if any(c is None for c in clock):
        return result(False, "format", "the quote carries no TPM clock", verdict.release, verdict.secure_boot)
    reset_count, restart_count, clock_ms = (int(c) for c in clock)
    seen = store.seen(host)
    if seen is not None and seen.ek_fingerprint != record.ek_fingerprint:
        seen = None  # a clock seen under an EK replaced since: not this TPM's
    if clock_went_back(seen, reset_count, restart_count, clock_ms):
        assert seen is not None
        return result(False, "replayed",
                      f"the TPM clock (resets {reset_count}, restarts {restart_count}, clock {clock_ms} ms) is not later than "
                      f"the last proven quote's (resets {seen.reset_count}, restarts {seen.restart_count}, clock {seen.clock_ms} ms)",
                      verdict.release, verdict.secure_boot)
    checked_at = time.time() if now is None else now
    store.write_seen(SeenRecord(format=attest_store.FORMAT, host=host, ek_fingerprint=record.ek_fingerprint, reset_count=reset_count,
                                restart_count=restart_count, clock_ms=clock_ms, checked_at=timestamp.utc(checked_at),
                                signer=store.signer))
    return result(True, "ok", "", verdict.release, verdict.secure_boot)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def prometheus_text(results: Sequence[Result]) -> str:
    """The textfile collector's file: proven 0/1 per host (release, Secure Boot state), when each
    host was checked, and the failure's code."""
    lines = ["# HELP appliance_attestation_proven 1 when the host proved with a TPM quote which signed release it booted",
             "# TYPE appliance_attestation_proven gauge"]
    for r in results:
        lines.append(f'appliance_attestation_proven{{host="{_label(r.host)}",release="{_label(r.release or "")}",'
                     f'secure_boot="{_label(r.secure_boot)}"}} {int(r.proven)}')
    lines += ["# HELP appliance_attestation_checked_timestamp_seconds when the host was last checked",
              "# TYPE appliance_attestation_checked_timestamp_seconds gauge"]
    lines += [f'appliance_attestation_checked_timestamp_seconds{{host="{_label(r.host)}"}} {r.checked_at:.3f}' for r in results]
    lines += ["# HELP appliance_attestation_failed 1 for the reason a host is not proven",
              "# TYPE appliance_attestation_failed gauge"]
    lines += [f'appliance_attestation_failed{{host="{_label(r.host)}",code="{_label(r.code)}"}} 1' for r in results if not r.proven]
    return "\n".join(lines) + "\n"


def check_hosts(hosts: Sequence[str], sites: Mapping[str, Site], store: Store, releases: Sequence[Any], trust: Any,
                parallel: int = DEFAULT_PARALLEL) -> list[Result]:
    """Every host checked, PARALLEL at a time; in the order given."""

    def one(host: str) -> Result:
        try:
            return check_host(host, sites[host], store, releases, trust)
        except UserError as e:  # the store's own record of this host refused: this host's verdict
            return Result(host, False, "store", _printable(e.message, 200), None, "unknown", time.time())

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(parallel, len(hosts)))) as pool:
        return list(pool.map(one, hosts))


# ----------------------------------------------------------------------------------- the command line


def _keys(args: argparse.Namespace, *, need_private: bool) -> tuple[dict[str, Ed25519PublicKey], Ed25519PrivateKey | None, Path | None]:
    """(trusted release keys, the signing key, the signing key's path)."""
    private: Ed25519PrivateKey | None = None
    path: Path | None = None
    if args.signing_key or need_private or not args.trusted_keys:
        import appliance.config
        from builder import build

        config = appliance.config.load(Path(args.config), args.profile)
        path = build.signing_key_for(config, Path(args.signing_key) if args.signing_key else None)
        private = release_manifest.load_private_key(path)
    keys: dict[str, Ed25519PublicKey] = {}
    if args.trusted_keys:
        keys.update(release_manifest.trusted_keys(Path(args.trusted_keys)))
    if private is not None:
        keys.setdefault(release_manifest.key_id(private.public_key()), private.public_key())
    return keys, private, path


def secure_boot_trust(args: argparse.Namespace, signing_key: Path | None) -> Any:
    """The fleet's own Secure Boot db certificates: the appliance's (secureboot.crt beside the
    release key, or --secure-boot-cert) and, as builds enroll them, Microsoft's."""
    import appliance.config
    from builder import keys, secureboot

    _, _, verify = _attest_modules()
    given = [Path(p) for p in args.secure_boot_cert or ()]
    if not given:
        if signing_key is None:
            raise UserError("no Secure Boot certificate", hint="give --secure-boot-cert PEM (the fleet's secureboot.crt)")
        given = [signing_key.parent / f"{keys.SECURE_BOOT_NAME}.crt"]
    certs = []
    for path in given:
        try:
            certs.append(secureboot.der(path))
        except (OSError, ValueError):
            raise UserError(f"{path}: not a PEM certificate",
                            hint="give the fleet's Secure Boot certificate (builder keys generate --boot)") from None
    config = appliance.config.load(Path(args.config), args.profile)
    if config.os.secure_boot_microsoft_ca:
        try:
            certs.extend(der for _, der in secureboot.microsoft_certificates())
        except ImportError:
            raise UserError("the images enroll Microsoft's UEFI CAs, whose copies come from python3-virt-firmware",
                            hint="run `make setup`") from None
    return verify.SecureBootTrust(db_certificates=tuple(certs))


def _site(url: str, args: argparse.Namespace) -> Site:
    if not re.match(r"^https://[^/\s]+(/.*)?\Z", url):
        raise UserError(f"{url}: not an https:// URL", hint="the appliance's metrics site, e.g. https://gpu-07.example.net:9443/")
    if args.client_key and not args.client_cert:
        raise UserError("--client-key without --client-cert", hint="give both (a scraper's client certificate and key)")
    return Site(url, ca=args.ca, client_cert=args.client_cert, client_key=args.client_key, timeout=args.timeout)


def _plan_attestation(args: argparse.Namespace) -> tuple[list[Path], bool, list[x509.Certificate]]:
    """The EK CAs and software-TPM acceptance: the options, and the plan's [attestation] when given."""
    extra: list[x509.Certificate] = []
    accept = bool(args.accept_software_tpm)
    if args.plan:
        from appliance.signed import install_plan

        plan = install_plan.load_toml(Path(args.plan))
        section = getattr(plan, "attestation", None)
        if section is not None:
            accept = accept or section.accept_software_tpm
            if section.ek_ca:
                extra.extend(pem_certificates(section.ek_ca.encode()))
    return [Path(p) for p in args.ek_ca or ()], accept, extra


def cmd_enroll(args: argparse.Namespace) -> int:
    if len(args.hosts) != 2:
        raise UserError("attest enroll takes one host", hint="python3 -m builder attest enroll HOST --url https://HOST:9443/ --store DIR")
    host = attest_store.check_host(args.hosts[1])
    if not args.url:
        raise UserError("attest enroll needs --url", hint=f"the appliance's metrics site, e.g. --url https://{host}:9443/")
    ca_files, accept, plan_cas = _plan_attestation(args)
    cas = load_cas(ca_files) + plan_cas
    if not cas and not accept:
        raise UserError("no EK CA to check the TPM's EK certificate against",
                        hint="give --ek-ca PEM (the TPM maker's EK CA), or --accept-software-tpm for a software TPM")
    keys, private, _ = _keys(args, need_private=True)
    store = Store(Path(args.store), keys, private)
    record = enroll(host, _site(args.url, args), store, cas=cas, accept_software_tpm=accept, replace=tuple(args.replace or ()))
    what = "a software TPM (proves nothing about hardware)" if record.software_tpm else f"EK certificate by {record.ek_issuer}"
    print(f"enrolled {host}: EK {record.ek_fingerprint}, AK {record.ak_name}; {what}")
    return 0


def cmd_attest(args: argparse.Namespace) -> int:
    if args.hosts and args.hosts[0] == ENROLL:
        return cmd_enroll(args)
    if not args.channel:
        raise UserError("attest needs --channel", hint="the update server's directory of the channel whose releases the fleet may run")
    if "{host}" not in args.url_template:
        raise UserError(f"--url-template {args.url_template}: no {{host}} in it", hint=f"e.g. {DEFAULT_TEMPLATE}")
    hosts = [attest_store.check_host(h) for h in args.hosts]
    if len(set(hosts)) != len(hosts):
        raise UserError("a host is named twice", hint="name each host once")
    if not 1 <= args.parallel <= 256:
        raise UserError(f"--parallel {args.parallel}: expected 1 to 256", hint=f"default {DEFAULT_PARALLEL}")
    keys, private, key_path = _keys(args, need_private=True)
    store = Store(Path(args.store), keys, private)
    _, _, verify = _attest_modules()
    releases = [verify.ReleasePolicy(version=v, pcr11_policies=p) for v, p in release_policies(Path(args.channel), keys, store)]
    trust = secure_boot_trust(args, key_path)
    sites = {h: _site(args.url_template.replace("{host}", h), args) for h in hosts}
    results = check_hosts(hosts, sites, store, releases, trust, parallel=args.parallel)
    if args.prometheus:
        atomic_write(Path(args.prometheus), prometheus_text(results).encode(), 0o644)
    if args.json:
        print(json.dumps([r.document() for r in results], indent=2))
    else:
        for r in results:
            print(r.line())
    return 0 if all(r.proven for r in results) else 1


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = cli_help.verb_parser(
        sub, "attest", "prove from afar which signed release each appliance booted (TPM quotes), or enroll one",
        examples=[
            "python3 -m builder attest enroll gpu-07.example.net --url https://gpu-07.example.net:9443/ --store /srv/attest "
            "--ek-ca tpm-maker-ek-ca.pem --ca appliance-ca.pem --client-cert verifier.crt --client-key verifier.key",
            "python3 -m builder attest gpu-07.example.net gpu-08.example.net --store /srv/attest --channel /srv/updates/stable "
            "--ca appliance-ca.pem --prometheus /var/lib/node-exporter/attestation.prom",
        ],
        exit_codes=[(0, "every host is proven (enroll: the host is enrolled)"),
                    (1, "a host is not proven, each with its reason (enroll: the proof failed, nothing recorded)"),
                    (2, "bad input, a host enrolled with another EK or an EK under another host, or a damaged store "
                        "(one line on stderr, then a hint)")],
        details="`attest enroll HOST` proves the host's attestation key (MakeCredential here, ActivateCredential in its TPM) "
                "and records it in the store, bound to its EK for good. docs/fleet.md, \"Proving what each appliance booted\".",
    )
    p.add_argument("hosts", nargs="+", metavar="HOST", help="the appliances to check (or: enroll HOST)")
    p.add_argument("--store", required=True, help="the verifier store: a directory of signed records")
    p.add_argument("--signing-key", help="the release signing key that signs the store's records (default: as for build)")
    p.add_argument("--trusted-keys", help="a directory of release public keys (*.pub) the channel, bundles and records are checked against "
                                          "(default: the signing key's)")
    p.add_argument("--ca", help="the PEM of the CA that signed the appliances' metrics site certificates (the appliance CA)")
    p.add_argument("--client-cert", help="the client certificate (PEM) the metrics site asks for (metrics.client_ca)")
    p.add_argument("--client-key", help="its key (PEM; read by the TLS library, never printed)")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds to wait for each answer (default {TIMEOUT_S:g})")
    enroll_options = p.add_argument_group("enroll")
    enroll_options.add_argument("--url", help="enroll: the appliance's metrics site, e.g. https://HOST:9443/")
    enroll_options.add_argument("--ek-ca", action="append", metavar="PEM",
                                help="enroll: a CA that signs the TPMs' EK certificates (repeatable)")
    enroll_options.add_argument("--accept-software-tpm", action="store_true",
                                help="enroll: accept an EK no trusted CA vouches for (a software TPM: tests only; recorded as such)")
    enroll_options.add_argument("--plan", help="enroll: the host's install plan (TOML): its [attestation] ek_ca and accept_software_tpm")
    enroll_options.add_argument("--replace", action="append", metavar="HOST",
                                help="enroll: remove HOST's record on purpose (a new TPM, a renamed host) once the new one is proven")
    check_options = p.add_argument_group("check")
    check_options.add_argument("--channel", help="the channel's directory (channel.json and .sig beside the release bundles)")
    check_options.add_argument("--url-template", default=DEFAULT_TEMPLATE, help=f"each host's metrics site (default {DEFAULT_TEMPLATE})")
    check_options.add_argument("--secure-boot-cert", action="append", metavar="PEM",
                               help="the fleet's Secure Boot certificate (default: secureboot.crt beside the release key)")
    check_options.add_argument("--parallel", type=int, default=DEFAULT_PARALLEL, help=f"hosts checked at once (default {DEFAULT_PARALLEL})")
    check_options.add_argument("--json", action="store_true", help="print the verdicts as a JSON list")
    check_options.add_argument("--prometheus", metavar="FILE", help="write a node-exporter textfile of the verdicts (atomically)")
    p.set_defaults(func=cmd_attest)
    return p

