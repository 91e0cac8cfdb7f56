"""The staged update: a verified bundle on /var, waiting for `applianctl update --apply`.

`applianctl update --download-only` downloads into the ordinary staging directory (resumable,
update_stage), proves every file, and only then publishes it here, in two steps that each leave a
whole state: the finished directory is renamed into paths.staged_update_dir() under a new name,
then the record staged.json, which names it, is replaced atomically. Whoever reads the record
sees the previous complete staging or the new one, never a half-staged directory; a power cut
between the two steps leaves an unnamed directory that the next publish removes.

Nothing here is trusted later: --apply checks the signature and every file's size and SHA-256
again (verify_in_place), since files on /var can change after they were verified.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from appliance import atomic, manifest, paths, progress
from appliance.bundle import BundleIndex
from appliance.errors import Refused, UserError
from appliance.hashing import sha256_file
from applianctl.update.download import to_fetch

RECORD = "staged.json"
_DIRECTORY = re.compile(r"^[0-9][0-9.]{0,48}-[0-9]{8}T[0-9]{6}Z-[0-9]{1,10}\Z")
DOWNLOAD_AGAIN = "download it again: `applianctl update --download-only SOURCE`"


def record_path() -> Path:
    return paths.staged_update_dir() / RECORD


def read() -> dict[str, Any] | None:
    """The staged update's record ({version, directory, bytes, files, signer, source, staged_at}),
    None when nothing is staged. A record whose directory is missing is returned with "error"."""
    try:
        record = json.loads(record_path().read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return {"error": f"{record_path()}: unreadable ({type(e).__name__})"}
    if not isinstance(record, dict) or not isinstance(record.get("version"), str):
        return {"error": f"{record_path()}: not a staged update's record"}
    name = record.get("directory")
    if not isinstance(name, str) or not _DIRECTORY.match(name) or not (paths.staged_update_dir() / name).is_dir():
        return {**record, "error": f"the staged directory {name!r} is missing"}
    return record


def directory(record: dict[str, Any]) -> Path:
    return paths.staged_update_dir() / str(record["directory"])


def publish(work: Path, index: BundleIndex, signed: tuple[bytes, bytes], source: str, engine: bool = False) -> dict[str, Any]:
    """Make WORK (every file proven this run) the staged update, replacing the previous one."""
    data, sig = signed
    atomic.atomic_write(work / "bundle.json", data, mode=0o600)
    atomic.atomic_write(work / "bundle.json.sig", sig, mode=0o600)
    root = paths.staged_update_dir()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = f"{index.version}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    final = root / name
    work.rename(final)  # same file system: both under the update directory on /var
    atomic.fsync_dir(work.parent)
    atomic.fsync_dir(root)
    files = to_fetch(index, engine)
    record = {
        "version": index.version,
        "directory": name,
        "bytes": sum(f.size for f in files),
        "files": len(files),
        "engine": engine,
        "signer": index.signer,
        "source": source,
        "staged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    atomic.write_json_atomic(record_path(), record)  # the switch: one rename
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
    record = read()
    if record is None:
        return
    staged = record.get("version")
    if "error" in record or not isinstance(staged, str) or manifest.version_tuple(staged) <= manifest.version_tuple(version):
        discard()


def seed(record: dict[str, Any] | None, index: BundleIndex, work: Path, engine: bool = False) -> None:
    """Hard-link the files of the same version already staged into WORK: stage() re-hashes them
    instead of downloading them again (and replaces, never modifies, one that does not match)."""
    if record is None or "error" in record or record.get("version") != index.version:
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
