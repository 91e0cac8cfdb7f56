# SPDX-License-Identifier: MIT
"""`applianctl shm-clean`, before the engine starts. vLLM's CPU KV offload files
(/dev/shm/vllm_offload_<id>.mmap) leak when an EngineCore dies uncleanly, and the next start fails
("Bad address") or runs short of memory. Removes each one no process holds, then checks that
/dev/shm and memory can take the configured offload plus its margin (verdict: paths.SHM_CHECK).

A held file (another replica, an engine shutting down) is never removed: holders are found in
/proc/*/fd and /proc/*/maps by device and inode (across mount namespaces) and by path, and the
unlink happens only under a write lease (F_SETLEASE F_WRLCK), which the kernel grants only when no
other open file or mapping exists, even in processes /proc does not show us.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import fnmatch
import json
import os
import re
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import cli_help, paths
from appliance.atomic import write_record
from appliance.config import Config
from appliance.host_settings import load_device
from appliance.schema import dump_record
from applianctl.records import ShmCheck, ShmRemoved

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
    """Who holds what open or mapped, from every readable /proc/PID (the appliance's one scanner):
    `scan_holders()` once, then `pids(path, st)` / `held(st)` per file."""

    inodes: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    paths: dict[str, set[int]] = field(default_factory=dict)
    unreadable: list[int] = field(default_factory=list)

    def pids(self, path: Path | str, st: os.stat_result) -> set[int]:
        """PIDs holding the file with stat result ST (by device and inode) or PATH open or mapped."""
        return self.inodes.get((st.st_dev, st.st_ino), set()) | self.paths.get(str(path), set())

    def held(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino) in self.inodes


def _maps_entry(line: str) -> tuple[int, int, str] | None:
    # address perms offset dev inode [path]
    parts = line.split(None, 5)
    if len(parts) < 5 or parts[4] == "0":
        return None
    try:
        major, minor = (int(x, 16) for x in parts[3].split(":"))
        inode = int(parts[4])
    except ValueError:
        return None
    path = parts[5].strip() if len(parts) == 6 else ""
    return os.makedev(major, minor), inode, path.removesuffix(" (deleted)")


def scan_holders(proc: Path = Path("/proc")) -> Holders:
    """Every file another process holds open or mapped; processes this user may not read go in
    `unreadable` (status runs unprivileged; the cleaner has CAP_SYS_PTRACE)."""
    holders = Holders()
    me = os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            for fd in (entry / "fd").iterdir():
                try:
                    target = os.readlink(fd)
                    st = os.stat(fd)
                except PermissionError:
                    raise
                except OSError:
                    continue  # closed meanwhile
                holders.inodes.setdefault((st.st_dev, st.st_ino), set()).add(pid)
                holders.paths.setdefault(target.removesuffix(" (deleted)"), set()).add(pid)
            for line in (entry / "maps").read_text(errors="replace").splitlines():
                if (parsed := _maps_entry(line)) is not None:
                    dev, ino, path = parsed
                    holders.inodes.setdefault((dev, ino), set()).add(pid)
                    if path:
                        holders.paths.setdefault(path, set()).add(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue  # the process ended while we looked
        except PermissionError:
            if pid not in holders.unreadable:
                holders.unreadable.append(pid)
    return holders


# ----------------------------------------------------------------------------------- cleaning

_PLAIN_NAME = re.compile(r"[A-Za-z0-9._+-]+")


def shown(name: str) -> str:
    """NAME as it may go into a log line: as is when plain, else quoted with every control
    character, non-ASCII character and undecodable byte escaped (so never a raw newline or escape
    sequence, and a quoted form never looks like a plain name)."""
    return name if _PLAIN_NAME.fullmatch(name) else ascii(name)


class _Skip(Exception):
    """This entry is not removed; the message says why."""


def _race_point(stage: str, name: str) -> None:
    """Called between looking at an entry and removing it; tests replace it to simulate races."""


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return kind
    return "not a regular file"


def _unlink_unless_open(dir_fd: int, name: str, seen: os.stat_result, trust_proc: bool) -> None:
    """Unlink NAME in DIR_FD if it is still the regular file SEEN and no process has it open or
    mapped (a write lease on it proves that); raise _Skip otherwise."""
    try:
        # O_NOFOLLOW: a symlink swapped in fails (ELOOP); O_NONBLOCK: a FIFO swapped in does not block.
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Skip("replaced by a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
            raise _Skip(f"replaced by another file ({_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else 'inode changed'})")
        leased = True
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EBUSY):
                raise _Skip("open in a process /proc does not show") from None
            if not trust_proc:  # no lease support and some processes unreadable: cannot tell
                raise _Skip(f"cannot take a lease ({e.strerror}) and some processes are unreadable") from None
            leased = False
        try:
            _race_point("before-unlink", name)
            # The name must still be the file we hold: re-check device and inode right before.
            # (What is left between this stat and unlinkat: /dev/shm is sticky, so only the entry's
            # owner or root could swap it in that instant.)
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise _Skip(f"replaced by another file ({_kind(now.st_mode) if not stat.S_ISREG(now.st_mode) else 'inode changed'})")
            os.unlink(name, dir_fd=dir_fd)
        finally:
            if leased:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    finally:
        os.close(fd)


def clean(shm_dir: Path, proc: Path = Path("/proc"), dry_run: bool = False) -> tuple[list[dict[str, Any]], int, int]:
    """Remove unheld offload files in SHM_DIR; return [{path, bytes, allocated_bytes}], the bytes
    freed and the bytes the held ones (live replicas') have allocated. An entry it cannot handle
    (symlink, FIFO, swapped, an error) is reported and kept; every operation is relative to one
    descriptor of SHM_DIR and never follows a symlink."""
    dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # Listed before the scan: a file made later is never a candidate.
        names = sorted(n for n in os.listdir(dir_fd) if fnmatch.fnmatchcase(n, PATTERN))
        if not names:
            return [], 0, 0
        holders = scan_holders(proc)
        removed: list[dict[str, Any]] = []
        freed = held = 0
        for name in names:
            where = f"{shm_dir}/{shown(name)}"
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as e:
                print(f"kept {where}: cannot look at it ({e.strerror})")
                continue
            if not stat.S_ISREG(st.st_mode):
                print(f"kept {where}: {_kind(st.st_mode)}, not a regular file")
                continue
            size_gb = st.st_size / 1e9
            held_by = holders.pids(shm_dir / name, st)
            if held_by:
                held += st.st_blocks * 512
                print(f"kept {where} ({size_gb:.2f} GB): held open by pid {', '.join(map(str, sorted(held_by)))}")
                continue
            allocated = st.st_blocks * 512
            if not dry_run:
                try:
                    _race_point("before-open", name)
                    _unlink_unless_open(dir_fd, name, st, trust_proc=not holders.unreadable)
                except _Skip as e:
                    print(f"kept {where} ({size_gb:.2f} GB): {e}")
                    continue
                except FileNotFoundError:
                    continue  # gone meanwhile: nothing to do
                except OSError as e:
                    print(f"kept {where} ({size_gb:.2f} GB): cannot remove it ({e.strerror})")
                    continue
            verb = "would remove" if dry_run else "removed"
            print(f"{verb} {where} ({size_gb:.2f} GB, {allocated / GIB:.2f} GiB in memory): no process holds it")
            removed.append({"path": str(shm_dir / name), "bytes": st.st_size, "allocated_bytes": allocated})
            freed += allocated
        return removed, freed, held
    finally:
        os.close(dir_fd)


def check(
    config: Config,
    shm_dir: Path,
    *,
    proc: Path = Path("/proc"),
    statvfs: Callable[[Path], FsUsage] = statvfs_usage,
    meminfo: Callable[[], str] = read_meminfo,
    dry_run: bool = False,
) -> ShmCheck:
    """Clean SHM_DIR, then check its room and memory for the offload; the result as SHM_CHECK holds it.
    What live replicas' files already hold counts as theirs: a replica restarting alone needs room
    only for its own file and what the others' have yet to fill."""
    mem_before = mem_available_bytes(meminfo())  # read before removal: the freed files add to it
    removed, freed, held = clean(shm_dir, proc, dry_run)
    required = max(config.shm_required_bytes - held, int(config.engine.shm.margin_gib * GIB))
    usage = statvfs(shm_dir)
    memory = mem_before + freed
    need = f"{required / GIB:.2f} GiB ({config.shm_need})"
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
    return ShmCheck(ok, reason, tuple(ShmRemoved(**r) for r in removed), usage.size_bytes, usage.used_bytes, required, memory)



def run(args: argparse.Namespace) -> int:
    result = check(load_device(), paths.SHM_DIR, dry_run=args.dry_run)
    if not args.dry_run:
        write_record(paths.SHM_CHECK, result)
    if getattr(args, "json", False):
        print(json.dumps(dump_record(result), indent=2))
        return 0 if result.ok else 1
    if result.ok:
        print(result.reason)
        return 0
    print(result.reason, file=sys.stderr)
    return 1


def add_parser(subparsers: Any) -> None:
    parser = cli_help.verb_parser(
        subparsers, "shm-clean", "remove leaked KV offload files from /dev/shm and check its room",
        examples=["applianctl shm-clean --dry-run", "applianctl shm-clean --json"],
        exit_codes=[(0, "/dev/shm and memory can take the configured KV offload"),
                    (1, "they cannot (the reason on stderr)"), cli_help.BAD_INPUT],
        details=f"Remove {PATTERN} files in {paths.SHM_DIR} that no process holds open, then check that "
        "/dev/shm and memory can take the configured KV offload plus its margin. Writes "
        f"{paths.SHM_CHECK}.",
    )
    parser.add_argument("--dry-run", action="store_true", help="only say what would be removed; write nothing")
    parser.add_argument("--json", action="store_true", help="print the result (the record status reads) as JSON")
    parser.set_defaults(func=run)
