# SPDX-License-Identifier: MIT
"""The factory /etc: what the signed image's /etc was at build, and what on a device differs from it
where a difference changes what the appliance runs.

/usr is read-only and dm-verity-verified, but / (holding /etc) is writable and persistent: a drop-in
in /etc changes the appliance without any signature. At build (builder/finalize.py, before the
release manifest is signed) the tree's /etc is copied to FACTORY_DIR and described in RECORD, both
on /usr. On the device `applianctl verify` compares the live /etc with RECORD in BEHAVIOUR_PLACES
and lists runtime units under /run (`compare`, `runtime`, `reported`); `applianctl etc-reset --root
DIR` puts those places back from the copy (`reset`).

Every walk goes one name at a time relative to its parent's descriptor with O_NOFOLLOW: a symbolic
link is an entry to compare or remove, never a way out of the tree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

from appliance.errors import UserError
from appliance.safe_read import loads_bounded, read_capped
from appliance.schema import Loader, check, optional, plain

FACTORY_DIR = "usr/share/factory/etc"  # the copy, relative to the image's root (as ParticleOS keeps it)
RECORD = "usr/lib/appliance/factory-etc.json"  # its description (appliance.paths.FACTORY_ETC_RECORD on the device)
MAX_RECORD_BYTES = 16 << 20  # a Debian /etc is a few thousand entries of ~150 bytes
MAX_DEPTH = 32  # deeper than any real /etc: below it a tree is reported, not walked

# Not copied nor recorded: each machine has its own, and a copy would hand every machine the same.
NOT_COPIED = (
    "machine-id",  # written at first boot (the image has "uninitialized")
    "ssh/ssh_host_*",  # the host's SSH keys: secrets
    "adjtime",  # the machine's hardware clock drift
)

# Where a file in /etc changes what the appliance runs: each a path relative to /etc (a directory
# counts with all it holds; a component may be a glob).
BEHAVIOUR_PLACES = (
    # systemd: units, drop-ins, system.conf.d, journald/logind/networkd/resolved/timesyncd, generators, presets, network
    "systemd",
    # podman: quadlets (containers/systemd), registries, storage.conf, policy.json
    "containers",
    # what boot sets up: tmpfiles, kernel tunables, kernel modules and their options
    "tmpfiles.d", "sysctl.d", "sysctl.conf", "modprobe.d", "modules-load.d",
    # device rules and the hardware database
    "udev",
    # the proxy
    "caddy",
    # the SSH server's configuration (not the host keys beside it)
    "ssh/sshd_config", "ssh/sshd_config.d",
    # every process's environment and dynamic linker, login shells
    "environment", "ld.so.preload", "ld.so.conf", "ld.so.conf.d", "profile.d",
    # who may do what
    "sudoers", "sudoers.d", "pam.d", "security",
    # the rules Debian's nftables.service loads
    "nftables.conf",
    # scheduled jobs: cron.d, cron.daily..., crontab
    "cron*",
    # defaults packaged units read (EnvironmentFile=-/etc/default/...)
    "default",
    # the appliance's own
    "appliance",
    # partitions and updates: systemd-repart, systemd-sysupdate
    "repart.d", "sysupdate.d",
    # kernel-install and the kernel command line
    "kernel",
    # what is unlocked and mounted
    "crypttab", "fstab",
)

# Per-host files that may differ from the factory's: never reported, never reset (today each lies
# outside BEHAVIOUR_PLACES; listed so that a wider place does not start reporting them).
PER_HOST = (
    "machine-id",  # written at first boot
    "ssh/ssh_host_*",  # the host's SSH keys, made on the host
    "hostname",  # hostnamectl (the plan's name is set transiently, applianctl.host)
    "adjtime",  # hwclock, timedatectl
    ".updated",  # systemd-update-done: /etc caught up with this /usr
    "ld.so.cache",  # ldconfig's cache of ld.so.conf(.d), which are compared
)

# Under /run: where units and quadlets placed at runtime take effect. systemd itself writes no
# unit there (transient units go to /run/systemd/transient, generators' to /run/systemd/generator*),
# nor does any appliance unit (they write /run/systemd/network and /run/appliance): every unit,
# drop-in or quadlet found is reported, as "runtime".
RUNTIME_PLACES = ("systemd/system", "systemd/system.control", "containers/systemd")
RUNTIME_SUFFIXES = (
    ".service", ".socket", ".target", ".device", ".mount", ".automount", ".swap", ".timer", ".path", ".slice", ".scope",
    ".container", ".volume", ".network", ".kube", ".image", ".build", ".pod",  # quadlet
    ".conf",  # a drop-in
)

FILE, SYMLINK, DIR = "file", "symlink", "dir"
OTHER, UNREADABLE = "other", "unreadable"  # seen on a device only: never in a record
ADDED, CHANGED, REMOVED, RUNTIME = "added", "changed", "removed", "runtime"

_MODE = re.compile(r"[0-7]{4}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PLAIN = re.compile(r"[A-Za-z0-9._+@:=,/~-]+")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
CHUNK = 1 << 20


def shown(path: str) -> str:
    """PATH for a log line: as is when plain, else quoted with every control, non-ASCII or
    undecodable character escaped (never a raw newline or escape sequence)."""
    return path if _PLAIN.fullmatch(path) else ascii(path)


# ----------------------------------------------------------------------------------- the record


def _type(value: str) -> str | None:
    return None if value in (FILE, SYMLINK, DIR) else "file, symlink or dir"


def _mode_value(value: str) -> str | None:
    return None if _MODE.fullmatch(value) else "four octal digits (0644)"


def _sha256(value: str) -> str | None:
    return None if _SHA256.fullmatch(value) else "a SHA-256 (64 lower-case hex digits)"


def _relative(value: str) -> str | None:
    parts = value.split("/")
    if value and "\x00" not in value and all(p not in ("", ".", "..") for p in parts):
        return None
    return "a path relative to /etc"


@dataclass(frozen=True)
class Entry:
    """One path of /etc: a file (mode, sha256), a symlink (target) or a directory (mode)."""

    type: str = field(metadata=check(_type))
    mode: str | None = optional(check=_mode_value)
    sha256: str | None = optional(check=_sha256)
    target: str | None = optional()

    def fault(self) -> str:
        """What is missing or extra for its type ("" when it is whole)."""
        want = {FILE: ("mode", "sha256"), SYMLINK: ("target",), DIR: ("mode",)}.get(self.type, ())
        have = tuple(k for k in ("mode", "sha256", "target") if getattr(self, k) is not None)
        return "" if have == want else f"a {self.type} has {', '.join(want) or 'nothing'}, this one {', '.join(have) or 'nothing'}"


_UNREADABLE = Entry(UNREADABLE)


@dataclass(frozen=True)
class FactoryEtc:
    """RECORD: every path of the factory /etc (relative to /etc) and what it is."""

    files: Mapping[str, Entry] = field(default_factory=dict, metadata={"keys": _relative})


def dumps(record: Mapping[str, Entry]) -> bytes:
    """RECORD as canonical JSON (sorted keys, no whitespace, UTF-8), as the manifest is written."""
    doc = {"files": {rel: plain(entry) for rel, entry in sorted(record.items())}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def loads(data: bytes, where: str) -> dict[str, Entry]:
    """The record in DATA; UserError (one line) when it is not one."""
    try:
        doc = loads_bounded(data)
    except ValueError as e:
        raise UserError(f"{where}: not JSON ({type(e).__name__})", hint="the image is damaged") from None
    loaded: FactoryEtc = Loader(where).load(FactoryEtc, doc)
    for rel, entry in loaded.files.items():
        if fault := entry.fault():
            raise UserError(f"{where}: {shown(rel)}: {fault}", hint="the image is damaged")
    return dict(loaded.files)


def load(path: Path) -> dict[str, Entry] | None:
    """The record at PATH, None when the image has none (built before it)."""
    raw = read_capped(path, MAX_RECORD_BYTES, what="the factory /etc record", hint="the image is damaged")
    return None if raw is None else loads(raw, str(path))


# ----------------------------------------------------------------------------------- which paths


def _under(rel: str, pattern: str) -> bool:
    """REL is PATTERN or below it (PATTERN's components may be globs)."""
    parts, want = rel.split("/"), pattern.split("/")
    return len(parts) >= len(want) and all(fnmatchcase(p, w) for p, w in zip(parts, want, strict=False))


def _above(rel: str, pattern: str) -> bool:
    """REL is a directory on the way to PATTERN (ssh for ssh/sshd_config)."""
    parts, want = rel.split("/"), pattern.split("/")
    return len(parts) < len(want) and all(fnmatchcase(p, w) for p, w in zip(parts, want, strict=False))


def _any(rel: str, patterns: Iterable[str]) -> bool:
    return any(_under(rel, p) for p in patterns)


def in_scope(rel: str) -> bool:
    """REL (relative to /etc) is compared: in a behaviour place, or a directory on the way to one
    (a link there would lead the place elsewhere), and not a per-host file."""
    if _any(rel, PER_HOST):
        return False
    return _any(rel, BEHAVIOUR_PLACES) or any(_above(rel, p) for p in BEHAVIOUR_PLACES)


def _copied(rel: str) -> bool:
    return not _any(rel, NOT_COPIED)


def _order(rel: str) -> list[str]:
    """Sort key: a directory before what it holds."""
    return rel.split("/")


# ----------------------------------------------------------------------------------- the walk


def _mode(st_mode: int) -> str:
    return f"{stat.S_IMODE(st_mode):04o}"


def _file_entry(parent: int, name: str) -> Entry:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced since it was looked at
            return Entry(OTHER, _mode(st.st_mode))
        digest = hashlib.sha256()
        while chunk := os.read(fd, CHUNK):
            digest.update(chunk)
        return Entry(FILE, _mode(st.st_mode), digest.hexdigest())
    finally:
        os.close(fd)


def _entry(parent: int, name: str, st: os.stat_result) -> Entry:
    if stat.S_ISDIR(st.st_mode):
        return Entry(DIR, _mode(st.st_mode))
    if stat.S_ISLNK(st.st_mode):
        return Entry(SYMLINK, target=os.readlink(name, dir_fd=parent))
    if stat.S_ISREG(st.st_mode):
        return _file_entry(parent, name)
    return Entry(OTHER, _mode(st.st_mode))


def scan(top: int, want: Callable[[str], bool]) -> dict[str, Entry]:
    """Every path below the directory TOP (a descriptor) that WANT takes, relative to it; a directory
    WANT refuses is not entered. A path that cannot be read is UNREADABLE (a directory then is not
    entered). OSError when TOP itself cannot be listed."""
    found: dict[str, Entry] = {}

    def walk(fd: int, prefix: str, depth: int) -> None:
        for name in sorted(os.listdir(fd)):
            rel = prefix + name
            if not want(rel):
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                found[rel] = _entry(fd, name, st)
            except FileNotFoundError:
                continue  # went while we looked
            except OSError:
                found[rel] = _UNREADABLE
                continue
            if found[rel].type != DIR:
                continue
            if depth >= MAX_DEPTH:
                found[rel] = _UNREADABLE
                continue
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                found[rel] = _UNREADABLE
                continue
            try:
                walk(child, rel + "/", depth + 1)
            except OSError:
                found[rel] = _UNREADABLE
            finally:
                os.close(child)

    walk(top, "", 0)
    return found


def _open_dir(path: Path) -> int:
    """PATH's descriptor; OSError when it is missing, not a directory or a symbolic link."""
    return os.open(path, _DIR_FLAGS)


# ----------------------------------------------------------------------------------- at build


def record_tree(etc: Path) -> dict[str, Entry]:
    """The record of the image tree's /etc ETC (what is copied: all but NOT_COPIED). UserError when
    it holds what a record cannot describe (a device, a FIFO, a socket, a name that is not UTF-8)."""
    fd = _open_dir(etc)
    try:
        record = scan(fd, _copied)
    finally:
        os.close(fd)
    for rel, entry in record.items():
        try:
            rel.encode("utf-8")
            (entry.target or "").encode("utf-8")
        except UnicodeEncodeError:
            raise UserError(f"{etc}/{shown(rel)}: a name or link target that is not UTF-8",
                            hint="the factory /etc record is JSON: rename it in the image") from None
        if entry.type not in (FILE, SYMLINK, DIR):
            raise UserError(f"{etc}/{shown(rel)}: is {entry.type}, not a file, a symlink or a directory",
                            hint="the factory /etc holds only those: remove it from the image")
    return record


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def copy_tree(etc: Path, target: Path, record: Mapping[str, Entry]) -> None:
    """Copy what RECORD describes from ETC to TARGET: symlinks as symlinks, modes (and, as root,
    owners) kept; an entry already at TARGET is replaced, one RECORD does not name is left."""
    target.mkdir(parents=True, exist_ok=True)
    as_root = os.geteuid() == 0
    for rel in sorted(record, key=_order):
        entry, src, dst = record[rel], etc / rel, target / rel
        if os.path.lexists(dst) and not (entry.type == DIR and dst.is_dir() and not dst.is_symlink()):
            _remove(dst)
        if entry.type == DIR:
            dst.mkdir(exist_ok=True)
        elif entry.type == SYMLINK:
            assert entry.target is not None
            os.symlink(entry.target, dst)
        else:
            shutil.copyfile(src, dst, follow_symlinks=False)
        if as_root:
            st = src.lstat()
            os.lchown(dst, st.st_uid, st.st_gid)
    # modes last: a read-only directory still takes what it holds first
    for rel in sorted(record, key=_order, reverse=True):
        entry = record[rel]
        if entry.mode is not None:
            os.chmod(target / rel, int(entry.mode, 8))


def write_factory(root: Path) -> int:
    """Copy ROOT/etc to ROOT/FACTORY_DIR and write ROOT/RECORD (builder/finalize.py, on the
    finished tree before /usr is sealed); the number of paths recorded."""
    record = record_tree(root / "etc")
    copy_tree(root / "etc", root / FACTORY_DIR, record)
    fd = _open_dir(root / FACTORY_DIR)
    try:
        copied = scan(fd, _copied)  # what the image's packages put there before stays, unrecorded
    finally:
        os.close(fd)
    wrong = sorted((rel for rel, entry in record.items() if copied.get(rel) != entry), key=_order)
    if wrong:
        raise UserError(f"{root / FACTORY_DIR}: {len(wrong)} paths differ from /etc after the copy, first {shown(wrong[0])}",
                        hint="the build tree changed while it was copied: build again")
    data = dumps(record)
    if len(data) > MAX_RECORD_BYTES:  # the device would refuse it
        raise UserError(f"/etc: a record of {len(data)} bytes, more than {MAX_RECORD_BYTES}",
                        hint="the image's /etc holds far more than a Debian /etc: remove what does not belong there")
    path = root / RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o644)
    return len(record)


# ----------------------------------------------------------------------------------- on the device


@dataclass(frozen=True)
class Finding:
    """A path in /etc (or /run) that is not as the factory's: `path` relative to `base`."""

    kind: str  # ADDED, CHANGED, REMOVED, UNREADABLE, RUNTIME
    path: str
    base: str = "/etc"
    directory: bool = False  # an added or removed directory: what it holds is a finding of its own
    retyped: bool = False  # CHANGED into another type (or UNREADABLE): what is below it follows from it

    def line(self) -> str:
        """The finding as shown: "added /etc/systemd/system/x.service.d/y.conf"."""
        return f"{self.kind} {shown(self.base + '/' + self.path)}"

    @property
    def matters(self) -> bool:
        """Whether it changes behaviour by itself (an empty directory added or gone does not)."""
        return not (self.directory and self.kind in (ADDED, REMOVED))


def _findings(live: Mapping[str, Entry], record: Mapping[str, Entry]) -> list[Finding]:
    factory = {rel: entry for rel, entry in record.items() if in_scope(rel)}
    out = []
    for rel in sorted(set(live) | set(factory), key=_order):
        have, want = live.get(rel), factory.get(rel)
        if have == want:
            continue
        if want is None:
            assert have is not None
            out.append(Finding(ADDED, rel, directory=have.type == DIR))
        elif have is None:
            out.append(Finding(REMOVED, rel, directory=want.type == DIR))
        elif have.type == UNREADABLE:
            out.append(Finding(UNREADABLE, rel, retyped=True))
        else:
            out.append(Finding(CHANGED, rel, retyped=have.type != want.type))
    return out


def compare_fd(etc: int, record: Mapping[str, Entry]) -> list[Finding]:
    """What in the /etc open at ETC differs from RECORD where it changes behaviour, a directory
    before what it holds."""
    return _findings(scan(etc, in_scope), record)


def compare(etc: Path, record: Mapping[str, Entry]) -> list[Finding]:
    """compare_fd on the directory ETC; OSError when it is missing, a symbolic link or unreadable."""
    fd = _open_dir(etc)
    try:
        return compare_fd(fd, record)
    finally:
        os.close(fd)


def _runtime_unit(rel: str, entry: Entry) -> bool:
    return entry.type != DIR and rel.rsplit("/", 1)[-1].endswith(RUNTIME_SUFFIXES)


def runtime(run: Path) -> list[Finding]:
    """Units, drop-ins and quadlets placed under RUN (/run) in RUNTIME_PLACES."""
    out = []
    try:
        top = _open_dir(run)
    except FileNotFoundError:
        return []
    try:
        for place in RUNTIME_PLACES:
            fd = os.dup(top)
            try:
                for name in place.split("/"):
                    try:
                        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    except FileNotFoundError:
                        break
                    except OSError:  # a link or a file where the directory belongs
                        out.append(Finding(RUNTIME, place, "/run"))
                        break
                    os.close(fd)
                    fd = child
                else:
                    for rel, entry in scan(fd, lambda rel: True).items():
                        if entry.type == UNREADABLE or _runtime_unit(rel, entry):
                            out.append(Finding(RUNTIME, f"{place}/{rel}", "/run"))
            finally:
                os.close(fd)
    finally:
        os.close(top)
    return out


def reported(findings: Iterable[Finding]) -> list[Finding]:
    """The findings that change behaviour by themselves: not an empty directory added or gone, nor
    what lies below a path that changed type (that one says it)."""
    findings = list(findings)
    covering = [(f.base, f.path + "/") for f in findings if f.retyped]
    return [f for f in findings if f.matters and not any(f.base == base and f.path.startswith(c) for base, c in covering)]


# ----------------------------------------------------------------------------------- the reset


def _parent(etc: int, rel: str) -> tuple[int, str]:
    """The descriptor of REL's directory (reached with O_NOFOLLOW) and REL's own name."""
    *dirs, name = rel.split("/")
    fd = os.dup(etc)
    try:
        for part in dirs:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def _lstat(parent: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _delete(parent: int, name: str) -> None:
    st = _lstat(parent, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent)  # descriptor-based: no link inside is followed
    else:
        os.unlink(name, dir_fd=parent)


def _owner(factory: int, rel: str) -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    fd, name = _parent(factory, rel)
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    finally:
        os.close(fd)
    return st.st_uid, st.st_gid


def _copy_in(factory: int, rel: str, entry: Entry, parent: int, tmp: str) -> None:
    """TMP in PARENT: the factory's file REL, checked against ENTRY, with its mode and owner."""
    src_dir, src_name = _parent(factory, rel)
    try:
        src = os.open(src_name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_dir)
    finally:
        os.close(src_dir)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent)
        try:
            digest = hashlib.sha256()
            while chunk := os.read(src, CHUNK):
                digest.update(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(dst, view):]
            if digest.hexdigest() != entry.sha256:
                raise OSError(f"the factory copy's sha256 is {digest.hexdigest()}, the record's {entry.sha256}")
            assert entry.mode is not None
            os.fchmod(dst, int(entry.mode, 8))
            if (owner := _owner(factory, rel)) is not None:
                os.fchown(dst, *owner)
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _restore(etc: int, factory: int, rel: str, entry: Entry) -> bool:
    """Put the factory's REL back in the /etc at ETC; whether what was there was a directory that
    is gone now (with all it held)."""
    parent, name = _parent(etc, rel)
    try:
        st = _lstat(parent, name)
        was_dir = st is not None and stat.S_ISDIR(st.st_mode)
        if entry.type == DIR:
            if st is not None and not was_dir:
                os.unlink(name, dir_fd=parent)
            if not was_dir:
                os.mkdir(name, 0o700, dir_fd=parent)
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
            try:
                assert entry.mode is not None
                os.fchmod(fd, int(entry.mode, 8))
                if (owner := _owner(factory, rel)) is not None:
                    os.fchown(fd, *owner)
            finally:
                os.close(fd)
            os.fsync(parent)
            return False
        tmp = f".#etc-reset-{secrets.token_hex(6)}"  # left behind by a crash, it is "added": the next reset deletes it
        try:
            if entry.type == SYMLINK:
                assert entry.target is not None
                os.symlink(entry.target, tmp, dir_fd=parent)
                if (owner := _owner(factory, rel)) is not None:
                    os.chown(tmp, *owner, dir_fd=parent, follow_symlinks=False)
            else:
                _copy_in(factory, rel, entry, parent, tmp)
            if was_dir:
                shutil.rmtree(name, dir_fd=parent)
            os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)  # over a link: the link is replaced
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise
        os.fsync(parent)
        return was_dir
    finally:
        os.close(parent)


def reset(root: Path, out: Callable[[str], None] = print) -> int:
    """Put ROOT/etc back to the factory's in BEHAVIOUR_PLACES: every changed or removed factory path
    restored from ROOT/FACTORY_DIR, every added one deleted, per-host files kept; one line to OUT per
    change, nothing when nothing differs. 0, or 1 when a path could not be reset (each said)."""
    record = load(root / RECORD)
    if record is None:
        out(f"etc-reset: {shown(str(root / RECORD))} absent (an image built before the factory /etc): nothing reset")
        return 0
    try:
        etc = _open_dir(root / "etc")
    except OSError as e:
        out(f"etc-reset: {shown(str(root / 'etc'))}: cannot open as a directory ({e.strerror}): nothing reset")
        return 1
    try:
        try:
            findings = compare_fd(etc, record)
        except OSError as e:
            out(f"etc-reset: {shown(str(root / 'etc'))}: cannot list ({e.strerror}): nothing reset")
            return 1
        if not findings:
            return 0
        try:
            factory = _open_dir(root / FACTORY_DIR)
        except OSError as e:
            out(f"etc-reset: {shown(str(root / FACTORY_DIR))}: cannot open ({e.strerror}): nothing reset")
            return 1
        try:
            return _apply(etc, factory, record, findings, out)
        finally:
            os.close(factory)
    finally:
        os.close(etc)


def _apply(etc: int, factory: int, record: Mapping[str, Entry], findings: list[Finding], out: Callable[[str], None]) -> int:
    gone: list[str] = []  # directories deleted with all they held
    failed = 0
    for f in findings:
        if any(f.path.startswith(g) for g in gone):
            continue
        shown_path = shown("/etc/" + f.path)
        try:
            if f.kind == ADDED:
                parent, name = _parent(etc, f.path)
                try:
                    _delete(parent, name)
                    os.fsync(parent)
                finally:
                    os.close(parent)
                gone.append(f.path + "/")
                out(f"etc-reset: deleted {shown_path} (not in the factory /etc)")
            else:
                if _restore(etc, factory, f.path, record[f.path]):
                    gone.append(f.path + "/")
                out(f"etc-reset: restored {shown_path} ({f.kind})")
        except OSError as e:
            failed += 1
            out(f"etc-reset: cannot reset {shown_path}: {e.strerror or e}")
    return 1 if failed else 0
