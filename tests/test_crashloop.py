"""The crash-loop guard (applianctl/slots/crashloop.py) on the slots model of tests/test_slots.py:
a version judged good that ends CRASH_LOOP_BOOTS boots in a row uncleanly is marked out of tries
and the machine reboots into the other slot; a clean end or a boot that served resets the count;
versions on trial are left to systemd-boot."""

from __future__ import annotations

import json
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


def test_a_damaged_count_starts_from_zero(machine: Machine, capsys: pytest.CaptureFixture[str]) -> None:
    paths.boots_record_path().parent.mkdir(parents=True, exist_ok=True)
    paths.boots_record_path().write_text("{damaged")
    _boot(machine, 0, [])
    assert _record()["unclean_in_a_row"] == 0 and "counting from zero" in capsys.readouterr().err


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
