# SPDX-License-Identifier: MIT
"""The one model of slots and boot entries (applianctl.slots.view) and `applianctl slots`.

bootctl and systemd-sysupdate output is systemd 257's (the image's; the host has 252), recorded
here in the format their JSON code writes (src/shared/bootspec.c boot_entry_to_json(),
src/sysupdate/sysupdate.c verb_list()): a counted UKI carries triesLeft/triesDone and its id
drops the counter; an automatic loader entry is listed too and must be ignored."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_release import usrhash_for
from fakeprog import fake_program

import applianctl.slots.view
from appliance import paths
from appliance.signed.bundle_index import USR_TYPE, USR_VERITY_TYPE, partuuids_from_usrhash
from applianctl.slots import release
from applianctl.slots.entries import BAD, GOOD, ON_TRIAL, parse_bootctl_list
from applianctl.slots.machine import EFI_LOADER_GUID, Host, boot_counting
from applianctl.slots.sysupdate import sysupdate_list

GIB = 1024**3
FAKE_BOOTCTL = Path(__file__).resolve().parent / "fake_bootctl.py"


def bootctl_257(esp: Path, selected: str = "appliance_2.0.0.efi") -> str:
    """`bootctl list --json=short` of systemd 257 on an appliance booted into 2.0.0 on trial
    (+2-1), with 1.0.0 judged good in the other slot, as recorded from its JSON format."""
    cmdline = f"usrhash={usrhash_for('2.0.0')} console=ttyS0"
    entries = [
        {"type": "type2", "source": "esp", "id": "appliance_2.0.0.efi", "path": f"{esp}/EFI/Linux/appliance_2.0.0+2-1.efi",
         "root": str(esp), "title": "Appliance", "showTitle": "Appliance (2.0.0)", "sortKey": "appliance", "version": "2.0.0",
         "options": cmdline, "linux": "/EFI/Linux/appliance_2.0.0+2-1.efi", "isReported": True, "triesLeft": 2, "triesDone": 1,
         "isDefault": True, "isSelected": selected == "appliance_2.0.0.efi", "addons": [], "cmdline": cmdline},
        {"type": "type2", "source": "esp", "id": "appliance_1.0.0.efi", "path": f"{esp}/EFI/Linux/appliance_1.0.0.efi",
         "root": str(esp), "title": "Appliance", "showTitle": "Appliance (1.0.0)", "sortKey": "appliance", "version": "1.0.0",
         "options": cmdline.replace(usrhash_for("2.0.0"), usrhash_for("1.0.0")), "linux": "/EFI/Linux/appliance_1.0.0.efi",
         "isReported": True, "isDefault": False, "isSelected": selected == "appliance_1.0.0.efi", "addons": [],
         "cmdline": cmdline.replace(usrhash_for("2.0.0"), usrhash_for("1.0.0"))},
        {"type": "auto", "source": "esp", "id": "auto-reboot-to-firmware-setup", "title": "Reboot Into Firmware Interface",
         "showTitle": "Reboot Into Firmware Interface", "isReported": True, "isDefault": False, "isSelected": False},
    ]
    return json.dumps(entries, separators=(",", ":"))


SYSUPDATE_257 = '{"current":"2.0.0","all":["2.0.0","1.0.0"],"appstreamUrls":[]}'
SYSUPDATE_257_PENDING = '{"current+pending":"2.0.0","all":["2.0.0","1.0.0"],"appstreamUrls":[]}'


def efi_var(directory: Path, name: str, value: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}-{EFI_LOADER_GUID}").write_bytes(b"\x06\0\0\0" + (value + "\0").encode("utf-16-le"))


class Machine:
    """Slot A holds 1.0.0, slot B 2.0.0 and is booted (its usrhash on the command line)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root, self.bin = root, root / "bin"
        self.bin.mkdir(parents=True)
        self.esp = root / "esp"
        (self.esp / "EFI/Linux").mkdir(parents=True)
        (self.esp / "EFI/Linux/appliance_1.0.0.efi").write_bytes(b"uki 1")
        (self.esp / "EFI/Linux/appliance_2.0.0+2-1.efi").write_bytes(b"uki 2")
        (root / "cmdline").write_text(f"usrhash={usrhash_for('2.0.0')} console=ttyS0\n")
        gpt = root / "gpt.json"
        a_usr, a_ver = partuuids_from_usrhash(usrhash_for("1.0.0"))
        b_usr, b_ver = partuuids_from_usrhash(usrhash_for("2.0.0"))
        parts = [
            {"node": "/dev/vda1", "size": 2048, "type": "C12A7328-F81F-11D2-BA4B-00A0C93EC93B", "uuid": "X", "name": "esp"},
            {"node": "/dev/vda2", "size": 3 * GIB // 512, "type": USR_TYPE, "uuid": a_usr.upper(), "name": "appliance_1.0.0"},
            {"node": "/dev/vda3", "size": 2048, "type": USR_VERITY_TYPE, "uuid": a_ver.upper(), "name": "appliance_1.0.0_verity"},
            {"node": "/dev/vda4", "size": 3 * GIB // 512, "type": USR_TYPE, "uuid": b_usr.upper(), "name": "appliance_2.0.0"},
            {"node": "/dev/vda5", "size": 2048, "type": USR_VERITY_TYPE, "uuid": b_ver.upper(), "name": "appliance_2.0.0_verity"},
        ]
        gpt.write_text(json.dumps({"partitiontable": {"label": "gpt", "sectorsize": 512, "partitions": parts}}))
        fake_program(self.bin, "sfdisk", script_body=f'cat "{gpt}"')
        self.recorded = root / "bootctl.json"
        self.recorded.write_text(bootctl_257(self.esp))
        self.use_recorded_bootctl()
        fake_program(self.bin, "systemd-sysupdate", stdout=SYSUPDATE_257 + "\n")
        monkeypatch.setenv("PATH", f"{self.bin}:{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_EFIVARS", str(root / "efivars"))
        monkeypatch.setattr(paths, "STATE_DIR", root / "state")
        self.host = Host(efivars=root / "efivars", cmdline=root / "cmdline", esp=self.esp, disk="/dev/vda", sfdisk="sfdisk")
        # this boot: systemd-boot booted the counted 2.0.0 entry
        efi_var(self.host.efivars, "LoaderEntrySelected", "appliance_2.0.0.efi")
        efi_var(self.host.efivars, "LoaderBootCountPath", "\\EFI\\Linux\\appliance_2.0.0+2-1.efi")

    def use_recorded_bootctl(self) -> None:
        fake_program(self.bin, "bootctl", script_body=f'cat "{self.recorded}"')

    def use_live_bootctl(self) -> None:
        """systemd 257's format computed from the ESP as it is now (after renames)."""
        fake_program(self.bin, "bootctl", script_body=f'exec {sys.executable} {FAKE_BOOTCTL} "$@"')


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Machine:
    return Machine(tmp_path / "m", monkeypatch)


def test_bootctl_257_json_is_read_and_loader_entries_ignored(machine: Machine) -> None:
    found = parse_bootctl_list(machine.recorded.read_text())
    assert [(e.version, e.state, e.tries_left, e.tries_done, e.is_default, e.is_selected) for e in found] == [
        ("2.0.0", ON_TRIAL, 2, 1, True, True),
        ("1.0.0", GOOD, None, None, False, False),
    ]
    assert found[0].path == machine.esp / "EFI/Linux/appliance_2.0.0+2-1.efi" and found[0].id == "appliance_2.0.0.efi"


def test_the_view_joins_slots_entries_and_this_boot(machine: Machine) -> None:
    view = applianctl.slots.view.read(machine.host, "2.0.0")
    assert view.errors == [] and view.entries_source == "bootctl"
    assert [(s.name, s.version, s.booted) for s in view.slots] == [("A", "1.0.0", False), ("B", "2.0.0", True)]
    assert view.booted is not None and view.booted.name == "B" and view.other is not None and view.other.name == "A"
    assert view.running_state()[0] == ON_TRIAL
    assert "2 tries left" in view.running_state()[1]
    doc = view.to_json()
    assert [(s["slot"], s["state"], s["default"]) for s in doc["slots"]] == [("A", "good", False), ("B", "on trial", True)]
    assert doc["boot_counting"]["tries_left"] == 2


def test_judged_good_is_read_from_the_entry_now_not_from_the_boot_variables(machine: Machine) -> None:
    """systemd-bless-boot renames the entry; LoaderBootCountPath still names the counted file."""
    machine.use_live_bootctl()
    (machine.esp / "EFI/Linux/appliance_2.0.0+2-1.efi").rename(machine.esp / "EFI/Linux/appliance_2.0.0.efi")
    view = applianctl.slots.view.read(machine.host, "2.0.0")
    assert boot_counting(machine.host) is not None, "this boot was counted"
    assert view.running_state()[0] == GOOD


def test_a_running_entry_out_of_tries_is_bad(machine: Machine) -> None:
    machine.use_live_bootctl()
    (machine.esp / "EFI/Linux/appliance_2.0.0+2-1.efi").rename(machine.esp / "EFI/Linux/appliance_2.0.0+0.efi")
    view = applianctl.slots.view.read(machine.host, "2.0.0")
    assert view.running_state()[0] == BAD
    # systemd-boot sorts an entry out of tries last: the other version is the default now
    assert [(e.version, e.is_default) for e in view.entries] == [("2.0.0", False), ("1.0.0", True)]


def test_without_bootctl_the_esp_is_read_and_the_view_says_so(machine: Machine) -> None:
    (machine.bin / "bootctl").unlink()
    machine.host.bootctl = str(machine.bin / "bootctl")  # not installed
    view = applianctl.slots.view.read(machine.host, "2.0.0")
    assert view.entries_source.startswith("ESP scan (bootctl:")
    assert [(e.version, e.state) for e in view.entries] == [("2.0.0", ON_TRIAL), ("1.0.0", GOOD)]
    assert view.running_state()[0] == ON_TRIAL


def test_bootctl_output_that_contradicts_the_file_name_is_not_believed(machine: Machine) -> None:
    data = json.loads(machine.recorded.read_text())
    del data[0]["triesLeft"]  # says "not counting" for a file that carries +2-1
    machine.recorded.write_text(json.dumps(data))
    view = applianctl.slots.view.read(machine.host, "2.0.0")
    assert view.entries_source.startswith("ESP scan") and "disagrees" in view.entries_source
    assert view.running_state()[0] == ON_TRIAL


def test_no_entry_for_the_running_version_is_unknown(machine: Machine) -> None:
    machine.use_live_bootctl()
    (machine.esp / "EFI/Linux/appliance_2.0.0+2-1.efi").unlink()
    state, why = applianctl.slots.view.read(machine.host, "2.0.0").running_state()
    assert state == "unknown" and "no boot entry for the running version 2.0.0" in why


def test_sysupdate_257_list_is_read(machine: Machine) -> None:
    assert sysupdate_list(str(machine.bin / "systemd-sysupdate")) == {"current": "2.0.0", "pending": False, "all": ["2.0.0", "1.0.0"]}
    fake_program(machine.bin, "systemd-sysupdate", stdout=SYSUPDATE_257_PENDING + "\n")
    assert sysupdate_list(str(machine.bin / "systemd-sysupdate"))["pending"] is True


def _cli(argv: list[str], machine: Machine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from applianctl.__main__ import main

    running = SimpleNamespace(version="2.0.0", engine_image=SimpleNamespace(digest="sha256:" + "ab" * 32))  # all it is asked
    monkeypatch.setattr(release, "running_manifest", lambda: running)
    monkeypatch.setenv("APPLIANCE_ESP_DIR", str(machine.esp))
    monkeypatch.setenv("APPLIANCE_EFIVARS_DIR", str(machine.host.efivars))
    monkeypatch.setenv("APPLIANCE_CMDLINE", str(machine.host.cmdline))
    monkeypatch.setenv("APPLIANCE_DISK", "/dev/vda")
    code = main(argv)
    return code, capsys.readouterr().out


def test_applianctl_slots_json(machine: Machine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli(["slots", "--json"], machine, monkeypatch, capsys)
    assert code == 0
    doc = json.loads(out)
    assert (doc["running_version"], doc["running_state"], doc["booted_slot"]) == ("2.0.0", "on trial", "B")
    assert [(s["slot"], s["version"], s["state"]) for s in doc["slots"]] == [("A", "1.0.0", "good"), ("B", "2.0.0", "on trial")]
    assert doc["sysupdate"] == {"current": "2.0.0", "pending": False, "all": ["2.0.0", "1.0.0"]}


def test_applianctl_slots_text(machine: Machine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli(["slots"], machine, monkeypatch, capsys)
    lines = out.splitlines()
    assert code == 0
    assert lines[0].startswith("running 2.0.0: on trial (appliance_2.0.0+2-1.efi: 2 tries left")
    assert lines[1] == "slot A /dev/vda2: 1.0.0 [good] appliance_1.0.0.efi"
    assert lines[2] == "slot B /dev/vda4: 2.0.0 [on trial] appliance_2.0.0+2-1.efi (booted, default)"
    assert "systemd-sysupdate: current 2.0.0, versions 2.0.0, 1.0.0" in lines


def test_applianctl_slots_exits_1_when_a_part_cannot_be_read(
    machine: Machine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_program(machine.bin, "sfdisk", script_body="echo 'sfdisk: cannot open /dev/vda' >&2", exit=1)
    code, out = _cli(["slots", "--no-sysupdate"], machine, monkeypatch, capsys)
    assert code == 1 and "error: sfdisk -J /dev/vda failed: sfdisk: cannot open /dev/vda" in out


def test_a_kernel_image_listed_once_per_boot_menu_profile_is_one_entry(machine: Machine) -> None:
    """bootctl lists a UKI with profiles (the factory reset entries) once per profile, each with the
    image's path: still one entry per version, booted when any of its profiles was."""
    items = json.loads(machine.recorded.read_text())
    extra = []
    for item in items:
        for n in (1, 2):
            copy = dict(item, id=f"{item.get('id', '')}@{n}", isDefault=False, isSelected=False)
            if n == 2 and "1.0.0" in str(item.get("path")):
                copy["isSelected"] = True  # this boot came through 1.0.0's factory reset entry
            extra.append(copy)
    found = parse_bootctl_list(json.dumps(items + extra))
    assert [(e.version, e.is_default, e.is_selected) for e in found] == [("2.0.0", True, True), ("1.0.0", False, True)]


def test_a_boot_through_a_boot_menu_profile_is_a_boot_of_its_version(machine: Machine) -> None:
    """systemd-boot names a UKI profile's entry FILE@PROFILE in LoaderEntrySelected."""
    efi_var(machine.host.efivars, "LoaderEntrySelected", "appliance_2.0.0.efi@factory-reset")
    view = applianctl.slots.view.read(machine.host, "2.0.0")
    assert view.booted_entry == "appliance_2.0.0.efi" and view.booted is not None and view.booted.name == "B"
