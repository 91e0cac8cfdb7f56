# SPDX-License-Identifier: MIT
"""SHA256SUMS: the pins of every overlay, diff, tuning table and firmware blob the profiles use.

SHA256SUMS is parsed by appliance/signed/sums.py as `sha256sum -c` reads it, but strictly: a malformed line, a
name listed twice or one that leaves the project is an error. check() refuses a changed, missing or
unlisted file, a symlink out of its directory, or an appliance.toml pin that disagrees; files only the
other profile uses need not be present. pin() rewrites SHA256SUMS on purpose.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from appliance.atomic import atomic_write
from appliance.config import PROFILES, Config, load
from appliance.errors import UserError
from appliance.hashing import sha256_file
from appliance.signed.sums import SUMS_FILE, SumEntry, format_line, parse_sums

# Everything under these directories must be listed in SHA256SUMS (README.md files aside).
PINNED_DIRS = ("overlays", "tuning", "firmware/amdgpu")
DIFFS_DIR = "overlays/diffs"
FIRMWARE_DIR = "firmware/amdgpu"
FIRMWARE_PINS = "firmware/amdgpu.sha256"
FIRMWARE_TARGET_DIR = "/usr/lib/firmware/updates/amdgpu"
NOT_PINNED = frozenset({"README.md", ".gitkeep"})
SKIPPED_DIRS = frozenset({"__pycache__"})

KINDS = ("overlay", "diff", "tuning", "firmware")
_FIRMWARE_NAME = re.compile(r"^[A-Za-z0-9_+-][A-Za-z0-9._+-]*\Z")
PIN_HINT = "if the change is intended: python3 -m builder pin (and update the sha256 in appliance.toml)"


@dataclass(frozen=True)
class PinnedArtifact:
    """A verified file: its project path, its hash, where it goes, and what it is."""

    path: str
    sha256: str
    target: str
    kind: str


# ----------------------------------------------------------------------------- reading


def read_sums(root: Path) -> dict[str, SumEntry]:
    path = root / SUMS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: missing", hint="create it with python3 -m builder pin") from None
    return parse_sums(data, str(path))


# ----------------------------------------------------------------------------- the tree


def _inside(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def _safe_file(root: Path, rel: str) -> Path | None:
    """ROOT/REL if it is a regular file that stays in its directory; None if it is missing."""
    path = root / rel
    real_root = root.resolve()
    parent = path.parent.resolve()
    if not _inside(parent, real_root):
        raise UserError(
            f"{rel}: its directory is a symlink that leaves the project", hint="copy the files in instead of linking"
        )
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        real = path.resolve()
        if not _inside(real, parent):
            raise UserError(
                f"{rel}: symlink to {os.readlink(path)} leaves its directory",
                hint="copy the file in instead of linking to it",
            )
        if not real.exists():
            return None
    if not stat.S_ISREG(path.stat().st_mode):
        raise UserError(f"{rel}: not a regular file", hint="pinned files are plain files")
    return path


def tree_files(root: Path) -> Iterator[str]:
    """Every file under the pinned directories (as project paths), symlinks checked."""
    real_root = root.resolve()
    for top in PINNED_DIRS:
        base = root / top
        if not base.exists() and not base.is_symlink():
            continue
        if not _inside(base.resolve(), real_root):
            raise UserError(
                f"{top}: symlink to a directory outside the project", hint="copy the files in instead of linking"
            )
        for dirpath, dirnames, filenames in os.walk(base):
            here = Path(dirpath)
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
            for name in list(dirnames):
                sub = here / name
                if sub.is_symlink():
                    dirnames.remove(name)
                    rel = sub.relative_to(root).as_posix()
                    if not _inside(sub.resolve(), here.resolve()):
                        raise UserError(
                            f"{rel}: symlink to {os.readlink(sub)} leaves its directory",
                            hint="copy the files in instead of linking",
                        )
                    raise UserError(f"{rel}: a symlinked directory", hint="pinned directories hold plain files")
            for name in sorted(filenames):
                if name in NOT_PINNED:
                    continue
                rel = (here / name).relative_to(root).as_posix()
                _safe_file(root, rel)
                yield rel


# ----------------------------------------------------------------------------- what a profile uses


@dataclass(frozen=True)
class _Use:
    kind: str
    path: str
    target: str
    pin: str  # from appliance.toml or the firmware pin list; "" if none


def read_firmware_pins(root: Path) -> list[tuple[str, str]]:
    """(name, sha256) of each blob in firmware/amdgpu.sha256 (the same format as SHA256SUMS)."""
    path = root / FIRMWARE_PINS
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out = []
    for entry in parse_sums(data, str(path)).values():
        if not _FIRMWARE_NAME.match(entry.name):
            raise UserError(
                f"{path}:{entry.line}: {entry.name!r} is not a plain file name",
                hint=f"name the blob as it goes into {FIRMWARE_TARGET_DIR}/, e.g. psp_13_0_6_sos.bin",
            )
        out.append((entry.name, entry.sha256))
    return out


def _uses(config: Config, root: Path) -> list[_Use]:
    uses: list[_Use] = []
    for kind, files in (("overlay", config.engine.overlays), ("tuning", config.engine.tuning)):
        for f in files:
            uses.append(_Use(kind, f.file, f.target, f.sha256))
    for f in config.engine.overlays:
        diff = diff_for(f.file)
        if os.path.lexists(root / diff) or diff in _listed(root):
            uses.append(_Use("diff", diff, f.target, ""))
    for name, sha in read_firmware_pins(root):
        uses.append(_Use("firmware", f"{FIRMWARE_DIR}/{name}", f"{FIRMWARE_TARGET_DIR}/{name}", sha))
    return uses


def diff_for(overlay_file: str) -> str:
    """overlays/demo/standin_answers.py -> overlays/diffs/standin_answers.patch"""
    return f"{DIFFS_DIR}/{PurePosixPath(overlay_file).stem}.patch"


def _listed(root: Path) -> set[str]:
    try:
        return set(read_sums(root))
    except UserError:
        return set()


# ----------------------------------------------------------------------------- check


def check(config: Config, root: Path) -> list[PinnedArtifact]:
    """Verify every file CONFIG's profile uses; raise the first problem (problems() lists them all)."""
    verified, found = _verify(config, root)
    if found:
        raise found[0]
    return verified


def problems(config: Config, root: Path) -> list[UserError]:
    try:
        return _verify(config, root)[1]
    except UserError as e:  # SHA256SUMS itself is unreadable or malformed
        return [e]


def _verify(config: Config, root: Path) -> tuple[list[PinnedArtifact], list[UserError]]:
    sums = read_sums(root)
    found: list[UserError] = []
    for rel in tree_files(root):
        if rel not in sums:
            found.append(UserError(
                f"{rel}: unlisted: not in {SUMS_FILE}", hint="remove it, or pin it with python3 -m builder pin"
            ))
    verified: list[PinnedArtifact] = []
    for use in _uses(config, root):
        entry = sums.get(use.path)
        if entry is None:
            found.append(UserError(f"{use.path}: unlisted: not in {SUMS_FILE}", hint="pin it with python3 -m builder pin"))
            continue
        if use.pin and use.pin != entry.sha256:
            source = "appliance.toml" if use.kind != "firmware" else FIRMWARE_PINS
            found.append(UserError(
                f"{use.path}: {source} pins sha256 {use.pin} but {SUMS_FILE} line {entry.line} has {entry.sha256}",
                hint=f"make {source} and {SUMS_FILE} agree",
            ))
            continue
        path = _safe_file(root, use.path)
        if path is None:
            found.append(UserError(
                f"{use.path}: missing: expected sha256 {entry.sha256}, actual none",
                hint=_supply_hint(use),
            ))
            continue
        actual = sha256_file(path)
        if actual != entry.sha256:
            found.append(UserError(f"{use.path}: changed: expected sha256 {entry.sha256}, actual {actual}", hint=PIN_HINT))
            continue
        verified.append(PinnedArtifact(use.path, actual, use.target, use.kind))
    return verified, found


def _supply_hint(use: _Use) -> str:
    if use.path.startswith(("overlays/production/", "tuning/production/")):
        return f"the operator supplies this third-party file: copy it to {use.path}"
    if use.kind == "firmware":
        return f"copy the blob to {use.path} (see firmware/README.md)"
    return "restore it from git"


# ----------------------------------------------------------------------------- pin


def pin(root: Path) -> list[str]:
    """Rewrite SHA256SUMS from the files present (and the pins of absent ones); return its lines."""
    return write_sums(root)


def _all_uses(root: Path) -> list[_Use]:
    uses: list[_Use] = []
    for profile in PROFILES:
        uses.extend(_uses(load(root / "appliance.toml", profile), root))
    return uses


def compute_sums(root: Path) -> dict[str, str]:
    hashes: dict[str, str] = {rel: sha256_file(root / rel) for rel in tree_files(root)}
    for use in _all_uses(root):
        path = _safe_file(root, use.path)
        if path is not None:
            hashes.setdefault(use.path, sha256_file(path))
            if use.pin and use.pin != hashes[use.path]:
                source = "appliance.toml" if use.kind != "firmware" else FIRMWARE_PINS
                raise UserError(
                    f"{use.path}: sha256 {hashes[use.path]} but {source} pins {use.pin}",
                    hint=f"if the new file is intended, put its sha256 in {source} first; else restore the file",
                )
        elif use.pin:
            hashes.setdefault(use.path, use.pin)
    return hashes


def write_sums(root: Path) -> list[str]:
    lines = [format_line(name, sha) for name, sha in sorted(compute_sums(root).items())]
    atomic_write(root / SUMS_FILE, "".join(line + "\n" for line in lines).encode("utf-8"))
    return lines


def by_kind(artifacts: Iterable[PinnedArtifact], kind: str) -> list[PinnedArtifact]:
    return [a for a in artifacts if a.kind == kind]
