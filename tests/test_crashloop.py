# SPDX-License-Identifier: MIT
"""The crash-loop guard (applianctl/slots/crashloop.py) on the slots model of tests/test_slots.py:
a version judged good that ends CRASH_LOOP_BOOTS boots in a row uncleanly is marked out of tries
and the machine reboots into the other slot; a clean end or a boot that served resets the count;
versions on trial are left to systemd-boot."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fakeprog import fake_program
from test_slots import Machine

from appliance import paths
from applianctl.slots import crashloop


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Machine:
    m = Machine(tmp_path / "m", monkeypatch)
    # 2.0.0 (slot B, booted) judged good: blessed, no counter
    (m.esp / "EFI/Linux/appliance_2.0.0+2-1.efi").rename(m.esp / "EFI/Linux/appliance_2.0.0.efi")
    m.use_live_bootctl()
    boot_id = tmp_path / "boot_id"
    monkeypatch.setattr(paths, "BOOT_ID", boot_id)
    return m


def _boot(machine: Machine, n: int, reboots: list[str]) -> str:
    """Boot number N of the machine: a new boot id, then the guard's start."""
    paths.BOOT_ID.write_text(f"boot-{n}\n")
    return crashloop.begin(machine.host, running_version="2.0.0", reboot=lambda: reboots.append(f"boot-{n}"))


def _record() -> dict[str, object]:
    data: dict[str, object] = json.loads(paths.boots_record_path().read_text())
    return data


def test_three_unclean_boots_in_a_row_of_a_good_version_roll_it_back(machine: Machine) -> None:
    reboots: list[str] = []
    for n in range(crashloop.CRASH_LOOP_BOOTS):
        said = _boot(machine, n, reboots)
        assert reboots == [] and _record()["unclean_in_a_row"] == n, said
    said = _boot(machine, crashloop.CRASH_LOOP_BOOTS, reboots)
    assert reboots == [f"boot-{crashloop.CRASH_LOOP_BOOTS}"], said
    assert (machine.esp / "EFI/Linux/appliance_2.0.0+0.efi").exists()  # out of tries: 1.0.0 boots next
    assert (machine.esp / "EFI/Linux/appliance_1.0.0.efi").exists()
    last = json.loads(paths.last_rollback_path().read_text())
    assert last["from_version"] == "2.0.0" and last["to_version"] == "1.0.0"
    assert "3 boots in a row uncleanly" in last["reason"]


@pytest.mark.parametrize("good_end", ["end", "stable"])
def test_a_clean_end_or_a_boot_that_served_resets_the_count(machine: Machine, good_end: str) -> None:
    reboots: list[str] = []
    _boot(machine, 0, reboots)
    _boot(machine, 1, reboots)
    _boot(machine, 2, reboots)
    assert _record()["unclean_in_a_row"] == 2
    if good_end == "end":
        crashloop.end()
    else:
        assert "not serving yet" in crashloop.stable(serving=lambda: (False, "502"))
        crashloop.stable(serving=lambda: (True, ""))
    for n in range(3, 3 + crashloop.CRASH_LOOP_BOOTS):
        _boot(machine, n, reboots)
    assert _record()["unclean_in_a_row"] == crashloop.CRASH_LOOP_BOOTS - 1 and reboots == []
    assert (machine.esp / "EFI/Linux/appliance_2.0.0.efi").exists()


def test_the_same_boot_counted_twice_counts_once(machine: Machine) -> None:
    reboots: list[str] = []
    _boot(machine, 0, reboots)
    for _ in range(5):
        assert "counted already" in crashloop.begin(machine.host, running_version="2.0.0", reboot=lambda: reboots.append("x"))
    assert _record()["unclean_in_a_row"] == 0 and reboots == []


def test_a_version_on_trial_is_left_to_boot_counting(machine: Machine) -> None:
    (machine.esp / "EFI/Linux/appliance_2.0.0.efi").rename(machine.esp / "EFI/Linux/appliance_2.0.0+2-1.efi")
    reboots: list[str] = []
    for n in range(crashloop.CRASH_LOOP_BOOTS + 2):
        said = _boot(machine, n, reboots)
    assert "systemd-boot counts its tries" in said and reboots == [] and _record()["unclean_in_a_row"] == 0


def test_with_nothing_good_to_go_back_to_it_stays(machine: Machine) -> None:
    (machine.esp / "EFI/Linux/appliance_1.0.0.efi").rename(machine.esp / "EFI/Linux/appliance_1.0.0+0-3.efi")
    reboots: list[str] = []
    for n in range(crashloop.CRASH_LOOP_BOOTS + 1):
        said = _boot(machine, n, reboots)
    assert "no version to go back to (1.0.0 is out of tries), so it stays" in said and reboots == []
    assert (machine.esp / "EFI/Linux/appliance_2.0.0.efi").exists()


def test_slots_it_cannot_read_are_named_as_the_reason_it_stays(machine: Machine) -> None:
    """The extended crashloop group's boot loop: the guard's sandbox kept sfdisk from the disk, so
    it saw no slots and said only that there was nothing to go back to. Now it says why."""
    fake_program(machine.bin, "sfdisk", script_body="echo 'sfdisk: cannot open /dev/vda: Operation not permitted' >&2", exit=1)
    reboots: list[str] = []
    for n in range(crashloop.CRASH_LOOP_BOOTS + 1):
        said = _boot(machine, n, reboots)
    assert "no version to go back to (slots read: none; sfdisk -J /dev/vda failed: sfdisk: cannot open" in said, said
    assert reboots == []


def _previous_boot(**record: object) -> None:
    """The record the previous boot of 2.0.0 left (its count as given)."""
    paths.boots_record_path().parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": 1, "version": "2.0.0", "boot_id": "boot-prev", "unclean_in_a_row": 0, "started_at": "x", **record}
    paths.boots_record_path().write_text(json.dumps(doc))


def _damage(kind: str, tmp_path: Path) -> None:
    where = paths.boots_record_path()
    where.parent.mkdir(parents=True, exist_ok=True)
    if kind == "not JSON":
        where.write_text("{damaged")
    elif kind == "a negative count":
        _previous_boot(unclean_in_a_row=-1000)
    elif kind == "a count that is a string":
        _previous_boot(unclean_in_a_row="2")
    elif kind == "a directory":
        where.mkdir()
        (where / "inside").write_text("x")
    elif kind == "a FIFO":
        os.mkfifo(where)
    elif kind == "a link":
        target = tmp_path / "elsewhere.json"
        target.write_text(json.dumps({"format": 1, "version": "2.0.0", "boot_id": "boot-prev", "unclean_in_a_row": 0,
                                      "started_at": "x"}))
        where.symlink_to(target)


DAMAGE = ["not JSON", "a negative count", "a count that is a string", "a directory", "a FIFO", "a link"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_record_counts_as_one_unclean_boot_and_is_replaced(machine: Machine, tmp_path: Path, kind: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Counting from zero would let a crash that damages the record reset the count every boot."""
    _damage(kind, tmp_path)
    said = _boot(machine, 0, [])
    err = capsys.readouterr().err
    assert "counted as 1 unclean boot(s) of 2.0.0" in err and len(err.splitlines()) <= 2, err
    assert paths.boots_record_path().is_file() and not paths.boots_record_path().is_symlink()
    assert _record()["unclean_in_a_row"] == 1 and _record()["boot_id"] == "boot-0", said
    if kind == "a link":
        assert json.loads((tmp_path / "elsewhere.json").read_text())["boot_id"] == "boot-prev"  # never written through


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_record_never_switches_the_guard_off(machine: Machine, tmp_path: Path, kind: str) -> None:
    """At unclean_in_a_row = -1000, or with a directory in the record's place (the write crashed), no
    rollback came within ten unclean boots: now the version goes back within CRASH_LOOP_BOOTS."""
    _damage(kind, tmp_path)
    reboots: list[str] = []
    for n in range(crashloop.CRASH_LOOP_BOOTS):
        _boot(machine, n, reboots)
    assert reboots == [f"boot-{crashloop.CRASH_LOOP_BOOTS - 1}"]
    assert (machine.esp / "EFI/Linux/appliance_2.0.0+0.efi").exists()


def test_a_directory_in_the_records_place_is_moved_aside(machine: Machine) -> None:
    where = paths.boots_record_path()
    where.parent.mkdir(parents=True, exist_ok=True)
    (where.with_name("boots.json.damaged") / "older").mkdir(parents=True)  # what an earlier damage left
    where.mkdir()
    (where / "inside").write_text("kept for a look")
    _boot(machine, 0, [])
    assert (where.with_name("boots.json.damaged") / "inside").read_text() == "kept for a look"
    assert _record()["unclean_in_a_row"] == 1


def test_a_record_that_cannot_be_written_still_rolls_back(machine: Machine, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.errors import UserError
    from applianctl.slots import history

    _previous_boot(unclean_in_a_row=crashloop.CRASH_LOOP_BOOTS - 1)

    def refuse(path: Path, record: object) -> None:
        raise UserError(f"{path}: cannot write (No space left on device)", hint="")

    monkeypatch.setattr(history, "write", refuse)
    reboots: list[str] = []
    _boot(machine, 0, reboots)
    assert reboots == ["boot-0"] and "this boot is not counted" in capsys.readouterr().err


def test_a_directory_where_the_rollback_is_recorded_never_stops_the_rollback(machine: Machine) -> None:
    paths.last_rollback_path().mkdir(parents=True)
    _previous_boot(unclean_in_a_row=crashloop.CRASH_LOOP_BOOTS - 1)
    reboots: list[str] = []
    _boot(machine, 0, reboots)
    assert reboots == ["boot-0"] and (machine.esp / "EFI/Linux/appliance_2.0.0+0.efi").exists()
    assert json.loads(paths.last_rollback_path().read_text())["to_version"] == "1.0.0"


def test_a_damaged_record_marks_nothing_and_says_so(machine: Machine, capsys: pytest.CaptureFixture[str]) -> None:
    paths.boots_record_path().parent.mkdir(parents=True, exist_ok=True)
    paths.boots_record_path().mkdir()
    paths.BOOT_ID.write_text("boot-0\n")
    assert "nothing to mark" in crashloop.end()
    assert "boots.json: is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["a link", "a FIFO", "no id"])
def test_the_boot_id_is_read_as_a_file_someone_else_could_have_written(machine: Machine, tmp_path: Path, kind: str) -> None:
    from appliance.errors import UserError

    if kind == "a link":
        real = tmp_path / "real-boot-id"
        real.write_text("boot-0\n")
        paths.BOOT_ID.symlink_to(real)
    elif kind == "a FIFO":
        os.mkfifo(paths.BOOT_ID)  # a plain read would wait here for ever
    else:
        paths.BOOT_ID.write_text("\n\n")
    with pytest.raises(UserError, match="boot_id: "):
        crashloop.begin(machine.host, running_version="2.0.0", reboot=lambda: None)
    assert not paths.boots_record_path().exists()


def test_the_units_count_before_the_engine_and_mark_clean_on_stop() -> None:
    root = Path(__file__).resolve().parents[1] / "units"
    unit = (root / "appliance-crashloop.service").read_text().splitlines()
    assert "ExecStart=/usr/bin/applianctl crashloop begin" in unit and "ExecStop=/usr/bin/applianctl crashloop end" in unit
    assert "RemainAfterExit=yes" in unit  # else the stop (the clean mark) would run right after the start
    engine = (root / "appliance-engine@.container.j2").read_text().splitlines()  # every replica after it
    assert any(line.startswith("After=") and "appliance-crashloop.service" in line.split("=")[1].split() for line in engine)
    timer = (root / "appliance-crashloop-stable.timer").read_text()
    assert f"OnBootSec={crashloop.STABLE_AFTER_S // 60}min" in timer
    preset = (root / "appliance.preset.j2").read_text().splitlines()
    assert "enable appliance-crashloop.service" in preset and "enable appliance-crashloop-stable.timer" in preset


def test_status_says_the_appliance_rolled_back_and_shows_the_count(machine: Machine) -> None:
    from applianctl.status import os_slots

    reboots: list[str] = []
    for n in range(crashloop.CRASH_LOOP_BOOTS + 1):
        _boot(machine, n, reboots)
    # what 1.0.0 (slot A, booted next) shows
    summary = os_slots.slots_summary(machine.host, running_version="1.0.0")
    assert summary["rolled_back"] is True and summary["rolled_back_by"] == "appliance", summary
    assert "ended 3 boots in a row uncleanly" in summary["rollback_reason"]
    assert summary["crash_loop"]["version"] == "2.0.0" and summary["crash_loop"]["unclean_in_a_row"] == 3
