# SPDX-License-Identifier: MIT
"""`applianctl update` and `rollback` against a fake device: a temporary ESP, EFI variables and
kernel command line, a fake `sfdisk -J` with two /usr slots, systemd 257's `bootctl list
--json=short` over that ESP (fake_bootctl.py), and fakes of systemd-sysupdate, bootctl's other
verbs and systemctl on PATH that only record how they were called. Downloads come from a real
HTTPS server on loopback with a CA made for the test."""

from __future__ import annotations

import configparser
import dataclasses
import hashlib
import http.server
import json
import os
import shutil
import ssl
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import fakeprog
import pytest
from fake_release import bundle, demo_config, fake_build, make_signing, store_roothash_for, usrhash_for
from fakeprog import fake_program, sh_record
from test_fetch import make_ca, make_server_cert

import applianctl.slots.engine
import applianctl.update.command
import applianctl.update.staged
import builder.keys
import builder.release
from appliance import atomic, fetch, paths
from appliance.errors import Refused, UserError
from appliance.signed import bundle_index, release_manifest, timestamp
from appliance.signed.bundle_index import (
    ENGINE_TYPE,
    ENGINE_VERITY_TYPE,
    USR_TYPE,
    USR_VERITY_SIG_TYPE,
    USR_VERITY_TYPE,
    engine_short,
    partuuids_from_usrhash,
    source_names,
)
from applianctl.records import LastRollback
from applianctl.slots import release, rollback
from applianctl.slots.machine import EFI_LOADER_GUID, Host, boot_counting
from applianctl.status import os_slots
from applianctl.update import download
from builder.https_server import HTTPSServer

GIB = 1024**3
TRANSFERS = Path(__file__).resolve().parents[1] / "image/mkosi.extra/usr/lib/sysupdate.d"

BOOTCTL = Path(__file__).resolve().parent / "fake_bootctl.py"

# the fakes' bodies, after each has recorded its call (fakeprog); systemd-sysupdate also records
# which files its source directory holds when it is called, one listing per call (Device.sources)
FAKE_BODY = {
    "systemd-sysupdate": 'cd "$FAKE_SOURCE" 2>/dev/null && (set -- *; [ -e "$1" ] || set --; {record})',
    "systemctl": "",
    "sfdisk": 'if [ "$1" = -J ]; then cat "$FAKE_GPT"; fi',
    "blkdiscard": "",
}


def efi_var(directory: Path, name: str, value: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}-{EFI_LOADER_GUID}").write_bytes(b"\x06\0\0\0" + (value + "\0").encode("utf-16-le"))


class Device:
    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.log = root / "calls.log"
        self.sources_log = root / "sources.log"
        self.gpt = root / "gpt.json"
        bin_dir = root / "bin"
        bin_dir.mkdir()
        for name, body in FAKE_BODY.items():
            fake_program(bin_dir, name, script_body=body.format(record=sh_record(self.sources_log, "source")), log=self.log)
        # bootctl: systemd 257's `list --json=short` over this ESP; other verbs only recorded
        fake_program(bin_dir, "bootctl", script_body=f'exec {sys.executable} {BOOTCTL} "$@"', log=self.log)
        monkeypatch.setenv("FAKE_EFIVARS", str(root / "efivars"))
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        monkeypatch.setenv("FAKE_GPT", str(self.gpt))
        monkeypatch.setattr(paths, "STATE_DIR", root / "state")
        monkeypatch.setenv("FAKE_SOURCE", str(paths.update_source_dir()))
        self.esp = root / "esp"
        (self.esp / "EFI/Linux").mkdir(parents=True)
        (self.esp / "EFI/Linux/appliance_1.0.0.efi").write_bytes(b"uki 1")
        self.cmdline = root / "cmdline"
        self.cmdline.write_text(f"usrhash={usrhash_for('1.0.0')} rw\n")
        self.host = Host(efivars=root / "efivars", cmdline=self.cmdline, esp=self.esp, disk="/dev/vda", sfdisk="sfdisk")
        self.set_gpt("appliance_1.0.0", "_empty")

    def set_gpt(
        self, label_a: str, label_b: str, b_bytes: int = 3 * GIB, b_uuid: str = "11111111-2222-3333-4444-555555555555",
        engine_b: str | None = None, signatures: bool = True,
    ) -> None:
        """The disk: /usr A and B, engine slot A as images of today label it (linux-generic,
        engine_D12 of the running engine), and with ENGINE_B an engine slot B of the
        appliance-engine type labelled ENGINE_B (e.g. _empty) as systemd-repart makes it."""
        a_usr, a_verity = partuuids_from_usrhash(usrhash_for("1.0.0"))
        engine = f"engine_{engine_short(RUNNING.engine_image.digest)}"
        linux = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
        slot_b = [] if engine_b is None else [
            {"node": "/dev/vda9", "size": 8192, "type": ENGINE_TYPE, "uuid": "99999999-2222-3333-4444-555555555555", "name": engine_b},
            {"node": "/dev/vda10", "size": 2048, "type": ENGINE_VERITY_TYPE, "uuid": "10101010-2222-3333-4444-555555555555",
             "name": engine_b if engine_b == "_empty" else engine_b + "-verity"},
        ]
        parts = [
            {"node": "/dev/vda1", "size": 1048576, "type": "C12A7328-F81F-11D2-BA4B-00A0C93EC93B", "uuid": "X", "name": "esp"},
            {"node": "/dev/vda2", "size": 3 * GIB // 512, "type": USR_TYPE, "uuid": a_usr.upper(), "name": label_a},
            {"node": "/dev/vda3", "size": 131072, "type": USR_VERITY_TYPE, "uuid": a_verity.upper(), "name": label_a + "_verity"},
            {"node": "/dev/vda5", "size": b_bytes // 512, "type": USR_TYPE, "uuid": b_uuid, "name": label_b},
            {
                "node": "/dev/vda6", "size": 131072, "type": USR_VERITY_TYPE, "uuid": "66666666-2222-3333-4444-555555555555",
                "name": label_b + ("_verity" if label_b != "_empty" else ""),
            },
            *([{"node": "/dev/vda4", "size": 32, "type": USR_VERITY_SIG_TYPE, "uuid": "44444444-2222-3333-4444-555555555555",
                 "name": label_a + "_verity_sig"},
               {"node": "/dev/vda11", "size": 32, "type": USR_VERITY_SIG_TYPE, "uuid": "11111111-4444-3333-4444-555555555555",
                "name": label_b + ("_verity_sig" if label_b != "_empty" else "")}] if signatures else []),
            {"node": "/dev/vda7", "size": 8192, "type": linux, "uuid": "77777777-2222-3333-4444-555555555555", "name": engine},
            {"node": "/dev/vda8", "size": 2048, "type": linux, "uuid": "88888888-2222-3333-4444-555555555555", "name": engine + "-verity"},
            *slot_b,
        ]
        self.gpt.write_text(json.dumps({"partitiontable": {"label": "gpt", "sectorsize": 512, "partitions": parts}}))

    def calls(self, program: str | None = None) -> list[list[str]]:
        """Every recorded call, PROGRAM's only if given, as its argument vector (program first),
        except bootctl's reads (`bootctl --no-pager list ...`)."""
        return [c for c in fakeprog.calls(self.log, program) if c[:3] != ["bootctl", "--no-pager", "list"]]

    def sources(self) -> list[list[str]]:
        """What the source directory held at each systemd-sysupdate call, in order: one listing per call."""
        return [listing[1:] for listing in fakeprog.calls(self.sources_log)]

    def writes(self) -> list[list[str]]:
        """The calls that change something (all but reading the partition table)."""
        return [c for c in self.calls() if c[:2] != ["sfdisk", "-J"]]

    def sysupdate_calls(self) -> list[list[str]]:
        return self.calls("systemd-sysupdate")


@pytest.fixture
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Device:
    root = tmp_path / "device"
    root.mkdir()
    return Device(root, monkeypatch)


@pytest.fixture(name="signing")
def signing_fixture(tmp_path: Path) -> tuple[Path, Path]:
    return make_signing(tmp_path)


def running_manifest(version: str = "1.0.0") -> release_manifest.Manifest:
    """The running version's release manifest, as release.running_manifest() reads it from /usr."""
    config = demo_config(version)
    digest = config.engine.digest
    engine = {"reference": config.engine.reference, "digest": digest, "store_label": f"engine_{engine_short(digest)}",
              "store_roothash": store_roothash_for(digest)}
    return release_manifest.load({
        "version": version, "min_version": "0", "build_time": "2026-01-01T00:00:00Z", "profile": "demo", "engine_image": engine,
        "model": {"id": config.model.id, "revision": config.model.revision}, "kernel_version": "6.12.38+deb13-amd64",
        "files": [], "signer": "0123456789abcdef",
    })


RUNNING = running_manifest()


def run_update(device: Device, source: str, trusted: Path, **kw: Any) -> int:
    return applianctl.update.command.update(
        source, host=device.host, keys_dir=trusted, running=kw.pop("running", RUNNING), say=lambda s: None, **kw)


# ----------------------------------------------------------------------------------- the good path


def test_update_from_directory_writes_the_inactive_slot_through_sysupdate(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    assert run_update(device, str(b), trusted) == 0
    usr_uuid, verity_uuid = partuuids_from_usrhash(usrhash_for("2.0.0"))
    calls = device.calls()
    assert [c for c in calls if c[0] == "systemd-sysupdate"] == [["systemd-sysupdate", "--no-pager", "update", "2.0.0"]]
    listed = [sorted(listing) for listing in device.sources()]
    assert listed == [sorted(["appliance_2.0.0.efi", f"appliance_2.0.0_{usr_uuid}.usr.raw",
                              f"appliance_2.0.0_{verity_uuid}.usr-verity.raw", "appliance_2.0.0.usr-verity-sig.raw"])]
    assert not any(c[0] in ("systemctl", "bootctl") for c in calls)  # no reboot asked, not a downgrade
    last = json.loads(paths.last_update_path().read_text())
    assert last["version"] == "2.0.0" and last["slot"] == "B" and last["downgrade"] is False
    assert not paths.update_source_dir().exists()  # cleaned after the write


def test_an_engine_image_the_appliance_has_is_never_downloaded(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0", engine=True)  # released without --previous: carries the same engine
    assert run_update(device, str(b), trusted, reboot=True) == 0
    assert not list(paths.update_staging_dir().glob("*/engine_*"))
    calls = [c for c in device.calls() if c[0] not in ("sfdisk", "blkdiscard")]
    assert calls == [["systemd-sysupdate", "--no-pager", "update", "2.0.0"], ["systemctl", "reboot"]]


def test_a_new_engine_on_a_disk_with_one_engine_slot_is_refused_before_any_download(tmp_path: Path, device: Device,
                                                                                     signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0", engine=True, digest="sha256:" + "ab" * 32)
    # a disk of before: one engine slot, running: the invariant refuses, naming what holds the slot
    with pytest.raises(UserError, match=r"^refused: no engine slot may be written for engine abababababab: slot A \(\w{12}\) runs") as e:
        run_update(device, str(b), trusted)
    assert "one engine slot" in e.value.hint and device.writes() == []
    assert not paths.update_staging_dir().exists() or not any(paths.update_staging_dir().rglob("*.raw*"))


@pytest.mark.programs
def test_a_new_engine_goes_into_the_free_engine_slot_first_then_usr(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0", engine=True, digest="sha256:" + "ab" * 32)
    device.set_gpt("appliance_1.0.0", "_empty", engine_b="_empty")
    assert run_update(device, str(b), trusted) == 0
    writes = device.writes()
    # the engine slot B (vda9, vda10) is zeroed, then written by the engine component; only then /usr
    assert writes == [["blkdiscard", "--zeroout", "/dev/vda9"], ["blkdiscard", "--zeroout", "/dev/vda10"],
                      ["systemd-sysupdate", "--no-pager", "--component=engine", "update", "abababababab"],
                      ["blkdiscard", "--zeroout", "/dev/vda5"], ["blkdiscard", "--zeroout", "/dev/vda6"],
                      ["blkdiscard", "--zeroout", "/dev/vda11"], ["systemd-sysupdate", "--no-pager", "update", "2.0.0"]]
    # never the running engine's partitions (vda7, vda8)
    assert not any("/dev/vda7" in a or "/dev/vda8" in a for c in device.calls() for a in c)
    assert not any(c[-2:] in (["7", "_empty"], ["8", "_empty"]) for c in device.calls())
    assert device.sources()[0] == ["engine_abababababab.raw", "engine_abababababab.verity.raw"]  # the engine component's
    # which engine each version runs, for the next choice
    assert applianctl.slots.engine.recorded()["2.0.0"] == "sha256:" + "ab" * 32


def test_an_engine_the_appliance_has_in_its_other_slot_is_not_downloaded_again(tmp_path: Path, device: Device,
                                                                               signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0", engine=True, digest="sha256:" + "ab" * 32)
    device.set_gpt("appliance_1.0.0", "_empty", engine_b="engine_abababababab")
    # slot B's full digest is known from signed data (an earlier install recorded it), not only its label
    applianctl.slots.engine.record({"1.5.0": "sha256:" + "ab" * 32}, keep={"1.5.0"})
    assert run_update(device, str(b), trusted) == 0
    assert not any(a.startswith("--component") for c in device.sysupdate_calls() for a in c)
    assert not list(paths.update_staging_dir().glob("*/engine_*"))


def test_a_new_engine_the_bundle_does_not_carry_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0", digest="sha256:" + "ab" * 32)  # released as if the target had it
    device.set_gpt("appliance_1.0.0", "_empty", engine_b="_empty")
    _refused(device, str(b), trusted, "does not have, and does not carry it")


# ----------------------------------------------------------------------------------- refusals


def _refused(device: Device, source: str, trusted: Path, match: str, **kw: Any) -> None:
    with pytest.raises(Refused, match=match) as e:
        run_update(device, source, trusted, **kw)
    assert e.value.exit_status == 1
    assert device.sysupdate_calls() == [], "nothing may be written when verification fails"
    assert "\n" not in e.value.message


@pytest.mark.parametrize(
    "victim",
    ["appliance_2.0.0.usr.raw", "appliance_2.0.0.usr-verity.raw", "appliance_2.0.0.efi", "manifest.json", "manifest.json.sig", "SHA256SUMS",
     "bundle.json", "bundle.json.sig"],
)
def test_a_flipped_byte_in_any_file_is_refused(tmp_path: Path, device: Device, signing: Any, victim: str) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    path = b / victim
    data = bytearray(path.read_bytes())
    where = len(data) // 2 if victim != "bundle.json.sig" else 10
    data[where] ^= 0x01
    path.write_bytes(bytes(data))
    _refused(device, str(b), trusted, ".")


def test_a_bundle_signed_by_an_untrusted_key_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    from builder import keys

    _, trusted = signing
    other, _ = keys.generate(tmp_path / "other-keys")
    b = bundle(tmp_path, other, "2.0.0")
    _refused(device, str(b), trusted, "not trust")


def test_a_truncated_signature_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    sig = b / "bundle.json.sig"
    sig.write_bytes(sig.read_bytes()[:40] + b"\n")
    _refused(device, str(b), trusted, "truncated|malformed")


def test_a_downgrade_is_refused_unless_asked_for(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "0.9.0")
    _refused(device, str(b), trusted, "older than the running version 1.0.0")
    assert run_update(device, str(b), trusted, allow_downgrade=True) == 0
    assert ["bootctl", "set-oneshot", "appliance_0.9.0.efi"] in device.calls()
    assert json.loads(paths.last_update_path().read_text())["downgrade"] is True


def test_the_running_version_again_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "1.0.0")
    _refused(device, str(b), trusted, "is the running version", allow_downgrade=True)


def test_min_version_is_enforced(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "3.0.0", min_version="2.0.0")
    _refused(device, str(b), trusted, "only be installed over 2.0.0")
    (device.esp / "EFI/Linux/appliance_1.0.0.efi").rename(device.esp / "EFI/Linux/appliance_2.0.0.efi")  # now running 2.0.0
    assert run_update(device, str(b), trusted, running=dataclasses.replace(RUNNING, version="2.0.0")) == 0


def test_a_bundle_of_another_profile_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    _refused(device, str(b), trusted, "profile", running=dataclasses.replace(RUNNING, profile="production"))


def test_a_bundle_larger_than_the_inactive_slot_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0", usr_bytes=8192)
    device.set_gpt("appliance_1.0.0", "_empty", b_bytes=4096)
    _refused(device, str(b), trusted, "larger than slot B")


def test_an_unknown_file_in_the_index_is_refused_before_any_download(tmp_path: Path, device: Device, signing: Any) -> None:
    from appliance.signed import release_manifest

    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    index = json.loads((b / "bundle.json").read_text())
    index["files"].append({"name": "evil.sh", "sha256": "0" * 64, "size": 1})
    data = release_manifest.canonical(index)
    (b / "bundle.json").write_bytes(data)
    (b / "bundle.json.sig").write_bytes(release_manifest.encode_signature(release_manifest.load_private_key(key).sign(data)))
    _refused(device, str(b), trusted, "not that of a release bundle")


@pytest.mark.parametrize("key_name", ["version", "min_version"])
def test_a_signed_index_with_a_5000_digit_version_is_one_refusal(tmp_path: Path, device: Device, signing: Any,
                                                                 key_name: str) -> None:
    # past Python's int-string limit (4300 digits): refused by the index's schema, never a ValueError
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    index = json.loads((b / "bundle.json").read_text())
    index[key_name] = "9" * 5000
    data = release_manifest.canonical(index)
    (b / "bundle.json").write_bytes(data)
    (b / "bundle.json.sig").write_bytes(release_manifest.encode_signature(release_manifest.load_private_key(key).sign(data)))
    with pytest.raises(Refused, match=f"bundle.json: {key_name} = '9+\\.\\.\\.: expected up to four numbers of up to 9 digits"):
        bundle_index.verify_index(data, (b / "bundle.json.sig").read_bytes(), trusted)
    _refused(device, str(b), trusted, "expected up to four numbers of up to 9 digits")


def test_a_half_written_slot_is_relabelled_and_written_again(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    device.set_gpt("appliance_1.0.0", "appliance_2.0.0")  # labelled, but no boot entry: interrupted
    assert run_update(device, str(b), trusted) == 0
    calls = device.calls()
    relabel = [i for i, c in enumerate(calls) if c == ["sfdisk", "--part-label", "/dev/vda", "5", "_empty"]]
    zero = [i for i, c in enumerate(calls) if c in (["blkdiscard", "--zeroout", "/dev/vda5"], ["blkdiscard", "--zeroout", "/dev/vda6"])]
    write = [i for i, c in enumerate(calls) if c[0] == "systemd-sysupdate"]
    assert relabel and len(zero) == 2 and write and zero[0] < zero[1] < relabel[0] < write[0]


def test_the_old_version_in_the_inactive_slot_loses_its_entry_before_the_slot_is_blanked(
    tmp_path: Path, device: Device, signing: Any
) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    device.set_gpt("appliance_1.0.0", "appliance_0.9.0")
    old_entry = device.esp / "EFI/Linux/appliance_0.9.0.efi"
    old_entry.write_bytes(b"uki 0.9")
    assert run_update(device, str(b), trusted) == 0
    assert not old_entry.exists()
    assert (device.esp / "EFI/Linux/appliance_1.0.0.efi").exists(), "the running version's entry is never touched"
    calls = device.calls()
    assert ["blkdiscard", "--zeroout", "/dev/vda5"] in calls and ["blkdiscard", "--zeroout", "/dev/vda2"] not in calls


def test_a_disk_installed_without_the_boot_menu_pin_gets_it_before_the_slot_is_written(
    tmp_path: Path, device: Device, signing: Any
) -> None:
    """The new version's kernel image carries factory reset profiles, which systemd-boot 257 sorts
    before its main entry: the update pins loader.conf's default first, keeping the rest."""
    from appliance.signed.bundle_index import DEFAULT_ENTRY

    key, trusted = signing
    conf = device.esp / "loader/loader.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text("editor no\ndefault @saved\n")
    assert run_update(device, str(bundle(tmp_path, key, "2.0.0")), trusted) == 0
    assert conf.read_text().splitlines() == ["editor no", f"default {DEFAULT_ENTRY}"]
    from applianctl.update.install import pin_default_entry

    assert pin_default_entry(device.host) is False  # pinned already: not written again


@pytest.mark.programs  # a sparse GiB image: only cp --sparse copies it quickly
def test_the_usr_images_ship_without_their_trailing_zeros(tmp_path: Path, signing: Any) -> None:
    key, trusted = signing
    config = demo_config("2.0.0")
    out = fake_build(tmp_path / "out", config, key)
    usr = out / "appliance_2.0.0.usr.raw"
    with open(usr, "r+b") as f:  # a sparse tail of zeros, as mkosi leaves the 3 GiB slot image
        data_len = f.seek(0, 2)
        f.truncate(3 * GIB)
    b = tmp_path / "bundle"
    builder.release.make_bundle(config, out, b, key)
    index = bundle_index.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)
    shipped = (b / "appliance_2.0.0.usr.raw").stat().st_size
    assert shipped == -(-data_len // 4096) * 4096
    assert index.partition_sizes["appliance_2.0.0.usr.raw"] == 3 * GIB
    assert (b / "appliance_2.0.0.usr.raw").read_bytes()[:data_len] == usr.read_bytes()[:data_len]


def test_an_installed_version_is_not_written_twice(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    device.set_gpt("appliance_1.0.0", "appliance_2.0.0")
    (device.esp / "EFI/Linux/appliance_2.0.0+3-0.efi").write_bytes(b"uki 2")
    assert run_update(device, str(b), trusted) == 0
    assert device.sysupdate_calls() == []


def test_one_plan_decides_for_every_verb(tmp_path: Path, device: Device, signing: Any) -> None:
    """--check prints the plan that update, --download-only and --apply act on: "already installed"
    is the plan's, and each verb says so the same way without writing a slot."""
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    plan = applianctl.update.command.check(str(b), host=device.host, keys_dir=trusted, running=RUNNING)
    assert sorted(plan.to_json()) == ["already_installed", "blocked", "downgrade", "download_bytes", "engine", "engine_slot",
                                      "engine_written", "expires", "files", "rolled_back", "running_version", "sequence", "signer",
                                      "slot", "slot_holds", "source", "version"]
    assert plan.already_installed is False and plan.download_bytes == sum(f.size for f in plan.files)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.downgrade = True  # type: ignore[misc]
    assert applianctl.update.command.download_only(str(b), host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None) == 0
    device.set_gpt("appliance_1.0.0", "appliance_2.0.0")
    (device.esp / "EFI/Linux/appliance_2.0.0+3-0.efi").write_bytes(b"uki 2")
    plan = applianctl.update.command.check(str(b), host=device.host, keys_dir=trusted, running=RUNNING)
    assert plan.already_installed and plan.to_json()["already_installed"] is True
    for verb in (applianctl.update.command.update, applianctl.update.command.download_only):
        said: list[str] = []
        assert verb(str(b), host=device.host, keys_dir=trusted, running=RUNNING, say=said.append) == 0
        assert said == ["version 2.0.0 is already installed in slot B; reboot to start it"]
    said = []
    assert applianctl.update.command.apply(host=device.host, keys_dir=trusted, running=RUNNING, say=said.append) == 0
    assert said == ["version 2.0.0 is already installed in slot B; reboot to start it"]
    assert device.writes() == [] and applianctl.update.staged.read() is None, "the staged copy of what is installed is discarded"


# ----------------------------------------------------------------------------------- HTTP, resumed


class _Server:
    """A static HTTPS file server on loopback with HTTP Range support; `cut` files are sent only
    halfway on a request without a Range header (the connection drops mid-file)."""

    def __init__(self, root: Path) -> None:
        self.root, self.cut, self.requests = root, set[str](), list[tuple[str, str | None]]()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                name = self.path.rsplit("/", 1)[-1]
                rng = self.headers.get("Range")
                server.requests.append((name, rng))
                path = server.root / name
                if not path.is_file():
                    self.send_error(404)
                    return
                data = path.read_bytes()
                start = 0
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if name in server.cut and not rng:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

        ca_key, ca, self.ca = make_ca(root, "update-test-ca")
        crt, key = make_server_cert(root, ca_key, ca)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(crt, key)
        self.httpd = HTTPSServer(("127.0.0.1", 0), Handler, tls)
        self.url = f"https://127.0.0.1:{self.httpd.server_address[1]}/bundle/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Server]:
    s = _Server(tmp_path)
    yield s
    s.close()


def test_a_download_interrupted_mid_file_is_resumed_with_a_range_request(
    tmp_path: Path, device: Device, signing: Any, server: _Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0", usr_bytes=300_000)
    server.root = b
    usr = "appliance_2.0.0.usr.raw"
    server.cut.add(usr)
    # first run: only one attempt, the connection drops halfway: the update stops, the part stays
    monkeypatch.setattr(fetch, "FETCH_ATTEMPTS", 1)
    with pytest.raises(UserError, match="download"):
        run_update(device, server.url, trusted, ca=str(server.ca))
    part = paths.update_staging_dir() / "2.0.0" / (usr + ".part")
    half = (b / usr).stat().st_size // 2
    assert part.stat().st_size == half
    assert device.sysupdate_calls() == []
    # second run: resumes from the half with Range, does not fetch the first half again
    server.requests.clear()
    assert run_update(device, server.url, trusted, ca=str(server.ca)) == 0
    assert (usr, f"bytes={half}-") in server.requests
    assert (usr, None) not in server.requests
    assert len(device.sysupdate_calls()) == 1


def test_a_drop_mid_file_is_retried_within_one_run(tmp_path: Path, device: Device, signing: Any, server: _Server) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0", usr_bytes=300_000)
    server.root = b
    server.cut.add("appliance_2.0.0.usr.raw")
    assert run_update(device, server.url, trusted, ca=str(server.ca)) == 0
    ranges = [r for n, r in server.requests if n == "appliance_2.0.0.usr.raw"]
    assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=")


def test_a_tampered_file_on_the_server_is_refused(tmp_path: Path, device: Device, signing: Any, server: _Server) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    efi = b / "appliance_2.0.0.efi"
    efi.write_bytes(efi.read_bytes()[:-1] + b"X")
    server.root = b
    _refused(device, server.url, trusted, "SHA-256", ca=str(server.ca))


# ----------------------------------------------------------------------------------- transfer definitions


def _transfer(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((TRANSFERS / name).read_text())
    return parser


def test_transfer_definitions_parse_and_match_what_update_stages(tmp_path: Path, signing: Any) -> None:
    import fnmatch

    key, trusted = signing
    names = ["10-usr.transfer", "20-usr-verity.transfer", "30-usr-verity-sig.transfer", "90-uki.transfer"]
    assert sorted(p.name for p in TRANSFERS.glob("*.transfer")) == names
    for name in names:
        t = _transfer(name)
        assert set(t.sections()) == {"Transfer", "Source", "Target"}
        assert t["Source"]["Type"] == "regular-file"
        assert t["Source"]["Path"] == "/var/lib/appliance/update/source"
        assert t["Transfer"]["ProtectVersion"] == "%A"
        assert t["Target"]["InstancesMax"] == "2"
    usr, verity, uki = _transfer("10-usr.transfer"), _transfer("20-usr-verity.transfer"), _transfer("90-uki.transfer")
    sig = _transfer("30-usr-verity-sig.transfer")
    assert sig["Target"]["MatchPartitionType"] == "usr-verity-sig" and sig["Target"]["MatchPattern"] == "appliance_@v_verity_sig"
    assert (usr["Target"]["Type"], usr["Target"]["MatchPartitionType"]) == ("partition", "usr")
    assert usr["Target"]["MatchPattern"] == "appliance_@v"
    assert verity["Target"]["MatchPartitionType"] == "usr-verity" and verity["Target"]["MatchPattern"] == "appliance_@v_verity"
    assert uki["Target"]["Type"] == "regular-file" and uki["Target"]["Path"] == "/EFI/Linux"
    assert uki["Target"]["PathRelativeTo"] == "boot" and uki["Target"]["TriesLeft"] == "3" and uki["Target"]["TriesDone"] == "0"
    assert "appliance_@v+@l-@d.efi" in uki["Target"]["MatchPattern"].split()
    # the kernel image is the last transfer (sysupdate orders transfers by file name)
    assert sorted(p.name for p in TRANSFERS.glob("*.transfer"))[-1] == "90-uki.transfer"
    # the staged names match the source patterns (@v -> version, @u -> a UUID)
    b = bundle(tmp_path, key, "2.0.0")
    index = bundle_index.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)
    staged = set(source_names(index).values())
    for t in (usr, verity, sig, uki):
        glob = t["Source"]["MatchPattern"].replace("@v", "2.0.0").replace("@u", "*")
        assert len([n for n in staged if fnmatch.fnmatch(n, glob)]) == 1, glob


# ----------------------------------------------------------------------------------- slots & rollback


def test_slots_summary_and_rollback(device: Device) -> None:
    device.set_gpt("appliance_1.0.0", "appliance_2.0.0")
    (device.esp / "EFI/Linux/appliance_2.0.0+0-3.efi").write_bytes(b"uki 2")
    atomic.write_json_atomic(paths.last_update_path(), {"version": "2.0.0", "from_version": "1.0.0"})
    failed = {"version": "2.0.0", "ok": False, "reason": "rolled back: engine not healthy within 600 s"}
    atomic.write_json_atomic(paths.last_assessment_path(), failed)
    summary = os_slots.slots_summary(device.host, running_version="1.0.0")
    assert summary["booted_slot"] == "A"
    assert [(s["slot"], s["version"], s["state"]) for s in summary["slots"]] == [("A", "1.0.0", "good"), ("B", "2.0.0", "bad")]
    assert summary["slots"][1]["tries_left"] == 0
    assert summary["rolled_back"] is True and "not healthy" in summary["rollback_reason"]
    # the other slot failed its assessment: refused without --force
    with pytest.raises(Refused, match="used up its tries"):
        rollback.rollback(device.host, running_version="1.0.0")
    message = rollback.rollback(device.host, running_version="1.0.0", force=True)
    assert "slot B (2.0.0) boots next" in message
    names = sorted(p.name for p in (device.esp / "EFI/Linux").iterdir())
    assert names == ["appliance_1.0.0+0.efi", "appliance_2.0.0.efi"]


def test_an_operator_rollback_is_reported_as_such_and_not_as_a_fault(device: Device) -> None:
    from appliance.config import Config
    from applianctl.status import probes

    device.set_gpt("appliance_1.0.0", "appliance_2.0.0")
    (device.esp / "EFI/Linux/appliance_2.0.0.efi").write_bytes(b"uki 2")  # judged good, then left by hand
    atomic.write_json_atomic(paths.last_update_path(), {"version": "2.0.0", "from_version": "1.0.0"})
    atomic.write_json_atomic(paths.last_assessment_path(), {"version": "2.0.0", "ok": True})
    atomic.write_json_atomic(paths.last_rollback_path(),
                            {"from_version": "2.0.0", "to_version": "1.0.0", "reason": "operator rollback", "at": "2026-11-30T12:00:00Z"})
    summary = os_slots.slots_summary(device.host, running_version="1.0.0")
    assert (summary["rolled_back"], summary["rolled_back_by"]) == (True, "operator")
    assert summary["rollback_reason"] == "applianctl rollback from 2.0.0 at 2026-11-30T12:00:00Z"
    part = os_slots.probe_slots(cast(Config, None), lambda: summary)
    assert part.state == probes.OK and part.reason.startswith("rolled back by the operator (applianctl rollback from 2.0.0"), part.reason
    # back on 2.0.0 (rolled forward by hand): nothing was rolled back
    assert os_slots.slots_summary(device.host, running_version="2.0.0")["rolled_back"] is False
    # the appliance's own rollback of a later update is a fault again
    atomic.write_json_atomic(paths.last_assessment_path(), {"version": "2.0.0", "ok": False, "reason": "engine not healthy"})
    summary = os_slots.slots_summary(device.host, running_version="1.0.0")
    assert summary["rolled_back_by"] == "appliance"
    assert os_slots.probe_slots(cast(Config, None), lambda: summary).state == probes.DEGRADED


def test_rollback_to_an_empty_slot_is_refused(device: Device) -> None:
    with pytest.raises(Refused, match="holds no version"):
        rollback.rollback(device.host, running_version="1.0.0")


def test_boot_counting_is_read_from_the_efi_variables(device: Device) -> None:
    assert boot_counting(device.host) is None
    efi_var(device.host.efivars, "LoaderEntrySelected", "appliance_2.0.0+2-1.efi")
    efi_var(device.host.efivars, "LoaderBootCountPath", "\\EFI\\Linux\\appliance_2.0.0+2-1.efi")
    counting = boot_counting(device.host)
    assert counting is not None and counting["tries_left"] == 2 and counting["tries_done"] == 1


def test_cli_registry_has_the_commands() -> None:
    from applianctl.__main__ import COMMAND_MODULES, build_parser

    for command in ("update", "assess", "rollback"):
        assert command in COMMAND_MODULES
        build_parser(command)
    assert stat.S_IMODE(0o755) == 0o755


# ----------------------------------------------------------------------------------- the invariant: never while on trial


def _on_trial(device: Device) -> None:
    """Slot A runs 1.0.0 on trial (2 tries left, one used); slot B holds 0.9.0, judged good."""
    device.set_gpt("appliance_1.0.0", "appliance_0.9.0")
    (device.esp / "EFI/Linux/appliance_1.0.0.efi").rename(device.esp / "EFI/Linux/appliance_1.0.0+2-1.efi")
    (device.esp / "EFI/Linux/appliance_0.9.0.efi").write_bytes(b"uki 0.9")
    efi_var(device.host.efivars, "LoaderEntrySelected", "appliance_1.0.0.efi")
    efi_var(device.host.efivars, "LoaderBootCountPath", "\\EFI\\Linux\\appliance_1.0.0+2-1.efi")


def _esp(device: Device) -> list[str]:
    return sorted(p.name for p in (device.esp / "EFI/Linux").iterdir())


def test_an_update_during_a_trial_is_refused_and_both_slots_are_unchanged(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    _on_trial(device)
    gpt, esp = device.gpt.read_text(), _esp(device)
    with pytest.raises(UserError, match=r"^refused: the running version 1\.0\.0 is on trial") as e:
        run_update(device, str(b), trusted)
    assert e.value.exit_status == 2 and "\n" not in e.value.message and e.value.hint
    assert "slot B may hold the only version known to be good" in e.value.message
    assert device.writes() == [], "nothing written: no blkdiscard, no relabel, no sysupdate, no bootctl verb"
    assert _esp(device) == esp and device.gpt.read_text() == gpt
    assert not paths.update_staging_dir().exists(), "refused before anything was downloaded"


def test_once_blessed_the_same_boot_may_update(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    _on_trial(device)
    # systemd-bless-boot drops the counter; the EFI variables still say this boot was counted
    (device.esp / "EFI/Linux/appliance_1.0.0+2-1.efi").rename(device.esp / "EFI/Linux/appliance_1.0.0.efi")
    assert boot_counting(device.host) is not None
    assert run_update(device, str(b), trusted) == 0
    assert len(device.sysupdate_calls()) == 1


def test_an_update_while_the_running_version_is_marked_bad_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    _on_trial(device)
    (device.esp / "EFI/Linux/appliance_1.0.0+2-1.efi").rename(device.esp / "EFI/Linux/appliance_1.0.0+0-3.efi")  # e.g. rolled back
    with pytest.raises(UserError, match=r"is marked bad .*slot B holds the version to fall back to"):
        run_update(device, str(b), trusted)
    assert device.writes() == []


def test_an_update_without_an_entry_for_the_running_version_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    (device.esp / "EFI/Linux/appliance_1.0.0.efi").unlink()
    with pytest.raises(UserError, match="cannot tell whether the running version is judged good"):
        run_update(device, str(b), trusted)
    assert device.writes() == []


def _cli(
    argv: list[str], device: Device, trusted: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    from applianctl.__main__ import main

    monkeypatch.setattr(release, "running_manifest", lambda: RUNNING)
    monkeypatch.setattr(paths, "TRUSTED_KEYS_DIR", trusted)
    monkeypatch.setenv("APPLIANCE_ESP_DIR", str(device.esp))
    monkeypatch.setenv("APPLIANCE_EFIVARS_DIR", str(device.host.efivars))
    monkeypatch.setenv("APPLIANCE_CMDLINE", str(device.cmdline))
    monkeypatch.setenv("APPLIANCE_DISK", "/dev/vda")
    capsys.readouterr()  # not the command's: what making the test's bundle wrote
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_and_the_timer_refuse_in_one_line_during_a_trial(
    tmp_path: Path,
    device: Device,
    signing: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    appliance_json: Callable[[str], Path],
) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    _on_trial(device)
    code, out, err = _cli(["update", str(b), "--yes"], device, trusted, monkeypatch, capsys)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 2 and lines[1].startswith("hint: ")
    assert lines[0].startswith("applianctl: refused: the running version 1.0.0 is on trial")
    config = appliance_json("demo")
    data = json.loads(config.read_text())
    data["update"]["url"] = "https://updates.invalid/demo/"  # never contacted: refused before any network
    config.write_text(json.dumps(data))
    monkeypatch.setenv("APPLIANCE_CONFIG", str(config))
    code, _, err = _cli(["update", "--from-config", "--yes"], device, trusted, monkeypatch, capsys)
    assert code == 2 and "is on trial" in err
    assert device.writes() == []


def test_check_says_what_would_be_installed_and_writes_nothing(
    tmp_path: Path, device: Device, signing: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    code, out, err = _cli(["update", "--check", str(b), "--json"], device, trusted, monkeypatch, capsys)
    assert code == 0, err
    plan = json.loads(out)
    summary = (plan["version"], plan["running_version"], plan["slot"], plan["downgrade"], plan["blocked"])
    assert summary == ("2.0.0", "1.0.0", "B", False, None)
    assert plan["download_bytes"] == sum(f.stat().st_size for f in b.iterdir()
               if not f.name.startswith(("bundle.json", "timestamp.json")) and not f.name.endswith(".packages.json"))
    assert not (device.root / "state").exists() and device.writes() == []
    code, out, err = _cli(["update", "--check", str(b)], device, trusted, monkeypatch, capsys)
    assert code == 0 and out.startswith("would install 2.0.0 over 1.0.0 (upgrade) into slot B")
    _on_trial(device)
    code, out, err = _cli(["update", "--check", str(b), "--json"], device, trusted, monkeypatch, capsys)
    assert code == 2 and "is on trial" in json.loads(out)["blocked"]
    assert not (device.root / "state").exists() and device.writes() == []


@pytest.mark.parametrize("where", ["unresolvable", "refused"])
def test_check_without_a_way_to_the_server_names_the_host_and_what_failed(
    tmp_path: Path, device: Device, signing: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    import socket

    _, trusted = signing
    with socket.socket() as s:  # bound, never listening: a connection to it is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        source, first = {
            "unresolvable": ("https://updates.invalid/demo/", "applianctl: cannot resolve updates.invalid: "),  # no DNS asked of the world
            "refused": (f"https://127.0.0.1:{port}/demo/", f"applianctl: cannot connect to 127.0.0.1:{port}: Connection refused"),
        }[where]
        code, out, err = _cli(["update", "--check", source], device, trusted, monkeypatch, capsys)
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 2, err
    assert lines[0].startswith(first) and "gaierror" not in lines[0] and "Error" not in lines[0]
    assert lines[1] == "hint: check this host's network and DNS, and the server's name and port in the URL"
    assert device.writes() == []


def test_not_enough_free_space_is_refused_before_downloading(
    tmp_path: Path, device: Device, signing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from applianctl.update import download

    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0", usr_bytes=300_000)
    need = sum(f.stat().st_size for f in b.iterdir()
               if not f.name.startswith(("bundle.json", "timestamp.json")) and not f.name.endswith(".packages.json"))
    real = download.free_bytes
    asked: list[Path] = []

    def free(path: Path) -> int:
        asked.append(path)
        assert real(path) > 0
        return need + download.SPACE_MARGIN_BYTES - 1  # one byte short of the bundle plus the margin

    monkeypatch.setattr(download, "free_bytes", free)
    with pytest.raises(UserError, match="MiB free, the bundle needs") as e:
        run_update(device, str(b), trusted)
    assert "plus a margin of 1024 MiB" in e.value.message and e.value.exit_status == 2  # the reserve the model fetch keeps too
    assert asked and asked[0] == paths.update_staging_dir() / "2.0.0", "the file system of the staging directory (/var)"
    assert not list(paths.update_staging_dir().rglob("*.part")) and not list(paths.update_staging_dir().rglob("*.raw"))
    assert device.sysupdate_calls() == []
    monkeypatch.setattr(download, "free_bytes", lambda path: need + download.SPACE_MARGIN_BYTES)
    assert run_update(device, str(b), trusted) == 0


def test_a_version_with_leading_zeros_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    from appliance.signed import release_manifest

    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    index = json.loads((b / "bundle.json").read_text())
    index["min_version"] = "01.0"
    data = release_manifest.canonical(index)
    (b / "bundle.json").write_bytes(data)
    (b / "bundle.json.sig").write_bytes(release_manifest.encode_signature(release_manifest.load_private_key(key).sign(data)))
    _refused(device, str(b), trusted, "no leading zeros")


# ----------------------------------------------------------------------------------- freshness (timestamp.json)

DAY = 86400


def _timestamp(b: Path, release_key: Path, *, signed_at: float | None = None, days: int = 7, by: Path | None = None,
               index: Path | None = None) -> timestamp.Timestamp:
    """B's timestamp replaced by one for INDEX (default: B's bundle.json), signed at SIGNED_AT by
    BY (default: the timestamp key beside RELEASE_KEY) with that key's next sequence number."""
    key = by or release_key.with_name("timestamp.key")
    data = (index or b / "bundle.json").read_bytes()
    signer = release_manifest.key_id(release_manifest.load_private_key(key).public_key())
    doc = timestamp.make(data, json.loads(data)["version"], builder.keys.next_sequence(key), signer,
                         now=time.time() if signed_at is None else signed_at, days=days)
    ts, sig = timestamp.sign(doc, key)
    (b / "timestamp.json").write_bytes(ts)
    (b / "timestamp.json.sig").write_bytes(sig)
    return timestamp.load(doc)


def _accepted() -> dict[str, int]:
    record = json.loads(paths.freshness_path().read_text())
    return dict(record["sequences"])


def test_an_expired_index_is_refused_by_every_verb_that_reads_it(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    ts = _timestamp(b, key, signed_at=time.time() - 8 * DAY)  # 7 days' validity, signed 8 days ago
    _refused(device, str(b), trusted, rf"^the index expired at {ts.expires}; the clock says 20")
    for verb in (applianctl.update.command.check, applianctl.update.command.download_only):
        with pytest.raises(Refused, match="the index expired at") as e:
            verb(str(b), host=device.host, keys_dir=trusted, running=RUNNING)
        assert "builder timestamp" in e.value.hint and "clock" in e.value.hint
    assert not paths.update_staging_dir().exists() and applianctl.update.staged.read() is None, "refused before any download"
    _timestamp(b, key)  # signed again: fresh
    assert run_update(device, str(b), trusted) == 0


def test_an_index_older_than_the_last_accepted_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    older = bundle(tmp_path, key, "2.0.0")  # timestamp sequence 1
    newer = bundle(tmp_path, key, "3.0.0")  # sequence 2
    applianctl.update.command.check(str(newer), host=device.host, keys_dir=trusted, running=RUNNING)
    assert not paths.freshness_path().exists(), "--check accepts nothing"
    assert run_update(device, str(newer), trusted) == 0
    signer = release_manifest.key_id(release_manifest.load_private_key(key.with_name("timestamp.key")).public_key())
    assert _accepted() == {signer: 2}
    with pytest.raises(Refused, match=r"^timestamp\.json has sequence 1, lower than the 2 this appliance accepted before") as e:
        run_update(device, str(older), trusted)
    assert e.value.exit_status == 1 and "builder timestamp" in e.value.hint
    assert len(device.sysupdate_calls()) == 1, "only the accepted update wrote the slot"
    with pytest.raises(Refused, match="lower than the 2"):
        applianctl.update.command.download_only(str(older), host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None)
    assert _timestamp(older, key).sequence == 3  # offered again on purpose: `builder timestamp`
    assert run_update(device, str(older), trusted) == 0
    assert _accepted() == {signer: 3}


def test_a_download_only_records_the_sequence_it_accepted(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    older = bundle(tmp_path, key, "2.0.0")
    newer = bundle(tmp_path, key, "3.0.0")
    assert applianctl.update.command.download_only(str(newer), host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None) == 0
    assert list(_accepted().values()) == [2]
    with pytest.raises(Refused, match="lower than the 2"):
        applianctl.update.command.check(str(older), host=device.host, keys_dir=trusted, running=RUNNING)


def test_a_timestamp_for_another_bundle_json_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    other = bundle(tmp_path, key, "3.0.0")
    _timestamp(b, key, index=other / "bundle.json")  # fresh, validly signed, names 3.0.0's index
    _refused(device, str(b), trusted, r"^timestamp\.json is for another bundle\.json \(version 3\.0\.0")


def test_a_timestamp_signed_by_the_release_key_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    _timestamp(b, key, by=key)  # the release key: trusted for bundle.json, never for freshness
    release_id = release_manifest.key_id(release_manifest.load_private_key(key).public_key())
    _refused(device, str(b), trusted, rf"^timestamp\.json is signed by key {release_id}, which this version does not trust for timestamps")


def test_a_bundle_without_a_timestamp_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    (b / "timestamp.json").unlink()
    _refused(device, str(b), trusted, r"timestamp\.json: missing from the bundle")


def test_a_clock_before_the_running_releases_build_time_is_refused_on_its_own(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    built_later = dataclasses.replace(RUNNING, build_time="2099-01-01T00:00:00Z")
    with pytest.raises(UserError, match=r"^the clock says 20[0-9-]+T[0-9:]+Z, earlier than this release's build time 2099-01-01") as e:
        run_update(device, str(b), trusted, running=built_later)
    assert e.value.exit_status == 2 and "timedatectl" in e.value.hint
    assert device.sysupdate_calls() == []


def test_apply_of_a_staged_bundle_does_not_depend_on_its_expiry(tmp_path: Path, device: Device, signing: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    assert applianctl.update.command.download_only(str(b), host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None) == 0
    staged = applianctl.update.staged.directory(applianctl.update.staged.read().usable)  # type: ignore[union-attr]
    assert (staged / "timestamp.json").read_bytes() == (b / "timestamp.json").read_bytes(), "kept as what was accepted"
    monkeypatch.setattr(timestamp, "system_clock", lambda: time.time() + 30 * DAY)  # long expired now
    with pytest.raises(Refused, match="expired"):
        applianctl.update.command.check(str(b), host=device.host, keys_dir=trusted, running=RUNNING)
    assert applianctl.update.command.apply(host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None) == 0
    assert len(device.sysupdate_calls()) == 1


# ----------------------------------------------------------------------------------- a version rolled back


def _rolled_back_in_slot_b(device: Device) -> None:
    """Slot B holds 2.0.0, whose entry ran out of tries: systemd-boot fell back to 1.0.0."""
    device.set_gpt("appliance_1.0.0", "appliance_2.0.0")
    (device.esp / "EFI/Linux/appliance_2.0.0+0-3.efi").write_bytes(b"uki 2")


def test_a_version_rolled_back_from_is_refused_unless_forced(
    tmp_path: Path, device: Device, signing: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    _rolled_back_in_slot_b(device)
    _refused(device, str(b), trusted, r"^version 2\.0\.0 was rolled back: its boot entry appliance_2\.0\.0\+0-3\.efi is out of tries")
    with pytest.raises(Refused, match="was rolled back") as e:
        applianctl.update.command.download_only(str(b), host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None)
    assert "--force" in e.value.hint and applianctl.update.staged.read() is None
    code, out, err = _cli(["update", "--check", str(b), "--json"], device, trusted, monkeypatch, capsys)
    plan = json.loads(out)
    assert code == 2 and plan["blocked"].startswith("version 2.0.0 was rolled back") and plan["already_installed"] is False
    code, out, err = _cli(["update", str(b), "--yes"], device, trusted, monkeypatch, capsys)
    assert code == 1 and out == "" and err.splitlines()[0].startswith("applianctl: version 2.0.0 was rolled back")
    assert device.sysupdate_calls() == []
    code, out, err = _cli(["update", str(b), "--yes", "--force"], device, trusted, monkeypatch, capsys)
    assert code == 0, err
    assert device.sysupdate_calls() == [["systemd-sysupdate", "--no-pager", "update", "2.0.0"]], "the slot written again"
    assert not (device.esp / "EFI/Linux/appliance_2.0.0+0-3.efi").exists(), "its spent entry went before the slot was blanked"


def test_the_last_rollback_record_names_a_version_rolled_back_from(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    atomic.write_record(paths.last_rollback_path(), LastRollback("2.0.0", "1.0.0", "operator rollback", "2026-11-30T10:00:00Z"))
    _refused(device, str(b), trusted, r"^version 2\.0\.0 was rolled back at 2026-11-30T10:00:00Z")
    # a rollback that led elsewhere (to another running version) says nothing about this one
    atomic.write_record(paths.last_rollback_path(), LastRollback("2.0.0", "0.9.0", "operator rollback", "2026-11-30T10:00:00Z"))
    assert run_update(device, str(b), trusted) == 0


# ----------------------------------------------------------------------------------- units


def _unit(name: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values]}} (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for line in (Path(__file__).resolve().parents[1] / "units" / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def test_the_update_unit_runs_only_after_the_boot_was_judged() -> None:
    unit = _unit("appliance-update.service")
    assert "boot-complete.target" in " ".join(unit["Unit"]["Requires"]).split()
    after = " ".join(unit["Unit"]["After"]).split()
    assert "boot-complete.target" in after and "systemd-bless-boot.service" in after
    service = unit["Service"]
    assert service["ExecStart"] == ["/usr/bin/applianctl update --from-config --yes"]
    assert service["TimeoutStartSec"] == ["4h 10min"] and applianctl.update.command.DEFAULT_DEADLINE_S < 4 * 3600 + 600
    assert service["MemoryMax"] == ["512M"]
    assert service["CapabilityBoundingSet"] == ["CAP_SYS_ADMIN CAP_LINUX_IMMUTABLE"]
    assert service["ProtectSystem"] == ["strict"] and service["NoNewPrivileges"] == ["yes"]
    timer = _unit("appliance-update.timer")
    assert "Unit" not in timer["Timer"], "the timer starts appliance-update.service, whose ordering applies"


@pytest.mark.programs
@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("name", ["appliance-update.service", "appliance-assess.service"])
def test_the_units_are_sandboxed_to_at_most_3(name: str) -> None:
    import re
    import subprocess

    unit = Path(__file__).resolve().parents[1] / "units" / name
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True).stdout
    found = re.findall(r"Overall exposure level for \S+: ([0-9.]+)", out)
    assert found and float(found[0]) <= 3.0, out[-2000:]


def test_staging_reports_each_download_and_each_verification(tmp_path: Path, signing: Any, capsys: pytest.CaptureFixture[str]) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    index = bundle_index.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)
    staging = tmp_path / "staging"
    staging.mkdir()
    source = fetch.open_source(str(b), None, fetch.Deadline(60))
    capsys.readouterr()
    download.stage(index, source, staging)
    names = [f.name for f in download.to_fetch(index)]
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == [f"{verb} {n}" for n in names for verb in ("downloading", "verifying")]
    assert all(" (100%), " in line and ", done in " in line for line in err)
    # run again: what is staged is hashed again (with progress), nothing is downloaded
    download.stage(index, source, staging)
    assert [line.split(":")[0] for line in capsys.readouterr().err.splitlines()] == [f"verifying {n}" for n in names]


def test_blanking_and_writing_the_slot_say_when_they_start_and_how_long_they_took(
    tmp_path: Path, device: Device, signing: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    capsys.readouterr()
    assert run_update(device, str(b), trusted) == 0
    steps = [line for line in capsys.readouterr().err.splitlines() if "slot B" in line]
    assert [line.split(": ")[0] for line in steps] == [
        "zeroing slot B ...", "zeroing slot B", "systemd-sysupdate 2.0.0 into slot B ...", "systemd-sysupdate 2.0.0 into slot B"
    ]
    assert steps[1].startswith("zeroing slot B: done in ") and steps[3].endswith(" s")


def test_the_engine_components_transfers_match_the_bundle_and_the_slots() -> None:
    """What the updater links and what systemd-sysupdate's engine component matches are the same
    names, and its targets are the engine slots' own types with the labels the slots model reads."""
    directory = TRANSFERS.parent / "sysupdate.engine.d"
    names = bundle_index.payload_names("2.0.0", "sha256:" + "ab" * 32, True)
    seen = {}
    for path in sorted(directory.glob("*.transfer")):
        t = configparser.ConfigParser(interpolation=None)
        t.optionxform = str  # type: ignore[assignment,method-assign]
        t.read(path)
        source = t["Source"]["MatchPattern"].replace("@v", "abababababab")
        target = t["Target"]
        assert target["Type"] == "partition" and target["Path"] == "auto" and "ProtectVersion" not in t["Transfer"]
        seen[source] = (target["MatchPartitionType"].upper(), target["MatchPattern"].replace("@v", "abababababab"))
    assert seen == {
        names["engine"]: (bundle_index.ENGINE_TYPE, "engine_abababababab"),
        names["engine-verity"]: (bundle_index.ENGINE_VERITY_TYPE, "engine_abababababab-verity"),
    }


# ----------------------------------------------------------------------------------- an index that contradicts its files


def resign_index(b: Path, release_key: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """B's bundle.json changed by CHANGE and signed again with the release key (a new timestamp for
    it too): an index the release key vouches for that says something else than its files."""
    doc = json.loads((b / "bundle.json").read_bytes())
    change(doc)
    data = release_manifest.canonical(doc)
    (b / "bundle.json").write_bytes(data)
    (b / "bundle.json.sig").write_bytes(release_manifest.encode_signature(release_manifest.load_private_key(release_key).sign(data)))
    _timestamp(b, release_key)


def listed(doc: dict[str, Any], path: Path) -> None:
    """DOC's file entry for PATH made to match the file as it is now."""
    entry = next(f for f in doc["files"] if f["name"] == path.name)
    entry["sha256"], entry["size"] = hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size


def test_a_manifest_other_than_the_one_the_index_names_is_refused_though_signed(tmp_path: Path, device: Device, signing: Any) -> None:
    """manifest.json is bound to bundle.json's manifest_sha256, not only to its file entry: here a
    manifest the release key signed, of the same version, profile and engine, but another build."""
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    named = hashlib.sha256((b / "manifest.json").read_bytes()).hexdigest()
    body = json.loads((b / "manifest.json").read_bytes())
    body["build_time"] = "2026-02-02T00:00:00Z"
    (b / "manifest.json").write_bytes(release_manifest.dumps(body))
    (b / "manifest.json.sig").write_bytes(release_manifest.sign(body, key))
    resign_index(b, key, lambda doc: (listed(doc, b / "manifest.json"), listed(doc, b / "manifest.json.sig")))
    assert json.loads((b / "bundle.json").read_bytes())["manifest_sha256"] == named  # still the first build's
    _refused(device, str(b), trusted, "manifest.json does not match bundle.json's manifest_sha256")
