# SPDX-License-Identifier: MIT
"""The attestation parsers (appliance/attest/tpm_wire.py, event_log.py, evidence.py): bounded,
refusing short and trailing data, and raising nothing but Refused on any input (Hypothesis); the
verifier never raises at all."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.attest import event_log, evidence, tpm_wire, verify
from appliance.errors import Refused
from testkit import attest_record
from tests.attest_forge import FIXTURES, SoftwareAk, check, der, load, log_bytes, write_events

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------- tpm_wire


def test_the_recorded_structures_parse() -> None:
    ak = tpm_wire.parse_public((FIXTURES / "enforcing" / "ak.pub").read_bytes())
    assert ak.restricted_signing_key and ak.scheme == tpm_wire.ALG_ECDSA and ak.scheme_hash == tpm_wire.ALG_SHA256
    attest = tpm_wire.parse_attest((FIXTURES / "enforcing" / "quote.msg").read_bytes())
    assert attest.pcr_selection == (tpm_wire.PcrSelection(tpm_wire.ALG_SHA256, (7, 11)),)
    assert attest.extra_data.hex() == load().nonce
    sig = tpm_wire.parse_signature((FIXTURES / "enforcing" / "quote.sig").read_bytes())
    assert sig.sig_alg == tpm_wire.ALG_ECDSA
    assert tpm_wire.verify_signature(ak, sig, (FIXTURES / "enforcing" / "quote.msg").read_bytes()) is None


@pytest.mark.parametrize("name, parser", [("ak.pub", tpm_wire.parse_public), ("quote.msg", tpm_wire.parse_attest),
                                          ("quote.sig", tpm_wire.parse_signature)])
def test_short_and_trailing_structures_are_refused(name: str, parser: object) -> None:
    data = (FIXTURES / "enforcing" / name).read_bytes()
    for bad, words in ((data[:-1], "truncated"), (data + b"\0", "trailing"), (b"", "truncated")):
        with pytest.raises(Refused, match=words):
            parser(bad)  # type: ignore[operator]


def test_a_tpm2b_larger_than_its_type_is_refused() -> None:
    quote = bytearray((FIXTURES / "enforcing" / "quote.msg").read_bytes())
    struct.pack_into(">H", quote, 6, 200)  # qualifiedSigner's size
    with pytest.raises(Refused, match="qualifiedSigner: size 200, more than the 66"):
        tpm_wire.parse_attest(bytes(quote))


def test_a_pcr_selection_count_bomb_is_refused() -> None:
    quote = (FIXTURES / "enforcing" / "quote.msg").read_bytes()
    attest = tpm_wire.parse_attest(quote)
    at = len(quote) - 2 - len(attest.pcr_digest) - (4 + 2 + 1 + 3)
    bomb = quote[:at] + struct.pack(">I", 0x7FFFFFFF) + quote[at + 4:]
    with pytest.raises(Refused, match="count 2147483647, more than 16 banks"):
        tpm_wire.parse_attest(bomb)


def test_an_ecc_point_off_its_curve_is_refused() -> None:
    public = bytearray(SoftwareAk().public)
    public[-1] ^= 1
    with pytest.raises(Refused, match="not on secp256r1"):
        tpm_wire.parse_public(bytes(public))


def test_the_name_is_what_tpm2_createak_wrote() -> None:
    identity = json.loads((FIXTURES / "enforcing" / "identity.json").read_text())
    assert tpm_wire.parse_public(base64.b64decode(identity["ak_public"])).name.hex() == identity["ak_name"]


def test_pcr_policy_digest_is_systemd_measures_pol() -> None:
    """The recorded `systemd-measure calculate` values against `sign`'s `pol`, phase by phase
    (tests/test_attest_programs.py runs the tool itself)."""
    values = [line.rpartition("=")[2] for line in (FIXTURES / "calculate.txt").read_text().split()]
    pols = [e["pol"] for e in json.loads((FIXTURES / "pcrsig.json").read_text())["sha256"]]
    assert [tpm_wire.pcr_policy_digest(11, bytes.fromhex(v)).hex() for v in values] == pols


# ----------------------------------------------------------------------------------- event_log


def test_the_recorded_log_parses_and_reads() -> None:
    events = event_log.parse(log_bytes())
    assert events[0].type == event_log.EV_NO_ACTION and len(events) == 24
    assert event_log.replay(events, 7).hex() == next(p.sha256 for p in load().pcrs if p.index == 7)
    facts = event_log.secure_boot(events)
    db, third = der(FIXTURES / "db.pem"), der(FIXTURES / "third-party.pem")
    assert facts == event_log.SecureBootFacts(enabled=True, pk=(db,), kek=(db,), db=(db, third), dbx_measured=True,
                                              authorities=(db,), other_authorities=())
    off = event_log.secure_boot(event_log.parse(log_bytes("off")))
    assert off.enabled is False and off.authorities == ()


def test_a_log_of_two_banks_parses_and_replays_sha256() -> None:
    evs = attest_record.firmware_events(secure_boot=True, db_cert=b"0\x03\x02\x01\x00", third_party=b"0\x00")
    log = attest_record.write_log(evs, ["sha1", "sha256"])
    events = event_log.parse(log)
    assert all([a for a, _ in e.digests] == [event_log.SHA1, event_log.SHA256] for e in events[1:])
    value = bytes(32)
    for e in evs:
        if e.pcr == 7:
            value = hashlib.sha256(value + hashlib.sha256(e.measured).digest()).digest()
    assert event_log.replay(events, 7) == value


def test_a_startup_locality_event_sets_pcr0s_start() -> None:
    head = attest_record.spec_id_event(["sha256"])
    locality = attest_record.event2(0, event_log.EV_NO_ACTION, b"StartupLocality\0\x03", {"sha256": bytes(32)})
    crtm = attest_record.event2(0, event_log.EV_S_CRTM_VERSION, b"v", {"sha256": hashlib.sha256(b"v").digest()})
    value = event_log.replay(event_log.parse(head + locality + crtm), 0)
    assert value == hashlib.sha256(bytes(31) + b"\x03" + hashlib.sha256(b"v").digest()).digest()


def spec_log(table: bytes, count: int, tail: bytes = b"\0") -> bytes:
    spec = struct.pack("<16sIBBBBI", b"Spec ID Event03\0", 0, 0, 2, 0, 2, count) + table + tail
    return struct.pack("<II20sI", 0, event_log.EV_NO_ACTION, bytes(20), len(spec)) + spec


@pytest.mark.parametrize("log, words", [
    (spec_log(struct.pack("<HH", 0x000B, 20), 1), "bank 0x000b a digest size of 20, expected 32"),
    (spec_log(struct.pack("<HH", 0x0004, 20), 1), "no sha256 bank"),
    (spec_log(struct.pack("<HHHH", 0x000B, 32, 0x000B, 32), 2), "a second time"),
    (spec_log(struct.pack("<HH", 0x000B, 32), 1, b"\0\0"), "trailing bytes in the Spec ID event"),
    (spec_log(b"", 100000), "lists 100000 banks"),
    (spec_log(struct.pack("<HH", 0x0999, 4096), 1), "expected at most 64"),
    (struct.pack("<II20sI", 0, event_log.EV_NO_ACTION, bytes(20), 28) + bytes(28), "not a Spec ID Event03"),
    (b"\0" * 32 + struct.pack("<I", 0), "first event is not EV_NO_ACTION"),
    (spec_log(struct.pack("<HH", 0x000B, 32), 1) + struct.pack("<III", 24, 1, 1), "PCR 24"),
    (spec_log(struct.pack("<HH", 0x000B, 32), 1) + struct.pack("<IIIH", 7, 1, 1, 0x0004), "bank 0x0004, which the Spec ID"),
    (spec_log(struct.pack("<HH", 0x000B, 32), 1) + struct.pack("<III", 7, 1, 0), "0 digests"),
    (b"\0" * (event_log.MAX_EVENT_LOG_BYTES + 1), "more than 1048576"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_logs_are_refused_with_their_fault(log: bytes, words: str) -> None:
    with pytest.raises(Refused, match=words):
        event_log.parse(log)


def test_a_variable_event_whose_sizes_lie_is_refused() -> None:
    events = list(event_log.parse(log_bytes()))
    i = next(i for i, e in enumerate(events) if e.type == event_log.EV_EFI_VARIABLE_DRIVER_CONFIG)
    data = bytearray(events[i].data)
    struct.pack_into("<Q", data, 24, 2**63)  # VariableDataLength
    events[i] = dataclasses.replace(events[i], data=bytes(data), digests=((event_log.SHA256, hashlib.sha256(data).digest()),))
    with pytest.raises(Refused, match="bytes of data in"):
        event_log.secure_boot(tuple(events))
    # and through the verifier: the log is unreadable, not forged
    ak = SoftwareAk()
    nonce = bytes(32)
    log = write_events(events)
    v = check(ak.evidence(nonce, log, pcr11=bytes.fromhex(load().pcrs[1].sha256)), ak_public=ak.public, nonce=nonce)
    assert v.code == "event-log" and "bytes of data in" in v.reason


# ----------------------------------------------------------------------------------- evidence


def test_the_documents_round_trip() -> None:
    raw = json.loads((FIXTURES / "enforcing" / "evidence.json").read_text())
    assert evidence.dump(evidence.load_evidence(raw)) == raw
    ident = json.loads((FIXTURES / "enforcing" / "identity.json").read_text())
    assert evidence.dump(evidence.load_identity(ident)) == ident


@pytest.mark.parametrize("change, words", [
    ({"extra": 1}, "unknown field 'extra'"),
    ({"nonce": "AB" * 32}, "nonce"),
    ({"nonce": "ab" * 33}, "nonce"),
    ({"format": 2}, "format"),
    ({"pcrs": [{"index": 24, "sha256": "00" * 32}]}, "PCR index"),
    ({"pcrs": [{"index": 7, "sha256": "00"}]}, "64 hex digits"),
    ({"event_log": "A" * (evidence.MAX_EVENT_LOG_CHARS + 4)}, "base64 of at most"),
    ({"quote": "not base64"}, "base64"),
])
def test_bad_evidence_documents_are_refused(change: dict[str, object], words: str) -> None:
    raw = json.loads((FIXTURES / "enforcing" / "evidence.json").read_text())
    raw.update(change)
    with pytest.raises(Refused, match=words):
        evidence.load_evidence(raw)


def test_evidence_missing_a_field_is_refused() -> None:
    raw = json.loads((FIXTURES / "enforcing" / "evidence.json").read_text())
    with pytest.raises(Refused, match="missing field 'quote'"):
        evidence.load_evidence({k: v for k, v in raw.items() if k != "quote"})


# ----------------------------------------------------------------------------------- fuzzing


@FUZZ
@given(st.binary(max_size=600))
def test_fuzzed_wire_structures_raise_only_refused(data: bytes) -> None:
    for parser in (tpm_wire.parse_attest, tpm_wire.parse_signature, tpm_wire.parse_public, event_log.parse):
        with contextlib.suppress(Refused):
            parser(data)


def mutate(data: bytes, positions: list[int], values: list[int], cut: int | None) -> bytes:
    out = bytearray(data)
    for p, v in zip(positions, values, strict=False):
        out[p % len(out)] = v
    return bytes(out[:cut] if cut is not None else out)


@FUZZ
@given(st.lists(st.integers(0, 10**6), max_size=6), st.lists(st.integers(0, 255), max_size=6),
       st.none() | st.integers(0, 6000))
def test_fuzzed_logs_raise_only_refused(positions: list[int], values: list[int], cut: int | None) -> None:
    try:
        events = event_log.parse(mutate(log_bytes(), positions, values, cut))
        event_log.replay(events, 7)
        event_log.secure_boot(events)
    except Refused:
        pass


@FUZZ
@given(st.sampled_from(["quote", "signature", "event_log"]), st.lists(st.integers(0, 10**6), max_size=4),
       st.lists(st.integers(0, 255), max_size=4), st.none() | st.integers(0, 6000))
def test_check_never_raises_on_mutated_evidence(field: str, positions: list[int], values: list[int], cut: int | None) -> None:
    ev = load()
    mutated = base64.b64encode(mutate(base64.b64decode(getattr(ev, field)), positions, values, cut)).decode()
    v = check(dataclasses.replace(ev, **{field: mutated}))
    assert v.code in verify.CODES and "\n" not in v.reason
    assert v.proven == (v.code == "ok")


@FUZZ
@given(st.binary(max_size=400))
def test_check_never_raises_on_a_forged_log(log: bytes) -> None:
    """Random logs signed by a software AK: the replay and Secure Boot reading never raise."""
    ak = SoftwareAk()
    nonce = bytes(32)
    head = attest_record.spec_id_event(["sha256"])
    for candidate in (log, head + log):
        try:
            pcr7 = event_log.replay(event_log.parse(candidate), 7)
        except Refused:
            pcr7 = bytes(32)
        v = check(ak.evidence(nonce, candidate, pcr11=bytes(32), pcr7=pcr7), ak_public=ak.public, nonce=nonce,
                  releases=[verify.ReleasePolicy("x", frozenset({tpm_wire.pcr_policy_digest(11, bytes(32))}))])
        assert v.code in verify.CODES and v.code not in ("ok", "format", "ak", "signature", "nonce")
