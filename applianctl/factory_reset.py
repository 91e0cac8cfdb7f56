# SPDX-License-Identifier: MIT
"""`applianctl factory-reset`: /var back to what it was right after install, at the next boot.

The running system only records the request (update/../factory-reset.json, on /var) and, with
--reboot, reboots; the wipe itself runs early in the next boot (appliance-factory-reset.service:
after /var is mounted, before anything reads or writes it: tmpfiles, the journal's flush, the
random seed, the per-host settings), so no service has a file open in what is deleted. The same
unit runs when the kernel command line carries systemd.factory_reset (systemd's own switch), which
the boot menu's signed "Factory reset" entries (UKI profiles, image/mkosi.uki-profiles) set for an
appliance that no longer boots far enough to be asked, and systemd-boot says it booted such an
entry of a version that has booted well (menu_refusal: systemd-boot 257 can boot a version on
trial with a reset profile's command line where its main entry was meant). When the boot loader's
variables are missing or unreadable the command line alone is not believed: nothing is deleted.

What is kept: the per-host settings (the signed install plan and SSH keys in host/, the proxy's
TLS key and CA in tls/, so clients that pin the CA still connect) unless --all; the model weights
(model.cache_dir) only with --keep-weights; they are checked against the signed manifest before
the engine starts, as on every boot. Everything else on /var goes: the journal, the container
state, update records and staged bundles, the boot history. Nothing is followed out of /var
(symlinks are deleted, never followed; directories are opened with O_NOFOLLOW relative to their
parent), and no other file system mounted below /var is entered.
"""

from __future__ import annotations

import argparse
import datetime
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from appliance import cli_help, paths
from appliance.atomic import write_record
from appliance.errors import UserError
from appliance.safe_read import file_kind, read_capped
from appliance.schema import load_record
from applianctl.records import FactoryResetRequest, LastFactoryReset

MAX_DEPTH = 512  # directories deeper than this are left (and named in the record), not followed
LISTED = 20  # paths named in the record per list

BOOT_SWITCH = "systemd.factory_reset"  # systemd's own factory-reset word (systemd-repart reads it too)
KEEP_WEIGHTS_SWITCH = "appliance.factory_reset_keep_weights"  # beside it: keep the weights too
# the boot menu's reset entries are the kernel images' profiles with these IDs (image/mkosi.uki-profiles)
RESET_PROFILES = ("factory-reset", "factory-reset-keep-weights")
BY_BOOT_MENU = "the kernel command line"  # the record's `by` of a reset the boot menu's entry asked for
TRUE_WORDS = ("", "1", "yes", "y", "true", "t", "on")  # as systemd's proc_cmdline_get_bool reads a value


@dataclass(frozen=True)
class BootedEntry:
    """What systemd-boot says it booted (its EFI variables), the second witness of a menu reset."""

    selected: str | None  # LoaderEntrySelected; None when the boot loader did not set it
    counted: bool  # LoaderBootCountPath is set: a version on trial, judged by this boot
    unreadable: str | None = None  # why the variables could not be read (one line): then neither is believed


def read_booted(efivars: Path) -> BootedEntry:
    """What systemd-boot's variables in EFIVARS say of this boot; what cannot be read is said in
    `unreadable`, never taken for "not counted" or "no boot loader"."""
    from appliance.efivars import read_string
    from applianctl.slots.machine import EFI_LOADER_GUID

    if not efivars.is_dir():
        return BootedEntry(None, False, f"the boot loader's variables cannot be seen ({efivars} is not there)")
    try:
        selected = read_string("LoaderEntrySelected", EFI_LOADER_GUID, efivars)
        count_path = read_string("LoaderBootCountPath", EFI_LOADER_GUID, efivars)
    except UserError as e:
        return BootedEntry(None, False, f"the boot loader's variables cannot be read ({e.message})")
    return BootedEntry(selected, count_path is not None)


@dataclass
class Outcome:
    var: Path
    deleted: int = 0
    kept: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)  # "PATH: why", e.g. a mount point or an error


# ----------------------------------------------------------------------------- what is kept

def kept_paths(request: FactoryResetRequest, cache_dir: str) -> list[Path]:
    """The directories the reset keeps (absolute), besides the request itself."""
    keep = [paths.STATE_DIR / "host", paths.STATE_DIR / paths.TLS_DIR.name] if request.keep_settings else []
    if request.keep_weights:
        keep.append(Path(cache_dir))
    return keep


def kept_files(request: FactoryResetRequest) -> tuple[Path, ...]:
    """Files kept outside the kept directories: with the weights, what this device proved of them
    (the fs-verity digests it recorded, the files a deep check refused), which live among the
    per-host settings; without them kept weights that the manifest gives no digest for would not
    verify."""
    if not request.keep_weights:
        return ()
    from applianctl.model.store import CORRUPT, RECORDED

    host = paths.STATE_DIR / "host"
    return (host / RECORDED, host / CORRUPT)


def _relative(var: Path, keep: list[Path]) -> set[PurePosixPath]:
    """KEEP below VAR, relative to it; a path outside /var is never deleted by the reset anyway."""
    out = set()
    for path in keep:
        rel = PurePosixPath(os.path.normpath(path))
        try:
            out.add(rel.relative_to(PurePosixPath(os.path.normpath(var))))
        except ValueError:
            continue
    return out


# ----------------------------------------------------------------------------------- the wipe

def _open_dir(parent_fd: int, name: str) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)


def _names(fd: int) -> list[str]:
    with os.scandir(fd) as it:
        return sorted((e.name for e in it), reverse=True)


def _shown(out: Outcome, rel: PurePosixPath, why: str) -> str:
    return f"{out.var / rel}: {why}"


def _delete_tree(parent_fd: int, name: str, where: PurePosixPath, dev: int, out: Outcome) -> None:
    """Delete directory NAME (in PARENT_FD) and everything below it, depth first, with one open
    descriptor per level (no recursion: a deep tree cannot exhaust Python's stack)."""
    stack = [(parent_fd, name, where, _open_dir(parent_fd, name))]
    pending = [_names(stack[0][3])]
    while stack:
        _, _, at, fd = stack[-1]
        if pending[-1]:
            child = pending[-1].pop()
            path = at / child
            try:
                st = os.stat(child, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(child, dir_fd=fd)
                    out.deleted += 1
                elif st.st_dev != dev:
                    out.left.append(_shown(out, path, "another file system is mounted there"))
                elif len(stack) >= MAX_DEPTH:
                    out.left.append(_shown(out, path, f"deeper than {MAX_DEPTH} directories"))
                else:
                    child_fd = _open_dir(fd, child)
                    stack.append((fd, child, path, child_fd))
                    pending.append(_names(child_fd))
            except OSError as e:
                out.left.append(_shown(out, path, e.strerror or str(e)))
            continue
        parent, leaf, at, fd = stack.pop()
        pending.pop()
        os.close(fd)
        try:
            os.rmdir(leaf, dir_fd=parent)
            out.deleted += 1
        except OSError as e:
            if not any(line.startswith(f"{out.var / at}/") for line in out.left):  # its cause is named already
                out.left.append(_shown(out, at, e.strerror or str(e)))


def wipe(var: Path, keep: list[Path], spare: tuple[Path, ...] = ()) -> Outcome:
    """Delete everything under VAR except the directories KEEP (and the files SPARE), keeping the
    directories above them. A kept path that is not a real directory (a symlink, a file) is
    deleted like anything else."""
    out = Outcome(var)
    keep_rel = _relative(var, keep)
    spare_rel = _relative(var, list(spare))
    top = os.open(var, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    dev = os.fstat(top).st_dev
    # (dir fd, its path relative to VAR): directories above a kept one, walked but not deleted
    walk = [(top, PurePosixPath("."))]
    try:
        while walk:
            fd, at = walk.pop()
            try:
                for name in _names(fd):
                    rel = PurePosixPath(name) if at == PurePosixPath(".") else at / name
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        is_dir = stat.S_ISDIR(st.st_mode)
                        if rel in spare_rel and stat.S_ISREG(st.st_mode):
                            continue
                        if rel in keep_rel and is_dir:
                            out.kept.append(str(var / rel))
                            continue
                        if is_dir and st.st_dev != dev:
                            out.left.append(_shown(out, rel, "another file system is mounted there"))
                        elif is_dir and any(k.is_relative_to(rel) for k in keep_rel | spare_rel):
                            walk.append((_open_dir(fd, name), rel))
                        elif is_dir:
                            _delete_tree(fd, name, rel, dev, out)
                        else:
                            os.unlink(name, dir_fd=fd)
                            out.deleted += 1
                    except OSError as e:
                        out.left.append(_shown(out, rel, e.strerror or str(e)))
                os.fsync(fd)
            finally:
                if fd != top:
                    os.close(fd)
    finally:
        os.close(top)
    return out


# ------------------------------------------------------------------------------ the request

def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def remove_entry(path: Path) -> list[str]:
    """Remove PATH whatever it is, never following it (a symlink itself goes, a directory's tree
    as the wipe deletes one); what could not be removed ("PATH: why"), [] when all went."""
    out = Outcome(path.parent)
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.stat(path.name, dir_fd=parent, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path.name, dir_fd=parent)
        elif st.st_dev != os.fstat(parent).st_dev:
            out.left.append(f"{path}: another file system is mounted there")
        else:
            _delete_tree(parent, path.name, PurePosixPath(path.name), st.st_dev, out)
        os.fsync(parent)
    except FileNotFoundError:
        pass
    except OSError as e:
        out.left.append(f"{path}: {e.strerror or e}")
    finally:
        os.close(parent)
    return out.left


def not_a_request(path: Path) -> str | None:
    """What PATH is when something other than a regular file sits where the request belongs ("a
    directory", "a FIFO", "a symbolic link"...); None when it is a file or nothing."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None  # nothing there, or unreadable: read_request says which
    return None if stat.S_ISREG(mode) else file_kind(mode)


def read_request() -> FactoryResetRequest | None:
    """The pending request, None when there is none. A damaged one is not ignored (the operator
    asked for a reset): the caller decides."""
    return load_record(FactoryResetRequest, paths.factory_reset_request_path(), lenient=False)


def boot_request(cmdline: str) -> FactoryResetRequest | None:
    """The request the kernel command line makes, None when it makes
    none: systemd.factory_reset with a true value (or none), settings kept; the entry that also
    keeps the weights adds appliance.factory_reset_keep_weights."""
    words = {}
    for word in cmdline.split():
        key, _, value = word.partition("=")
        words[key] = value.lower()
    if words.get(BOOT_SWITCH, "0") not in TRUE_WORDS:
        return None
    keep_weights = words.get(KEEP_WEIGHTS_SWITCH, "0") in TRUE_WORDS
    return FactoryResetRequest(keep_weights=keep_weights, keep_settings=True, requested_at=_now(), by=BY_BOOT_MENU)


def request(keep_weights: bool, keep_settings: bool) -> FactoryResetRequest:
    """Record a reset for the next boot (replacing one that is pending)."""
    req = FactoryResetRequest(keep_weights=keep_weights, keep_settings=keep_settings, requested_at=_now(), by="applianctl factory-reset")
    if kind := not_a_request(paths.factory_reset_request_path()):
        raise UserError(f"{paths.factory_reset_request_path()}: is {kind}, not a factory reset request",
                        hint="remove it with `applianctl factory-reset --cancel`, then ask again")
    write_record(paths.factory_reset_request_path(), req)
    os.chmod(paths.factory_reset_request_path(), 0o600)
    return req


def describe(req: FactoryResetRequest) -> str:
    kept = [w for w, k in (("the per-host settings (plan, SSH and TLS keys)", req.keep_settings),
                           ("the model weights", req.keep_weights)) if k]
    return "keeps " + " and ".join(kept) if kept else "keeps nothing"


def menu_refusal(booted: BootedEntry | None) -> str | None:
    """Why a reset the kernel command line asks for must not run, None when it may. The command line
    is signed, but systemd-boot 257 can boot a reset profile where the main entry was meant: the
    loader must also say it booted a reset entry, and of a blessed version (on a trial boot the loader
    may not tell a kernel image's profiles apart, and a wipe would erase what judges the trial).
    Fails closed: a loader that was not asked, or whose variables are missing or unreadable, refuses."""
    if booted is None:
        return "the boot loader was not asked which entry it booted"
    if booted.unreadable:
        return booted.unreadable
    if not booted.selected:
        return "the boot loader did not say which entry it booted (no LoaderEntrySelected)"
    image, _, profile = booted.selected.partition("@")
    if profile not in RESET_PROFILES:
        return f"the boot loader booted {booted.selected}, not a factory reset entry"
    if booted.counted:
        return f"{image} is a version on trial; choose the factory reset entry of a version that has booted well"
    return None


def run_at_boot(var: Path, cache_dir: str, cmdline: str, booted: BootedEntry | None = None) -> LastFactoryReset | None:
    """Run the pending reset (the request file's, else the command line's when the boot loader
    agrees, see menu_refusal); None when none is."""
    request_path = paths.factory_reset_request_path()
    req: FactoryResetRequest | None = None
    if kind := not_a_request(request_path):
        # Not something `applianctl factory-reset` writes, so no operator asked for a wipe with it;
        # removed, else it would stay and be seen again at every boot.
        left = remove_entry(request_path)
        also = f"; could not remove {'; '.join(left[:3])}" if left else ""
        print(f"factory-reset: {request_path} is {kind}, not a request: removed without a reset{also}", file=sys.stderr)
    else:
        try:
            req = read_request()
        except UserError as e:
            # Damaged: the operator did ask for a reset, so do the safest one, which keeps everything
            # that cannot be fetched again (settings and weights).
            print(f"factory-reset: {e.message}; resetting with settings and weights kept", file=sys.stderr)
            req = FactoryResetRequest(keep_weights=True, keep_settings=True, requested_at=_now(), by="a damaged request")
    if req is None and (req := boot_request(cmdline)) is not None and (why := menu_refusal(booted)):
        print(f"factory-reset: the kernel command line asks for a reset, but {why}: nothing deleted", file=sys.stderr)
        return None
    if req is None:
        if not kind:  # else the line above said what there was
            print("factory-reset: none asked for")
        return None
    out = wipe(var, kept_paths(req, cache_dir), spare=(request_path, *kept_files(req)))
    done = LastFactoryReset(at=_now(), by=req.by, kept=tuple(out.kept), deleted=out.deleted, left=tuple(out.left[:LISTED]))
    write_record(paths.last_factory_reset_path(), done)
    # Removed last: a power cut before this line runs the (idempotent) reset again next boot.
    for line in remove_entry(request_path):  # it stays: the next boot runs the reset again
        print(f"factory-reset: cannot remove the request: {line}", file=sys.stderr)
    return done


# -------------------------------------------------------------------------------- the command

def add_parser(subparsers: Any) -> None:
    p = cli_help.verb_parser(
        subparsers, "factory-reset", "wipe /var at the next boot, keeping the per-host settings (and the weights if asked)",
        examples=["applianctl factory-reset --yes --keep-weights --reboot", "applianctl factory-reset --cancel"],
        exit_codes=[(0, "the reset is asked for (or withdrawn)"), (2, "bad input, not confirmed (no --yes), or not root")],
        details="The appliance is then as it was right after install: the per-host "
        "settings (install plan, SSH and TLS keys) are kept unless --all, the model weights only with --keep-weights.",
    )
    p.add_argument("--keep-weights", action="store_true", help="keep the model weights (checked again before the engine starts)")
    p.add_argument("--all", action="store_true", help="also delete the per-host settings: the image's defaults apply afterwards")
    p.add_argument("--yes", action="store_true", help="yes, delete everything else on /var")
    p.add_argument("--reboot", action="store_true", help="reboot now, so that the reset runs")
    p.add_argument("--cancel", action="store_true", help="withdraw a reset asked for and not yet run")
    p.add_argument("--at-boot", action="store_true", help=argparse.SUPPRESS)  # appliance-factory-reset.service
    p.set_defaults(func=cmd_factory_reset)


def cmd_factory_reset(args: argparse.Namespace) -> int:
    if args.at_boot:
        return _cmd_at_boot()
    if args.cancel:
        return _cancel(paths.factory_reset_request_path())
    keep_settings = not args.all
    preview = FactoryResetRequest(keep_weights=args.keep_weights, keep_settings=keep_settings, requested_at="", by="")
    if not args.yes:
        raise UserError(f"a factory reset deletes everything on /var at the next boot and {describe(preview)}",
                        hint="run it again with --yes (and --reboot to reboot now); --keep-weights keeps the weights, "
                        "--all also deletes the per-host settings")
    try:
        req = request(args.keep_weights, keep_settings)
    except PermissionError:
        raise UserError(f"cannot write {paths.factory_reset_request_path()}: permission denied",
                        hint="run it as root") from None
    print(f"factory reset asked for: the next boot wipes /var and {describe(req)}")
    if args.reboot:
        from appliance.run import run

        run(["systemctl", "reboot"], "systemctl reboot", "reboot by hand")
    else:
        print("reboot to run it (applianctl factory-reset --cancel withdraws it)")
    return 0


def _cancel(path: Path) -> int:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        print("no factory reset was asked for")
        return 0
    except PermissionError:
        raise UserError(f"cannot read {path}: permission denied", hint="run it as root") from None
    left = remove_entry(path)
    if left:
        raise UserError(f"cannot remove {left[0]}", hint="run it as root, or remove it by hand")
    if stat.S_ISREG(mode):
        print("factory reset withdrawn: nothing will be deleted")
    else:
        print(f"{path} was {file_kind(mode)}, not a request: removed; nothing will be deleted")
    return 0


def _cmd_at_boot() -> int:
    from appliance.config.device import load_image
    from applianctl.slots.machine import Host

    cmdline_raw = read_capped(paths.PROC_CMDLINE, 64 * 1024, what="the kernel command line")
    if cmdline_raw is None:
        # Linux always has it: missing means a sandbox hides it (ProcSubset=pid), and a reset the boot
        # menu's entry asked for would be skipped without a word. Failing keeps a request file for next boot.
        raise UserError(f"{paths.PROC_CMDLINE}: cannot be seen, so a reset asked for on the kernel command line would be missed",
                        hint="run it without ProcSubset=pid (appliance-factory-reset.service), with /proc mounted")
    cmdline = cmdline_raw.decode("utf-8", "replace")
    booted = read_booted(Host().efivars)
    done = run_at_boot(paths.VAR_DIR, load_image().model.cache_dir, cmdline, booted)
    if done is None:  # run_at_boot said why
        return 0
    print(f"factory-reset: deleted {done.deleted} entries on /var; kept: {', '.join(done.kept) or 'nothing'}")
    for line in done.left:
        print(f"factory-reset: left {line}", file=sys.stderr)
    return 0
