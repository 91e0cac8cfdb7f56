# SPDX-License-Identifier: MIT
"""`applianctl factory-reset` and the boot-time wipe (applianctl/factory_reset.py) on a real tree:
what is kept, what goes, that nothing is followed out of /var or into another file system, and
that a reset is asked for only with --yes and runs only once."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from appliance import paths
from applianctl import factory_reset
from applianctl.__main__ import main
from applianctl.records import FactoryResetRequest

ROOT = Path(__file__).resolve().parents[1]
CACHE = "lib/appliance/huggingface"


@pytest.fixture
def var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A /var as a served appliance has it, and a directory outside it that symlinks point to."""
    var = tmp_path / "var"
    files = {
        "lib/appliance/host/plan.json": "{}", "lib/appliance/host/plan.json.sig": "sig",
        "lib/appliance/tls/server.key": "key", "lib/appliance/tls/ca.crt": "ca",
        f"{CACHE}/models--x/snapshots/abc/model.safetensors": "weights",
        "lib/appliance/update/freshness.json": "{}", "lib/appliance/update/staged/staged.json": "{}",
        "lib/appliance/aiter/tuned.csv": "t", "lib/containers/storage/overlay/l/a/b/c": "layer",
        "log/journal/0123/system.journal": "j", "lib/systemd/random-seed": "seed", "tmp/.hidden": "x",
    }
    for rel, text in files.items():
        (var / rel).parent.mkdir(parents=True, exist_ok=True)
        (var / rel).write_text(text)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("not on /var")
    (var / "lib/escape").symlink_to(outside)
    (var / "lib/appliance/update/link").symlink_to(outside / "precious")
    monkeypatch.setattr(paths, "STATE_DIR", var / "lib/appliance")
    monkeypatch.setattr(paths, "VAR_DIR", var)
    return var


def _tree(var: Path) -> set[str]:
    return {str(p.relative_to(var)) for p in var.rglob("*") if not p.is_dir() or p.is_symlink()}


RESET_ENTRY = factory_reset.BootedEntry("appliance_1.0.0.efi@factory-reset", counted=False)
LOADER_GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"


def _request(keep_weights: bool, keep_settings: bool) -> FactoryResetRequest:
    return FactoryResetRequest(keep_weights=keep_weights, keep_settings=keep_settings, requested_at="t", by="test")


def test_the_wipe_keeps_settings_and_weights_when_asked_and_nothing_else(var: Path) -> None:
    keep = factory_reset.kept_paths(_request(True, True), str(var / CACHE))
    out = factory_reset.wipe(var, keep)
    assert _tree(var) == {"lib/appliance/host/plan.json", "lib/appliance/host/plan.json.sig",
                          "lib/appliance/tls/server.key", "lib/appliance/tls/ca.crt",
                          f"{CACHE}/models--x/snapshots/abc/model.safetensors"}
    assert (var / f"{CACHE}/models--x/snapshots/abc/model.safetensors").read_text() == "weights"
    assert sorted(out.kept) == sorted(str(p) for p in keep) and out.left == []
    # the directories above the kept ones stay, their other entries went
    assert sorted(p.name for p in (var / "lib").iterdir()) == ["appliance"]
    assert sorted(p.name for p in var.iterdir()) == ["lib"]


def test_without_keep_weights_the_weights_go_and_with_all_the_settings_too(var: Path) -> None:
    factory_reset.wipe(var, factory_reset.kept_paths(_request(False, True), str(var / CACHE)))
    assert not (var / CACHE).exists() and (var / "lib/appliance/host/plan.json").exists()
    factory_reset.wipe(var, factory_reset.kept_paths(_request(False, False), str(var / CACHE)))
    assert _tree(var) == set() and list(var.iterdir()) == []


def test_nothing_is_followed_out_of_var(var: Path, tmp_path: Path) -> None:
    # a kept name that is a symlink to a directory elsewhere is deleted, never entered
    (var / "lib/appliance/host").rename(var / "lib/appliance/host.real")
    (var / "lib/appliance/host").symlink_to(tmp_path / "outside")
    factory_reset.wipe(var, factory_reset.kept_paths(_request(True, True), str(var / CACHE)))
    assert (tmp_path / "outside/precious").read_text() == "not on /var"
    assert not (var / "lib/escape").is_symlink() and not (var / "lib/appliance/host").is_symlink()
    assert not (var / "lib/appliance/host.real").exists()


@pytest.mark.parametrize("where", ["lib/containers/storage", "lib/appliance/aiter"])  # in a deleted tree; beside a kept one
def test_another_file_system_below_var_is_not_entered(var: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    real_stat = os.stat
    mounted = var / where

    def stat(path: str | Path, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> os.stat_result:
        st = real_stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        if dir_fd is not None and path == mounted.name and os.path.samestat(st, real_stat(mounted)):
            fields = list(st)
            fields[2] = st.st_dev + 1  # st_dev: as a mount point shows it
            return os.stat_result(fields)
        return st

    monkeypatch.setattr(factory_reset.os, "stat", stat)
    out = factory_reset.wipe(var, factory_reset.kept_paths(_request(False, True), str(var / CACHE)))
    assert [p.name for p in mounted.iterdir()] and all(p.exists() for p in mounted.rglob("*"))
    assert out.left == [f"{mounted}: another file system is mounted there"]
    assert not (var / "log").exists()


def test_a_tree_deeper_than_the_bound_is_left_and_named(var: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(factory_reset, "MAX_DEPTH", 4)
    deep = var / "lib/deep"
    (deep / "1/2/3/4/5/6").mkdir(parents=True)
    (deep / "1/2/3/4/5/6/f").write_text("x")
    out = factory_reset.wipe(var, [])
    assert any("deeper than 4 directories" in line for line in out.left), out.left
    assert not (var / "log").exists()


def test_the_request_runs_once_at_boot_and_is_removed_last(var: Path) -> None:
    factory_reset.request(keep_weights=True, keep_settings=True)
    request_path = paths.factory_reset_request_path()
    assert request_path.stat().st_mode & 0o777 == 0o600
    done = factory_reset.run_at_boot(var, str(var / CACHE), cmdline="quiet")
    assert done is not None and done.by == "applianctl factory-reset" and done.deleted > 0
    assert not request_path.exists() and (var / f"{CACHE}/models--x/snapshots/abc/model.safetensors").exists()
    record = json.loads(paths.last_factory_reset_path().read_text())
    assert record["format"] == 1 and str(var / "lib/appliance/host") in record["kept"]
    assert not (var / "log").exists()
    # nothing pending: the next boot deletes nothing
    (var / "log").mkdir()
    assert factory_reset.run_at_boot(var, str(var / CACHE), cmdline="quiet") is None
    assert (var / "log").is_dir()


@pytest.mark.parametrize(("cmdline", "weights_kept"), [
    ("quiet systemd.factory_reset=1", False),
    ("systemd.factory_reset", False),
    ("systemd.factory_reset=yes appliance.factory_reset_keep_weights=1", True),
])
def test_the_boot_menus_switch_resets_with_the_settings_kept(var: Path, cmdline: str, weights_kept: bool) -> None:
    done = factory_reset.run_at_boot(var, str(var / CACHE), cmdline=cmdline, booted=RESET_ENTRY)
    assert done is not None and done.by == "the kernel command line"
    assert (var / "lib/appliance/host/plan.json").exists() and (var / "lib/appliance/tls/server.key").exists()
    assert (var / CACHE).exists() == weights_kept and not (var / "lib/containers").exists()


@pytest.mark.parametrize(("selected", "counted", "runs"), [
    (None, False, False),  # the loader did not say what it booted: the command line alone is not believed
    ("", False, False),
    ("appliance_1.0.0.efi@factory-reset", False, True),
    ("appliance_1.0.0.efi@factory-reset-keep-weights", False, True),
    ("appliance_1.0.0.efi", False, False),  # the main entry: the loader and the command line disagree
    ("appliance_1.1.0.efi", True, False),  # a version on trial whose reset profile was booted for its main entry
    ("appliance_1.1.0.efi@factory-reset", True, False),  # a wipe would erase what judges the trial
])
def test_the_boot_menus_switch_runs_only_when_the_boot_loader_booted_a_reset_entry_of_a_blessed_version(
        var: Path, selected: str | None, counted: bool, runs: bool, capsys: pytest.CaptureFixture[str]) -> None:
    before = _tree(var)
    booted = factory_reset.BootedEntry(selected, counted)
    done = factory_reset.run_at_boot(var, str(var / CACHE), cmdline="systemd.factory_reset=1", booted=booted)
    assert (done is not None) == runs and (_tree(var) == before) != runs
    if not runs:
        assert "nothing deleted" in capsys.readouterr().err


def test_the_boot_menus_reset_entries_are_the_profiles_the_image_ships() -> None:
    ids = set()
    for conf in (ROOT / "image/mkosi.uki-profiles").glob("*.conf"):
        ids |= set(re.findall(r"^Profile=ID=(\S+)", conf.read_text(), re.M))
    assert ids == set(factory_reset.RESET_PROFILES)


def test_a_switch_that_says_no_resets_nothing(var: Path) -> None:
    before = _tree(var)
    assert factory_reset.run_at_boot(var, str(var / CACHE), cmdline="systemd.factory_reset=0 foo.systemd.factory_reset=1") is None
    assert _tree(var) == before


def test_a_damaged_request_resets_keeping_everything_that_cannot_be_fetched_again(var: Path) -> None:
    paths.factory_reset_request_path().write_text("{not json")
    done = factory_reset.run_at_boot(var, str(var / CACHE), cmdline="")
    assert done is not None and done.by == "a damaged request"
    assert (var / CACHE).exists() and (var / "lib/appliance/host").exists() and not (var / "log").exists()


def test_the_command_asks_for_yes_then_records_and_cancels(var: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["factory-reset", "--keep-weights"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "deletes everything on /var" in err[0] and "the model weights" in err[0]
    assert err[1].startswith("hint: run it again with --yes")
    assert not paths.factory_reset_request_path().exists()

    assert main(["factory-reset", "--all", "--yes"]) == 0
    assert "keeps nothing" in capsys.readouterr().out
    doc = json.loads(paths.factory_reset_request_path().read_text())
    assert doc["keep_settings"] is False and doc["keep_weights"] is False
    assert main(["factory-reset", "--cancel"]) == 0
    assert "withdrawn" in capsys.readouterr().out and not paths.factory_reset_request_path().exists()


def test_the_unit_runs_after_var_is_mounted_and_before_anything_uses_it() -> None:
    unit = (ROOT / "units/appliance-factory-reset.service").read_text()
    directives = [line for line in unit.splitlines() if line and not line.startswith("#")]
    after = {w for d in directives if d.startswith("After=") for w in d[6:].split()}
    before = {w for d in directives if d.startswith("Before=") for w in d[7:].split()}
    assert {"var.mount", "appliance-var-verity.service"} <= after
    assert {"local-fs.target", "systemd-tmpfiles-setup.service", "systemd-journal-flush.service",
            "systemd-random-seed.service", "appliance-host.service", "appliance-tls.service"} <= before
    # either trigger starts it (the '|' prefix), and only on the switch's word
    assert "ConditionPathExists=|/var/lib/appliance/factory-reset.json" in directives
    assert "ConditionKernelCommandLine=|systemd.factory_reset" in directives
    assert "ExecStart=/usr/bin/python3 -m applianctl factory-reset --at-boot" in directives
    # the boot menu's entries ask on the kernel command line: the sandbox must leave /proc/cmdline visible
    assert not any(d.startswith("ProcSubset=") and d.split("=", 1)[1] != "all" for d in directives), directives
    assert re.search(r"^enable appliance-factory-reset\.service$", (ROOT / "units/appliance.preset.j2").read_text(), re.M)


@pytest.mark.programs
def test_status_shows_a_pending_reset_as_degraded_and_the_last_one(var: Path, tmp_path: Path) -> None:
    from appliance.config import load
    from applianctl.status import host
    from applianctl.status.probes import DEGRADED, Sources

    config = load(ROOT / "appliance.toml", profile="demo")
    applied = tmp_path / "host.json"
    applied.write_text(json.dumps({"ok": True, "reason": "", "source": "image defaults"}))
    part = host.probe_host(config, Sources(), applied)
    assert part.state != DEGRADED and part.to_json()["factory_reset"] == {"pending": None, "last": None}
    factory_reset.request(keep_weights=True, keep_settings=True)
    part = host.probe_host(config, Sources(), applied)
    assert part.state == DEGRADED and "factory reset is pending" in part.reason and "the model weights" in part.reason
    assert part.to_json()["factory_reset"]["pending"]["keep_weights"] is True
    factory_reset.run_at_boot(var, str(var / CACHE), cmdline="")
    part = host.probe_host(config, Sources(), applied)
    assert part.state != DEGRADED and part.to_json()["factory_reset"]["last"]["by"] == "applianctl factory-reset"


@pytest.mark.programs
def test_status_does_not_call_a_directory_where_the_request_belongs_a_pending_wipe(var: Path, tmp_path: Path) -> None:
    """The boot removes such a thing without a wipe: status must not promise one."""
    from appliance.config import load
    from applianctl.status import host
    from applianctl.status.probes import DEGRADED, Sources

    config = load(ROOT / "appliance.toml", profile="demo")
    applied = tmp_path / "host.json"
    applied.write_text(json.dumps({"ok": True, "reason": "", "source": "image defaults"}))
    paths.factory_reset_request_path().parent.mkdir(parents=True, exist_ok=True)
    paths.factory_reset_request_path().mkdir()
    part = host.probe_host(config, Sources(), applied)
    assert part.state == DEGRADED and "is a directory, not a factory reset request" in part.reason
    assert "wipes" not in part.reason and "--cancel" in part.reason
    assert part.to_json()["factory_reset"]["pending"] is None


def test_the_units_command_reads_the_switch_and_the_images_weights_directory(var: Path, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`applianctl factory-reset --at-boot` as appliance-factory-reset.service runs it: the kernel
    command line from /proc/cmdline, model.cache_dir from the image's configuration."""
    import dataclasses

    from appliance.config import load

    config = load(ROOT / "appliance.toml", "demo")
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, cache_dir=str(var / CACHE)))
    (tmp_path / "appliance.json").write_text(json.dumps(config.to_json()))
    monkeypatch.setenv("APPLIANCE_CONFIG", str(tmp_path / "appliance.json"))
    cmdline = tmp_path / "cmdline"
    monkeypatch.setattr(paths, "PROC_CMDLINE", cmdline)
    efivars = tmp_path / "efivars"
    efivars.mkdir()
    monkeypatch.setenv("APPLIANCE_EFIVARS_DIR", str(efivars))
    # a command line it cannot see (a sandbox hiding /proc/cmdline) fails the unit rather than skip a reset
    (var / "lib/appliance").mkdir(parents=True, exist_ok=True)
    assert main(["factory-reset", "--at-boot"]) == 2
    err = capsys.readouterr().err.splitlines()
    said = f"applianctl: {cmdline}: cannot be seen, so a reset asked for on the kernel command line would be missed"
    assert len(err) == 2 and err[0] == said, err
    assert err[1].startswith("hint: ") and (var / "log").exists()
    cmdline.write_text("usrhash=abc quiet\n")
    assert main(["factory-reset", "--at-boot"]) == 0 and "none asked for" in capsys.readouterr().out
    assert (var / "log").exists()
    cmdline.write_text("usrhash=abc systemd.factory_reset=1 appliance.factory_reset_keep_weights=1\n")
    # systemd-boot says it booted the main entry: the switch is not believed
    selected = efivars / "LoaderEntrySelected-4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"
    selected.write_bytes(b"\x06\0\0\0" + "appliance_1.0.0.efi\0".encode("utf-16-le"))
    assert main(["factory-reset", "--at-boot"]) == 0
    said = capsys.readouterr()
    assert "booted appliance_1.0.0.efi, not a factory reset entry" in said.err and "none asked for" not in said.out
    assert (var / "log").exists()
    selected.write_bytes(b"\x06\0\0\0" + "appliance_1.0.0.efi@factory-reset-keep-weights\0".encode("utf-16-le"))
    assert main(["factory-reset", "--at-boot"]) == 0
    out = capsys.readouterr().out
    assert "factory-reset: deleted" in out and str(var / CACHE) in out
    assert (var / f"{CACHE}/models--x/snapshots/abc/model.safetensors").exists() and not (var / "log").exists()


def test_with_all_and_keep_weights_what_the_device_proved_of_the_weights_stays(var: Path) -> None:
    """--all --keep-weights: the settings go, but not the fs-verity digests this device recorded
    (host/weights-verity.json), without which kept weights would not verify."""
    (var / "lib/appliance/host/weights-verity.json").write_text("{}")
    (var / "lib/appliance/host/weights-corrupt.json").write_text("{}")
    factory_reset.request(keep_weights=True, keep_settings=False)
    factory_reset.run_at_boot(var, str(var / CACHE), cmdline="")
    assert sorted(p.name for p in (var / "lib/appliance/host").iterdir()) == ["weights-corrupt.json", "weights-verity.json"]
    assert not (var / "lib/appliance/tls").exists() and (var / CACHE).is_dir()


def test_the_boot_menus_switch_is_refused_when_the_boot_loader_was_not_asked_or_could_not_be_read(
        var: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _tree(var)
    unreadable = factory_reset.BootedEntry("appliance_1.0.0.efi@factory-reset", False,
                                           unreadable="the boot loader's variables cannot be read (x)")
    for booted in (None, unreadable):
        assert factory_reset.run_at_boot(var, str(var / CACHE), cmdline="systemd.factory_reset=1", booted=booted) is None
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].endswith(": nothing deleted"), err
    assert _tree(var) == before


@pytest.fixture
def at_boot(var: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`applianctl factory-reset --at-boot` as the unit runs it, with the image's configuration
    pointing model.cache_dir into VAR; the efivars directory it reads (not created)."""
    import dataclasses

    from appliance.config import load

    config = load(ROOT / "appliance.toml", "demo")
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, cache_dir=str(var / CACHE)))
    (tmp_path / "appliance.json").write_text(json.dumps(config.to_json()))
    monkeypatch.setenv("APPLIANCE_CONFIG", str(tmp_path / "appliance.json"))
    monkeypatch.setattr(paths, "PROC_CMDLINE", tmp_path / "cmdline")
    efivars = tmp_path / "efivars"
    monkeypatch.setenv("APPLIANCE_EFIVARS_DIR", str(efivars))
    return efivars


def _efi(efivars: Path, name: str, data: bytes) -> Path:
    efivars.mkdir(exist_ok=True)
    path = efivars / f"{name}-{LOADER_GUID}"
    path.write_bytes(b"\x06\0\0\0" + data)
    return path


def _utf16(text: str) -> bytes:
    return (text + "\0").encode("utf-16-le")


RESET = _utf16("appliance_1.0.0.efi@factory-reset")


@pytest.mark.parametrize(("case", "said"), [
    ("no efivarfs", "variables cannot be seen"),
    ("no LoaderEntrySelected", "did not say which entry it booted"),
    ("odd length", "not UTF-16 text"),
    ("lone surrogate", "not UTF-16 text"),
    ("shorter than its attributes", "shorter than the 4 bytes"),
    ("a symlink", "symbolic link"),
    ("a directory", "a directory, not a regular file"),
    ("counted", "is a version on trial"),
    ("count path not UTF-16", "not UTF-16 text"),
    ("count path a directory", "a directory, not a regular file"),
])
def test_the_units_command_refuses_the_switch_unless_the_boot_loader_clearly_says_it_booted_a_reset_entry(
        var: Path, at_boot: Path, tmp_path: Path, case: str, said: str, capsys: pytest.CaptureFixture[str]) -> None:
    paths.PROC_CMDLINE.write_text("usrhash=abc systemd.factory_reset=1\n")
    at_boot.mkdir()
    selected = at_boot / f"LoaderEntrySelected-{LOADER_GUID}"
    if case == "no efivarfs":
        at_boot.rmdir()
    elif case == "odd length":
        _efi(at_boot, "LoaderEntrySelected", RESET[:-1])
    elif case == "lone surrogate":
        _efi(at_boot, "LoaderEntrySelected", b"\x00\xd8" + RESET)
    elif case == "shorter than its attributes":
        selected.write_bytes(b"\x06\0")
    elif case == "a symlink":
        _efi(tmp_path, "LoaderEntrySelected", RESET)
        selected.symlink_to(tmp_path / selected.name)
    elif case == "a directory":
        selected.mkdir()
    elif case.startswith("count"):
        _efi(at_boot, "LoaderEntrySelected", RESET)
        if case == "counted":
            _efi(at_boot, "LoaderBootCountPath", _utf16("/EFI/Linux/appliance_1.0.0+2-1.efi"))
        elif case == "count path not UTF-16":
            _efi(at_boot, "LoaderBootCountPath", b"\x00\xdc")
        else:
            (at_boot / f"LoaderBootCountPath-{LOADER_GUID}").mkdir()
    before = _tree(var)
    assert main(["factory-reset", "--at-boot"]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and said in lines[0], lines
    assert lines[0].startswith("factory-reset: the kernel command line asks for a reset, but ")
    assert lines[0].endswith(": nothing deleted") and out == ""
    assert _tree(var) == before and not paths.last_factory_reset_path().exists()


def test_the_units_command_runs_the_switch_when_the_boot_loader_says_it_booted_a_reset_entry_uncounted(
        var: Path, at_boot: Path, capsys: pytest.CaptureFixture[str]) -> None:
    paths.PROC_CMDLINE.write_text("usrhash=abc systemd.factory_reset=1\n")
    _efi(at_boot, "LoaderEntrySelected", RESET)
    _efi(at_boot, "LoaderInfo", _utf16("systemd-boot 257"))
    assert main(["factory-reset", "--at-boot"]) == 0
    assert "factory-reset: deleted" in capsys.readouterr().out and not (var / "log").exists()


@pytest.mark.parametrize("cmdline", ["usrhash=abc quiet", "usrhash=abc systemd.factory_reset=0"])
def test_with_nothing_asked_the_units_command_says_so_whatever_the_boot_loader_left(
        var: Path, at_boot: Path, cmdline: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The unit also starts on systemd.factory_reset=0 (its condition matches the word): no EFI
    variables, no request, nothing deleted and one line that says so."""
    paths.PROC_CMDLINE.write_text(cmdline + "\n")
    before = _tree(var)
    assert main(["factory-reset", "--at-boot"]) == 0
    assert capsys.readouterr() == ("factory-reset: none asked for\n", "")
    assert _tree(var) == before


def _plant(kind: str, path: Path, outside: Path) -> None:
    if kind == "a directory":
        (path / "sub").mkdir(parents=True)
        (path / "sub/file").write_text("x")
        (path / "escape").symlink_to(outside)
    elif kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "a symbolic link":
        (outside / "request.json").write_text(json.dumps({"format": 1, "keep_weights": False, "keep_settings": False,
                                                          "requested_at": "t", "by": "someone"}))
        path.symlink_to(outside / "request.json")
    elif kind == "a symbolic link to a directory":
        path.symlink_to(outside)
    else:
        path.symlink_to(outside / "nothing")


KINDS = ["a directory", "a FIFO", "a symbolic link", "a symbolic link to a directory", "a dangling symbolic link"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_that_is_not_a_regular_file_is_removed_without_a_wipe(
        var: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    outside = tmp_path / "outside"
    request_path = paths.factory_reset_request_path()
    _plant(kind, request_path, outside)
    before = {p for p in _tree(var) if not p.startswith("lib/appliance/factory-reset.json")}
    outside_before = sorted(p.name for p in outside.iterdir())
    assert factory_reset.run_at_boot(var, str(var / CACHE), cmdline="quiet") is None
    out, err = capsys.readouterr()
    lines = err.splitlines()
    shown = kind.replace(" to a directory", "").replace("a dangling", "a")
    assert lines == [f"factory-reset: {request_path} is {shown}, not a request: removed without a reset"] and out == ""
    assert not os.path.lexists(request_path) and _tree(var) == before
    assert sorted(p.name for p in outside.iterdir()) == outside_before and (outside / "precious").read_text() == "not on /var"
    # and the next boot finds nothing to do
    assert factory_reset.run_at_boot(var, str(var / CACHE), cmdline="quiet") is None
    assert capsys.readouterr().out == "factory-reset: none asked for\n" and (var / "log").is_dir()


def test_a_request_directory_does_not_stop_a_reset_the_boot_menu_asked_for(var: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request_path = paths.factory_reset_request_path()
    (request_path / "sub").mkdir(parents=True)
    done = factory_reset.run_at_boot(var, str(var / CACHE), cmdline="systemd.factory_reset=1", booted=RESET_ENTRY)
    assert done is not None and done.by == "the kernel command line" and not (var / "log").exists()
    assert not os.path.lexists(request_path) and "not a request: removed" in capsys.readouterr().err


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_removes_whatever_sits_where_the_request_belongs(var: Path, tmp_path: Path, kind: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    outside = tmp_path / "outside"
    request_path = paths.factory_reset_request_path()
    _plant(kind, request_path, outside)
    outside_before = sorted(p.name for p in outside.iterdir())
    assert main(["factory-reset", "--cancel"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{request_path} was a ") and out.endswith("not a request: removed; nothing will be deleted\n")
    assert not os.path.lexists(request_path)
    assert sorted(p.name for p in outside.iterdir()) == outside_before and (outside / "precious").exists()
    assert main(["factory-reset", "--cancel"]) == 0 and "no factory reset was asked for" in capsys.readouterr().out


def test_asking_for_a_reset_where_a_directory_sits_says_how_to_clear_it(var: Path, capsys: pytest.CaptureFixture[str]) -> None:
    request_path = paths.factory_reset_request_path()
    request_path.mkdir()
    assert main(["factory-reset", "--yes"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].endswith(f"{request_path}: is a directory, not a factory reset request"), err
    assert "--cancel" in err[1] and request_path.is_dir()


@pytest.mark.parametrize("where", ["lib/appliance", "lib/containers", "lib/containers/storage"])  # above a kept one; a deleted tree; in it
def test_a_directory_swapped_for_a_symlink_before_it_is_opened_does_not_lead_the_wipe_out_of_var(
        var: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Between the wipe's look at an entry (not followed) and its opening it, the directory is
    replaced by a symlink to one outside /var: the opening must not follow it."""
    real_stat = os.stat
    target = var / where
    outside = tmp_path / "outside"
    swapped = []

    def stat(path: str | Path, *, dir_fd: int | None = None, follow_symlinks: bool = True) -> os.stat_result:
        st = real_stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        if not swapped and dir_fd is not None and path == target.name and os.path.samestat(st, real_stat(target)):
            os.rename(target, target.with_name(target.name + ".moved"))
            target.symlink_to(outside)
            swapped.append(where)
        return st

    monkeypatch.setattr(factory_reset.os, "stat", stat)
    out = factory_reset.wipe(var, factory_reset.kept_paths(_request(False, True), str(var / CACHE)))
    assert swapped and (outside / "precious").read_text() == "not on /var"
    assert any(line.startswith(f"{target}: ") for line in out.left), out.left


def test_a_var_that_is_a_symlink_is_not_wiped(tmp_path: Path, var: Path) -> None:
    link = tmp_path / "var-link"
    link.symlink_to(tmp_path / "outside")
    with pytest.raises(OSError):
        factory_reset.wipe(link, [])
    assert (tmp_path / "outside/precious").read_text() == "not on /var"
