# SPDX-License-Identifier: MIT
"""The device's records: each sample in tests/fixtures/state/ (written by the release before the
records were typed) loads, what this release writes is what those readers read, and what a newer
release writes (a newer format, keys added) this one reads leniently."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from appliance.atomic import write_record
from appliance.errors import UserError
from appliance.schema import Record, dump_record, from_json, load_record
from applianctl import records

STATE = Path(__file__).parent / "fixtures" / "state"

RECORDS: dict[str, type[Record]] = {
    "verify.json": records.VerifyResult,
    "preflight.json": records.PreflightResult,
    "shm-check.json": records.ShmCheck,
    "startup-report.json": records.StartupReport,
    "model-verify.json": records.ModelVerifyResult,
    "engine-slot.json": records.EngineSlotOpened,
    "host.json": records.HostResult,
    "weights-fetch.json": records.WeightsFetch,
    "weights-verity.json": records.WeightsVerity,
    "weights-corrupt.json": records.WeightsCorrupt,
    "fetch-journal.json": records.FetchJournal,
    "engines.json": records.EngineVersions,
    "last-update.json": records.LastUpdate,
    "last-assessment.json": records.LastAssessment,
    "last-rollback.json": records.LastRollback,
    "staged.json": records.Staged,
    "freshness.json": records.Freshness,
}

# What the previous release's readers took from each record: key -> type (they read it with
# dictionary access, so each key must be there with that type).
OLD_READERS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "verify.json": {"ok": bool, "reason": str, "version": str, "signer": str},  # status/files.py
    "preflight.json": {"ok": bool, "reason": str},
    "shm-check.json": {"ok": bool, "reason": str, "removed": list, "required_bytes": int},
    "startup-report.json": {"state": str, "reason": str, "figures": dict, "reached_s": dict, "expected": dict},
    "model-verify.json": {"ok": bool, "reason": str, "revision": str, "file": str},  # status/weights.py
    "engine-slot.json": {"partition": str, "label": str},  # slots engine.opened()
    "host.json": {"ok": bool, "source": str, "settings": dict, "network_files": list},  # host.privileged, status/host.py
    "weights-fetch.json": {"source": str},
    "weights-verity.json": {"revision": str, "files": dict},  # Store.recorded()
    "weights-corrupt.json": {"revision": str, "files": dict},  # Store.corrupt()
    "fetch-journal.json": {"length": int, "chunks": list, "sha256": str, "size": int},  # fetch.read_journal
    "engines.json": {"versions": dict},
    "last-update.json": {"version": str, "from_version": str, "downgrade": bool},  # slots view, assess
    "last-assessment.json": {"ok": bool, "version": str, "reason": str},
    "last-rollback.json": {"from_version": str, "to_version": str, "at": str},
    "staged.json": {"version": str, "directory": str},  # update/staged.read()
    "freshness.json": {"sequences": dict},  # new in this release: update/update_plan.py accepted_sequences()
}


def _sample(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((STATE / name).read_text())
    return data


def test_every_sample_has_a_record() -> None:
    assert sorted(p.name for p in STATE.iterdir()) == sorted(RECORDS) == sorted(OLD_READERS)


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_the_previous_releases_file_loads_and_this_release_writes_what_it_read(name: str, tmp_path: Path) -> None:
    cls = RECORDS[name]
    sample = _sample(name)
    assert "format" not in sample  # written before records had formats
    record = load_record(cls, STATE / name, lenient=True)
    assert record is not None
    written = tmp_path / name
    write_record(written, record)
    again = json.loads(written.read_text())
    assert again.pop("format", None) == cls.FORMAT
    assert again == sample  # key for key, type for type: the previous release reads it as it read its own
    for key, tp in OLD_READERS[name].items():
        assert isinstance(again[key], tp), (name, key)
    assert load_record(cls, written, lenient=True) == record


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_own_records_skip_what_the_next_release_adds_and_check_the_rest(name: str) -> None:
    cls = RECORDS[name]
    sample = _sample(name)
    newer = {**sample, "format": 7, "added_later": {"x": [1]}}
    assert from_json(cls, newer, name, lenient=True) == from_json(cls, sample, name, lenient=True)
    with pytest.raises(UserError, match="unknown key 'added_later'"):
        from_json(cls, {**sample, "added_later": 1}, name, lenient=False)
    key = sorted(OLD_READERS[name])[0]
    wrong: Any = 1.5 if not isinstance(sample[key], float) else "x"
    with pytest.raises(UserError) as e:
        from_json(cls, {**sample, key: wrong}, name, lenient=True)
    assert "\n" not in e.value.message and e.value.message.startswith(f"{name}: {key} = ")
    assert e.value.hint


def test_a_newer_format_is_refused_where_the_input_is_strict() -> None:
    sample = {**_sample("staged.json"), "format": 2}
    with pytest.raises(UserError, match="format 2 is newer than this release reads"):
        from_json(records.Staged, sample, "staged.json", lenient=False)
    assert from_json(records.Staged, {**sample, "format": 1}, "staged.json", lenient=False).version == "2.0.0"


def test_unreadable_and_absent_files(tmp_path: Path) -> None:
    assert load_record(records.VerifyResult, tmp_path / "absent.json", lenient=True) is None
    (tmp_path / "half.json").write_text("{half")
    with pytest.raises(UserError, match=r"half\.json: not JSON"):
        load_record(records.VerifyResult, tmp_path / "half.json", lenient=True)
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(UserError, match=r"list\.json: the record = \[...\]: invalid"):
        load_record(records.VerifyResult, tmp_path / "list.json", lenient=True)


def test_optional_fields_are_absent_when_unset_and_nulls_stay_where_they_were() -> None:
    assert dump_record(records.PreflightResult(False, "no GPU")) == {"ok": False, "reason": "no GPU"}
    assert dump_record(records.VerifyResult(False, "bad")) == {"ok": False, "reason": "bad", "version": None, "signer": None}
    assert dump_record(records.EngineVersions()) == {"versions": {}, "format": 1}


# ----------------------------------------------------------------------------------- across releases
# The previous release's readers of the updater's, the assessment's, the rollback's, the staged
# update's and appliance-host's records, in the shapes earlier releases wrote them (slots/records.py read_json,
# status/os_slots.py slots_summary, slots/assess.py assess, update/staged.py read, update/command.py
# apply, host.py privileged, status/host.py probe_host), cut to what each took from the file.


def _old_read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _old_rolled_back(last_update: dict[str, Any] | None, last_assessment: dict[str, Any] | None,
                     last_rollback: dict[str, Any] | None, running_version: str) -> tuple[bool, str | None, str | None]:
    if last_assessment and last_assessment.get("ok") is False and last_assessment.get("version") != running_version:
        return True, "appliance", str(last_assessment.get("reason") or "assessment failed")
    if (last_rollback and last_update and last_rollback.get("to_version") == running_version
            and last_rollback.get("from_version") == last_update.get("version") != running_version):
        return True, "operator", f"applianctl rollback from {last_rollback.get('from_version')} at {last_rollback.get('at')}"
    return False, None, None


def _old_staged(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return {"error": f"{path}: unreadable ({type(e).__name__})"}
    if not isinstance(record, dict) or not isinstance(record.get("version"), str):
        return {"error": f"{path}: not a staged update's record"}
    name = record.get("directory")
    if not isinstance(name, str) or not (path.parent / name).is_dir():
        return {**record, "error": f"the staged directory {name!r} is missing"}
    return record


def _old_host(path: Path) -> tuple[Any, ...]:
    applied = json.loads(path.read_text())
    settings = applied.get("settings", {}) if applied.get("source") == "plan" and isinstance(applied.get("settings"), dict) else {}
    return (applied["ok"], applied.get("source"), applied.get("network_files", []), settings.get("hostname"),
            bool(settings.get("ssh_authorized_keys")), str(applied.get("reason") or "the install plan was not applied"))


def test_the_previous_release_reads_what_this_one_writes(tmp_path: Path) -> None:
    """Written as this release's writers write them (update/command.py install, slots/assess.py,
    slots/rollback.py, update/staged.py publish, host.py apply), read by the previous release's code."""
    update = records.LastUpdate(version="2.0.0", from_version="1.0.0", slot="B", downgrade=True,
                                installed_at="2026-12-01T09:29:23Z", source="/media/usb/bundle-2.0.0")
    failed = records.LastAssessment(version="2.0.0", ok=False, reason="rolled back: no right smoke completion", entry=None,
                                    tries_left=None, deadline_s=600.0, through="https://127.0.0.1:443 as appliance.local",
                                    at="2026-12-01T09:30:00Z")
    rollback = records.LastRollback("2.0.0", "1.0.0", "operator rollback", "2026-12-01T09:31:00Z")
    for name, record in (("last-update.json", update), ("last-assessment.json", failed), ("last-rollback.json", rollback)):
        write_record(tmp_path / name, record)
    old = [_old_read_json(tmp_path / n) for n in ("last-update.json", "last-assessment.json", "last-rollback.json")]
    assert old[1] is not None and (old[1]["entry"], old[1]["tries_left"]) == (None, None)  # null, as it always was
    assert _old_rolled_back(old[0], old[1], old[2], "1.0.0") == (True, "appliance", "rolled back: no right smoke completion")
    write_record(tmp_path / "last-assessment.json", dataclasses.replace(failed, ok=True, reason="", version="2.0.0"))
    old[1] = _old_read_json(tmp_path / "last-assessment.json")
    assert _old_rolled_back(*old, "1.0.0") == (True, "operator", "applianctl rollback from 2.0.0 at 2026-12-01T09:31:00Z")
    assert _old_rolled_back(*old, "2.0.0") == (False, None, None)
    last = old[0] or {}
    assert last.get("downgrade") and last.get("version") == "2.0.0"  # assess: a judged downgrade demotes newer entries

    staged = tmp_path / "staged"
    (staged / "2.0.0-20261201T092923Z-13902").mkdir(parents=True)
    record = records.Staged(version="2.0.0", directory="2.0.0-20261201T092923Z-13902", bytes=102563, files=6,
                            signer="b28ddc5ae8cc1309", source="/media/usb/bundle-2.0.0", staged_at="2026-12-01T09:29:23Z")
    write_record(staged / "staged.json", record)
    seen = _old_staged(staged / "staged.json")
    assert seen is not None and "error" not in seen
    assert (seen["version"], seen.get("source"), seen.get("staged_at")) == ("2.0.0", record.source, record.staged_at)  # apply
    assert seen.get("bytes") == record.bytes  # status line

    settings = from_json(records.EffectiveSettings, _sample("host.json")["settings"], "host.json", lenient=False)
    write_record(tmp_path / "host.json", records.HostResult(True, "", "plan", settings, ("10-appliance-host-en.network",)))
    assert _old_host(tmp_path / "host.json") == (True, "plan", ["10-appliance-host-en.network"], "gpu-07", False,
                                                 "the install plan was not applied")
    write_record(tmp_path / "host.json", records.HostResult(False, "plan refused: unsigned", "image defaults"))
    assert _old_host(tmp_path / "host.json") == (False, "image defaults", [], None, False, "plan refused: unsigned")


NEWER = {"format": 2, "added_later": {"by": "the next release"}}


def test_this_release_reads_what_a_newer_one_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a rollback the older slot reads the newer one's state: a newer format and keys it does
    not know are read leniently (the keys it knows are checked and used), never refused."""
    import applianctl.update.staged
    from appliance import paths
    from applianctl import host
    from applianctl.slots import history

    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")
    paths.update_dir().mkdir(parents=True)
    for name, path in (("last-update.json", paths.last_update_path()), ("last-assessment.json", paths.last_assessment_path()),
                       ("last-rollback.json", paths.last_rollback_path())):
        path.write_text(json.dumps({**_sample(name), **NEWER}))
    last = history.read()
    assert last.update == from_json(records.LastUpdate, _sample("last-update.json"), "x", lenient=True)
    assert last.assessment is not None and last.assessment.tries_left == 2 and last.rollback is not None
    shown = last.to_json()
    assert shown["last_rollback"] == {**_sample("last-rollback.json"), "format": 1}  # status: as this release reads it

    sample = _sample("staged.json")
    (paths.staged_update_dir() / sample["directory"]).mkdir(parents=True)
    applianctl.update.staged.record_path().write_text(json.dumps({**sample, **NEWER}))
    state = applianctl.update.staged.read()
    assert state is not None and state.problem is None and state.usable is not None and state.usable.version == "2.0.0"
    assert state.to_json() == {**sample, "format": 1}

    result = tmp_path / "host.json"
    result.write_text(json.dumps({**_sample("host.json"), **NEWER}))
    named: list[str] = []
    monkeypatch.setattr(host.socket, "sethostname", named.append)
    assert host.privileged(result, runner=lambda argv: None) == ["host name gpu-07"] and named == ["gpu-07"]
    loaded = load_record(records.HostResult, result, lenient=True)
    assert loaded is not None and loaded.settings is not None and loaded.settings.hostname == "gpu-07"
    # a known key with a wrong type is still one clear line, in a newer format too
    paths.last_rollback_path().write_text(json.dumps({**_sample("last-rollback.json"), **NEWER, "at": 5}))
    with pytest.raises(UserError, match=r"last-rollback\.json: at = 5: invalid"):
        load_record(records.LastRollback, paths.last_rollback_path(), lenient=True)
    assert history.read().rollback is None  # the readers take a damaged record as none, as read_json did


# ------------------------------------------------------------------------- lower bounds


def _numbers(cls: type, where: str = "") -> list[tuple[str, dataclasses.Field[Any]]]:
    """Every field of CLS (and the tables in it) that holds numbers: (where, field)."""
    import typing

    found = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        args = typing.get_args(tp) or (tp,)
        inner = [a for arg in args for a in (typing.get_args(arg) or (arg,))]
        if any(a in (int, float) for a in inner) and not any(a is bool for a in inner):
            found.append((f"{where}{cls.__name__}.{f.name}", f))
        found += [hit for a in inner if dataclasses.is_dataclass(a) for hit in _numbers(typing.cast(type, a), where)]
    return found


def test_every_number_in_a_device_record_has_a_lower_bound() -> None:
    """Counts, sizes and durations a guard reads back: a negative one reads as damaged."""
    classes = [c for c in vars(records).values() if isinstance(c, type) and issubclass(c, Record) and c is not Record]
    fields = [hit for cls in classes for hit in _numbers(cls)]
    assert len(fields) > 20 and "BootRecord.unclean_in_a_row" in {name for name, _ in fields}
    unbounded = [name for name, f in fields if f.metadata.get("min") != 0]
    assert unbounded == []


@pytest.mark.parametrize(("cls", "doc", "key"), [
    (records.BootRecord, {"version": "1", "boot_id": "b", "unclean_in_a_row": -1000, "started_at": "x"}, "unclean_in_a_row"),
    (records.LastAssessment, {"version": "1", "ok": False, "tries_left": -1}, "tries_left"),
    (records.Freshness, {"sequences": {"key": -5}}, "sequences.key"),
    (records.FetchJournal, {"sha256": "0" * 64, "size": 1, "length": 0, "chunks": [1, -2]}, r"chunks\[1\]"),
    (records.StartupReport, {"state": "ok", "reached_s": {"ready": -0.5}}, "reached_s.ready"),
    (records.SelftestBaseline, {"correctable_counts": {"gpu:0": -1}}, "correctable_counts.gpu:0"),
])
def test_a_number_below_its_bound_is_a_damaged_record(cls: type[Record], doc: dict[str, Any], key: str) -> None:
    with pytest.raises(UserError, match=rf"x: {key} = -[0-9.]+: invalid") as e:
        from_json(cls, doc, "x", lenient=True)
    assert "of at least 0" in e.value.hint
    from_json(cls, json.loads(json.dumps(doc).replace("-", "")), "x", lenient=True)  # 0 and up are fine


def test_the_guards_records_damaged_are_one_line_and_written_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """history's readers take a damaged record as none, with a line in the journal; its writer
    moves a directory in the record's place aside (else every write onto it fails)."""
    from appliance import paths
    from applianctl.slots import history

    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")
    paths.last_rollback_path().mkdir(parents=True)
    paths.last_assessment_path().write_text(json.dumps({**_sample("last-assessment.json"), "tries_left": -3}))
    last = history.read()
    assert last.rollback is None and last.assessment is None
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.endswith("taken as no record") for line in err), err
    assert any("last-rollback.json: is a directory" in line for line in err)
    history.write(paths.last_rollback_path(), records.LastRollback("2.0.0", "1.0.0", "operator rollback", "now"))
    assert history.read().rollback == records.LastRollback("2.0.0", "1.0.0", "operator rollback", "now")
    assert paths.last_rollback_path().with_name("last-rollback.json.damaged").is_dir()
    assert "moved to last-rollback.json.damaged" in capsys.readouterr().err
