# SPDX-License-Identifier: MIT
"""Staged updates: `applianctl update --download-only SOURCE` and `--apply`, against the fake device
of test_update (temporary ESP and EFI variables, a fake `sfdisk -J`, systemd 257's `bootctl list
--json=short`, recording fakes of systemd-sysupdate, blkdiscard and systemctl)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fake_release import bundle, make_signing, usrhash_for
from test_update import RUNNING, Device, _esp, _on_trial

import applianctl.update.staged
from appliance import atomic, host_settings, paths
from appliance.errors import ConfigError, Refused, UserError
from appliance.signed.bundle_index import partuuids_from_usrhash, verify_index
from applianctl.records import Staged
from applianctl.slots import release
from applianctl.status import os_slots
from applianctl.update import command


@pytest.fixture
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Device:
    root = tmp_path / "device"
    root.mkdir()
    return Device(root, monkeypatch)


@pytest.fixture
def signing(tmp_path: Path) -> tuple[Path, Path]:
    return make_signing(tmp_path)


def staged_record() -> Staged:
    """The staged record, which must be there and usable."""
    state = applianctl.update.staged.read()
    assert state is not None and state.problem is None and state.record is not None, state
    return state.record


def download(device: Device, source: Path, trusted: Path, **kw: Any) -> int:
    return command.download_only(
        str(source), host=device.host, keys_dir=trusted, running=kw.pop("running", RUNNING), say=lambda s: None, **kw)


def apply(device: Device, trusted: Path, **kw: Any) -> int:
    return command.apply(host=device.host, keys_dir=trusted, running=kw.pop("running", RUNNING), say=lambda s: None, **kw)


def staged_dirs() -> list[str]:
    root = paths.staged_update_dir()
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


def no_slot_written(device: Device) -> None:
    """Nothing but reading the partition table: no blkdiscard, relabel, sysupdate or bootctl verb."""
    assert device.writes() == []


# ----------------------------------------------------------------------------------- download-only


def test_download_only_stages_a_verified_bundle_and_touches_no_slot(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0", usr_bytes=100_000)
    gpt, esp = device.gpt.read_text(), _esp(device)
    assert download(device, b, trusted) == 0
    no_slot_written(device)
    assert device.gpt.read_text() == gpt and _esp(device) == esp
    assert not paths.last_update_path().exists() and not paths.update_source_dir().exists()
    record = staged_record()  # there, and no error
    fetched = [f for f in b.iterdir() if not f.name.endswith(".packages.json")]  # the package manifest is never fetched
    payload = [f for f in fetched if not f.name.startswith(("bundle.json", "timestamp.json"))]
    assert (record.version, record.files, record.bytes) == ("2.0.0", len(payload), sum(f.stat().st_size for f in payload))
    assert record.source == str(b) and record.staged_at.endswith("Z")
    staged = applianctl.update.staged.directory(record)
    assert sorted(p.name for p in staged.iterdir()) == sorted(p.name for p in fetched)
    for f in fetched:
        assert (staged / f.name).read_bytes() == f.read_bytes()
    assert staged_dirs() == [record.directory]
    assert not any(paths.update_staging_dir().iterdir()), "the download directory was moved, not copied"


def test_download_only_is_allowed_while_on_trial_but_apply_is_not(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    _on_trial(device)
    esp = _esp(device)
    assert download(device, b, trusted) == 0
    with pytest.raises(UserError, match=r"^refused: the running version 1\.0\.0 is on trial") as e:
        apply(device, trusted)
    assert e.value.exit_status == 2 and e.value.hint and "\n" not in e.value.message
    no_slot_written(device)
    assert _esp(device) == esp
    assert applianctl.update.staged.read() is not None, "a refused apply keeps what was staged"


def test_download_only_refuses_what_update_refuses_before_downloading(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    with pytest.raises(Refused, match="is the running version"):
        download(device, bundle(tmp_path, key, "1.0.0"), trusted)
    with pytest.raises(UserError, match="no engine slot may be written"):
        download(device, bundle(tmp_path, key, "2.0.0", engine=True, digest="sha256:" + "ab" * 32), trusted)
    assert applianctl.update.staged.read() is None and staged_dirs() == []
    assert not paths.update_staging_dir().exists() or not any(paths.update_staging_dir().rglob("*.raw*"))


def test_a_second_download_replaces_the_first_and_a_failed_one_leaves_it(
    tmp_path: Path, device: Device, signing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, trusted = signing
    assert download(device, bundle(tmp_path, key, "2.0.0"), trusted) == 0
    first = staged_record()
    # a bundle with a damaged file: refused after downloading, the staged 2.0.0 stays whole
    bad = bundle(tmp_path, key, "2.1.0")
    efi = bad / "appliance_2.1.0.efi"
    efi.write_bytes(efi.read_bytes()[:-1] + b"X")
    with pytest.raises(Refused, match="SHA-256"):
        download(device, bad, trusted)
    assert staged_record() == first and staged_dirs() == [first.directory]
    # cut between the rename and the record: the record still names the whole first staging
    real = atomic.write_json_atomic

    def cut(path: Path, data: Any) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(atomic, "write_json_atomic", cut)
    with pytest.raises(OSError, match="power cut"):
        download(device, bundle(tmp_path, key, "2.2.0"), trusted)
    monkeypatch.setattr(atomic, "write_json_atomic", real)
    assert staged_record() == first
    first_dir = applianctl.update.staged.directory(first)
    applianctl.update.staged.verify_in_place(verify_index(*_signed(first_dir), trusted), first_dir)
    assert len(staged_dirs()) == 2, "the unnamed directory of the cut run"
    # a good second download: the record switches, the previous staging and the orphan are gone
    assert download(device, bundle(tmp_path, key, "2.3.0"), trusted) == 0
    second = staged_record()
    assert second.version == "2.3.0" and staged_dirs() == [second.directory]
    no_slot_written(device)


def _signed(directory: Path) -> tuple[bytes, bytes]:
    return (directory / "bundle.json").read_bytes(), (directory / "bundle.json.sig").read_bytes()


def test_the_same_version_again_is_neither_downloaded_nor_hashed_again(
    tmp_path: Path, device: Device, signing: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    assert download(device, b, trusted) == 0
    first = applianctl.update.staged.read()
    capsys.readouterr()
    said: list[str] = []
    assert command.download_only(str(b), host=device.host, keys_dir=trusted, running=RUNNING, say=said.append) == 0
    assert said and said[0].startswith("version 2.0.0 is already staged")
    assert capsys.readouterr().err == "", "no download or verification progress"
    assert applianctl.update.staged.read() == first


# ----------------------------------------------------------------------------------- apply


def test_apply_installs_what_was_staged(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    assert download(device, b, trusted) == 0
    record = staged_record()
    for f in b.iterdir():  # the source is gone: apply needs only what was staged
        f.unlink()
    assert apply(device, trusted) == 0
    usr_uuid, verity_uuid = partuuids_from_usrhash(usrhash_for("2.0.0"))
    calls = device.calls()
    assert [c for c in calls if c[0] == "systemd-sysupdate"] == [["systemd-sysupdate", "--no-pager", "update", "2.0.0"]]
    listed = [sorted(listing) for listing in device.sources()]
    assert listed == [sorted(["appliance_2.0.0.efi", f"appliance_2.0.0_{usr_uuid}.usr.raw",
                              f"appliance_2.0.0_{verity_uuid}.usr-verity.raw", "appliance_2.0.0.usr-verity-sig.raw"])]
    assert calls.index(["blkdiscard", "--zeroout", "/dev/vda5"]) < calls.index(["systemd-sysupdate", "--no-pager", "update", "2.0.0"])
    last = json.loads(paths.last_update_path().read_text())
    assert (last["version"], last["slot"], last["source"], last["staged_at"]) == ("2.0.0", "B", str(b), record.staged_at)
    assert applianctl.update.staged.read() is None and staged_dirs() == [], "applied: nothing staged any more"
    assert not paths.update_source_dir().exists()


def test_apply_with_nothing_staged_is_refused(device: Device, signing: Any) -> None:
    _, trusted = signing
    with pytest.raises(UserError, match=r"^nothing is staged$") as e:
        apply(device, trusted)
    assert e.value.exit_status == 2 and "--download-only" in e.value.hint
    no_slot_written(device)


@pytest.mark.parametrize(
    "victim",
    ["appliance_2.0.0.usr.raw", "appliance_2.0.0.usr-verity.raw", "appliance_2.0.0.efi", "manifest.json", "manifest.json.sig",
     "SHA256SUMS", "bundle.json", "bundle.json.sig"],
)
def test_a_staged_file_changed_on_var_is_refused_before_the_slot_is_touched(
    tmp_path: Path, device: Device, signing: Any, victim: str
) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    assert download(device, b, trusted) == 0
    record = staged_record()
    path = applianctl.update.staged.directory(record) / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if victim != "bundle.json.sig" else 10] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(Refused) as e:
        apply(device, trusted)
    assert "\n" not in e.value.message and "are discarded" in e.value.hint
    no_slot_written(device)
    assert not paths.last_update_path().exists()
    # discarded: downloading it again fetches it whole (not "already staged"), and then it applies
    assert applianctl.update.staged.read() is None and staged_dirs() == []
    assert download(device, b, trusted) == 0
    assert apply(device, trusted) == 0 and len(device.sysupdate_calls()) == 1


def test_a_staged_file_replaced_by_a_link_or_cut_short_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    assert download(device, b, trusted) == 0
    record = staged_record()
    usr = applianctl.update.staged.directory(record) / "appliance_2.0.0.usr.raw"
    copy = tmp_path / "usr-copy"
    copy.write_bytes(usr.read_bytes())
    usr.unlink()
    usr.symlink_to(copy)
    with pytest.raises(Refused, match="not a regular file"):
        apply(device, trusted)
    assert applianctl.update.staged.read() is None, "discarded"
    assert download(device, b, trusted) == 0
    record = staged_record()
    usr = applianctl.update.staged.directory(record) / "appliance_2.0.0.usr.raw"
    usr.write_bytes(usr.read_bytes()[:-1])
    with pytest.raises(Refused, match=r"bytes, bundle\.json says"):
        apply(device, trusted)
    no_slot_written(device)


def test_a_staged_bundle_not_newer_than_the_running_version_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    assert download(device, bundle(tmp_path, key, "2.0.0"), trusted) == 0
    # meanwhile 2.0.0 was installed another way and runs
    (device.esp / "EFI/Linux/appliance_1.0.0.efi").rename(device.esp / "EFI/Linux/appliance_2.0.0.efi")
    running = dataclasses.replace(RUNNING, version="2.0.0")
    with pytest.raises(UserError, match=r"^the staged bundle 2\.0\.0 is not newer than the running version 2\.0\.0$") as e:
        apply(device, trusted, running=running, allow_downgrade=True)
    assert e.value.exit_status == 2 and "--download-only" in e.value.hint
    no_slot_written(device)


def test_a_staged_downgrade_needs_allow_downgrade_at_both_steps(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "0.9.0")
    with pytest.raises(Refused, match="older than the running version"):
        download(device, b, trusted)
    assert download(device, b, trusted, allow_downgrade=True) == 0
    with pytest.raises(UserError, match=r"not newer than the running version 1\.0\.0") as e:
        apply(device, trusted)
    assert e.value.exit_status == 2
    no_slot_written(device)
    assert apply(device, trusted, allow_downgrade=True) == 0
    assert ["bootctl", "set-oneshot", "appliance_0.9.0.efi"] in device.calls()


def test_a_direct_update_discards_a_staged_one_it_supersedes(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    assert download(device, bundle(tmp_path, key, "2.0.0"), trusted) == 0
    assert command.update(str(bundle(tmp_path, key, "2.1.0")), host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None) == 0
    assert applianctl.update.staged.read() is None and staged_dirs() == []


# ----------------------------------------------------------------------------------- command line, timer, status


def _cli(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from applianctl.__main__ import main

    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["update", "--download-only", "--apply", "/b"], "--download-only and --apply are two steps"),
        (["update", "--apply", "/b"], "--apply installs what was staged and takes no SOURCE"),
        (["update", "--apply", "--from-config"], "--apply installs what was staged and takes no SOURCE"),
        (["update", "--apply", "--check"], "--check goes with a SOURCE"),
        (["update", "--apply", "--ca", "/ca.crt"], "--apply downloads nothing"),
        (["update", "--download-only", "--reboot", "/b"], "--download-only writes no slot: --reboot"),
    ],
)
def test_combinations_that_mean_nothing_are_refused_in_one_line(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(command, "apply", lambda **kw: pytest.fail("must be refused before anything runs"))
    monkeypatch.setattr(command, "download_only", lambda *a, **kw: pytest.fail("must be refused before anything runs"))
    code, out, err = _cli(argv, monkeypatch, capsys)
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 2
    assert lines[0].startswith(f"applianctl: {message}") and lines[1].startswith("hint: ")


def test_apply_with_nothing_staged_on_the_command_line(
    device: Device, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(release, "running_manifest", lambda: RUNNING)
    code, out, err = _cli(["update", "--apply", "--yes"], monkeypatch, capsys)
    assert code == 2 and out == "" and err.splitlines() == [
        "applianctl: nothing is staged", "hint: download a bundle first: `applianctl update --download-only SOURCE`"
    ]


@pytest.mark.parametrize(("action", "called"), [("install", "update"), ("download-only", "download_only")])
def test_the_timer_does_what_update_timer_action_says(
    action: str,
    called: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    appliance_json: Callable[[str], Path],
) -> None:
    path = appliance_json("demo")
    data = json.loads(path.read_text())
    assert data["update"]["timer_action"] == "install", "the default keeps today's behaviour"
    data["update"].update(url="https://updates.example.net/demo/", timer_action=action)
    path.write_text(json.dumps(data))
    monkeypatch.setenv("APPLIANCE_CONFIG", str(path))
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(command, "update", lambda spec, **kw: seen.append(("update", spec)) or 0)
    monkeypatch.setattr(command, "download_only", lambda spec, **kw: seen.append(("download_only", spec)) or 0)
    code, _, err = _cli(["update", "--from-config", "--yes"], monkeypatch, capsys)
    assert code == 0, err
    assert seen == [(called, "https://updates.example.net/demo/")]


def test_timer_action_is_checked_on_the_device_too(tmp_path: Path, appliance_json: Callable[[str], Path]) -> None:
    path = appliance_json("demo")
    data = json.loads(path.read_text())
    data["update"]["timer_action"] = "apply"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"update\.timer_action = 'apply': invalid") as e:
        host_settings.load_device(path)
    assert "'download-only'" in e.value.hint


def test_status_shows_what_is_staged(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    summary = os_slots.slots_summary(device.host, running_version="1.0.0")
    assert summary["staged"] is None and os_slots.staged_line(None) == ""
    assert download(device, bundle(tmp_path, key, "2.0.0", usr_bytes=3 << 20), trusted) == 0
    summary = os_slots.slots_summary(device.host, running_version="1.0.0")
    staged = summary["staged"]
    assert staged["version"] == "2.0.0" and staged["bytes"] > 3 << 20
    part = os_slots.probe_slots(None, lambda: summary)  # type: ignore[arg-type]
    assert part.state == "ok"
    mib = staged["bytes"] / (1 << 20)
    engine = RUNNING.engine_image.digest.removeprefix("sha256:")[:12]  # not marked running: no manifest on this host's /usr
    assert part.reason == f"A 1.0.0 booted, good; B empty; engine A {engine}; staged 2.0.0 ({mib:.1f} MiB, {staged['staged_at']})"
    # a record whose directory went missing: shown, and --apply says so
    for d in paths.staged_update_dir().iterdir():
        if d.is_dir():
            d.rename(tmp_path / "moved")
    summary = os_slots.slots_summary(device.host, running_version="1.0.0")
    assert "is missing" in summary["staged"]["error"]
    assert os_slots.staged_line(summary["staged"]).startswith("; staged update unusable: the staged directory")
    with pytest.raises(UserError, match="the staged update cannot be used"):
        apply(device, trusted)
