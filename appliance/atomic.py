# SPDX-License-Identifier: MIT
"""Writing the appliance's files: each lands whole or not at all, and survives a power cut.

The one place for atomic, durable writes on the device and on the build host (the builder uses it
too): a temporary file beside the target, synced, renamed over it, then the directory synced.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from appliance.schema import dump_record


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o644, group: int | None = None) -> None:
    """PATH holds DATA, with MODE (and GROUP) from the start: nobody sees a partial file or a
    private key with looser permissions."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        if group is not None:
            os.fchown(fd, -1, group)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, data: Any) -> None:
    """PATH holds DATA as JSON (indented, keys sorted), written with atomic_write."""
    atomic_write(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def write_record(path: Path, record: Any) -> None:
    """PATH holds RECORD (an appliance.schema.Record dataclass) as JSON, with write_json_atomic."""
    write_json_atomic(path, dump_record(record))


@contextmanager
def record_lock(path: Path) -> Iterator[None]:
    """Held around a read-check-write of the record at PATH (an exclusive flock on PATH.lock, made
    0600 and never through a link): two writers at once would otherwise both read the old record,
    and the one that writes last wins, whatever it read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def replace_dir(new: Path, final: Path) -> None:
    """Swap NEW into FINAL's place; the old FINAL is removed only after the swap."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)
