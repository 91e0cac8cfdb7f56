# SPDX-License-Identifier: MIT
"""The attestation documents, as JSON between the device and the verifier: the device's identity
(its EK and the AK made under it, recorded at enrollment) and the evidence of one quote (the quote,
its signature, the claimed PCR values and the firmware's event log). Loaded through the core's
schema loader, strict and bounded: a fault is one `Refused` line. The binary values are base64
(the TPM's structures as tpm2-tools writes them, tss format) or hex."""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import Any

from appliance import schema
from appliance.attest.event_log import MAX_EVENT_LOG_BYTES
from appliance.errors import Refused

FORMAT = 1
PCRS = (7, 11)  # the PCRs of the sha256 bank a quote covers: Secure Boot policy, the UKI's sections and phases
NONCE_BYTES = 32
__all__ = ["FORMAT", "MAX_EVENT_LOG_BYTES", "NONCE_BYTES", "PCRS", "Evidence", "Identity", "Pcr",
           "decode_base64", "dump", "load_evidence", "load_identity"]

HINT = "the device's attestation service answered something else than its documents: check its version"
_HEX = re.compile(r"^(?:[0-9a-f]{2})*\Z")
_BASE64 = re.compile(r"^[A-Za-z0-9+/]*={0,2}\Z")
_PEM = re.compile(r"^-----BEGIN PUBLIC KEY-----\n[A-Za-z0-9+/=\n]+-----END PUBLIC KEY-----\n?\Z")
# the base64 of a structure of at most N bytes has at most this many characters
MAX_QUOTE_CHARS = 2048
MAX_SIGNATURE_CHARS = 2048
MAX_PUBLIC_CHARS = 2048
MAX_PEM_CHARS = 4096
MAX_CERTIFICATE_CHARS = 16384
MAX_NAME_HEX = 2 * 66
MAX_EVENT_LOG_CHARS = (MAX_EVENT_LOG_BYTES + 2) // 3 * 4


def _checked(regex: re.Pattern[str], limit: int, expected: str) -> dict[str, Any]:
    return schema.check(lambda v: None if len(v) <= limit and regex.match(v) else expected)


def _base64(limit: int) -> dict[str, Any]:
    return schema.check(lambda v: None if len(v) <= limit and len(v) % 4 == 0 and _BASE64.match(v)
                        else f"base64 of at most {limit} characters")


_FORMAT = schema.check(lambda v: None if v == FORMAT else f"{FORMAT}")


class _Loader(schema.Loader):
    """The attestation documents' wording: every fault refuses the document (exit 1)."""

    def invalid(self, key: str, value: Any, expected: str) -> Refused:
        return Refused(f"{self.where}: {key or 'the document'} = {schema.shown(value, 60)}: expected {expected}",
                       hint=HINT)

    def unknown(self, key: str, value: Any, known: list[str]) -> Refused:
        return Refused(f"{self.where}: unknown field {key!r}", hint=HINT)

    def missing(self, key: str, tp: Any) -> Refused:
        return Refused(f"{self.where}: missing field {key!r}", hint=HINT)


@dataclass(frozen=True)
class Identity:
    """The device's TPM identity: the EK, its certificate ("" when the TPM has none) and the AK."""

    format: int = field(metadata=_FORMAT)
    ek_public: str = field(metadata=_checked(_PEM, MAX_PEM_CHARS, "a PEM public key (SubjectPublicKeyInfo)"))
    ek_certificate: str = field(metadata=_base64(MAX_CERTIFICATE_CHARS))  # DER
    ak_public: str = field(metadata=_base64(MAX_PUBLIC_CHARS))  # TPM2B_PUBLIC
    ak_name: str = field(metadata=_checked(_HEX, MAX_NAME_HEX, "the AK's name in hex (nameAlg || digest)"))


@dataclass(frozen=True)
class Pcr:
    index: int = field(metadata=schema.check(lambda v: None if 0 <= v < 24 else "a PCR index, 0 to 23"))
    sha256: str = field(metadata=schema.check(lambda v: None if len(v) == 64 and _HEX.match(v) else "64 hex digits"))


@dataclass(frozen=True)
class Evidence:
    """One quote of PCRS over the verifier's nonce, with what a verifier needs to check it."""

    format: int = field(metadata=_FORMAT)
    nonce: str = field(metadata=_checked(_HEX, 2 * NONCE_BYTES, f"{NONCE_BYTES} bytes in hex"))
    pcrs: tuple[Pcr, ...]
    quote: str = field(metadata=_base64(MAX_QUOTE_CHARS))  # TPMS_ATTEST
    signature: str = field(metadata=_base64(MAX_SIGNATURE_CHARS))  # TPMT_SIGNATURE
    ak_name: str = field(metadata=_checked(_HEX, MAX_NAME_HEX, "the AK's name in hex (nameAlg || digest)"))
    event_log: str = field(metadata=_base64(MAX_EVENT_LOG_CHARS))


def load_identity(value: Any) -> Identity:
    """VALUE (parsed JSON) as an Identity; Refused (one line) when it is not one."""
    model: Identity = _Loader("identity").load(Identity, value)
    return model


def load_evidence(value: Any) -> Evidence:
    """VALUE (parsed JSON) as Evidence; Refused (one line) when it is not."""
    model: Evidence = _Loader("evidence").load(Evidence, value)
    if len(model.pcrs) > 24:
        raise Refused(f"evidence: {len(model.pcrs)} PCR values, more than there are PCRs", hint=HINT)
    return model


def dump(model: Identity | Evidence) -> dict[str, Any]:
    """MODEL as JSON-ready data (what the device answers, what load_* reads back)."""
    value: dict[str, Any] = schema.plain(model)
    return value


def decode_base64(text: str, what: str, limit: int) -> bytes:
    """TEXT (strict base64) as bytes of at most LIMIT; Refused otherwise."""
    if len(text) > (limit + 2) // 3 * 4:
        raise Refused(f"evidence: {what}: {len(text)} characters of base64, more than {limit} bytes", hint=HINT)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise Refused(f"evidence: {what} is not base64", hint=HINT) from None
