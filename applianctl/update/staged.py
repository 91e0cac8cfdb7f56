# SPDX-License-Identifier: MIT
"""The staged update: a verified bundle on /var, waiting for `applianctl update --apply`.

`--download-only` stages as a plain update does (update.download), then publishes in two steps
that each leave a whole state: the directory is renamed into paths.staged_update_dir() under a new
name, then staged.json, naming it, is replaced atomically. A power cut between them leaves an
unnamed directory the next publish removes. --apply trusts none of it: files on /var can change,
so the signature and every file are checked again (verify_in_place).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import atomic, paths, progress
from appliance.errors import Refused, UserError
from appliance.hashing import sha256_file
from appliance.schema import dump_record, load_record
from appliance.signed import release_manifest
from appliance.signed.bundle_index import BundleIndex
from appliance.signed.timestamp import TIMESTAMP, TIMESTAMP_SIG
from applianctl.records import Staged
from applianctl.update.download import to_fetch

RECORD = "staged.json"
_DIRECTORY = re.compile(r"^[0-9][0-9.]{0,48}-[0-9]{8}T[0-9]{6}Z-[0-9]{1,10}\Z")
DOWNLOAD_AGAIN = "download it again: `applianctl update --download-only SOURCE`"


def record_path() -> Path:
    return paths.staged_update_dir() / RECORD


@dataclass(frozen=True)
class StagedState:
    """staged.json as read: its RECORD (None when it is not one) and PROBLEM, why it cannot be used
    (None: it can)."""

    record: Staged | None
    problem: str | None = None

    @property
    def usable(self) -> Staged | None:
        return self.record if self.problem is None else None

    def to_json(self) -> dict[str, Any]:
        """As status shows it: the record as written, plus "error" when it cannot be used."""
        doc = dump_record(self.record) if self.record is not None else {}
        return doc if self.problem is None else {**doc, "error": self.problem}


def read() -> StagedState | None:
    """The staged update, None when nothing is staged."""
    try:
        record = load_record(Staged, record_path(), lenient=True)
    except UserError as e:
        return StagedState(None, e.message)
    if record is None:
        return None
    name = record.directory
    if not _DIRECTORY.match(name) or not (paths.staged_update_dir() / name).is_dir():
        return StagedState(record, f"the staged directory {name!r} is missing")
    return StagedState(record)


def directory(record: Staged) -> Path:
    return paths.staged_update_dir() / record.directory


def publish(work: Path, index: BundleIndex, signed: tuple[bytes, bytes], source: str, engine: bool = False,
            timestamp: tuple[bytes, bytes] | None = None) -> Staged:
    """Make WORK (every file proven this run) the staged update, replacing the previous one; with
    it the TIMESTAMP accepted as fresh for it (kept as what was accepted: --apply does not depend
    on its expiry)."""
    data, sig = signed
    atomic.atomic_write(work / "bundle.json", data, mode=0o600)
    atomic.atomic_write(work / "bundle.json.sig", sig, mode=0o600)
    if timestamp is not None:
        atomic.atomic_write(work / TIMESTAMP, timestamp[0], mode=0o600)
        atomic.atomic_write(work / TIMESTAMP_SIG, timestamp[1], mode=0o600)
    root = paths.staged_update_dir()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = f"{index.version}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    final = root / name
    work.rename(final)  # same file system: both under the update directory on /var
    atomic.fsync_dir(work.parent)
    atomic.fsync_dir(root)
    files = to_fetch(index, engine)
    record = Staged(version=index.version, directory=name, bytes=sum(f.size for f in files), files=len(files),
                    signer=index.signer, source=source, staged_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    engine=engine)
    atomic.write_record(record_path(), record)  # the switch: one rename
    _remove_others(name)
    return record


def _remove_others(keep: str | None) -> None:
    root = paths.staged_update_dir()
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.is_dir() and entry.name != keep:
            shutil.rmtree(entry, ignore_errors=True)


def discard() -> None:
    """Nothing staged: the record goes first, so no reader sees it name a directory being removed."""
    record_path().unlink(missing_ok=True)
    if paths.staged_update_dir().is_dir():
        atomic.fsync_dir(paths.staged_update_dir())
    _remove_others(None)


def discard_if_not_newer(version: str) -> None:
    """After VERSION was installed: a staged update of it, or of an older version, has nothing left to do."""
    state = read()
    if state is None:
        return
    if state.usable is None or release_manifest.version_tuple(state.usable.version) <= release_manifest.version_tuple(version):
        discard()


def seed(record: Staged | None, index: BundleIndex, work: Path, engine: bool = False) -> None:
    """Hard-link RECORD's files (a usable staged update of the same version) into WORK, so that
    download.stage() re-hashes them instead of downloading (and replaces, never modifies, a mismatch)."""
    if record is None or record.version != index.version:
        return
    old = directory(record)
    for f in to_fetch(index, engine):
        src, dst = old / f.name, work / f.name
        if src.is_file() and not src.is_symlink() and not dst.exists():
            with suppress(OSError):  # else downloaded instead
                os.link(src, dst)


def verify_in_place(index: BundleIndex, staged: Path, engine: bool = False) -> None:
    """Every file of the signed INDEX in STAGED (the engine image too when ENGINE), as a regular
    file of the signed size and SHA-256."""
    for f in to_fetch(index, engine):
        path = staged / f.name
        if path.is_symlink() or not path.is_file():
            raise Refused(f"staged {f.name}: missing or not a regular file")
        size = path.stat().st_size
        if size != f.size:
            raise Refused(f"staged {f.name}: {size} bytes, bundle.json says {f.size}")
        with progress.Progress(f"verifying {f.name}", total=size) as p:
            digest = sha256_file(path, p.advance)
        if digest != f.sha256:
            raise Refused(f"staged {f.name}: SHA-256 {digest[:16]}... does not match bundle.json")


@contextmanager
def discarded_if_refused() -> Iterator[None]:
    """A staged update that fails its signature, a hash or a content check is of no use to anyone:
    it is discarded, so that the next --download-only fetches it whole instead of answering
    "already staged"."""
    try:
        yield
    except Refused as e:
        discard()
        raise Refused(e.message, hint=f"the staged files were changed or damaged on /var and are discarded; {DOWNLOAD_AGAIN}") from None


def nothing_staged() -> UserError:
    return UserError("nothing is staged", hint="download a bundle first: `applianctl update --download-only SOURCE`")
