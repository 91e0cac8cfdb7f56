"""/dev/shm hygiene before the engine starts (`applianctl shm-clean`).

vLLM's CPU KV offload lives in /dev/shm/vllm_offload_<id>.mmap and leaks whenever an EngineCore
dies uncleanly; the next start then fails ("Bad address") or runs short of memory. This removes
every such file that no process holds open or mapped, then checks that /dev/shm and memory can
take the configured offload plus its margin. The verdict goes to paths.SHM_CHECK.

A file held by any process (another replica, an engine still shutting down) is never removed.
Holders are looked for in /proc/*/fd and /proc/*/maps, by device and inode (which works across
container mount namespaces) and by path; then, as the kernel's own word, the file is removed only
while this process holds a write lease on it (F_SETLEASE F_WRLCK), which the kernel grants only
when no other open file or mapping of it exists anywhere, even in processes /proc does not show us.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.atomic import write_json_atomic
from applianctl import config

GIB = 2**30
PATTERN = "vllm_offload_*.mmap"


@dataclass(frozen=True)
class FsUsage:
    size_bytes: int
    used_bytes: int
    free_bytes: int  # available to unprivileged writers (f_bavail)


def statvfs_usage(path: Path) -> FsUsage:
    st = os.statvfs(path)
    return FsUsage(
        size_bytes=st.f_blocks * st.f_frsize,
        used_bytes=(st.f_blocks - st.f_bfree) * st.f_frsize,
        free_bytes=st.f_bavail * st.f_frsize,
    )


def read_meminfo() -> str:
    return Path("/proc/meminfo").read_text()


def mem_available_bytes(meminfo: str) -> int:
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            value, *unit = line.split(":", 1)[1].split()
            return int(value) * (1024 if unit == ["kB"] else 1)
    raise ValueError("no MemAvailable line in /proc/meminfo")


# ----------------------------------------------------------------------------------- holders


@dataclass
class Holders:
    """Who holds what open: (device, inode) and paths, from every readable /proc/PID."""

    inodes: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    paths: dict[str, set[int]] = field(default_factory=dict)
    unreadable: list[int] = field(default_factory=list)

    def pids(self, path: Path, st: os.stat_result) -> set[int]:
        return self.inodes.get((st.st_dev, st.st_ino), set()) | self.paths.get(str(path), set())


def _maps_entry(line: str) -> tuple[int, int, str] | None:
    # address perms offset dev inode [path]
    parts = line.split(None, 5)
    if len(parts) < 5 or parts[4] == "0":
        return None
    major, minor = (int(x, 16) for x in parts[3].split(":"))
    path = parts[5].strip() if len(parts) == 6 else ""
    return os.makedev(major, minor), int(parts[4]), path.removesuffix(" (deleted)")


def scan_holders(proc: Path = Path("/proc")) -> Holders:
    holders = Holders()
    me = os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            fds = list((entry / "fd").iterdir())
            for fd in fds:
                try:
                    target = os.readlink(fd)
                    st = os.stat(fd)
                except PermissionError:
                    raise
                except OSError:
                    continue  # closed meanwhile
                holders.inodes.setdefault((st.st_dev, st.st_ino), set()).add(pid)
                holders.paths.setdefault(target.removesuffix(" (deleted)"), set()).add(pid)
            for line in (entry / "maps").read_text().splitlines():
                if (parsed := _maps_entry(line)) is not None:
                    dev, ino, path = parsed
                    holders.inodes.setdefault((dev, ino), set()).add(pid)
                    if path:
                        holders.paths.setdefault(path, set()).add(pid)
        except FileNotFoundError:
            continue  # the process ended while we looked
        except PermissionError:
            if pid not in holders.unreadable:
                holders.unreadable.append(pid)
        except ProcessLookupError:
            continue
    return holders


# ----------------------------------------------------------------------------------- cleaning


class _Held(Exception):
    pass


def _unlink_unless_open(path: Path, trust_proc: bool) -> None:
    """Unlink PATH while holding a write lease on it; raise _Held when any process has it open or mapped."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EBUSY):
                raise _Held("open in a process /proc does not show") from None
            if not trust_proc:  # no lease support and some processes unreadable: cannot tell
                raise _Held(f"cannot take a lease ({e.strerror}) and some processes are unreadable") from None
            path.unlink()
            return
        try:
            path.unlink()
        finally:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    finally:
        os.close(fd)


def clean(shm_dir: Path, proc: Path = Path("/proc"), dry_run: bool = False) -> tuple[list[dict[str, Any]], int]:
    """Remove unheld offload files in SHM_DIR; return [{path, bytes, allocated_bytes}] and the bytes freed."""
    candidates = sorted(shm_dir.glob(PATTERN))  # listed before the scan: a file made later is never a candidate
    if not candidates:
        return [], 0
    holders = scan_holders(proc)
    removed: list[dict[str, Any]] = []
    freed = 0
    for path in candidates:
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        size_gb = st.st_size / 1e9
        if not path.is_file() or path.is_symlink():
            print(f"kept {path}: not a regular file")
            continue
        held_by = holders.pids(path, st)
        if held_by:
            print(f"kept {path} ({size_gb:.2f} GB): held open by pid {', '.join(map(str, sorted(held_by)))}")
            continue
        allocated = st.st_blocks * 512
        if not dry_run:
            try:
                _unlink_unless_open(path, trust_proc=not holders.unreadable)
            except _Held as e:
                print(f"kept {path} ({size_gb:.2f} GB): {e}")
                continue
            except FileNotFoundError:
                continue
        verb = "would remove" if dry_run else "removed"
        print(f"{verb} {path} ({size_gb:.2f} GB, {allocated / GIB:.2f} GiB in memory): no process holds it")
        removed.append({"path": str(path), "bytes": st.st_size, "allocated_bytes": allocated})
        freed += allocated
    return removed, freed


def check(
    cfg: dict[str, Any],
    shm_dir: Path,
    *,
    proc: Path = Path("/proc"),
    statvfs: Callable[[Path], FsUsage] = statvfs_usage,
    meminfo: Callable[[], str] = read_meminfo,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Clean SHM_DIR, then check its room and memory for the offload; the result as SHM_CHECK holds it."""
    engine = cfg.get("engine", {})
    offload_gib = float(engine.get("offload_gib") or 0.0)
    margin_gib = float((engine.get("shm") or {}).get("margin_gib", 8.0))
    required = int((offload_gib + margin_gib) * GIB)
    mem_before = mem_available_bytes(meminfo())  # read before removal: the freed files add to it
    removed, freed = clean(shm_dir, proc, dry_run)
    usage = statvfs(shm_dir)
    memory = mem_before + freed
    need = f"{required / GIB:.2f} GiB ({offload_gib:g} GiB KV offload + {margin_gib:g} GiB margin)"
    if usage.free_bytes < required:
        ok = False
        reason = (f"{shm_dir} has {usage.free_bytes / GIB:.2f} GiB free of {usage.size_bytes / GIB:.2f} GiB "
                  f"but needs {need}: enlarge it (tmpfs size=) or lower --kv-offloading-size")
    elif memory < required:
        ok = False
        reason = (f"only {memory / GIB:.2f} GiB of memory available (MemAvailable {mem_before / GIB:.2f} GiB "
                  f"+ {freed / GIB:.2f} GiB freed) but the engine needs {need}: free memory or lower "
                  "--kv-offloading-size")
    else:
        ok = True
        reason = (f"{shm_dir} has {usage.free_bytes / GIB:.2f} GiB free and {memory / GIB:.2f} GiB of memory "
                  f"is available for {need}; removed {len(removed)} leaked file(s)")
    return {
        "ok": ok,
        "reason": reason,
        "removed": removed,
        "shm_size_bytes": usage.size_bytes,
        "shm_used_bytes": usage.used_bytes,
        "required_bytes": required,
        "mem_available_bytes": memory,
    }



def run(args: argparse.Namespace) -> int:
    result = check(config.load(), paths.SHM_DIR, dry_run=args.dry_run)
    if not args.dry_run:
        write_json_atomic(paths.SHM_CHECK, result)
    if result["ok"]:
        print(result["reason"])
        return 0
    print(result["reason"], file=sys.stderr)
    return 1


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "shm-clean",
        help="remove leaked KV offload files from /dev/shm and check its room",
        description=f"Remove {PATTERN} files in {paths.SHM_DIR} that no process holds open, then check that "
        "/dev/shm and memory can take the configured KV offload plus its margin. Writes "
        f"{paths.SHM_CHECK}; exit status 1 when the check fails.",
    )
    parser.add_argument("--dry-run", action="store_true", help="only say what would be removed; write nothing")
    parser.set_defaults(func=run)
