# SPDX-License-Identifier: MIT
"""/dev/shm hygiene: real files on the real tmpfs, real processes holding them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from appliance.config import Config, load
from applianctl.engine import shm
from applianctl.records import ShmRemoved
from testkit.standin import ROOT, StandinProcess

pytestmark = pytest.mark.timeout(60)

GIB = 2**30
MEMINFO = "MemTotal:       247000000 kB\nMemFree:         1000000 kB\nMemAvailable:   {} kB\n"

HOLD = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
if sys.argv[2] == "map":
    m = mmap.mmap(fd, 0)
    os.close(fd)  # held by the mapping alone
print("holding", flush=True)
time.sleep(60)
"""


def _leak(directory: Path, name: str, size: int = 1 << 20) -> Path:
    path = directory / f"vllm_offload_{name}_dp0.mmap"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    os.write(fd, b"x" * 8192)  # some pages really in memory
    os.close(fd)
    return path


@pytest.fixture
def holder() -> Iterator[Callable[[Path, str], subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []

    def hold(path: Path, how: str = "fd") -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), how], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "holding\n"
        procs.append(proc)
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def _cfg(offload_gib: float, margin_gib: float = 8) -> Config:
    """The demo configuration, one engine (the demo runs two replicas), with this KV offload
    (--kv-offloading-size) and /dev/shm margin."""
    base = load(ROOT / "appliance.toml", "demo")
    base = dataclasses.replace(base, topology=dataclasses.replace(base.topology, gpus=1, layout="1x1"))
    args = list(base.engine.args)
    args[args.index("--kv-offloading-size") + 1] = str(offload_gib)
    engine = dataclasses.replace(base.engine, args=tuple(args), shm=dataclasses.replace(base.engine.shm, margin_gib=float(margin_gib)))
    return dataclasses.replace(base, engine=engine)


def _fs(free_gib: float, size_gib: float = 128) -> Callable[[Path], shm.FsUsage]:
    return lambda path: shm.FsUsage(int(size_gib * GIB), int((size_gib - free_gib) * GIB), int(free_gib * GIB))


def _mem(available_gib: float) -> Callable[[], str]:
    return lambda: MEMINFO.format(int(available_gib * GIB / 1024))


def test_removes_unheld_and_keeps_held_files(shm_dir: Path, holder: Callable[..., object],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    leaked = _leak(shm_dir, "1")
    by_fd = _leak(shm_dir, "2")
    by_map = _leak(shm_dir, "3")
    other = shm_dir / "not_vllm.mmap"
    other.write_bytes(b"keep")
    holder(by_fd, "fd")
    holder(by_map, "map")
    result = shm.check(_cfg(1, 1), shm_dir, statvfs=_fs(100), meminfo=_mem(100))
    assert not leaked.exists()
    assert by_fd.exists() and by_map.exists() and other.exists()
    assert result.ok is True
    assert result.removed == (ShmRemoved(path=str(leaked), bytes=1 << 20, allocated_bytes=8192),)
    out = capsys.readouterr().out
    assert f"removed {leaked} (0.00 GB" in out
    assert f"kept {by_fd}" in out and f"kept {by_map}" in out


def test_lease_protects_a_holder_that_proc_does_not_show(shm_dir: Path, tmp_path: Path,
                                                         holder: Callable[..., object]) -> None:
    """With an empty /proc (as if every process were unreadable) the kernel lease still sees the holder."""
    held = _leak(shm_dir, "held")
    free = _leak(shm_dir, "free")
    holder(held, "map")
    (tmp_path / "proc").mkdir()
    removed, *_ = shm.clean(shm_dir, proc=tmp_path / "proc")
    assert held.exists() and not free.exists()
    assert [r["path"] for r in removed] == [str(free)]


def test_dry_run_removes_nothing(shm_dir: Path) -> None:
    leaked = _leak(shm_dir, "1")
    removed, *_ = shm.clean(shm_dir, dry_run=True)
    assert leaked.exists() and removed[0]["path"] == str(leaked)


def test_capacity_check_fails_when_shm_is_too_small(shm_dir: Path) -> None:
    result = shm.check(_cfg(96, 8), shm_dir, statvfs=_fs(free_gib=100, size_gib=117), meminfo=_mem(200))
    assert result.ok is False
    assert result.required_bytes == 104 * GIB
    assert result.shm_size_bytes == 117 * GIB and result.shm_used_bytes == 17 * GIB
    assert "100.00 GiB free" in result.reason and "104.00 GiB" in result.reason
    assert "\n" not in result.reason


def test_capacity_check_fails_when_memory_is_short(shm_dir: Path) -> None:
    result = shm.check(_cfg(96, 8), shm_dir, statvfs=_fs(150), meminfo=_mem(100))
    assert result.ok is False and "memory available" in result.reason


def test_removed_files_count_towards_memory(shm_dir: Path) -> None:
    _leak(shm_dir, "big", size=4 * GIB)  # sparse apart from 8 KiB, so it frees 8 KiB
    need = 1 + 1  # GiB
    just_short = need - 8192 / GIB / 2
    assert shm.check(_cfg(1, 1), shm_dir, statvfs=_fs(50), meminfo=_mem(just_short)).ok is True
    _leak(shm_dir, "big2", size=GIB)
    assert shm.check(_cfg(1, 1), shm_dir, statvfs=_fs(50), meminfo=_mem(need - 1 / 1024)).ok is False


def test_capacity_check_passes(shm_dir: Path) -> None:
    result = shm.check(_cfg(96, 8), shm_dir, statvfs=_fs(150), meminfo=_mem(200))
    assert result.ok is True and result.removed == ()


def _cli(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "applianctl", "shm-clean"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore", **env}, timeout=30)


def test_cli_writes_the_check_and_keeps_a_live_engines_file(shm_dir: Path, tmp_path: Path) -> None:
    """A live stand-in's offload file survives; one left by a crashed stand-in is removed."""
    args = ["--kv-offloading-size", "0.0625"]
    crashed = StandinProcess(args, env={"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_CRASH_AFTER_S": "0",
                                        "STANDIN_CRASH_LEAVE_MMAP": "1"})
    assert crashed.proc.wait(15) == 1
    crashed.stop()
    (leaked,) = shm_dir.glob("vllm_offload_*.mmap")
    live = StandinProcess(args, env={"STANDIN_SHM_DIR": str(shm_dir)}).wait_ready()
    try:
        (live_file,) = set(shm_dir.glob("vllm_offload_*.mmap")) - {leaked}
        config = tmp_path / "appliance.json"
        config.write_text(json.dumps(_cfg(0.0625, 0.5).to_json()))
        env = {"APPLIANCE_CONFIG": str(config), "APPLIANCE_SHM_DIR": str(shm_dir),
               "APPLIANCE_RUN_DIR": str(tmp_path / "run")}
        done = _cli(env)
        assert done.returncode == 0, done.stderr
        assert f"removed {leaked} (0.07 GB" in done.stdout
        assert f"kept {live_file} (0.07 GB): held open by pid {live.proc.pid}" in done.stdout
        assert not leaked.exists() and live_file.exists()
        report = json.loads((tmp_path / "run" / "shm-check.json").read_text())
        assert report["ok"] is True and [r["path"] for r in report["removed"]] == [str(leaked)]
        assert set(report) >= {"ok", "reason", "removed", "shm_size_bytes", "shm_used_bytes", "required_bytes"}
        assert not list((tmp_path / "run").glob(".*.tmp"))

        config.write_text(json.dumps(_cfg(1_000_000, 8).to_json()))
        failed = _cli(env)
        assert failed.returncode == 1
        assert len(failed.stderr.strip().splitlines()) == 1 and "1000008.00 GiB" in failed.stderr
        assert json.loads((tmp_path / "run" / "shm-check.json").read_text())["ok"] is False
    finally:
        live.stop()


def test_cli_without_configuration_says_what_to_do(tmp_path: Path) -> None:
    done = _cli({"APPLIANCE_CONFIG": str(tmp_path / "absent.json"), "APPLIANCE_RUN_DIR": str(tmp_path)})
    assert done.returncode == 2 and "no appliance configuration" in done.stderr and "hint:" in done.stderr


# ----------------------------------------------------------------------------------- odd entries and races


def test_odd_entries_are_reported_and_kept_and_the_rest_still_cleaned(
    shm_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("must survive")
    link = shm_dir / "vllm_offload_link.mmap"
    link.symlink_to(victim)
    directory = shm_dir / "vllm_offload_dir.mmap"
    directory.mkdir()
    (directory / "inside").write_text("x")
    fifo = shm_dir / "vllm_offload_fifo.mmap"
    os.mkfifo(fifo)
    leaked = _leak(shm_dir, "z")
    removed, *_ = shm.clean(shm_dir)
    assert [r["path"] for r in removed] == [str(leaked)] and not leaked.exists()
    assert link.is_symlink() and victim.read_text() == "must survive"
    assert (directory / "inside").exists() and fifo.exists()
    out = capsys.readouterr().out
    assert f"kept {link}: a symlink, not a regular file" in out
    assert f"kept {directory}: a directory, not a regular file" in out
    assert f"kept {fifo}: a FIFO, not a regular file" in out


@pytest.mark.parametrize(
    "name",
    ["vllm_offload_a\nremoved evil (0.00 GB).mmap", "vllm_offload_\x1b[2J\x1b[31mred.mmap", "vllm_offload_\r\x07.mmap",
     "vllm_offload_caf\u00e9.mmap", "vllm_offload_\udcff.mmap"],
)
def test_names_are_escaped_in_the_log(shm_dir: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    path = shm_dir / name
    path.write_bytes(b"x")
    fresh = _leak(shm_dir, "plain")
    removed, *_ = shm.clean(shm_dir)
    assert not path.exists() and not fresh.exists() and len(removed) == 2
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 2, out  # one line per file: no newline from a name
    assert not any(ord(c) < 0x20 or c == "\x7f" or ord(c) > 0x7e for c in out.replace("\n", "")), ascii(out)
    assert f"removed {shm_dir}/{name!a} " in out
    assert f"removed {fresh} " in out  # a plain name stays plain


def _swap(stage: str, how: str, shm_dir: Path, tmp_path: Path) -> Callable[[str, str], None]:
    """A race: at STAGE, replace the entry NAME with HOW (symlink, fifo, dir, file, gone)."""

    def hook(at: str, name: str) -> None:
        if at != stage:
            return
        path = shm_dir / name
        path.unlink()
        if how == "symlink":
            path.symlink_to(tmp_path / "victim")
        elif how == "fifo":
            os.mkfifo(path)
        elif how == "dir":
            path.mkdir()
        elif how == "file":
            path.write_text("another file under the same name")
        elif how == "fail":
            raise OSError(5, "Input/output error")

    return hook


@pytest.mark.parametrize("stage", ["before-open", "before-unlink"])
@pytest.mark.parametrize("how", ["symlink", "fifo", "dir", "file", "gone", "fail"])
def test_an_entry_swapped_between_scan_and_unlink_is_kept_and_the_rest_cleaned(
    shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    stage: str, how: str,
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("must survive")
    racy = _leak(shm_dir, "a_racy")
    later = _leak(shm_dir, "b_later")
    swap = _swap(stage, how, shm_dir, tmp_path)
    monkeypatch.setattr(shm, "_race_point", lambda at, name: swap(at, name) if name == racy.name else None)
    removed, *_ = shm.clean(shm_dir)  # never raises
    assert [r["path"] for r in removed] == [str(later)] and not later.exists()
    assert victim.read_text() == "must survive"
    out = capsys.readouterr().out
    if how == "gone":
        assert not racy.exists() and "kept" not in out
        return
    if how == "fail":
        assert f"kept {racy} (0.00 GB): cannot remove it (Input/output error)" in out
        return
    # Whatever was swapped in is still there, untouched.
    assert {"symlink": racy.is_symlink, "fifo": racy.is_fifo, "dir": racy.is_dir, "file": racy.is_file}[how]()
    if how == "file":
        assert racy.read_text() == "another file under the same name"
    assert f"kept {racy} (0.00 GB): replaced by " in out


def test_holders_are_found_by_inode_and_path(shm_dir: Path, holder: Callable[..., subprocess.Popen[str]]) -> None:
    by_fd, by_map, free = _leak(shm_dir, "fd"), _leak(shm_dir, "map"), _leak(shm_dir, "free")
    p1, p2 = holder(by_fd, "fd"), holder(by_map, "map")
    found = shm.scan_holders()
    assert p1.pid in found.pids(by_fd, by_fd.stat()) and found.held(by_fd.stat())
    assert p2.pid in found.pids(by_map, by_map.stat()) and found.held(by_map.stat())
    assert not found.held(free.stat()) and found.pids(free, free.stat()) == set()


@pytest.mark.parametrize(
    ("name", "expected"),
    [("vllm_offload_1.mmap", "vllm_offload_1.mmap"), ("a\nb", "'a\\nb'"), ("x\x1by", "'x\\x1by'"), ("'q'", "\"'q'\"")],
)
def test_shown(name: str, expected: str) -> None:
    assert shm.shown(name) == expected


def test_a_replica_restarting_alone_needs_room_only_for_its_own_file(shm_dir: Path, tmp_path: Path,
                                                                     holder: Callable[..., object]) -> None:
    """Two replicas of 64 MiB each and a 64 MiB margin need 192 MiB; while replica 0 lives, its file
    (fully allocated) is counted as its share, so replica 1's restart needs the other 128 MiB."""
    base = _cfg(1 / 16, 1 / 16)
    two = dataclasses.replace(base, topology=dataclasses.replace(base.topology, gpus=2, layout="2x1"))
    live = shm_dir / "vllm_offload_live_dp0.mmap"
    live.write_bytes(b"x" * (64 << 20))
    holder(live, "map")
    free_gib = 150 / 1024  # MiB: more than 128, less than 192
    result = shm.check(two, shm_dir, statvfs=_fs(free_gib), meminfo=_mem(free_gib))
    assert result.ok, result.reason
    assert live.exists() and result.required_bytes == 128 << 20
    # and with nothing live, the whole 192 MiB
    (empty := tmp_path / "empty").mkdir()
    one_short = shm.check(two, empty, statvfs=_fs(free_gib), meminfo=_mem(free_gib))
    assert not one_short.ok and one_short.required_bytes == 192 << 20
