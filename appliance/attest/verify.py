# SPDX-License-Identifier: MIT
"""The check of one quote: which signed release a device booted, in which Secure Boot state,
proven by its enrolled attestation key over this verifier's nonce.

`check` never raises on what the device sent: every fault is a `Verdict` with its code and one line
saying which value was found and which was expected. The order (each step trusts only what the
steps before it proved):

  format           the evidence decodes (base64, hex, the signature's structure)
  ak               the evidence names the enrolled AK (its name recomputed from the enrolled public
                   area, which must be a restricted signing key)
  signature        that AK signed the quote
  magic            the quote is a TPM-generated TPMS_ATTEST of type quote
  nonce            over this verifier's nonce (another one: a stale or replayed quote)
  selection        of exactly the sha256 PCRs asked for (evidence.PCRS)
  pcr-digest       the claimed PCR values hash to the quote's pcrDigest
  unknown-release  PCR 11's PolicyPCR digest is one of an accepted release's signed policies (the
                   `pol` of its UKI's .pcrsig: systemd-measure signs each boot phase)
  event-log        the firmware's event log parses
  pcr7-replay      its PCR 7 events replay to the quoted PCR 7 (and the events read hash to their
                   digests)
  secure-boot-off  the SecureBoot variable measured is 1
  foreign-key      every certificate that allowed a boot image, and every certificate in the db,
                   is one of the fleet's (a literal PCR 7 would break on every dbx update)
"""

from __future__ import annotations

import binascii
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography import x509

from appliance.attest import event_log, evidence, tpm_wire
from appliance.attest.evidence import Evidence, Pcr
from appliance.errors import Refused

CODES = ("ok", "format", "ak", "signature", "magic", "nonce", "selection", "pcr-digest", "unknown-release",
         "event-log", "pcr7-replay", "secure-boot-off", "foreign-key")
SECURE_BOOT_STATES = ("enforcing", "off", "unknown")


@dataclass(frozen=True)
class ReleasePolicy:
    version: str
    pcr11_policies: frozenset[bytes]  # the `pol` digests of the release's UKI .pcrsig (sha256 bank)


@dataclass(frozen=True)
class SecureBootTrust:
    db_certificates: tuple[bytes, ...]  # DER: the certificates the fleet enrolls in db


@dataclass(frozen=True)
class Verdict:
    proven: bool
    code: str  # one of CODES; "ok" when proven
    reason: str  # one line; "" when proven
    release: str | None
    secure_boot: str  # one of SECURE_BOOT_STATES
    pcrs: tuple[Pcr, ...]
    reset_count: int | None
    restart_count: int | None
    clock_ms: int | None


@dataclass(frozen=True)
class _Decoded:
    nonce: bytes
    pcrs: dict[int, bytes]
    quote: bytes
    signature: tpm_wire.Signature
    ak_name: bytes
    event_log: bytes


class _Seen:
    """What the steps so far have established, for the verdict."""

    def __init__(self) -> None:
        self.release: str | None = None
        self.secure_boot = "unknown"
        self.pcrs: tuple[Pcr, ...] = ()
        self.attest: tpm_wire.Attest | None = None


def _hex(text: object, what: str, size: int | None = None) -> bytes:
    if not isinstance(text, str) or len(text) > 256:
        raise Refused(f"evidence: {what} is not hex", hint=evidence.HINT)
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise Refused(f"evidence: {what} is not hex", hint=evidence.HINT) from None
    if size is not None and len(raw) != size:
        raise Refused(f"evidence: {what} is {len(raw)} bytes, not {size}", hint=evidence.HINT)
    return raw


def _base64(text: object, what: str, limit: int) -> bytes:
    if not isinstance(text, str):
        raise Refused(f"evidence: {what} is not base64", hint=evidence.HINT)
    return evidence.decode_base64(text, what, limit)


def _decode(ev: Evidence) -> _Decoded:
    """EV's values as bytes; Refused (one line) for any that is not what the format says."""
    if ev.format != evidence.FORMAT:
        raise Refused(f"evidence: format {ev.format!r}, this verifier reads format {evidence.FORMAT}", hint=evidence.HINT)
    if not isinstance(ev.pcrs, tuple) or len(ev.pcrs) > 24:
        raise Refused("evidence: pcrs is not a list of at most 24 PCR values", hint=evidence.HINT)
    pcrs: dict[int, bytes] = {}
    for pcr in ev.pcrs:
        if not isinstance(pcr, Pcr) or type(pcr.index) is not int or not 0 <= pcr.index < 24 or pcr.index in pcrs:
            raise Refused(f"evidence: PCR {getattr(pcr, 'index', '?')!r} is not a PCR index, or twice", hint=evidence.HINT)
        pcrs[pcr.index] = _hex(pcr.sha256, f"PCR {pcr.index}", 32)
    return _Decoded(
        nonce=_hex(ev.nonce, "nonce"),
        pcrs=pcrs,
        quote=_base64(ev.quote, "quote", tpm_wire.MAX_ATTEST),
        signature=tpm_wire.parse_signature(_base64(ev.signature, "signature", tpm_wire.MAX_SIGNATURE)),
        ak_name=_hex(ev.ak_name, "ak_name"),
        event_log=_base64(ev.event_log, "event_log", event_log.MAX_EVENT_LOG_BYTES),
    )


def _selection(banks: tuple[tpm_wire.PcrSelection, ...]) -> str:
    shown = [f"{tpm_wire.alg_name(b.hash_alg)}:{','.join(map(str, b.pcrs))}" for b in banks if b.pcrs]
    return " ".join(shown) or "no PCR"


def _certificate(der: bytes) -> str:
    """DER as a reader knows it: its subject, and its sha256."""
    fingerprint = hashlib.sha256(der).hexdigest()[:16]
    try:
        subject = x509.load_der_x509_certificate(der).subject.rfc4514_string()
    except ValueError:
        subject = "not an X.509 certificate"
    return f"{subject[:80]} (sha256 {fingerprint}...)"


def check(evidence_: Evidence, *, nonce: bytes, ak_public: bytes, releases: Sequence[ReleasePolicy],
          secure_boot: SecureBootTrust) -> Verdict:
    """The verdict on EVIDENCE_ for this verifier's NONCE, against the enrolled AK_PUBLIC (its
    TPM2B_PUBLIC), the accepted RELEASES and the fleet's SECURE_BOOT certificates. Never raises on
    what the device sent."""
    seen = _Seen()

    def verdict(code: str, reason: str = "") -> Verdict:
        attest = seen.attest
        return Verdict(proven=code == "ok", code=code, reason=reason, release=seen.release,
                       secure_boot=seen.secure_boot, pcrs=seen.pcrs,
                       reset_count=attest.reset_count if attest else None,
                       restart_count=attest.restart_count if attest else None,
                       clock_ms=attest.clock if attest else None)

    try:
        decoded = _decode(evidence_)
    except Refused as e:
        return verdict("format", e.message)
    seen.pcrs = tuple(sorted(evidence_.pcrs, key=lambda p: p.index))

    try:
        ak = tpm_wire.parse_public(ak_public)
    except Refused as e:
        return verdict("ak", f"the enrolled AK's public area does not parse: {e.message}")
    if faults := tpm_wire.attribute_faults(ak.attributes):
        return verdict("ak", f"the enrolled AK is not a restricted signing key: {', '.join(faults)}")
    if decoded.ak_name != ak.name:
        return verdict("ak", f"the evidence is from AK {decoded.ak_name.hex()[:72]}, the enrolled AK is {ak.name.hex()}")

    if why := tpm_wire.verify_signature(ak, decoded.signature, decoded.quote):
        return verdict("signature", why)

    head = decoded.quote[:6]
    wanted = tpm_wire.TPM_GENERATED_VALUE.to_bytes(4, "big") + tpm_wire.TPM_ST_ATTEST_QUOTE.to_bytes(2, "big")
    if head != wanted:
        return verdict("magic", f"the signed structure starts {binascii.hexlify(head).decode()}, a TPM's quote "
                                f"starts {wanted.hex()} (TPM_GENERATED_VALUE, TPM_ST_ATTEST_QUOTE)")
    try:
        attest = tpm_wire.parse_attest(decoded.quote)
    except Refused as e:
        return verdict("format", e.message)
    seen.attest = attest

    if attest.extra_data != nonce:
        return verdict("nonce", f"the quote is over nonce {attest.extra_data.hex()}, this verifier asked for "
                                f"{nonce.hex()} (a stale or replayed quote)")
    if decoded.nonce != nonce:
        return verdict("nonce", f"the evidence names nonce {decoded.nonce.hex()}, this verifier asked for {nonce.hex()}")

    asked = tpm_wire.PcrSelection(tpm_wire.ALG_SHA256, evidence.PCRS)
    if attest.pcr_selection != (asked,):
        return verdict("selection", f"the quote covers {_selection(attest.pcr_selection)}, "
                                    f"asked for {_selection((asked,))}")

    if tuple(sorted(decoded.pcrs)) != evidence.PCRS:
        return verdict("pcr-digest", f"the evidence claims PCRs {', '.join(map(str, sorted(decoded.pcrs))) or 'none'}, "
                                     f"the quote covers {', '.join(map(str, evidence.PCRS))}")
    composite = hashlib.sha256(b"".join(decoded.pcrs[i] for i in evidence.PCRS)).digest()
    if composite != attest.pcr_digest:
        return verdict("pcr-digest", f"the claimed PCR values hash to {composite.hex()}, the quote's pcrDigest is "
                                     f"{attest.pcr_digest.hex()}")

    pcr11 = decoded.pcrs[11]
    policy = tpm_wire.pcr_policy_digest(11, pcr11)
    release = next((r.version for r in releases if policy in r.pcr11_policies), None)
    if release is None:
        return verdict("unknown-release", f"PCR 11 = {pcr11.hex()} (PolicyPCR digest {policy.hex()}) is in no signed "
                                          f"PCR 11 policy of the {len(releases)} accepted releases")
    seen.release = release

    if not decoded.event_log:
        return verdict("event-log", "the evidence carries no event log")
    try:
        events = event_log.parse(decoded.event_log)
    except Refused as e:
        return verdict("event-log", e.message)
    replayed = event_log.replay(events, 7)
    if replayed != decoded.pcrs[7]:
        count = sum(1 for e in events if e.pcr == 7)
        return verdict("pcr7-replay", f"PCR 7 replayed from the event log's {count} PCR 7 events is {replayed.hex()}, "
                                      f"the quote's PCR 7 is {decoded.pcrs[7].hex()}")
    try:
        facts = event_log.secure_boot(events)
    except event_log.Unmeasured as e:
        return verdict("pcr7-replay", e.message)
    except Refused as e:
        return verdict("event-log", e.message)

    if facts.enabled is None:
        return verdict("secure-boot-off", "PCR 7's events measure no SecureBoot variable")
    if not facts.enabled:
        seen.secure_boot = "off"
        return verdict("secure-boot-off", "the SecureBoot variable measured into PCR 7 is 0: Secure Boot is off")
    seen.secure_boot = "enforcing"

    trusted = frozenset(secure_boot.db_certificates)
    if facts.other_authorities:
        return verdict("foreign-key", f"a boot image was allowed by the variable {facts.other_authorities[0][:40]!r}, "
                                      "not by the db")
    for der in facts.authorities:
        if der not in trusted:
            return verdict("foreign-key", f"a boot image was allowed by {_certificate(der)}, not one of the fleet's "
                                          f"{len(trusted)} db certificates")
    if not facts.db:
        return verdict("foreign-key", "PCR 7's events measure no certificate in the db")
    for der in facts.db:
        if der not in trusted:
            return verdict("foreign-key", f"the db holds {_certificate(der)}, not one of the fleet's "
                                          f"{len(trusted)} db certificates")
    return verdict("ok")
