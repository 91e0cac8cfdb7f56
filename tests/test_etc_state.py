# SPDX-License-Identifier: MIT
"""The factory /etc (appliance/factory_etc.py): recorded at build (builder/finalize.py), compared by
`applianctl verify` (what in /etc or /run changes behaviour outside the signed image), and put back
by `applianctl etc-reset --root DIR`, which follows no link out of DIR/etc."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from appliance import factory_etc, paths
from appliance.errors import UserError
from appliance.schema import dump_record
from appliance.signed import release_manifest
from applianctl.slots import release_verify
from applianctl.status import collect
from builder import keys

ROOT = Path(__file__).resolve().parents[1]
UNIT = b"[Service]\nExecStart=/usr/bin/true\n"
DROPIN = "systemd/system/appliance-engine.service.d/x.conf"


def image(root: Path) -> Path:
    """A finished image tree's /etc, as mkosi leaves it before finalize."""
    etc = root / "etc"
    files = {
        "systemd/system/foo.service": UNIT,
        "systemd/journald.conf": b"[Journal]\n",
        "ssh/sshd_config": b"Include /etc/ssh/sshd_config.d/*.conf\n",
        "ssh/sshd_config.d/50-appliance.conf": b"PasswordAuthentication no\n",
        "ssh/ssh_config": b"Host *\n",
        "ssh/ssh_host_ed25519_key": b"secret\n",
        "containers/storage.conf": b"[storage]\n",
        "sudoers": b"root ALL=(ALL) ALL\n",
        "fstab": b"PARTLABEL=appliance-var /var ext4 defaults 0 2\n",
        "machine-id": b"uninitialized\n",
        "hostname": b"appliance\n",
        "motd": b"hello\n",
    }
    for rel, data in files.items():
        (etc / rel).parent.mkdir(parents=True, exist_ok=True)
        (etc / rel).write_bytes(data)
    (etc / "sudoers").chmod(0o440)
    (etc / "ssh/ssh_host_ed25519_key").chmod(0o600)
    (etc / "systemd/system/multi-user.target.wants").mkdir()
    (etc / "systemd/system/multi-user.target.wants/appliance-host.service").symlink_to(
        "/usr/lib/systemd/system/appliance-host.service")
    (etc / "systemd/system/ctrl-alt-del.target").symlink_to("/dev/null")  # a mask
    (etc / "systemd/system/sockets.target.wants").mkdir()  # empty
    (etc / "sudoers.d").mkdir(mode=0o750)
    (etc / "sudoers.d").chmod(0o750)
    (root / "usr/lib/appliance").mkdir(parents=True)
    return etc


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    image(root)
    factory_etc.write_factory(root)
    return root


def record(root: Path) -> dict[str, factory_etc.Entry]:
    loaded = factory_etc.load(root / factory_etc.RECORD)
    assert loaded is not None
    return loaded


def findings(root: Path) -> list[factory_etc.Finding]:
    return factory_etc.compare(root / "etc", record(root))


def lines(root: Path) -> list[str]:
    return [f.line() for f in factory_etc.reported(findings(root))]


def tamper(root: Path) -> None:
    """What the tests do to a device's /etc: a drop-in added, a unit changed, a mask removed, a
    per-host file added, a file outside the places changed and one added."""
    etc = root / "etc"
    (etc / DROPIN).parent.mkdir()
    (etc / DROPIN).write_text("[Service]\nExecStart=\nExecStart=/bin/sh\n")
    (etc / "systemd/system/foo.service").write_bytes(UNIT + b"User=root\n")
    (etc / "systemd/system/ctrl-alt-del.target").unlink()
    (etc / "ssh/ssh_host_rsa_key").write_text("this host's\n")
    (etc / "motd").write_text("changed\n")
    (etc / "issue").write_text("added\n")


TAMPERED = [
    "added /etc/systemd/system/appliance-engine.service.d/x.conf",
    "removed /etc/systemd/system/ctrl-alt-del.target",
    "changed /etc/systemd/system/foo.service",
]


def in_scope_state(root: Path) -> dict[str, factory_etc.Entry]:
    fd = os.open(root / "etc", os.O_RDONLY | os.O_DIRECTORY)
    try:
        return factory_etc.scan(fd, factory_etc.in_scope)
    finally:
        os.close(fd)


def snapshot(top: Path) -> dict[str, tuple[int, int, int]]:
    """Every path below TOP: inode, mode, mtime (what any write would change)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), top)] = (st.st_ino, st.st_mode, st.st_mtime_ns)
    return out


# ----------------------------------------------------------------------------------- at build


def test_the_record_describes_etc_and_the_copy_is_exact(tree: Path) -> None:
    rec = record(tree)
    assert rec["systemd/system/foo.service"] == factory_etc.Entry("file", "0644", hashlib.sha256(UNIT).hexdigest())
    assert rec["systemd/system/ctrl-alt-del.target"] == factory_etc.Entry("symlink", target="/dev/null")
    assert rec["sudoers"].mode == "0440" and rec["sudoers.d"] == factory_etc.Entry("dir", "0750")
    assert rec["motd"].type == "file"  # the whole /etc is recorded; only the places are compared
    assert "machine-id" not in rec and "ssh/ssh_host_ed25519_key" not in rec  # per machine: not copied
    factory = tree / factory_etc.FACTORY_DIR
    assert not (factory / "machine-id").exists() and not (factory / "ssh/ssh_host_ed25519_key").exists()
    assert os.readlink(factory / "systemd/system/ctrl-alt-del.target") == "/dev/null"
    assert (factory / "sudoers").stat().st_mode & 0o7777 == 0o440
    assert (factory / "systemd/system/foo.service").read_bytes() == UNIT
    assert factory_etc.compare(factory, rec) == []


def test_the_record_is_canonical_json_in_the_documented_form(tree: Path) -> None:
    data = (tree / factory_etc.RECORD).read_bytes()
    doc = json.loads(data)
    assert list(doc) == ["files"] and list(doc["files"]) == sorted(doc["files"])
    assert data == json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert doc["files"]["systemd/system/ctrl-alt-del.target"] == {"type": "symlink", "target": "/dev/null"}
    assert doc["files"]["sudoers.d"] == {"type": "dir", "mode": "0750"}
    assert set(doc["files"]["sudoers"]) == {"type", "mode", "sha256"}
    assert factory_etc.dumps(record(tree)) == data
    assert paths.FACTORY_ETC_RECORD.name == Path(factory_etc.RECORD).name and Path(factory_etc.RECORD).parent == Path("usr/lib/appliance")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"x": {"type": "file", "mode": "0644"}}, "a file has mode, sha256"),
        ({"x": {"type": "symlink", "target": "/dev/null", "mode": "0777"}}, "a symlink has target"),
        ({"x": {"type": "fifo", "mode": "0644"}}, "file, symlink or dir"),
        ({"x": {"type": "dir", "mode": "755"}}, "four octal digits"),
        ({"../x": {"type": "dir", "mode": "0755"}}, "relative to /etc"),
        ({"x": {"type": "dir", "mode": "0755", "owner": "root"}}, "unknown key"),
    ],
)
def test_a_damaged_record_is_refused(files: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError) as e:
        factory_etc.loads(json.dumps({"files": files}).encode(), "factory-etc.json")
    assert message in f"{e.value.message} {e.value.hint}" and "\n" not in e.value.message


def test_a_special_file_in_the_image_etc_fails_the_build(tmp_path: Path) -> None:
    image(tmp_path)
    os.mkfifo(tmp_path / "etc/initctl")
    with pytest.raises(UserError, match="initctl: is other"):
        factory_etc.write_factory(tmp_path)


def _release_plan(root: Path) -> None:
    (root / "usr/lib/modules/6.12.38+deb13-amd64").mkdir(parents=True)
    (root / "usr/lib/modules/6.12.38+deb13-amd64/modules.dep").write_text("")
    plan = {
        "version": "1.2.0", "min_version": "1.0.0", "profile": "demo", "gpu_required": False, "files": [],
        "engine_image": {"reference": "localhost/e@sha256:" + "0" * 64, "digest": "sha256:" + "0" * 64,
                         "store_label": "engine_000000000000", "store_roothash": "1" * 64},
        "model": {"id": "standin/tiny-demo", "revision": "0" * 39 + "1"},
    }
    (root / "usr/lib/appliance/release-plan.json").write_text(json.dumps(plan))


def test_finalize_records_the_factory_etc_before_it_signs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from builder import finalize

    root = tmp_path / "root"
    image(root)
    _release_plan(root)
    private, public = keys.generate(tmp_path / "keys")
    (root / "usr/lib/appliance/keys").mkdir()
    (root / "usr/lib/appliance/keys" / keys.trusted_name(public)).write_bytes(public.read_bytes())
    (tmp_path / "out").mkdir()
    monkeypatch.setenv("BUILDROOT", str(root))
    monkeypatch.setenv("APPLIANCE_SIGNING_KEY", str(private))
    monkeypatch.setenv("OUTPUTDIR", str(tmp_path / "out"))
    sign = release_manifest.sign
    seen: list[bool] = []
    monkeypatch.setattr(release_manifest, "sign", lambda body, key: seen.append((root / factory_etc.RECORD).is_file()) or sign(body, key))
    assert finalize.main() == 0
    assert seen == [True]
    assert factory_etc.compare(root / factory_etc.FACTORY_DIR, record(root)) == []
    assert (root / "usr/lib/appliance/manifest.json").is_file()


# ----------------------------------------------------------------------------------- what counts


def test_the_findings_exactly(tree: Path) -> None:
    tamper(tree)
    assert findings(tree) == [
        factory_etc.Finding("added", "systemd/system/appliance-engine.service.d", directory=True),
        factory_etc.Finding("added", DROPIN),
        factory_etc.Finding("removed", "systemd/system/ctrl-alt-del.target"),
        factory_etc.Finding("changed", "systemd/system/foo.service"),
    ]
    assert lines(tree) == TAMPERED  # the directory holding the drop-in is said by the drop-in


def test_an_untouched_etc_has_no_findings(tree: Path) -> None:
    assert findings(tree) == []


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda etc: (etc / "systemd/system/bar.service").write_bytes(UNIT), ["added /etc/systemd/system/bar.service"]),
        (lambda etc: (etc / "systemd/journald.conf").write_text("[Journal]\nStorage=none\n"), ["changed /etc/systemd/journald.conf"]),
        (lambda etc: (etc / "sudoers").chmod(0o666), ["changed /etc/sudoers"]),  # the mode alone
        (lambda etc: (etc / "ssh/sshd_config.d/50-appliance.conf").unlink(), ["removed /etc/ssh/sshd_config.d/50-appliance.conf"]),
        (lambda etc: _relink(etc / "systemd/system/ctrl-alt-del.target", "/usr/lib/systemd/system/reboot.target"),
         ["changed /etc/systemd/system/ctrl-alt-del.target"]),
        (lambda etc: _replace_with_link(etc / "systemd/system/foo.service", etc / "foo.real"),  # same bytes, now a link
         ["changed /etc/systemd/system/foo.service"]),
        (lambda etc: (etc / "containers/systemd").mkdir(), []),  # an empty directory changes nothing
        (lambda etc: (etc / "systemd/system/sockets.target.wants").rmdir(), []),
        (lambda etc: (etc / "ld.so.preload").write_text("/tmp/x.so\n"), ["added /etc/ld.so.preload"]),
        (lambda etc: (etc / "cron.d").mkdir() or (etc / "cron.d/job").write_text("* * * * * root x\n"), ["added /etc/cron.d/job"]),
        (lambda etc: (etc / "ld.so.cache").write_text("x"), []),  # per host
        (lambda etc: (etc / "ssh/moduli").write_text("x"), []),  # ssh/: only sshd's configuration counts
        (lambda etc: (etc / "ssh/ssh_config").write_text("Host x\n"), []),
        (lambda etc: (etc / "motd").unlink(), []),
    ],
)
def test_each_kind_of_finding_alone(tree: Path, mutate: Any, expected: list[str]) -> None:
    mutate(tree / "etc")
    assert lines(tree) == expected


def _relink(path: Path, target: str) -> None:
    path.unlink()
    path.symlink_to(target)


def _replace_with_link(path: Path, real: Path) -> None:
    real.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(real)


def test_per_host_files_are_never_reported_even_in_a_wider_place(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(factory_etc, "BEHAVIOUR_PLACES", (*factory_etc.BEHAVIOUR_PLACES, "ssh", "hostname"))
    (tree / "etc/ssh/ssh_host_rsa_key").write_text("this host's\n")
    (tree / "etc/hostname").write_text("other\n")
    (tree / "etc/ssh/moduli").write_text("x")
    assert lines(tree) == ["added /etc/ssh/moduli"]


def test_a_link_where_a_place_was_is_one_finding_and_not_followed(tree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sshd_config").write_text("PermitRootLogin yes\n")
    (outside / "evil.service").write_bytes(UNIT)
    etc = tree / "etc"
    os.rename(etc / "ssh", tmp_path / "ssh.orig")
    (etc / "ssh").symlink_to(outside)
    _plant_link(etc / "systemd/system", outside)
    assert lines(tree) == ["changed /etc/ssh", "changed /etc/systemd/system"]
    assert "evil.service" not in " ".join(f.path for f in findings(tree))


def _plant_link(path: Path, target: Path) -> None:
    import shutil

    shutil.rmtree(path)
    path.symlink_to(target)


def test_a_name_with_control_characters_is_shown_escaped(tree: Path) -> None:
    (tree / "etc/systemd/system/x\n\x1b[2J.conf").write_text("x")
    (shown,) = lines(tree)
    assert shown.isprintable() and "\\n" in shown and "\\x1b" in shown


def test_runtime_units_and_drop_ins(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "systemd/system/appliance-engine.service.d").mkdir(parents=True)
    (run / "systemd/system/appliance-engine.service.d/x.conf").write_text("[Service]\n")
    (run / "systemd/system/multi-user.target.wants").mkdir()
    (run / "systemd/system/multi-user.target.wants/evil.service").symlink_to("/run/evil.service")
    (run / "systemd/system/notes.txt").write_text("not a unit")
    (run / "systemd/transient").mkdir()
    (run / "systemd/transient/run-u1.service").write_text("[Service]\n")  # systemd-run's own
    (run / "containers/systemd/sub").mkdir(parents=True)
    (run / "containers/systemd/sub/x.container").write_text("[Container]\n")
    assert [f.line() for f in factory_etc.runtime(run)] == [
        "runtime /run/systemd/system/appliance-engine.service.d/x.conf",
        "runtime /run/systemd/system/multi-user.target.wants/evil.service",
        "runtime /run/containers/systemd/sub/x.container",
    ]
    assert factory_etc.runtime(tmp_path / "absent") == []


def test_systemd_booted_marker_alone_is_not_a_finding(tmp_path: Path) -> None:
    (tmp_path / "run/systemd/system").mkdir(parents=True)  # PID 1 makes it, empty, on every boot
    assert factory_etc.runtime(tmp_path / "run") == []


# ----------------------------------------------------------------------------------- applianctl verify


def _signed_manifest(lib: Path, tmp_path: Path) -> None:
    private, public = keys.generate(tmp_path / "signing")
    (lib / "keys").mkdir(exist_ok=True)
    (lib / "keys" / keys.trusted_name(public)).write_bytes(public.read_bytes())
    body = {
        "version": "1.2.0", "min_version": "1.0.0", "build_time": "2026-08-04T12:00:00Z", "profile": "demo",
        "engine_image": {"reference": "localhost/e@sha256:" + "0" * 64, "digest": "sha256:" + "0" * 64,
                         "store_label": "engine_000000000000", "store_roothash": "1" * 64},
        "model": {"id": "standin/tiny-demo", "revision": "0" * 39 + "1"},
        "kernel_version": "6.12.38+deb13-amd64", "files": [], "signer": keys.public_key_id(public),
    }
    (lib / "manifest.json").write_bytes(release_manifest.dumps(body))
    (lib / "manifest.json.sig").write_bytes(release_manifest.sign(body, private))


@pytest.fixture
def device(tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    lib = tree / "usr/lib/appliance"
    _signed_manifest(lib, tmp_path)
    monkeypatch.setattr(paths, "MANIFEST", lib / "manifest.json")
    monkeypatch.setattr(paths, "MANIFEST_SIG", lib / "manifest.json.sig")
    monkeypatch.setattr(paths, "TRUSTED_KEYS_DIR", lib / "keys")
    monkeypatch.setattr(paths, "ENGINE_FILES_DIR", lib / "engine")
    monkeypatch.setattr(paths, "FACTORY_ETC_RECORD", lib / "factory-etc.json")
    monkeypatch.setattr(paths, "ETC_DIR", tree / "etc")
    monkeypatch.setattr(paths, "RUN_ROOT", tree / "run")
    monkeypatch.setattr(paths, "VERIFY_RESULT", tree / "run/appliance/verify.json")
    return tree


def test_verify_reports_what_overrides_the_image(device: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tamper(device)
    result = release_verify.check()
    assert not result.ok
    assert result.overrides == tuple(TAMPERED)
    assert result.reason == "3 files outside the signed image change behaviour: " + ", ".join(TAMPERED)
    assert release_verify.run(argparse.Namespace(command="verify", debug=False)) == 1
    assert json.loads(paths.VERIFY_RESULT.read_text())["overrides"] == TAMPERED
    assert capsys.readouterr().err == f"applianctl verify: {result.reason}\n"


def test_verify_names_one_drop_in(device: Path) -> None:
    (device / "etc/systemd/system/x.service.d").mkdir()
    (device / "etc/systemd/system/x.service.d/y.conf").write_text("[Service]\n")
    reason = release_verify.check().reason
    assert reason == "1 file outside the signed image changes behaviour: added /etc/systemd/system/x.service.d/y.conf"


def test_verify_counts_runtime_units(device: Path, tmp_path: Path) -> None:
    (device / "run/systemd/system").mkdir(parents=True)
    (device / "run/systemd/system/appliance-engine.service").write_text("[Service]\n")
    result = release_verify.check()
    assert not result.ok and result.overrides == ("runtime /run/systemd/system/appliance-engine.service",)
    (tmp_path / "elsewhere").mkdir()
    _plant_link(device / "etc/systemd/system", tmp_path / "elsewhere")  # what it covers in /etc is not in /run
    assert release_verify.check().overrides == ("changed /etc/systemd/system", "runtime /run/systemd/system/appliance-engine.service")


def test_verify_is_ok_on_the_factory_etc(device: Path) -> None:
    result = release_verify.check()
    assert result.ok, result.reason
    assert result.overrides == ()
    assert result.reason == f"manifest 1.2.0 signed by {result.signer}: 0 files match; /etc as the factory's"


def test_verify_without_a_record_says_so_and_passes(device: Path) -> None:
    (device / factory_etc.RECORD).unlink()
    tamper(device)
    result = release_verify.check()
    assert result.ok
    assert "/etc not compared" in result.reason and "absent" in result.reason
    assert "overrides" not in dump_record(result)  # as an older release wrote it


def test_verify_fails_on_a_damaged_record(device: Path) -> None:
    (device / factory_etc.RECORD).write_text('{"files": {"x": {"type": "file"}}}')
    result = release_verify.check()
    assert not result.ok and "factory-etc.json" in result.reason


def test_verify_caps_the_overrides_and_counts_the_rest(device: Path) -> None:
    dropins = device / "etc/systemd/system/appliance-engine.service.d"
    dropins.mkdir()
    for i in range(60):
        (dropins / f"{i:02}.conf").write_text("[Service]\n")
    result = release_verify.check()
    assert result.overrides is not None and len(result.overrides) == 51
    assert result.overrides[0] == "added /etc/systemd/system/appliance-engine.service.d/00.conf"
    assert result.overrides[-1] == "... and 10 more"
    assert result.reason.startswith("60 files outside the signed image change behaviour: added ")
    assert result.reason.endswith(" and 57 more (applianctl verify --json)")


def test_status_says_when_etc_was_not_compared() -> None:
    assert collect.summary("verify", {"version": "1.2.0", "signer": "k"}) == "version 1.2.0 signer k; /etc not compared"
    assert collect.summary("verify", {"version": "1.2.0", "signer": "k", "overrides": []}) == "version 1.2.0 signer k"


# ----------------------------------------------------------------------------------- the reset


def test_reset_restores_the_factory_places_and_keeps_the_rest(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    factory = in_scope_state(tree)
    tamper(tree)
    assert factory_etc.reset(tree) == 0
    assert capsys.readouterr().out.splitlines() == [
        "etc-reset: deleted /etc/systemd/system/appliance-engine.service.d (not in the factory /etc)",
        "etc-reset: restored /etc/systemd/system/ctrl-alt-del.target (removed)",
        "etc-reset: restored /etc/systemd/system/foo.service (changed)",
    ]
    assert in_scope_state(tree) == factory
    assert findings(tree) == []
    etc = tree / "etc"
    assert (etc / "ssh/ssh_host_rsa_key").read_text() == "this host's\n"  # per host: kept
    assert (etc / "motd").read_text() == "changed\n" and (etc / "issue").is_file()  # outside the places: kept
    assert (etc / "machine-id").read_text() == "uninitialized\n"


def test_reset_twice_touches_nothing_the_second_time(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tamper(tree)
    factory_etc.reset(tree)
    capsys.readouterr()
    before = snapshot(tree)
    assert factory_etc.reset(tree) == 0
    assert capsys.readouterr().out == ""
    assert snapshot(tree) == before


def test_reset_of_an_untouched_etc_touches_nothing(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = snapshot(tree)
    assert factory_etc.reset(tree) == 0
    assert capsys.readouterr().out == ""
    assert snapshot(tree) == before


def test_reset_never_follows_a_link_out_of_etc(tree: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "foo.service").write_text("someone else's\n")
    (outside / "keep.txt").write_text("keep\n")
    factory = in_scope_state(tree)
    _plant_link(tree / "etc/systemd/system", outside)
    before = snapshot(outside)
    assert factory_etc.reset(tree) == 0
    assert snapshot(outside) == before
    assert (outside / "foo.service").read_text() == "someone else's\n"
    assert not (tree / "etc/systemd/system").is_symlink()
    assert in_scope_state(tree) == factory


def test_reset_replaces_a_directory_where_a_mask_was(tree: Path) -> None:
    mask = tree / "etc/systemd/system/ctrl-alt-del.target"
    mask.unlink()
    mask.mkdir()
    (mask / "inner.conf").write_text("x")
    assert factory_etc.reset(tree) == 0
    assert os.readlink(mask) == "/dev/null"


def test_reset_restores_modes_and_a_removed_place(tree: Path) -> None:
    import shutil

    factory = in_scope_state(tree)
    (tree / "etc/sudoers").chmod(0o666)
    shutil.rmtree(tree / "etc/ssh/sshd_config.d")
    assert factory_etc.reset(tree) == 0
    assert in_scope_state(tree) == factory


def test_reset_refuses_a_factory_copy_that_is_not_the_recorded_one(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tree / factory_etc.FACTORY_DIR / "systemd/system/foo.service").write_text("not the factory's\n")
    (tree / "etc/systemd/system/foo.service").unlink()
    assert factory_etc.reset(tree) == 1
    assert "cannot reset /etc/systemd/system/foo.service" in capsys.readouterr().out
    assert not (tree / "etc/systemd/system/foo.service").exists()
    assert not [p for p in (tree / "etc/systemd/system").iterdir() if p.name.startswith(".#")]


def test_reset_without_a_record_does_nothing(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tree / factory_etc.RECORD).unlink()
    tamper(tree)
    before = snapshot(tree)
    assert factory_etc.reset(tree) == 0
    assert "nothing reset" in capsys.readouterr().out
    assert snapshot(tree) == before


def test_reset_refuses_an_etc_that_is_a_link(tree: Path, tmp_path: Path) -> None:
    os.rename(tree / "etc", tmp_path / "elsewhere")
    (tree / "etc").symlink_to(tmp_path / "elsewhere")
    assert factory_etc.reset(tree) == 1


# ----------------------------------------------------------------------------------- the command


def test_etc_reset_is_a_hidden_command(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import applianctl.__main__

    assert applianctl.__main__.COMMAND_MODULES["etc-reset"] == "applianctl.slots.release_verify"
    assert "etc-reset" not in applianctl.__main__.build_parser().format_help()
    tamper(tree)
    assert applianctl.__main__.main(["etc-reset", "--root", str(tree)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert findings(tree) == []


def test_etc_reset_does_not_import_cryptography() -> None:
    """It runs in the initrd: the manifest module (cryptography) is verify's only."""
    code = ("import sys; from applianctl.__main__ import build_parser; "
            "build_parser('etc-reset'); print('cryptography' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
