# SPDX-License-Identifier: MIT
"""Downloading a bundle into the staging directory, every file proven against the signed index,
after checking /var (shared with the journal and the model) has room for the rest plus the reserve
every download keeps free there (appliance.fetch.RESERVE_BYTES); while writing, the download stops
at that reserve, its partial file kept for the next run to resume.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from appliance import fetch, paths
from appliance.errors import UserError
from appliance.fetch import Source, fetch_proven, missing_bytes
from appliance.signed.bundle_index import BundleFile, BundleIndex, install_names, payload_names

SPACE_MARGIN_BYTES = fetch.RESERVE_BYTES  # the one reserve, shared with the model fetch


def to_fetch(index: BundleIndex, engine: bool = False) -> list[BundleFile]:
    """The bundle files this appliance downloads: the engine image only when ENGINE (an engine slot
    is written: update.checks.check_engine), never the installer's whole disk image."""
    install = set(install_names(index.version).values())
    uki = payload_names(index.version, index.engine_digest, False)["uki"]
    wanted = [f for f in index.files if (engine or not f.name.startswith("engine_")) and f.name not in install]
    # the kernel image first: what can be refused from it alone (its Secure Boot signer) is then
    # refused before the large /usr image is downloaded
    return sorted(wanted, key=lambda f: f.name != uki)


def free_bytes(path: Path) -> int:
    return fetch.free_bytes(path)


def check_space(index: BundleIndex, staging: Path, margin: int = SPACE_MARGIN_BYTES, engine: bool = False) -> int:
    """Refuse before downloading when STAGING's file system lacks room for the rest plus MARGIN;
    the bytes still to fetch."""
    need = sum(missing_bytes(f.name, f.size, staging) for f in to_fetch(index, engine))
    free = free_bytes(staging)
    if free < need + margin:
        mib = 1 << 20
        raise UserError(
            f"{staging}: {free // mib} MiB free, the bundle needs {-(-need // mib)} MiB more plus a margin of {margin // mib} MiB",
            hint=f"free {fetch.size(need + margin - free)} more on {fetch.mount_point(staging)} "
                 "(journalctl --vacuum-size, old files), then run the same command again",
        )
    return need


def staging_for(version: str) -> Path:
    """The staging directory of VERSION; other versions' leftovers are removed."""
    root = paths.update_staging_dir()
    if root.is_dir():
        for old in root.iterdir():
            if old.name != version:
                shutil.rmtree(old, ignore_errors=True)
    staging = root / version
    staging.mkdir(mode=0o700, parents=True, exist_ok=True)
    return staging


def stage(index: BundleIndex, source: Source, staging: Path, engine: bool = False, *,
          reserve: int = SPACE_MARGIN_BYTES, free: fetch.FreeBytes | None = None,
          proven: Callable[[BundleFile], None] | None = None) -> None:
    """Fetch every file of the bundle into STAGING, each checked against bundle.json. A file
    already staged is re-hashed, not trusted; a partial one (NAME.part) is resumed. Stops
    (fetch.ReserveReached) before a write would leave less than RESERVE free, the partial kept.
    PROVEN is called with each file once it is proven, and may refuse the rest."""
    files = to_fetch(index, engine)
    guard = fetch.Guard(staging, sum(missing_bytes(f.name, f.size, staging) for f in files),
                        free=free_bytes if free is None else free, reserve=reserve)
    for f in files:
        fetch_proven(source, f.name, f.size, f.sha256, staging, guard.claim)
        if proven is not None:
            proven(f)
