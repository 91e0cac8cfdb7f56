# SPDX-License-Identifier: MIT
"""The weights manifest: every file of the model snapshot the engine serves, pinned.

Made by `python3 -m builder weights pin`, shipped on the verity-protected /usr and pinned by the
signed release manifest (model.weights_sha256), so the device trusts it as far as the release;
canonical JSON like the manifest. Each file: path, size, SHA-256 (the Hub's LFS hash for large
files) and, when the builder had the files, its fs-verity digest; without one the device records
the digest it measures after proving the SHA-256 (applianctl/model/fetch.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from appliance import schema
from appliance.hashing import SHA256
from appliance.patterns import MODEL_ID, REVISION
from appliance.signed.release_manifest import ManifestError, canonical, is_repo_path, parse_canonical

FILE_NAME = "weights.json"  # in /usr/lib/appliance (paths.LIB_DIR)
MAX_FILES = 100_000
NAME_MAX, PATH_MAX = 255, 4095  # Linux's limits, in bytes, on one name and on a whole path
_HINT = "the weights manifest was not written by this builder"


def _check(fn: Any) -> dict[str, Any]:
    return schema.check(fn)


def _path_fault(value: str) -> str | None:
    """What is wrong with a file's path, None when nothing: a file system must be able to hold it
    (the device adds its store's prefix and suffixes: applianctl/model/store.py check_names)."""
    if not is_repo_path(value):
        return "a relative path without '..' (letters, digits, ._+-)"
    if any(len(part.encode()) > NAME_MAX for part in value.split("/")):
        return f"a path whose names are at most {NAME_MAX} bytes each"
    if len(value.encode()) > PATH_MAX:
        return f"a path of at most {PATH_MAX} bytes"
    return None


def _hex64_or_empty(value: str) -> str | None:
    return None if value == "" or SHA256.match(value) else "64 lower-case hex digits, or \"\""


@dataclass(frozen=True)
class WeightFile:
    path: str = field(metadata=_check(_path_fault))
    size: int = field(metadata=_check(lambda v: None if v >= 0 else "a size in bytes (0 or more)"))
    sha256: str = field(metadata=_check(lambda v: None if SHA256.match(v) else "64 lower-case hex digits"))
    fsverity: str = field(default="", metadata=_check(_hex64_or_empty))


@dataclass(frozen=True)
class WeightsManifest:
    model: str = field(metadata=_check(lambda v: None if MODEL_ID.match(v) else "a model id such as org/name"))
    revision: str = field(metadata=_check(lambda v: None if REVISION.match(v) else "40 lower-case hex digits"))
    files: tuple[WeightFile, ...]
    total_bytes: int

    def file(self, path: str) -> WeightFile | None:
        return next((f for f in self.files if f.path == path), None)


class _Loader(schema.Loader):
    def invalid(self, key: str, value: Any, expected: str) -> ManifestError:
        return ManifestError(f"{self.where}: {key} = {schema.shown(value)}: expected {expected}", hint=_HINT)

    def unknown(self, key: str, value: Any, known: list[str]) -> ManifestError:
        return ManifestError(f"{self.where}: unknown field {key!r}", hint="known fields here: " + ", ".join(sorted(known)))

    def missing(self, key: str, tp: Any) -> ManifestError:
        return ManifestError(f"{self.where}: missing field {key!r}", hint="the weights manifest is incomplete")


def check(model: WeightsManifest, where: str = "weights manifest") -> WeightsManifest:
    """Rules across the files: each path once, none inside another, at least one, total = sum."""
    hint = _HINT
    if not model.files or len(model.files) > MAX_FILES:
        raise ManifestError(f"{where}: {len(model.files)} files (expected 1 to {MAX_FILES})", hint=hint)
    paths = [f.path for f in model.files]
    seen: set[str] = set()
    for path in paths:
        if path in seen:
            raise ManifestError(f"{where}: {path} is listed twice", hint=hint)
        seen.add(path)
    for path in paths:
        parts = path.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in seen:
                raise ManifestError(f"{where}: {path} is inside the file {'/'.join(parts[:i])}", hint=hint)
    total = sum(f.size for f in model.files)
    if total != model.total_bytes:
        raise ManifestError(f"{where}: total_bytes = {model.total_bytes}, but the files add up to {total}", hint=hint)
    return model


def from_plain(data: Any, where: str = "weights manifest") -> WeightsManifest:
    model: WeightsManifest = _Loader(where).load(WeightsManifest, data)
    return check(model, where)


def loads(data: bytes, where: str = "weights manifest") -> WeightsManifest:
    """Parse and check weights manifest bytes (canonical form and schema)."""
    return from_plain(parse_canonical(data), where)


def dumps(model: WeightsManifest) -> bytes:
    """The canonical bytes of MODEL (checked first)."""
    check(model)
    return canonical(schema.plain(model))


def make(model_id: str, revision: str, files: list[WeightFile]) -> WeightsManifest:
    files = sorted(files, key=lambda f: f.path)
    return check(WeightsManifest(model_id, revision, tuple(files), sum(f.size for f in files)))


def sha256(data: bytes) -> str:
    """What the release manifest pins: the SHA-256 of the manifest's bytes."""
    return hashlib.sha256(data).hexdigest()
