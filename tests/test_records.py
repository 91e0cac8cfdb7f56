"""The device's records: each sample in tests/fixtures/state/ (written by the release before the
records were typed) loads, and what this release writes is what those readers read."""

from __future__ import annotations

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
