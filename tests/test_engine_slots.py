# SPDX-License-Identifier: MIT
"""The engine slots (applianctl.slots.engine) in the one slots model, against partition tables
that `sfdisk -J` (util-linux 2.38.1) printed for GPT images written with sfdisk on a plain file:
tests/fixtures/gpt/engine-slots-*.sfdisk is the input, *.sfdisk.json what `sfdisk -J` printed.

first-boot: /usr A 1.0.0, engine A `engine_e68d18b2ba50` labelled by an image of today (type
linux-generic), /usr B and engine B `_empty` as systemd-repart makes them (the appliance-engine
types). two-engines: /usr B holds 2.0.0 and engine B `engine_abababababab`, both engine slots typed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path

import pytest
from fake_release import bundle, make_signing
from fakeprog import fake_program
from test_update import RUNNING

import applianctl.slots.view
import applianctl.update.command
from appliance import paths
from appliance.errors import UserError
from appliance.signed.bundle_index import USR_TYPE, USR_VERITY_TYPE, engine_short
from applianctl.slots import command, engine, release
from applianctl.slots.engine import EngineSlot, choose_engine_slot
from applianctl.slots.machine import Host
from applianctl.slots.partitions import Partition, parse_sfdisk
from applianctl.status import os_slots

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpt"
BOOTCTL = Path(__file__).resolve().parent / "fake_bootctl.py"
E1 = "sha256:e68d18b2ba50298661bfc49baf01158fbf036645c2362cccf3e8a7a79fe6c69a"
E2 = "sha256:" + "ab" * 32
E3 = "sha256:" + "cd" * 32
ENGINE_RUNNING = dataclasses.replace(RUNNING, engine_image=dataclasses.replace(RUNNING.engine_image, digest=E1))


def table(name: str) -> list[Partition]:
    """The partitions of a recorded `sfdisk -J`, read by the model's own reader."""
    return parse_sfdisk((FIXTURES / f"engine-slots-{name}.sfdisk.json").read_text(), f"{name}.img")


# ----------------------------------------------------------------------------------- finding them


def test_the_engine_slots_of_a_first_boot_disk() -> None:
    found = engine.find(table("first-boot"), E1)
    assert [(s.name, s.data.node, s.verity.node if s.verity else None, s.short, s.empty, s.typed, s.running) for s in found] == [
        ("A", "first-boot.img4", "first-boot.img5", "e68d18b2ba50", False, False, True),
        ("B", "first-boot.img9", "first-boot.img10", None, True, True, False),
    ]


def test_the_engine_slots_once_both_are_written() -> None:
    found = engine.find(table("two-engines"), E2)
    assert [(s.name, s.short, s.typed, s.running, s.verity.label if s.verity else None) for s in found] == [
        ("A", "e68d18b2ba50", True, False, "engine_e68d18b2ba50-verity"),
        ("B", "abababababab", True, True, "engine_abababababab-verity"),
    ]
    assert not any(s.running for s in engine.find(table("two-engines"), None)), "no running digest: none is known to run"


def test_what_is_not_an_engine_slot() -> None:
    parts = table("first-boot")
    # /usr B and its verity are `_empty` too: by type they are /usr, not engine slots
    usr_b = [p for p in parts if p.label == "_empty" and p.type in (USR_TYPE, USR_VERITY_TYPE)]
    assert len(usr_b) == 2 and not any(engine.is_engine(p) or engine.is_engine_verity(p) for p in usr_b)
    # an engine label on a /usr partition, a near-miss label on an untyped one: neither
    odd = [dataclasses.replace(parts[1], label="engine_e68d18b2ba50"), dataclasses.replace(parts[3], label="engine_E68D18B2BA50"),
           dataclasses.replace(parts[3], label="engine_e68d18b2ba5")]
    assert engine.find(odd, E1) == []


def test_an_empty_slot_pairs_with_the_next_unpaired_verity_partition() -> None:
    parts = table("first-boot")
    # swap the labels of slot A's partitions to _empty on untyped partitions: not recognisable, so not slots
    untyped_empty = [dataclasses.replace(p, label="_empty") if p.number in (4, 5) else p for p in parts]
    assert [s.data.number for s in engine.find(untyped_empty, E1)] == [9]
    assert engine.find(untyped_empty, E1)[0].verity is not None
    # slot B without its verity partition
    no_verity = [p for p in parts if p.number != 10]
    assert [s.verity for s in engine.find(no_verity, E1)][1] is None


# ----------------------------------------------------------------------------------- choosing


def _slots(name: str, running: str | None, known: tuple[str, ...] = ()) -> list[EngineSlot]:
    return engine.find(table(name), running, False, known)


def test_a_new_engine_goes_to_the_empty_slot() -> None:
    choice = choose_engine_slot(_slots("first-boot", E1), {"1.0.0": E1}, E2)
    assert (choice.slot.name, choice.already_present) == ("B", False)


def test_an_engine_already_on_the_disk_is_not_written_again() -> None:
    # E1's full digest is recorded (signed data): slot A, labelled for it, holds it
    choice = choose_engine_slot(_slots("two-engines", E2, (E1,)), {"2.0.0": E2}, E1)
    assert (choice.slot.name, choice.already_present) == ("A", True)
    # only the label is known: written again, into that very slot (its label must not be on two)
    choice = choose_engine_slot(_slots("two-engines", E2), {"2.0.0": E2}, E1)
    assert (choice.slot.name, choice.already_present) == ("A", False)
    choice = choose_engine_slot(_slots("two-engines", E2), {"2.0.0": E2}, E2)
    assert (choice.slot.name, choice.already_present) == ("B", True)


def test_the_engine_of_the_version_that_leaves_may_be_written() -> None:
    # 2.0.0 runs on engine B; 1.0.0 in the other /usr slot (engine A) is replaced by the update
    choice = choose_engine_slot(_slots("two-engines", E2), {"2.0.0": E2}, E3)
    assert (choice.slot.name, choice.already_present) == ("A", False)


def test_no_slot_when_every_slot_is_running_or_in_use() -> None:
    with pytest.raises(UserError) as e:
        choose_engine_slot(_slots("two-engines", E2), {"2.0.0": E2, "1.0.0": E1}, E3)
    assert e.value.message == (
        "refused: no engine slot may be written for engine cdcdcdcdcdcd: slot A (e68d18b2ba50) is the engine of 1.0.0; "
        "slot B (abababababab) runs the engine"
    )
    assert e.value.exit_status == 2 and e.value.hint and "\n" not in e.value.hint


def test_an_entry_whose_engine_is_not_known_leaves_only_an_empty_slot() -> None:
    with pytest.raises(UserError, match=r"slot A \(e68d18b2ba50\) may be the engine of 1\.0\.0 \(not known\)"):
        choose_engine_slot(_slots("two-engines", E2), {"2.0.0": E2, "1.0.0": None}, E3)
    choice = choose_engine_slot(_slots("first-boot", E1), {"1.0.0": E1, "0.9.0": None}, E3)
    assert choice.slot.name == "B" and choice.slot.empty


def test_a_disk_with_one_engine_slot_says_how_to_get_the_second() -> None:
    one = [p for p in table("first-boot") if p.number not in (9, 10)]
    with pytest.raises(UserError, match=r"runs the engine$") as e:
        choose_engine_slot(engine.find(one, E1), {"1.0.0": E1}, E2)
    assert "one engine slot" in e.value.hint
    with pytest.raises(UserError, match="this disk has none"):
        choose_engine_slot([], {"1.0.0": E1}, E2)


def test_a_slot_without_its_verity_partition_is_not_written() -> None:
    no_verity = [p for p in table("first-boot") if p.number != 10]
    with pytest.raises(UserError, match="slot B has no verity partition"):
        choose_engine_slot(engine.find(no_verity, E1), {"1.0.0": E1}, E2)


def _verity(label: str) -> str:
    return label if label == "_empty" else label + "-verity"


E1_TWIN = E1[:19] + "3" + E1[20:]  # shares E1's first 12 hex digits, so its label


def test_the_invariant_over_every_small_case() -> None:
    """Whatever the slots hold and the entries use: the chosen slot is never the running one,
    never one a bootable entry's engine may be in, only an empty one while an engine is unknown;
    a slot counts as holding the new engine only when its full digest is known to be it; a new
    engine's label never ends up on two slots; a refusal happens only when no slot satisfies that."""
    base = table("two-engines")
    labels = ["_empty", "engine_e68d18b2ba50", "engine_abababababab", "engine_cdcdcdcdcdcd"]
    digests = [E1, E2, E3, None]
    checked = present = 0
    for la, lb, run, used, new, known in itertools.product(labels, labels, [E1, E2, E3, None], itertools.product(digests, repeat=2),
                                                           ["sha256:" + "ef" * 32, E1, E1_TWIN], [(), (E1, E2, E3)]):
        names = {4: la, 5: _verity(la), 9: lb, 10: _verity(lb)}
        parts = [dataclasses.replace(p, label=names[p.number]) if p.number in names else p for p in base]
        found = engine.find(parts, run, False, known)
        entries = {f"1.{i}": d for i, d in enumerate(used)}
        allowed = [s for s in found if not s.running and not engine.users(s, entries)
                   and (s.empty or None not in entries.values()) and s.verity is not None]
        same_label = [s for s in found if s.short == engine_short(new)]
        if same_label:
            allowed = [s for s in allowed if s in same_label] if len(same_label) == 1 else []
        try:
            choice = choose_engine_slot(found, entries, new)
        except UserError as e:
            assert allowed == [] and not any(s.digest == new for s in found), (la, lb, run, entries, new, known)
            assert "\n" not in e.message
            continue
        checked += 1
        if choice.already_present:
            present += 1
            assert choice.slot.digest == new, "present only by its full digest"
            continue
        assert choice.slot in allowed
        assert not choice.slot.running and not engine.users(choice.slot, entries)
        assert not any(s.short == engine_short(new) for s in found if s is not choice.slot), "one slot per label"
        if choice.slot.empty is False and not same_label:
            assert not any(s.empty for s in allowed), "an empty slot comes first"
    assert checked > 200 and present > 20


def test_a_slots_full_digest_comes_from_signed_data_only() -> None:
    two = table("two-engines")
    # the running slot: the running manifest's digest; the other: the one recorded digest with its label's 12 hex digits
    assert [s.digest for s in engine.find(two, E2, False, (E1,))] == [E1, E2]
    assert [s.digest for s in engine.find(two, E2, False)] == [None, E2], "only the label: not known"
    # two signed digests for one label: which one the slot holds is not known
    assert [s.digest for s in engine.find(two, E2, False, (E1, E1_TWIN))] == [None, E2]
    # one label on two slots: neither is known, not even the one taken as running
    twins = [dataclasses.replace(p, label={9: "engine_e68d18b2ba50", 10: "engine_e68d18b2ba50-verity"}.get(p.number, p.label))
             for p in two]
    assert [(s.running, s.digest) for s in engine.find(twins, E3, False, (E1,))] == [(False, None), (False, None)]
    assert [(s.running, s.digest) for s in engine.find(twins, E1, False, (E1,))] == [(True, None), (False, None)]


def test_a_twin_of_an_engine_in_use_is_refused_and_a_free_twin_is_written_again() -> None:
    # slot A holds E1 (recorded), the engine of 1.0.0: a twin of E1 cannot go to B, its label would be on two slots
    with pytest.raises(UserError, match=r"would be labelled engine_e68d18b2ba50 like engine slot A, which holds engine e68d18b2ba50"
                                        r"\w{52} and may not be written \(slot A \(e68d18b2ba50\) is the engine of 1\.0\.0\)$"):
        choose_engine_slot(_slots("two-engines", E2, (E1,)), {"2.0.0": E2, "1.0.0": E1}, E1_TWIN)
    # no entry uses slot A: it is rewritten, though slot B would be free on a first-boot disk
    choice = choose_engine_slot(_slots("first-boot", E2, (E1,)), {"2.0.0": E2}, E1_TWIN)
    assert (choice.slot.name, choice.already_present) == ("A", False)
    assert choose_engine_slot(_slots("first-boot", E2, (E1,)), {"2.0.0": E2}, E3).slot.name == "B", "an empty slot first"


# ----------------------------------------------------------------------------------- in the model and status


class Disk:
    """A device whose `sfdisk -J` is a recorded table; boot entries from systemd 257's bootctl
    format over a temporary ESP; the running version's manifest names engine E1."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, name: str, entries: list[str], running: str) -> None:
        self.esp = root / "esp"
        (self.esp / "EFI/Linux").mkdir(parents=True)
        for entry in entries:
            (self.esp / "EFI/Linux" / entry).write_bytes(b"uki")
        bin_dir = root / "bin"
        bin_dir.mkdir()
        self.gpt = root / "gpt.json"
        self.gpt.write_text((FIXTURES / f"engine-slots-{name}.sfdisk.json").read_text())
        for prog, body in (("sfdisk", f'cat "{self.gpt}"'), ("bootctl", f'exec {sys.executable} {BOOTCTL} "$@"')):
            fake_program(bin_dir, prog, script_body=body)
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_EFIVARS", str(root / "efivars"))
        monkeypatch.setattr(paths, "STATE_DIR", root / "state")
        (root / "cmdline").write_text(f"usrhash={running} rw\n")
        self.host = Host(efivars=root / "efivars", cmdline=root / "cmdline", esp=self.esp, disk=f"{name}.img", sfdisk="sfdisk")


A_HASH, B_HASH = "a" * 32 + "b" * 32, "c" * 32 + "d" * 32  # the fixtures' /usr A and B partition UUIDs


def test_the_view_knows_which_version_uses_which_engine_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2.0.0 was installed by the updater (from a bundle for engine E2) and runs; 1.0.0 (engine E1) is the other slot
    disk = Disk(tmp_path, monkeypatch, "two-engines", ["appliance_1.0.0.efi", "appliance_2.0.0.efi"], B_HASH)
    monkeypatch.setattr(release, "running_manifest", lambda: dataclasses.replace(RUNNING, version="2.0.0",
                        engine_image=dataclasses.replace(RUNNING.engine_image, digest=E2)))
    engine.record({"1.0.0": E1, "2.0.0": E2}, keep={"1.0.0", "2.0.0"})
    view = applianctl.slots.view.read(disk.host, "2.0.0")
    assert view.errors == [] and view.booted is not None and view.booted.name == "B"
    doc = view.to_json()
    assert doc["running_engine"] == E2
    assert [(e["slot"], e["partition"], e["digest"], e["running"], e["used_by"], e["typed"]) for e in doc["engine_slots"]] == [
        ("A", "two-engines.img4", "e68d18b2ba50", False, ["1.0.0"], True),
        ("B", "two-engines.img9", "abababababab", True, ["2.0.0"], True),
    ]
    assert [e["full_digest"] for e in doc["engine_slots"]] == [E1, E2], "from the record and the running manifest"
    # an update to a version with engine E3: 1.0.0 leaves with its /usr slot, so engine A is written
    choice = view.engine_slot_for(E3)
    assert (choice.slot.name, choice.already_present) == ("A", False)
    assert view.bootable_engines() == {"1.0.0": E1, "2.0.0": E2}
    # 1.0.0 marked bad (out of tries): not bootable, so its engine does not count even if it stayed
    (disk.esp / "EFI/Linux/appliance_1.0.0.efi").rename(disk.esp / "EFI/Linux/appliance_1.0.0+0-3.efi")
    bad = applianctl.slots.view.read(disk.host, "2.0.0")
    assert bad.bootable_engines() == {"2.0.0": E2}
    assert choose_engine_slot(bad.engine_slots, bad.bootable_engines(), E3).slot.name == "A"
    (disk.esp / "EFI/Linux/appliance_1.0.0+0-3.efi").rename(disk.esp / "EFI/Linux/appliance_1.0.0.efi")
    # without the record, 1.0.0's engine is not known: only an empty slot would do, and there is none
    paths.engines_record_path().unlink()
    with pytest.raises(UserError, match="no engine slot may be written"):
        seen = applianctl.slots.view.read(disk.host, "2.0.0")
        choose_engine_slot(seen.engine_slots, seen.bootable_engines(), E3)
    assert applianctl.slots.view.read(disk.host, "2.0.0").engine_slot_for(E3).slot.name == "A", "1.0.0 leaves: its engine does not count"


def test_status_and_slots_show_both_engine_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = Disk(tmp_path, monkeypatch, "first-boot", ["appliance_1.0.0.efi"], A_HASH)
    monkeypatch.setattr(release, "running_manifest", lambda: ENGINE_RUNNING)
    summary = os_slots.slots_summary(disk.host, "1.0.0")
    part = os_slots.probe_slots(None, lambda: summary)  # type: ignore[arg-type]
    assert part.reason == "A 1.0.0 booted, good; B empty; engine A e68d18b2ba50 running (1.0.0), B empty"
    lines = command.render(applianctl.slots.view.read(disk.host, "1.0.0"))
    assert "engine slot A first-boot.img4 (8 MiB): e68d18b2ba50 used by 1.0.0 (running, untyped: labelled by an older image)" in lines
    assert "engine slot B first-boot.img9 (8 MiB): _empty" in lines


def test_an_update_records_which_engine_each_version_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_update import Device

    root = tmp_path / "device"
    root.mkdir()
    device = Device(root, monkeypatch)
    key, trusted = make_signing(tmp_path)
    (device.esp / "EFI/Linux/appliance_0.9.0.efi").write_bytes(b"an entry of a version long gone")
    engine.record({"0.8.0": E3}, keep={"0.8.0"})
    source = str(bundle(tmp_path, key, "2.0.0"))
    assert applianctl.update.command.update(source, host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None) == 0
    recorded = json.loads(paths.engines_record_path().read_text())["versions"]
    digest = RUNNING.engine_image.digest
    assert recorded == {"1.0.0": digest, "2.0.0": digest}, "the running version's and the new one's; 0.8.0 has no entry"
