# SPDX-License-Identifier: MIT
"""/usr trusted by its own signature: the usr-verity-sig partition in the image, the initrd package
that hands the signature to dm-verity, the updater that writes it with the slot and refuses a disk
without room for it, and status. The kernel's check itself runs in QEMU (the journey's boots, and
make test-extended GROUPS=rollback: a /usr whose signature does not verify)."""

from __future__ import annotations

import configparser
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from fake_release import bundle, signature_partition, usrhash_for
from test_update import Device, run_update
from test_update import device as device
from test_update import signing_fixture as signing_fixture

from appliance.errors import Refused
from appliance.signed import bundle_index
from applianctl.status import sealed
from builder import build, initrd_package

REPO = Path(__file__).resolve().parents[1]


def _conf(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(path)
    return parser


def test_the_image_carries_a_signature_partition_for_each_slot() -> None:
    built = _conf(REPO / "image/mkosi.repart/12-usr-verity-sig.conf")["Partition"]
    assert (built["Type"], built["Verity"], built["VerityMatchKey"]) == ("usr-verity-sig", "signature", "usr")
    first_boot = REPO / "image/mkosi.extra/usr/lib/repart.d"
    sigs = sorted(p.name for p in first_boot.glob("*.conf") if _conf(p)["Partition"]["Type"] == "usr-verity-sig")
    assert sigs == ["11-usr-a-verity-sig.conf", "13-usr-b-verity-sig.conf"]  # A's, as built; B's, made empty
    assert _conf(first_boot / sigs[1])["Partition"]["Label"] == "_empty"


def test_mkosi_signs_the_root_hash_with_the_secure_boot_key_and_the_initrd_reads_it(tmp_path: Path) -> None:
    from appliance import config

    demo = config.load(REPO / "appliance.toml", "demo")
    key = build.signing_key_for(demo, None)
    args = build.mkosi_arguments(demo, tmp_path / "generated", tmp_path / "sandbox", tmp_path / "repart", tmp_path / "out", key)
    boot = build.secureboot.boot_keys(demo, key)
    assert f"--verity-key={boot.secure_boot_key}" in args and f"--verity-certificate={boot.secure_boot_cert}" in args
    assert f"--kernel-command-line=systemd.verity_usr_options=root-hash-signature={build.USR_SIGNATURE}" in args
    assert f"--initrd-volatile-package={initrd_package.NAME}" in args


@pytest.mark.programs
def test_the_initrd_package_holds_the_reader_and_requires_it_for_usr(tmp_path: Path) -> None:
    deb = initrd_package.make(tmp_path / "pkgs")
    listing = subprocess.run(["dpkg-deb", "-c", str(deb)], check=True, capture_output=True, text=True).stdout
    assert "./usr/lib/appliance/usr-signature" in listing
    assert "./usr/lib/systemd/system/systemd-veritysetup@usr.service.d/appliance-signature.conf" in listing
    dropin = _conf(initrd_package.SOURCE / "usr/lib/systemd/system/systemd-veritysetup@usr.service.d/appliance-signature.conf")
    assert dropin["Unit"]["Requires"] == "appliance-usr-signature.service"  # fail closed: no signature, no /usr
    script = (initrd_package.SOURCE / "usr/lib/appliance/usr-signature").read_text()
    assert "root-hash-signature=" in script and bundle_index.USR_VERITY_SIG_TYPE.lower() in script
    # the same tree makes the same package; a changed file, another version (mkosi's cache never hides it)
    again = initrd_package.make(tmp_path / "again")
    assert again.name == deb.name and again.read_bytes() == deb.read_bytes()
    source = tmp_path / "source"
    subprocess.run(["cp", "-a", str(initrd_package.SOURCE), str(source)], check=True)
    (source / "usr/lib/appliance/usr-signature").write_text("#!/bin/bash\nexit 0\n")
    assert initrd_package.make(tmp_path / "changed", source).name != deb.name


def test_the_signed_root_hash_is_read_and_anything_else_refused(tmp_path: Path) -> None:
    good = tmp_path / "sig.raw"
    good.write_bytes(signature_partition("ab" * 32))
    assert bundle_index.signed_root_hash(good) == "ab" * 32
    for content, says in ((b"\0" * 16384, "not the JSON"), (b'{"rootHash": "xyz", "signature": "A"}', "64 hex digits"),
                          (b'{"rootHash": "' + b"ab" * 32 + b'"}', "signature"), (b"x" * 70000, "more than")):
        good.write_bytes(content)
        with pytest.raises(ValueError, match=says):
            bundle_index.signed_root_hash(good)


def test_the_update_writes_the_signature_with_the_slot(tmp_path: Path, device: Device, signing: Any) -> None:
    key, trusted = signing
    assert run_update(device, str(bundle(tmp_path, key, "2.0.0")), trusted) == 0
    assert ["blkdiscard", "--zeroout", "/dev/vda11"] in device.writes()  # slot B's signature partition zeroed
    assert "appliance_2.0.0.usr-verity-sig.raw" in device.sources()[0]


def test_a_signature_of_another_root_hash_is_refused_before_any_write(tmp_path: Path, device: Device, signing: Any) -> None:
    import fake_release

    key, trusted = signing
    real_build = fake_release.fake_build

    def build_with_foreign_signature(out: Path, config: Any, key: Path, usr_bytes: int = 4096) -> Path:
        result = real_build(out, config, key, usr_bytes)
        (out / f"appliance_{config.appliance.version}.usr-verity-sig.raw").write_bytes(signature_partition(usrhash_for("9.9.9")))
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fake_release, "fake_build", build_with_foreign_signature)
        with pytest.raises(Exception, match="signs root hash") as e:  # the builder refuses to release it
            bundle(tmp_path, key, "2.0.0")
        assert "build it again" in getattr(e.value, "hint", "")
        # released anyway (the builder's check skipped): the updater refuses it after download, before any write
        mp.setattr(bundle_index, "signed_root_hash", lambda path: usrhash_for("2.0.0"))
        b = bundle(tmp_path / "forced", key, "2.0.0")
    with pytest.raises(Refused, match=r"signs another root hash than bundle\.json's usrhash"):
        run_update(device, str(b), trusted)
    assert device.sysupdate_calls() == [] and device.writes() == []


def test_a_disk_installed_before_the_signature_partition_is_refused_in_one_line(tmp_path: Path, device: Device,
                                                                               signing: Any) -> None:
    key, trusted = signing
    device.set_gpt("appliance_1.0.0", "_empty", signatures=False)
    with pytest.raises(Refused, match=r"^slot B has no partition for /usr's root hash signature \(usr-verity-sig\)") as e:
        run_update(device, str(bundle(tmp_path, key, "2.0.0")), trusted)
    assert "\n" not in e.value.message and "re-install" in e.value.hint
    assert device.writes() == [] and not list((tmp_path / "device").rglob("*.usr.raw"))  # refused before the download


def test_status_says_whether_usr_was_opened_with_its_signature(tmp_path: Path) -> None:
    cmdline, signature = tmp_path / "cmdline", tmp_path / "usr-roothash.p7s"
    cmdline.write_text(f"usrhash={'ab' * 32} rw systemd.verity_usr_options=root-hash-signature={signature}\n")
    assert not sealed.usr_signature_checked(cmdline)  # the initrd wrote no signature: /usr would not have opened
    signature.write_bytes(b"0\x82")
    assert sealed.usr_signature_checked(cmdline)
    cmdline.write_text(f"usrhash={'ab' * 32} rw\n")
    assert not sealed.usr_signature_checked(cmdline)
    part = sealed.probe_sealed(tmp_path / "efivars-missing", cmdline=cmdline)
    assert part.state == "not configured"  # not booted through UEFI: the part says nothing more


# ------------------------------------------------------------------ the initrd's reader, run on the host

SCRIPT = initrd_package.SOURCE / "usr/lib/appliance/usr-signature"
ROOT_HASH = "52dfc5c1fab09899fd6c8e061c7a3dc2c64f79e33a86b63331fa89790b5f3e25"


def _initrd(tmp_path: Path, cmdline: str, partitions: dict[str, tuple[str, bytes]]) -> tuple[Any, Path]:
    """Run the real script with fake udevadm and lsblk; PARTITIONS are regular files standing in
    for the disk's partitions: name -> (GPT type, content)."""
    import fakeprog

    bin_dir, by_uuid = tmp_path / "bin", tmp_path / "by-partuuid"
    by_uuid.mkdir(parents=True)
    disk = tmp_path / "disk"
    disk.mkdir()
    table = []
    for name, (kind, content) in partitions.items():
        (disk / name).write_bytes(content)
        table.append(f"{disk / name} {kind}")
    data = f"{ROOT_HASH[:8]}-{ROOT_HASH[8:12]}-{ROOT_HASH[12:16]}-{ROOT_HASH[16:20]}-{ROOT_HASH[20:32]}"
    (by_uuid / data).symlink_to(disk / "vda2")
    fakeprog.fake_program(bin_dir, "udevadm")
    listing = " ".join(repr(t) for t in table)
    fakeprog.fake_program(bin_dir, "lsblk", script_body=f'case "$1" in -ndo) echo vda;; *) printf "%s\\n" {listing};; esac')
    (tmp_path / "cmdline").write_text(cmdline + "\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "APPLIANCE_CMDLINE": str(tmp_path / "cmdline"), "APPLIANCE_BY_PARTUUID": str(by_uuid)}
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, check=False, timeout=60)
    return proc, bin_dir / fakeprog.LOG


def _calls(log: Path) -> list[list[str]]:
    import fakeprog

    return fakeprog.calls(log) if log.exists() else []


@pytest.mark.programs
def test_the_reader_hands_the_signature_of_the_booted_root_hash_to_dm_verity(tmp_path: Path) -> None:
    import base64
    import json as json_module

    target = tmp_path / "run/usr-roothash.p7s"
    other = signature_partition("ab" * 32)  # the other slot's, for another root hash
    mine = signature_partition(ROOT_HASH)
    signature = base64.b64decode(json_module.loads(mine.rstrip(b"\0"))["signature"])
    sig_type = bundle_index.USR_VERITY_SIG_TYPE.lower()
    proc, _ = _initrd(tmp_path, f"usrhash={ROOT_HASH} rw systemd.verity_usr_options=root-hash-signature={target}",
                        {"vda2": (bundle_index.USR_TYPE.lower(), b"usr"), "vda4": (sig_type, other), "vda11": (sig_type, mine)})
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == signature and "from " + str(tmp_path / "disk/vda11") in proc.stderr


@pytest.mark.programs
@pytest.mark.parametrize("case", ["missing", "empty-signature"])
def test_without_a_signature_for_the_booted_root_hash_the_reader_fails(tmp_path: Path, case: str) -> None:
    """Fail closed: systemd-veritysetup@usr requires the reader, so /usr is not opened."""
    target = tmp_path / "run/usr-roothash.p7s"
    sig_type = bundle_index.USR_VERITY_SIG_TYPE.lower()
    content = {"missing": signature_partition("cd" * 32),
               "empty-signature": json.dumps({"rootHash": ROOT_HASH, "signature": ""}).encode()}[case]
    proc, _ = _initrd(tmp_path, f"usrhash={ROOT_HASH} systemd.verity_usr_options=root-hash-signature={target}",
                      {"vda2": (bundle_index.USR_TYPE.lower(), b"usr"), "vda4": (sig_type, content)})
    assert proc.returncode == 1 and "/usr is not opened" in proc.stderr, proc.stderr
    assert not target.exists()


@pytest.mark.programs
def test_a_command_line_that_asks_for_no_signature_is_not_the_signed_one_and_is_left_alone(tmp_path: Path) -> None:
    proc, log = _initrd(tmp_path, f"usrhash={ROOT_HASH} init=/usr/bin/bash", {})
    assert proc.returncode == 0 and "not checked" in proc.stderr
    assert _calls(log) == []
    proc, _ = _initrd(tmp_path / "x", f"usrhash={ROOT_HASH} systemd.verity_usr_options=root-hash-signature=../x", {})
    assert proc.returncode == 1 and "not a plain absolute path" in proc.stderr
