# SPDX-License-Identifier: MIT
"""Engine images count only once checked: a bundle's engine image and hash tree are
hashed with the real `veritysetup verify` against the root hash its signed release manifest pins,
and its label checked, before any slot is blanked; engine slots are compared by their full
digest, not the 12 hex digits of their label. The device is test_update's fake (sfdisk, bootctl,
blkdiscard and systemd-sysupdate record their calls); the engine images are real dm-verity
images made with `veritysetup format` (tests/fake_release.py)."""

from __future__ import annotations

import builtins
import dataclasses
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from fake_release import demo_config, fake_build, make_signing, verity_format
from fakeprog import fake_program
from test_update import RUNNING, Device, run_update

import applianctl.slots.engine
import builder.release
from appliance.errors import Refused, UserError
from appliance.signed import bundle_index, release_manifest
from appliance.signed.bundle_index import engine_short, payload_names
from applianctl.update import checks, command, staged

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)

NEW = "sha256:" + "ab" * 32
RUNNING_DIGEST = RUNNING.engine_image.digest
# another engine whose digest shares the running one's first 12 hex digits (its label, engine_D12)
TWIN = RUNNING_DIGEST[:19] + ("1" if RUNNING_DIGEST[19] == "0" else "0") + RUNNING_DIGEST[20:]


@pytest.fixture
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Device:
    root = tmp_path / "device"
    root.mkdir()
    d = Device(root, monkeypatch)
    d.set_gpt("appliance_1.0.0", "_empty", engine_b="_empty")  # engine slot B free
    return d


@pytest.fixture
def signing(tmp_path: Path) -> tuple[Path, Path]:
    return make_signing(tmp_path)


def engine_bundle(tmp_path: Path, key: Path, digest: str = NEW, **engine_image: str) -> Path:
    """A signed bundle 2.0.0 carrying the engine DIGEST, its manifest's engine_image fields
    changed to ENGINE_IMAGE (signed again, as a faulty or hostile builder would)."""
    config = demo_config("2.0.0", digest=digest)
    out = fake_build(tmp_path / "out-engine", config, key)
    if engine_image:
        body = json.loads((out / "manifest.json").read_bytes())
        body["engine_image"].update(engine_image)
        (out / "manifest.json").write_bytes(release_manifest.dumps(body))
        (out / "manifest.json.sig").write_bytes(release_manifest.sign(body, key))
    target = tmp_path / "bundle-engine"
    builder.release.make_bundle(config, out, target, key)
    return target


def index_of(b: Path, trusted: Path) -> bundle_index.BundleIndex:
    return bundle_index.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)


def release_of(b: Path) -> release_manifest.Manifest:
    return release_manifest.load(release_manifest.parse_canonical((b / "manifest.json").read_bytes()))


def refused_before_any_write(device: Device, b: Path, trusted: Path, match: str) -> Refused:
    with pytest.raises(Refused, match=match) as e:
        run_update(device, str(b), trusted)
    assert e.value.exit_status == 1 and "\n" not in e.value.message and e.value.hint
    assert device.writes() == [], "no slot blanked, labelled or written"
    return e.value


# ----------------------------------------------------------------------------------- the root hash


def test_a_real_engine_image_shipped_without_its_zeros_is_accepted(tmp_path: Path, signing: Any) -> None:
    key, trusted = signing
    b = engine_bundle(tmp_path, key)
    index = index_of(b, trusted)
    names = payload_names(index.version, index.engine_digest, True)
    # the tree covers 4 blocks, the shipped image stops after its 2 non-zero ones: checked padded
    assert (b / names["engine"]).stat().st_size == 8192 < index.partition_sizes[names["engine"]]
    checks.check_staged(index, b, trusted, engine_written=True)
    assert sorted(p.name for p in b.iterdir() if p.name.startswith(".")) == [], "the padded copy is removed"


def test_an_update_writes_a_real_engine_image_it_has_checked(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    assert run_update(device, str(engine_bundle(tmp_path, key)), trusted) == 0
    assert ["systemd-sysupdate", "--no-pager", "--component=engine", "update", "abababababab"] in device.writes()


def test_a_wrong_engine_root_hash_is_refused_before_any_write(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    b = engine_bundle(tmp_path, key, store_roothash="0" * 64)
    e = refused_before_any_write(device, b, trusted,
                                 r"^the bundle's engine image does not hash to the root hash its release manifest pins$")
    assert "nothing was written" in (e.hint or "")


def test_an_engine_image_that_differs_from_its_tree_is_refused(tmp_path: Path, signing: Any) -> None:
    key, trusted = signing
    b = engine_bundle(tmp_path, key)
    index, release = index_of(b, trusted), release_of(b)
    names = payload_names(index.version, index.engine_digest, True)
    data = b / names["engine"]
    data.write_bytes(data.read_bytes()[:-1] + b"X")  # past the SHA-256 check: only the hash tree sees it
    with pytest.raises(Refused, match="does not hash to the root hash"):
        checks.check_engine_images(index, release.engine_image, b)


def test_download_only_refuses_it_and_apply_checks_again(tmp_path: Path, device: Device, signing: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    key, trusted = signing
    b = engine_bundle(tmp_path, key, store_roothash="0" * 64)
    with pytest.raises(Refused, match="does not hash"):
        command.download_only(str(b), host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None)
    assert staged.read() is None
    # staged past the check (as by an older updater): --apply hashes the engine again before writing
    with monkeypatch.context() as m:
        m.setattr(checks, "check_engine_images", lambda *a: None)
        assert command.download_only(str(b), host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None) == 0
    with pytest.raises(Refused, match="does not hash"):
        command.apply(host=device.host, keys_dir=trusted, running=RUNNING, say=lambda s: None)
    assert device.writes() == []


def test_a_hash_tree_without_a_superblock_is_refused(tmp_path: Path, signing: Any) -> None:
    key, trusted = signing
    b = engine_bundle(tmp_path, key)
    index, release = index_of(b, trusted), release_of(b)
    tree = b / payload_names(index.version, index.engine_digest, True)["engine-verity"]
    tree.write_bytes(b"\x07" * 8192)
    with pytest.raises(Refused, match=r"engine_abababababab\.verity\.raw is not a dm-verity hash tree with a superblock"):
        checks.check_engine_images(index, release.engine_image, b)


def test_a_tree_covering_more_than_the_engine_partition_is_refused(tmp_path: Path, signing: Any) -> None:
    key, trusted = signing
    b = engine_bundle(tmp_path, key)
    index, release = index_of(b, trusted), release_of(b)
    names = payload_names(index.version, index.engine_digest, True)
    # a tree over 1 GiB of data: the padded copy would be that large; the partition is 16 KiB
    big = tmp_path / "big.raw"
    with open(big, "wb") as f:
        f.write(b"x" * 4096)
        f.truncate(1 << 30)
    roothash = verity_format(big, b / names["engine-verity"])
    engine = dataclasses.replace(release.engine_image, store_roothash=roothash)
    with pytest.raises(Refused, match=r"covers 1073741824 bytes of data, more than the engine partition's 16384"):
        checks.check_engine_images(index, engine, b)
    assert not any(p.name.endswith(".padded") for p in b.iterdir())


def test_a_full_disk_while_padding_is_one_line(tmp_path: Path, signing: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    key, trusted = signing
    b = engine_bundle(tmp_path, key)
    index, release = index_of(b, trusted), release_of(b)
    real_open = builtins.open

    def full(path: Any, mode: str = "r", *a: Any, **kw: Any) -> Any:
        if "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", full)
    with pytest.raises(UserError, match=r"zero-padded copy of engine_abababababab\.raw for its check cannot be written "
                                         r"\(No space left on device\)$") as e:
        checks.check_engine_images(index, release.engine_image, b)
    assert e.value.exit_status == 2 and "free" in (e.value.hint or "")


def test_without_veritysetup_the_engine_is_not_taken_unchecked(tmp_path: Path, signing: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    key, trusted = signing
    b = engine_bundle(tmp_path, key)
    monkeypatch.setattr(checks, "VERITYSETUP", "veritysetup-that-is-not-installed")
    with pytest.raises(UserError, match="is not installed: the engine image cannot be checked"):
        checks.check_engine_images(index_of(b, trusted), release_of(b).engine_image, b)


def test_a_veritysetup_that_hangs_is_stopped_in_one_line(tmp_path: Path, signing: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    key, trusted = signing
    b = engine_bundle(tmp_path, key)
    slow = fake_program(tmp_path / "bin", "veritysetup", script_body="exec sleep 30")
    monkeypatch.setattr(checks, "VERITYSETUP", str(slow))
    monkeypatch.setattr(checks, "HASH_BASE_S", 0.5)
    monkeypatch.setattr(checks, "HASH_BYTES_PER_S", 1 << 40)
    with pytest.raises(UserError, match=r"veritysetup dump did not finish within 0\.5\d* s$"):
        checks.check_engine_images(index_of(b, trusted), release_of(b).engine_image, b)


# ----------------------------------------------------------------------------------- the label


def test_a_label_naming_the_running_slot_is_refused_before_any_write(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    running_label = RUNNING.engine_image.store_label
    b = engine_bundle(tmp_path, key, store_label=running_label)
    refused_before_any_write(device, b, trusted, rf"^the release manifest labels its engine store {running_label}, "
                                                 r"not engine_abababababab \(engine_ and its digest's first 12 hex digits\)$")


def test_the_label_is_checked_even_when_no_engine_is_written(tmp_path: Path, signing: Any) -> None:
    key, trusted = signing
    b = engine_bundle(tmp_path, key, store_label="engine_" + "0" * 12)
    with pytest.raises(Refused, match="labels its engine store engine_000000000000"):
        checks.check_staged(index_of(b, trusted), b, trusted)


# ----------------------------------------------------------------------------------- full digests


def test_a_digest_sharing_the_running_engines_12_hex_digits_is_not_already_present(tmp_path: Path, device: Device,
                                                                                     signing: Any) -> None:
    key, trusted = signing
    assert engine_short(TWIN) == engine_short(RUNNING_DIGEST) and TWIN != RUNNING_DIGEST
    b = engine_bundle(tmp_path, key, digest=TWIN)
    # it would be labelled like the running slot A, and slot A may not be written: refused at the plan
    expected = (rf"^refused: engine {TWIN[7:]} would be labelled engine_{TWIN[7:19]} like engine slot A, "
                rf"which holds engine {RUNNING_DIGEST[7:]} and may not be written \(slot A .* runs the engine\)$")
    with pytest.raises(UserError, match=expected) as e:
        run_update(device, str(b), trusted)
    assert e.value.exit_status == 2 and "first 12 hex digits" in (e.value.hint or "")
    assert device.writes() == []


def test_a_slot_whose_full_digest_is_not_known_is_written_again(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    device.set_gpt("appliance_1.0.0", "_empty", engine_b="engine_abababababab")  # no record says which engine that is
    assert run_update(device, str(engine_bundle(tmp_path, key)), trusted) == 0
    writes = device.writes()
    # slot B blanked (zeroed, labelled _empty) and written, before /usr
    assert writes[:5] == [["blkdiscard", "--zeroout", "/dev/vda9"], ["blkdiscard", "--zeroout", "/dev/vda10"],
                          ["sfdisk", "--part-label", "/dev/vda", "9", "_empty"], ["sfdisk", "--part-label", "/dev/vda", "10", "_empty"],
                          ["systemd-sysupdate", "--no-pager", "--component=engine", "update", "abababababab"]]
    assert applianctl.slots.engine.recorded()["2.0.0"] == NEW, "from now on it is known"


def test_a_recorded_twin_of_the_slot_leaves_its_digest_unknown(tmp_path: Path, device: Device, signing: Any) -> None:
    """Two signed digests recorded for one label: which one the slot holds is not known, so it is
    written again rather than taken as present."""
    key, trusted = signing
    device.set_gpt("appliance_1.0.0", "_empty", engine_b="engine_abababababab")
    applianctl.slots.engine.record({"1.4.0": NEW, "1.5.0": NEW[:19] + "c" + NEW[20:]}, keep={"1.4.0", "1.5.0"})
    assert run_update(device, str(engine_bundle(tmp_path, key)), trusted) == 0
    assert ["systemd-sysupdate", "--no-pager", "--component=engine", "update", "abababababab"] in device.writes()


def test_the_same_engine_pinned_at_another_root_hash_is_refused_before_any_write(tmp_path: Path, device: Device,
                                                                                 signing: Any) -> None:
    """No engine is written (the running one is reused): the new version would open the running
    engine store with its own pinned root hash, so that hash must be the running store's."""
    key, trusted = signing
    b = engine_bundle(tmp_path, key, digest=RUNNING_DIGEST, store_roothash="f" * 64)
    refused_before_any_write(device, b, trusted, r"the running one \(which it would open, unwritten\) has .*: "
                                                 r"the new version could not open its engine$")


@pytest.mark.programs
@pytest.mark.parametrize("blocks", [1, 4, 129])
def test_the_fake_builds_verity_tree_is_veritysetups(tmp_path: Path, blocks: int) -> None:
    """fake_release.verity_format writes what the real `veritysetup format` writes, byte for byte."""
    import subprocess

    from fake_release import VERITY_UUID

    data = tmp_path / "data.raw"
    data.write_bytes(b"".join(i.to_bytes(4, "little") * 1024 for i in range(blocks)))
    out = subprocess.run(["veritysetup", "format", "--salt=" + "5a" * 32, f"--uuid={VERITY_UUID}", data, tmp_path / "real.verity"],
                         capture_output=True, text=True, check=True).stdout
    real_root = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Root hash:"))
    assert verity_format(data, tmp_path / "fake.verity") == real_root
    assert (tmp_path / "fake.verity").read_bytes() == (tmp_path / "real.verity").read_bytes()
