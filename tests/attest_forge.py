# SPDX-License-Identifier: MIT
"""The attestation fixtures (tests/fixtures/attest/, recorded from swtpm by testkit/attest_record.py)
as the verifier's inputs, and a software AK that signs quotes of any content: the cases no TPM
would sign (another magic, a non-restricted key, a log that only a forger has) go through the
whole check with it."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from appliance.attest import event_log, evidence, tpm_wire, verify
from appliance.attest.evidence import Evidence, Pcr

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "attest"
RELEASE = "1.0"
AK_ATTRIBUTES = 0x00050072  # fixedTPM fixedParent sensitiveDataOrigin userWithAuth restricted sign (tpm2_createak)


def der(pem_file: Path) -> bytes:
    return x509.load_pem_x509_certificate(pem_file.read_bytes()).public_bytes(serialization.Encoding.DER)


def load(variant: str = "enforcing", name: str = "evidence.json", root: Path = FIXTURES) -> Evidence:
    return evidence.load_evidence(json.loads((root / variant / name).read_text()))


def ak_public(variant: str = "enforcing", root: Path = FIXTURES) -> bytes:
    return (root / variant / "ak.pub").read_bytes()


def policies(root: Path = FIXTURES) -> frozenset[bytes]:
    return frozenset(bytes.fromhex(e["pol"]) for e in json.loads((root / "pcrsig.json").read_text())["sha256"])


def releases(root: Path = FIXTURES) -> list[verify.ReleasePolicy]:
    return [verify.ReleasePolicy("0.9", frozenset({bytes(32)})), verify.ReleasePolicy(RELEASE, policies(root))]


def trust(*names: str, root: Path = FIXTURES) -> verify.SecureBootTrust:
    return verify.SecureBootTrust(tuple(der(root / n) for n in (names or ("db.pem", "third-party.pem"))))


def check(ev: Evidence, variant: str = "enforcing", **overrides: Any) -> verify.Verdict:
    """The verdict on EV with the inputs of VARIANT's recording, some OVERRIDDEN."""
    kwargs: dict[str, Any] = {"nonce": bytes.fromhex(ev.nonce), "ak_public": ak_public(variant),
                              "releases": releases(), "secure_boot": trust()}
    kwargs.update(overrides)
    return verify.check(ev, **kwargs)


def log_bytes(variant: str = "enforcing") -> bytes:
    return (FIXTURES / variant / "event_log.bin").read_bytes()


def claimed(ev: Evidence, index: int) -> bytes:
    return bytes.fromhex(next(p.sha256 for p in ev.pcrs if p.index == index))


def write_events(events: Sequence[event_log.Event]) -> bytes:
    """EVENTS (as event_log.parse gives them, the Spec ID event first) written back as a log."""
    first = events[0]
    out = struct.pack("<II20sI", first.pcr, first.type, first.digest(event_log.SHA1), len(first.data)) + first.data
    for e in events[1:]:
        out += struct.pack("<III", e.pcr, e.type, len(e.digests))
        out += b"".join(struct.pack("<H", alg) + d for alg, d in e.digests)
        out += struct.pack("<I", len(e.data)) + e.data
    return out


def with_log(ev: Evidence, log: bytes) -> Evidence:
    return dataclasses.replace(ev, event_log=base64.b64encode(log).decode())


# ----------------------------------------------------------------------------------- a software AK


def tpm2b(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


class SoftwareAk:
    """An ECC P-256 key presented as an AK (its TPM2B_PUBLIC with ATTRIBUTES) that signs anything."""

    def __init__(self, attributes: int = AK_ATTRIBUTES) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        numbers = self.key.public_key().public_numbers()
        area = (struct.pack(">HHI", tpm_wire.ALG_ECC, tpm_wire.ALG_SHA256, attributes) + tpm2b(b"")
                + struct.pack(">HHHHH", tpm_wire.ALG_NULL, tpm_wire.ALG_ECDSA, tpm_wire.ALG_SHA256, 0x0003, tpm_wire.ALG_NULL)
                + tpm2b(numbers.x.to_bytes(32, "big")) + tpm2b(numbers.y.to_bytes(32, "big")))
        self.public = tpm2b(area)
        self.name = struct.pack(">H", tpm_wire.ALG_SHA256) + hashlib.sha256(area).digest()

    def sign(self, message: bytes) -> bytes:
        r, s = decode_dss_signature(self.key.sign(message, ec.ECDSA(hashes.SHA256())))
        return struct.pack(">HH", tpm_wire.ALG_ECDSA, tpm_wire.ALG_SHA256) + tpm2b(r.to_bytes(32, "big")) + tpm2b(s.to_bytes(32, "big"))

    def quote(self, nonce: bytes, pcrs: dict[int, bytes], *, magic: int = tpm_wire.TPM_GENERATED_VALUE,
              kind: int = tpm_wire.TPM_ST_ATTEST_QUOTE, selection: Sequence[int] | None = None,
              trailing: bytes = b"") -> bytes:
        """A TPMS_ATTEST over NONCE of sha256 PCRS (selected: SELECTION, by default PCRS' indexes)."""
        chosen = sorted(pcrs) if selection is None else list(selection)
        bits = bytearray(3)
        for i in chosen:
            bits[i // 8] |= 1 << (i % 8)
        composite = hashlib.sha256(b"".join(pcrs[i] for i in sorted(pcrs))).digest()
        return (struct.pack(">IH", magic, kind) + tpm2b(self.name) + tpm2b(nonce)
                + struct.pack(">QIIB", 1234, 3, 1, 1) + struct.pack(">Q", 0x20191023)
                + struct.pack(">IHB", 1, tpm_wire.ALG_SHA256, 3) + bytes(bits) + tpm2b(composite) + trailing)

    def evidence(self, nonce: bytes, log: bytes, *, pcr11: bytes, pcr7: bytes | None = None, **quote: Any) -> Evidence:
        """Evidence as a device with this AK would send it: PCR 7 replayed from LOG unless given."""
        if pcr7 is None:
            pcr7 = event_log.replay(event_log.parse(log), 7)
        values = {7: pcr7, 11: pcr11}
        message = self.quote(nonce, values, **quote)
        return Evidence(format=evidence.FORMAT, nonce=nonce.hex(),
                        pcrs=tuple(Pcr(i, v.hex()) for i, v in sorted(values.items())),
                        quote=base64.b64encode(message).decode(), signature=base64.b64encode(self.sign(message)).decode(),
                        ak_name=self.name.hex(), event_log=base64.b64encode(log).decode())
