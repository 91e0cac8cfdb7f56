"""Downloading a bundle into the staging directory, every file proven against the signed index.

Before the first byte: the file system that holds the staging directory must have room for
what is still to be fetched plus a margin (it is /var, which also holds the journal and the
model). A file already staged is re-hashed, not trusted; a partial one (NAME.part) is resumed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from appliance import atomic, progress
from appliance.bundle import BundleFile, BundleIndex
from appliance.errors import Refused, UserError
from appliance.fetch import Source
from appliance.hashing import sha256_file
from applianctl import slots

SPACE_MARGIN_BYTES = 512 << 20


def to_fetch(index: BundleIndex) -> list[BundleFile]:
    """The files of the bundle this appliance downloads (never an engine image it has: check_engine)."""
    return [f for f in index.files if not f.name.startswith("engine_")]


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_space(index: BundleIndex, staging: Path, margin: int = SPACE_MARGIN_BYTES) -> int:
    """Refuse before downloading when STAGING's file system lacks room for the rest plus MARGIN;
    the bytes still to fetch."""
    need = 0
    for f in to_fetch(index):
        final, part = staging / f.name, staging / (f.name + ".part")
        have = final.stat().st_size if final.exists() else part.stat().st_size if part.exists() else 0
        need += max(f.size - have, 0)
    free = free_bytes(staging)
    if free < need + margin:
        mib = 1 << 20
        raise UserError(
            f"{staging}: {free // mib} MiB free, the bundle needs {need // mib} MiB more plus a margin of {margin // mib} MiB",
            hint=f"free space on {staging.parent} (journalctl --vacuum-size, old files), then run the same command again",
        )
    return need


def staging_for(version: str) -> Path:
    """The staging directory of VERSION; other versions' leftovers are removed."""
    root = slots.staging_dir()
    if root.is_dir():
        for old in root.iterdir():
            if old.name != version:
                shutil.rmtree(old, ignore_errors=True)
    staging = root / version
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)
    return staging


def _sha256(path: Path, name: str) -> str:
    """PATH's SHA-256, with progress: a /usr image takes a while to hash on a slow disk."""
    with progress.Progress(f"verifying {name}", total=path.stat().st_size) as p:
        return sha256_file(path, p.advance)


def stage(index: BundleIndex, source: Source, staging: Path) -> None:
    """Fetch every file of the bundle into STAGING, each checked against bundle.json. A file
    already staged is re-hashed, not trusted; a partial one (NAME.part) is resumed."""
    for f in to_fetch(index):
        final, part = staging / f.name, staging / (f.name + ".part")
        if final.exists():
            if final.stat().st_size == f.size and _sha256(final, f.name) == f.sha256:
                continue
            final.unlink()
        source.fetch(f.name, part, f.size)
        digest = _sha256(part, f.name)
        if digest != f.sha256:
            part.unlink()
            raise Refused(
                f"{f.name}: SHA-256 {digest[:16]}... does not match bundle.json",
                hint="the file was changed or damaged; nothing was written",
            )
        part.rename(final)
    atomic.fsync_dir(staging)
