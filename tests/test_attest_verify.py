# SPDX-License-Identifier: MIT
"""The verifier (appliance/attest/verify.py) on quotes and event logs recorded from swtpm
(tests/fixtures/attest/) and on each way a quote fails: one verdict code per failure, its reason
naming the value found and the one expected, and never an exception."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import struct
import time

import pytest

from appliance.attest import event_log, evidence, tpm_wire, verify
from appliance.attest.evidence import Pcr
from tests.attest_forge import (
    FIXTURES,
    RELEASE,
    SoftwareAk,
    ak_public,
    check,
    claimed,
    der,
    load,
    log_bytes,
    releases,
    trust,
    with_log,
    write_events,
)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def flip(text: str, byte: int, bit: int = 0) -> str:
    raw = bytearray(base64.b64decode(text))
    raw[byte] ^= 1 << bit
    return b64(bytes(raw))


# ----------------------------------------------------------------------------------- proven


def test_a_good_quote_is_proven_with_its_release_and_enforcing() -> None:
    ev = load()
    v = check(ev)
    assert (v.proven, v.code, v.reason, v.release, v.secure_boot) == (True, "ok", "", RELEASE, "enforcing")
    assert [p.index for p in v.pcrs] == [7, 11]
    assert v.reset_count is not None and v.restart_count == 0 and v.clock_ms is not None and v.clock_ms > 0


def test_every_boot_phase_of_the_release_is_accepted() -> None:
    """The signed policies of all four phases: PCR 11 proven at each (forged quotes over the same log)."""
    phases = [line.rpartition("=")[2] for line in (FIXTURES / "calculate.txt").read_text().split()]
    assert len(phases) == 4
    ak = SoftwareAk()
    nonce = os.urandom(32)
    for value in phases:
        v = check(ak.evidence(nonce, log_bytes(), pcr11=bytes.fromhex(value)), ak_public=ak.public, nonce=nonce)
        assert (v.code, v.release) == ("ok", RELEASE), v.reason


def test_the_verifier_spends_well_under_50_ms_of_cpu_per_host() -> None:
    ev = load()
    rounds = 50
    start = time.process_time()
    for _ in range(rounds):
        assert check(ev).proven
    assert (time.process_time() - start) / rounds < 0.050


# ----------------------------------------------------------------------------------- each failure


def test_a_replayed_quote_against_a_new_nonce_is_refused() -> None:
    ev = load()
    fresh = os.urandom(32)
    v = check(ev, nonce=fresh)
    assert v.code == "nonce" and not v.proven
    assert ev.nonce in v.reason and fresh.hex() in v.reason and "replayed" in v.reason
    # the evidence naming the new nonce changes nothing: the signed extraData is what counts
    v = check(dataclasses.replace(ev, nonce=fresh.hex()), nonce=fresh)
    assert v.code == "nonce" and ev.nonce in v.reason


def test_evidence_naming_another_nonce_than_its_quote_is_refused() -> None:
    ev = load()
    other = os.urandom(32).hex()
    v = check(dataclasses.replace(ev, nonce=other), nonce=bytes.fromhex(ev.nonce))
    assert v.code == "nonce" and other in v.reason


def test_evidence_from_another_ak_is_refused() -> None:
    ev = load()
    v = check(ev, ak_public=ak_public("off"))  # the other recording's TPM
    assert v.code == "ak"
    assert ev.ak_name in v.reason and load("off").ak_name in v.reason


def test_another_aks_quote_under_the_enrolled_name_is_a_bad_signature() -> None:
    other = load("off")
    v = check(dataclasses.replace(other, ak_name=load().ak_name), ak_public=ak_public("enforcing"))
    assert v.code == "signature" and "does not verify" in v.reason


@pytest.mark.parametrize("name, covers", [("evidence-pcr7.json", "sha256:7"), ("evidence-pcr7-11-14.json", "sha256:7,11,14")])
def test_a_quote_of_other_pcrs_than_asked_is_refused(name: str, covers: str) -> None:
    v = check(load(name=name))
    assert v.code == "selection"
    assert v.reason == f"the quote covers {covers}, asked for sha256:7,11"


def test_a_claimed_value_that_is_not_the_quoted_one_is_refused() -> None:
    ev = load()
    pcrs = (ev.pcrs[0], Pcr(11, "00" * 32))
    v = check(dataclasses.replace(ev, pcrs=pcrs))
    assert v.code == "pcr-digest" and "pcrDigest" in v.reason


def test_claims_of_other_pcrs_than_quoted_are_refused() -> None:
    ev = load()
    v = check(dataclasses.replace(ev, pcrs=ev.pcrs[:1]))
    assert v.code == "pcr-digest" and v.reason == "the evidence claims PCRs 7, the quote covers 7, 11"


@pytest.mark.parametrize("field, byte", [("quote", 60), ("quote", 0), ("signature", 40), ("signature", 71)])
def test_a_flipped_bit_is_a_bad_signature(field: str, byte: int) -> None:
    ev = load()
    v = check(dataclasses.replace(ev, **{field: flip(getattr(ev, field), byte)}))
    assert v.code == "signature", v.reason


def test_a_signed_structure_that_is_not_a_quote_is_refused() -> None:
    ak = SoftwareAk()
    nonce = os.urandom(32)
    pcr11 = claimed(load(), 11)
    for overrides in ({"magic": 0xFF544348}, {"kind": 0x8017}):
        v = check(ak.evidence(nonce, log_bytes(), pcr11=pcr11, **overrides), ak_public=ak.public, nonce=nonce)
        assert v.code == "magic" and "(TPM_GENERATED_VALUE, TPM_ST_ATTEST_QUOTE)" in v.reason
    v = check(ak.evidence(nonce, log_bytes(), pcr11=pcr11, trailing=b"\0"), ak_public=ak.public, nonce=nonce)
    assert v.code == "format" and "trailing" in v.reason


def test_a_pcr11_of_no_accepted_release_is_refused() -> None:
    ev = load()
    v = check(ev, releases=releases()[:1])
    assert v.code == "unknown-release" and v.release is None
    assert claimed(ev, 11).hex() in v.reason and "1 accepted releases" in v.reason
    assert check(ev, releases=[]).code == "unknown-release"


def test_a_log_with_an_event_removed_does_not_replay() -> None:
    events = event_log.parse(log_bytes())
    dbx = next(e for e in events if e.pcr == 7 and e.type == event_log.EV_EFI_VARIABLE_DRIVER_CONFIG
               and event_log.variable(e).name == "dbx")
    v = check(with_log(load(), write_events([e for e in events if e is not dbx])))
    assert v.code == "pcr7-replay"
    assert claimed(load(), 7).hex() in v.reason and "4 PCR 7 events" not in v.reason and "6 PCR 7 events" in v.reason


def test_a_log_with_an_event_changed_does_not_replay() -> None:
    events = list(event_log.parse(log_bytes()))
    i = next(i for i, e in enumerate(events) if e.type == event_log.EV_EFI_VARIABLE_AUTHORITY)
    digest = bytearray(events[i].digest(event_log.SHA256) or b"")
    digest[0] ^= 1
    events[i] = dataclasses.replace(events[i], digests=((event_log.SHA256, bytes(digest)),))
    assert check(with_log(load(), write_events(events))).code == "pcr7-replay"


def test_secure_boot_data_changed_under_its_digest_is_refused() -> None:
    """The off recording's SecureBoot byte set to 1, its digest left: PCR 7 still replays, the data lies."""
    events = list(event_log.parse(log_bytes("off")))
    i = next(i for i, e in enumerate(events) if e.pcr == 7 and e.data.endswith(b"\x00") and b"S\0e\0c\0u\0r\0e" in e.data)
    events[i] = dataclasses.replace(events[i], data=events[i].data[:-1] + b"\x01")
    v = check(with_log(load("off"), write_events(events)), "off")
    assert v.code == "pcr7-replay" and "does not hash to its sha256 digest" in v.reason


def test_secure_boot_off_is_refused() -> None:
    v = check(load("off"), "off")
    assert (v.code, v.secure_boot, v.release) == ("secure-boot-off", "off", RELEASE)
    assert "Secure Boot is off" in v.reason


def test_a_log_without_the_secure_boot_variable_is_unknown() -> None:
    events = event_log.parse(log_bytes())
    kept = [e for e in events if not (e.pcr == 7 and e.type == event_log.EV_EFI_VARIABLE_DRIVER_CONFIG
                                      and event_log.variable(e).name == "SecureBoot")]
    log = write_events(kept)
    ak = SoftwareAk()
    nonce = os.urandom(32)
    v = check(ak.evidence(nonce, log, pcr11=claimed(load(), 11)), ak_public=ak.public, nonce=nonce)
    assert (v.code, v.secure_boot) == ("secure-boot-off", "unknown")


def test_a_db_certificate_not_the_fleets_is_refused() -> None:
    v = check(load(), secure_boot=trust("db.pem"))
    assert (v.code, v.secure_boot) == ("foreign-key", "enforcing")
    assert v.reason.startswith("the db holds CN=Example Third-Party UEFI CA")


def test_an_authority_not_the_fleets_is_refused() -> None:
    v = check(load(), secure_boot=trust("third-party.pem"))
    assert v.code == "foreign-key"
    assert v.reason.startswith("a boot image was allowed by CN=Appliance Secure Boot")


def test_an_authority_from_another_variable_than_the_db_is_refused() -> None:
    """A shim boot: an image allowed by MokList, whatever certificate it names."""
    events = list(event_log.parse(log_bytes()))
    i = next(i for i, e in enumerate(events) if e.type == event_log.EV_EFI_VARIABLE_AUTHORITY)
    var = event_log.variable(events[i])
    data = struct.pack("<16sQQ", event_log.IMAGE_SECURITY_GUID.bytes_le, 7, len(var.data)) + "MokList".encode("utf-16-le") + var.data
    import hashlib

    events[i] = dataclasses.replace(events[i], data=data, digests=((event_log.SHA256, hashlib.sha256(data).digest()),))
    ak = SoftwareAk()
    nonce = os.urandom(32)
    v = check(ak.evidence(nonce, write_events(events), pcr11=claimed(load(), 11)), ak_public=ak.public, nonce=nonce)
    assert v.code == "foreign-key" and "'MokList'" in v.reason


def test_a_db_without_certificates_is_refused() -> None:
    events = list(event_log.parse(log_bytes()))
    keep = [e for e in events if not (e.type == event_log.EV_EFI_VARIABLE_DRIVER_CONFIG and event_log.variable(e).name == "db")]
    ak = SoftwareAk()
    nonce = os.urandom(32)
    v = check(ak.evidence(nonce, write_events(keep), pcr11=claimed(load(), 11)), ak_public=ak.public, nonce=nonce)
    assert v.code == "foreign-key" and "no certificate in the db" in v.reason


def test_a_truncated_log_is_refused() -> None:
    log = log_bytes()
    for cut in (len(log) - 1, len(log) - 700, 40, 3):
        v = check(with_log(load(), log[:cut]))
        assert v.code == "event-log" and "truncated" in v.reason, (cut, v.reason)
    v = check(with_log(load(), b""))
    assert (v.code, v.reason) == ("event-log", "the evidence carries no event log")


def test_hostile_logs_are_refused_in_one_line() -> None:
    log = log_bytes()
    events = event_log.parse(log)
    spec = len(write_events(events[:1]))
    huge = bytearray(log)
    # the first TCG_PCR_EVENT2's eventSize: after pcrIndex, eventType, count, one sha256 digest
    struct.pack_into("<I", huge, spec + 12 + 2 + 32, 0xFFFFFFF0)
    tiny = struct.pack("<III", 8, event_log.EV_EFI_ACTION, 1) + struct.pack("<H", 0x000B) + bytes(32) + struct.pack("<I", 0)
    bomb = write_events(events[:1]) + tiny
    bomb = bomb[:spec] + bomb[spec:] * 30000
    liar = bytearray(log)
    struct.pack_into("<I", liar, spec + 8, 0xFFFFFFFF)  # the first event's digest count
    for hostile, words in ((bytes(huge), "eventSize 4294967280"), (bomb[: event_log.MAX_EVENT_LOG_BYTES], "more than 4096 events"),
                           (bytes(liar), "4294967295 digests"), (bomb, "more than 1048576")):
        ev = with_log(load(), hostile)
        v = check(ev) if len(hostile) <= event_log.MAX_EVENT_LOG_BYTES else verify.check(
            ev, nonce=bytes.fromhex(ev.nonce), ak_public=ak_public(), releases=releases(), secure_boot=trust())
        assert v.code in ("event-log", "format") and words in v.reason and "\n" not in v.reason, (words, v.reason)


def test_an_ak_that_is_not_a_restricted_signing_key_is_refused() -> None:
    """A software key with the quote's every other value right: only the attribute check stops it."""
    nonce = os.urandom(32)
    for attributes, missing in ((0x00040072, "not restricted"), (0x00010072 | 0x00020000, "not sign"),
                                (0x00050070, "not fixedTPM")):
        ak = SoftwareAk(attributes)
        v = check(ak.evidence(nonce, log_bytes(), pcr11=claimed(load(), 11)), ak_public=ak.public, nonce=nonce)
        assert v.code == "ak" and "not a restricted signing key" in v.reason and missing in v.reason, v.reason
    good = SoftwareAk()
    assert check(good.evidence(nonce, log_bytes(), pcr11=claimed(load(), 11)), ak_public=good.public, nonce=nonce).proven


def test_an_enrolled_ak_public_that_does_not_parse_is_refused() -> None:
    v = check(load(), ak_public=ak_public()[:-1])
    assert v.code == "ak" and "does not parse" in v.reason


def test_evidence_that_does_not_decode_is_a_format_fault() -> None:
    ev = load()
    for change, words in (({"format": 2}, "format 2"), ({"quote": "not base64!"}, "quote is not base64"),
                          ({"signature": b64(b"\x00\x10")}, "sigAlg null"), ({"ak_name": "zz"}, "ak_name is not hex"),
                          ({"pcrs": (Pcr(7, "00" * 32), Pcr(7, "00" * 32))}, "twice"),
                          ({"pcrs": (Pcr(7, "00"),)}, "PCR 7 is 1 bytes")):
        v = check(dataclasses.replace(ev, **change))  # type: ignore[arg-type]
        assert v.code == "format" and words in v.reason, v.reason
        assert v.release is None and v.pcrs == ()


def test_the_verdict_keeps_what_was_proven_before_the_fault() -> None:
    v = check(load("off"), "off")
    assert v.release == RELEASE and [p.index for p in v.pcrs] == [7, 11] and v.reset_count is not None


def test_the_recordings_agree_with_the_fixture_files() -> None:
    """evidence.json holds the raw files tpm2-tools wrote (quote.msg, quote.sig, event_log.bin)."""
    for variant in ("enforcing", "off"):
        ev = load(variant)
        assert base64.b64decode(ev.quote) == (FIXTURES / variant / "quote.msg").read_bytes()
        assert base64.b64decode(ev.signature) == (FIXTURES / variant / "quote.sig").read_bytes()
        assert base64.b64decode(ev.event_log) == log_bytes(variant)
        identity = evidence.load_identity(json.loads((FIXTURES / variant / "identity.json").read_text()))
        assert base64.b64decode(identity.ak_public) == ak_public(variant)
        assert tpm_wire.parse_public(ak_public(variant)).name.hex() == identity.ak_name == ev.ak_name
    assert der(FIXTURES / "db.pem") != der(FIXTURES / "third-party.pem")


def test_every_code_is_listed() -> None:
    assert set(verify.CODES) == {"ok", "format", "ak", "signature", "magic", "nonce", "selection", "pcr-digest",
                                 "unknown-release", "event-log", "pcr7-replay", "secure-boot-off", "foreign-key"}
