# SPDX-License-Identifier: MIT
"""The bundle's timestamp (appliance/signed/timestamp.py): its format, `builder release` writing the first
one and `builder timestamp` signing it again with the timestamp key's next sequence number. What
the updater does with it is in test_update.py."""

from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from fake_release import bundle, demo_config, fake_build, make_signing

import builder.__main__
from appliance import paths
from appliance.errors import Refused, UserError
from appliance.signed import release_manifest, timestamp
from builder import keys, release

DAY = 86400


@pytest.fixture(name="signing")
def signing_fixture(tmp_path: Path) -> tuple[Path, Path]:
    return make_signing(tmp_path)


def _read(b: Path, trusted: Path) -> timestamp.Timestamp:
    """B's timestamp, as the updater checks it: against the timestamp keys beside TRUSTED."""
    return timestamp.verify((b / "timestamp.json").read_bytes(), (b / "timestamp.json.sig").read_bytes(),
                            paths.timestamp_keys_dir(trusted))


def _builder(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = builder.__main__.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------------------------- builder release


def test_a_release_carries_a_fresh_timestamp_for_its_index(tmp_path: Path, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    ts = _read(b, trusted)
    index = (b / "bundle.json").read_bytes()
    timestamp.check_names(ts, index, "2.0.0")
    assert (ts.version, ts.sequence) == ("2.0.0", 1)
    assert ts.expires_s - timestamp.parse_utc(ts.signed_at) == timestamp.DEFAULT_DAYS * DAY
    assert ts.signer == keys.public_key_id(key.with_name("timestamp.pub")) != keys.public_key_id(key.with_suffix(".pub"))
    assert (b / "timestamp.json").read_bytes() == release_manifest.canonical(json.loads((b / "timestamp.json").read_text()))
    assert _read(bundle(tmp_path, key, "3.0.0"), trusted).sequence == 2, "one counter per timestamp key"


def test_a_release_refuses_the_release_key_as_its_timestamp_key(tmp_path: Path, signing: Any) -> None:
    key, _ = signing
    config = demo_config("2.0.0")
    out = fake_build(tmp_path / "out", config, key)
    with pytest.raises(UserError, match=r"release\.key is the release key [0-9a-f]{16}: timestamps need a key of their own") as e:
        release.make_bundle(config, out, tmp_path / "b", key, [config.engine.digest], timestamp_key=key)
    assert "keys generate --timestamp" in e.value.hint
    assert not (tmp_path / "b").exists()


def test_a_production_release_without_a_timestamp_key_is_refused(tmp_path: Path) -> None:
    private, _ = keys.generate(tmp_path / "keys")  # a keys directory from before timestamps
    with pytest.raises(UserError, match=r"^no timestamp key at .*/keys/timestamp\.key$") as e:
        keys.timestamp_key(private.with_name("timestamp.key"))
    assert "python3 -m builder keys generate --timestamp" in e.value.hint
    made = keys.timestamp_key(private.with_name("timestamp.key"), make=True)  # the demo's: made on the fly
    assert made.is_file() and made.with_suffix(".pub").is_file() and (made.stat().st_mode & 0o777) == 0o600


def test_keys_generate_makes_both_pairs_and_timestamp_only_the_missing_one(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _builder(["keys", "generate", "--directory", str(tmp_path / "new")], capsys)
    assert code == 0 and sorted(p.name for p in (tmp_path / "new").iterdir()) == [
        "pcr-policy.crt", "pcr-policy.key", "release.key", "release.pub", "secureboot.crt", "secureboot.key",
        "timestamp.key", "timestamp.pub"]
    old = tmp_path / "old"
    keys.generate(old)
    release_before = (old / "release.key").read_bytes()
    code, out, _ = _builder(["keys", "generate", "--timestamp", "--directory", str(old)], capsys)
    assert code == 0 and (old / "timestamp.key").is_file() and (old / "release.key").read_bytes() == release_before
    assert "timestamp.pub" in out and "release.pub" not in out and "secureboot" not in out
    code, out, _ = _builder(["keys", "generate", "--boot", "--directory", str(old)], capsys)
    assert code == 0 and (old / "secureboot.crt").is_file() and (old / "pcr-policy.key").is_file()
    assert (old / "release.key").read_bytes() == release_before and "release.pub" not in out

# ----------------------------------------------------------------------------------- builder timestamp


def test_builder_timestamp_signs_the_next_sequence_and_replaces_the_files_whole(
    tmp_path: Path, signing: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    timestamp_key = key.with_name("timestamp.key")
    inode = (b / "timestamp.json").stat().st_ino
    code, out, err = _builder(["timestamp", str(b), "--key", str(timestamp_key)], capsys)
    assert code == 0, err
    ts = _read(b, trusted)
    assert ts.sequence == 2 and out.startswith(f"timestamp 2 for bundle 2.0.0 at {b}: signed ")
    assert (b / "timestamp.json").stat().st_ino != inode, "a new file renamed over the old one, not rewritten in place"
    assert sorted(p.name for p in b.iterdir() if p.name.startswith(".")) == [], "no temporary file left"
    assert keys.sequence_path(timestamp_key).read_text() == "2\n"
    assert (keys.sequence_path(timestamp_key).stat().st_mode & 0o777) == 0o600
    code, _, err = _builder(["timestamp", str(b), "--key", str(timestamp_key), "--days", "30"], capsys)
    ts = _read(b, trusted)
    assert code == 0 and ts.sequence == 3 and ts.expires_s - timestamp.parse_utc(ts.signed_at) == 30 * DAY
    timestamp.check_names(ts, (b / "bundle.json").read_bytes(), "2.0.0")


def test_a_failed_timestamp_write_keeps_the_old_one_and_never_hands_out_its_number_again(
    tmp_path: Path, signing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    timestamp_key = key.with_name("timestamp.key")
    before = (b / "timestamp.json").read_bytes(), (b / "timestamp.json.sig").read_bytes()
    real = release.atomic_write

    def cut(path: Path, data: bytes, *args: Any, **kw: Any) -> None:
        if path.name.startswith("timestamp.json"):
            raise OSError("power cut")
        real(path, data, *args, **kw)

    monkeypatch.setattr(release, "atomic_write", cut)
    with pytest.raises(OSError, match="power cut"):
        release.sign_timestamp(b, timestamp_key)
    assert ((b / "timestamp.json").read_bytes(), (b / "timestamp.json.sig").read_bytes()) == before
    monkeypatch.setattr(release, "atomic_write", real)
    assert release.sign_timestamp(b, timestamp_key).sequence == 3, "2 was handed out to the failed run"
    assert _read(b, trusted).sequence == 3


def test_a_damaged_sequence_counter_is_refused_not_restarted(tmp_path: Path, signing: Any) -> None:
    key, _ = signing
    b = bundle(tmp_path, key, "2.0.0")
    timestamp_key = key.with_name("timestamp.key")
    keys.sequence_path(timestamp_key).write_text("seven\n")
    with pytest.raises(UserError, match=r"timestamp\.key\.sequence: 'seven' is not a sequence number") as e:
        release.sign_timestamp(b, timestamp_key)
    assert "the highest one its timestamps carry" in e.value.hint


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["{empty}"], r"\{empty\}: not a bundle directory \(no bundle\.json\)"),
        (["{empty}/absent"], r"absent: no such directory"),
        (["{bundle}", "--days", "0"], r"--days 0: expected a number of days from 1 to 366"),
        (["{bundle}", "--days", "367"], r"--days 367: expected a number of days from 1 to 366"),
        (["{bundle}", "--key", "{empty}/timestamp.key"], r"no timestamp key at \{empty\}/timestamp\.key"),
        (["{bad_index}"], r"bad_index/bundle\.json: manifest is not valid JSON"),
    ],
)
def test_builder_timestamp_refuses_bad_input_in_one_line(tmp_path: Path, signing: Any, capsys: pytest.CaptureFixture[str],
                                                         argv: list[str], says: str) -> None:
    key, _ = signing
    b = bundle(tmp_path, key, "2.0.0")
    before = (b / "timestamp.json").read_bytes()
    empty, bad_index = tmp_path / "empty", tmp_path / "bad_index"
    empty.mkdir()
    bad_index.mkdir()
    (bad_index / "bundle.json").write_text("{not json")
    given = [a.format(empty=empty, bundle=b, bad_index=bad_index) for a in argv]
    if "--key" not in given:
        given += ["--key", str(key.with_name("timestamp.key"))]
    code, out, err = _builder(["timestamp", *given], capsys)
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 2, err
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: ")
    assert re.search(says.replace(r"\{empty\}", re.escape(str(empty))), lines[0]), lines[0]
    assert (b / "timestamp.json").read_bytes() == before
    assert keys.sequence_path(key.with_name("timestamp.key")).read_text() == "1\n", "no number spent on a refusal"


# ----------------------------------------------------------------------------------- the format


def _signed(tmp_path: Path, signing: Any, **changes: Any) -> tuple[bytes, bytes, Path]:
    """A timestamp with CHANGES to its fields, signed by the timestamp key: (data, sig, its keys dir)."""
    key, trusted = signing
    timestamp_key = key.with_name("timestamp.key")
    doc = timestamp.make(b"{}", "2.0.0", 1, keys.public_key_id(timestamp_key.with_suffix(".pub")), now=1_800_000_000)
    doc.update(changes)
    doc = {k: v for k, v in doc.items() if v is not None}
    data = release_manifest.canonical(doc)
    signature = release_manifest.load_private_key(timestamp_key).sign(data)
    return data, release_manifest.encode_signature(signature), paths.timestamp_keys_dir(trusted)


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"expires": "2030-01-01T00:00:00Z"}, r"valid for [0-9.]+ days from .*: expected more than 0 and at most 366"),
        ({"expires": "2027-01-14T08:00:00Z", "signed_at": "2027-01-15T08:00:00Z"}, "expected more than 0"),
        ({"expires": "2027-13-40T00:00:00Z"}, r"expires = '2027-13-40T00:00:00Z': expected a UTC time"),
        ({"sequence": 0}, r"sequence = 0: expected a number from 1 to"),
        ({"added_later": 1}, r"unknown field 'added_later'"),
        ({"bundle_sha256": None}, r"missing field 'bundle_sha256'"),
        ({"format": 2}, r"format = 2: expected 1"),
        ({"signer": "0123456789abcdef"}, r"names signer 0123456789abcdef but was signed by [0-9a-f]{16}"),
    ],
)
def test_a_signed_timestamp_of_the_wrong_form_is_one_refusal(tmp_path: Path, signing: Any, changes: dict[str, Any],
                                                             says: str) -> None:
    data, sig, keys_dir = _signed(tmp_path, signing, **changes)
    with pytest.raises(Refused, match=says) as e:
        timestamp.verify(data, sig, keys_dir)
    assert "\n" not in e.value.message and e.value.hint


def test_a_changed_timestamp_fails_its_signature(tmp_path: Path, signing: Any) -> None:
    data, sig, keys_dir = _signed(tmp_path, signing)
    assert timestamp.verify(data, sig, keys_dir).sequence == 1
    forged = data.replace(b'"sequence":1', b'"sequence":9')
    with pytest.raises(Refused, match="signature does not match any trusted timestamp key"):
        timestamp.verify(forged, sig, keys_dir)
    with pytest.raises(UserError, match="no trusted timestamp keys"):
        timestamp.verify(data, sig, tmp_path / "an image without timestamp keys")


def test_a_timestamp_names_its_index_by_hash_and_version(tmp_path: Path, signing: Any) -> None:
    data, sig, keys_dir = _signed(tmp_path, signing, version="9.9")  # names b"{}" by hash
    ts = timestamp.verify(data, sig, keys_dir)
    with pytest.raises(Refused, match=r"is for another bundle\.json"):
        timestamp.check_names(ts, b"{ }", "9.9")
    with pytest.raises(Refused, match=r"timestamp\.json says version 9\.9, bundle\.json 2\.0\.0"):
        timestamp.check_names(ts, b"{}", "2.0.0")
    timestamp.check_names(ts, b"{}", "9.9")


def test_the_clock_and_the_sequence_rules(tmp_path: Path, signing: Any) -> None:
    data, sig, keys_dir = _signed(tmp_path, signing)
    ts = timestamp.verify(data, sig, keys_dir)
    built = "2026-01-01T00:00:00Z"
    timestamp.check_clock(ts, ts.expires_s - 1, built)  # the last second it is valid
    with pytest.raises(Refused, match=f"the index expired at {ts.expires}; the clock says {ts.expires}"):
        timestamp.check_clock(ts, ts.expires_s, built)
    with pytest.raises(UserError, match="earlier than this release's build time") as e:
        timestamp.check_clock(ts, timestamp.parse_utc(built) - 1, built)
    assert type(e.value) is UserError, "not the bundle's fault: exit 2"
    timestamp.check_sequence(ts, None)
    timestamp.check_sequence(ts, 1)  # the same timestamp again (the timer, an unchanged server)
    with pytest.raises(Refused, match="sequence 1, lower than the 2"):
        timestamp.check_sequence(ts, 2)


def test_a_timestamp_signed_later_than_the_clock_allows_is_refused(tmp_path: Path, signing: Any) -> None:
    """Signed for 2099 with 7 days' validity, it would be fresh until 2099: refused beyond the clock
    skew a signing host may have; the build-time check still comes first."""
    built = "2026-01-01T00:00:00Z"
    data, sig, keys_dir = _signed(tmp_path, signing)
    ts = timestamp.verify(data, sig, keys_dir)
    signed = timestamp.parse_utc(ts.signed_at)
    timestamp.check_clock(ts, signed - timestamp.MAX_CLOCK_SKEW_S, built)  # a signing host a little ahead
    with pytest.raises(Refused, match=rf"timestamp\.json was signed at {ts.signed_at}, later than the clock says "
                                      r"\(.*\) by more than 5 minutes") as e:
        timestamp.check_clock(ts, signed - timestamp.MAX_CLOCK_SKEW_S - 1, built)
    assert "timedatectl" in e.value.hint and "builder timestamp" in e.value.hint and "\n" not in e.value.message
    data, sig, keys_dir = _signed(tmp_path, signing, signed_at="2099-01-01T00:00:00Z", expires="2099-01-08T00:00:00Z")
    with pytest.raises(Refused, match="signed at 2099-01-01T00:00:00Z"):
        timestamp.check_clock(timestamp.verify(data, sig, keys_dir), signed, built)


def test_the_counter_is_counted_under_the_key_files_lock(tmp_path: Path, signing: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs at once cannot read the same counter: while one reads and writes it, the key file
    is locked (a second taker would wait; LOCK_NB shows it)."""
    key, _ = signing
    timestamp_key = key.with_name("timestamp.key")
    real_write = keys.atomic_write
    held: list[bool] = []

    def write(path: Path, data: bytes, **kw: Any) -> None:
        other = os.open(timestamp_key, os.O_RDONLY)
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(other)
        real_write(path, data, **kw)

    monkeypatch.setattr(keys, "atomic_write", write)
    assert keys.next_sequence(timestamp_key) == 1
    assert held == [True]


@pytest.mark.programs
def test_the_image_carries_the_timestamp_key_in_a_directory_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """build.prepare, its expensive steps stubbed: the release key's .pub among the trusted keys,
    the timestamp key's (made on the fly for the demo) in timestamp-keys/, where the updater looks."""
    from builder import build, engine_image, engine_store, pins, render, tuning

    for module, name, value in ((pins, "check", lambda *a: []), (tuning, "validate_all", lambda *a: None),
                                (engine_image, "obtain", lambda *a: None), (engine_store, "make", lambda *a: None),
                                (render, "generate_tree", lambda config, tree, store: tree.mkdir(parents=True)),
                                (render, "repart_definitions", lambda *a: None), (build, "release_plan", lambda *a: {}),
                                (build, "write_sandbox", lambda *a: None), (build, "work_dir", lambda config: tmp_path / "work")):
        monkeypatch.setattr(module, name, value)
    release_key, _ = keys.generate(tmp_path / "keys")
    generated, _, _ = build.prepare(demo_config("2.0.0"), None, release_key)
    lib = generated / render.LIB
    timestamp_pub = tmp_path / "keys" / "timestamp.pub"
    assert [p.name for p in (lib / "keys").iterdir()] == [keys.trusted_name(release_key.with_suffix(".pub"))]
    assert [p.read_bytes() for p in (lib / "timestamp-keys").iterdir()] == [timestamp_pub.read_bytes()]
    assert paths.timestamp_keys_dir(Path("/") / render.LIB / "keys") == Path("/") / render.LIB / "timestamp-keys"
