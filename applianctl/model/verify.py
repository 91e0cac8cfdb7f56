# SPDX-License-Identifier: MIT
"""`applianctl model verify`: before every engine start, the weights on /var are exactly the signed ones.

Each manifest file must be a regular file of the pinned size, sealed with fs-verity, with the
manifest's fs-verity digest (or the one this device recorded on proving its SHA-256). The kernel
gives a sealed file's digest in constant time, so this takes milliseconds where re-hashing 156 GiB
takes minutes, and then checks every byte the engine reads. No other file may be in the snapshot
(the engine runs its code with --trust-remote-code). A block changed behind the file system's
back shows only when read (EIO): `--deep` reads every byte, like a RAID scrub, and records a
refused file, which every later check refuses until `applianctl model fetch` replaces it.
"""

from __future__ import annotations

import hmac
import os
import stat
from pathlib import Path

from appliance.signed import weights_manifest
from applianctl.model.fsverity_seal import Verity
from applianctl.model.store import Store
from applianctl.records import CorruptFile, ModelVerifyResult

READ_BYTES = 4 << 20


def _fault(entry: weights_manifest.WeightFile, store: Store, verity: Verity, recorded: dict[str, str],
           corrupt: dict[str, CorruptFile]) -> str | None:
    target = store.target(entry.path)
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return f"{entry.path} is missing"
    if not stat.S_ISREG(st.st_mode):
        return f"{entry.path} is not a regular file"
    if entry.path in corrupt and corrupt[entry.path].inode == st.st_ino:
        return f"{entry.path}: {corrupt[entry.path].reason}"
    if st.st_size != entry.size:
        return f"{entry.path} has {st.st_size} bytes, the signed manifest {entry.size}"
    measured = verity.measure(target)
    if measured is None:
        return f"{entry.path} is not sealed with fs-verity"
    expected = entry.fsverity or recorded.get(entry.path)
    if not expected:
        return f"{entry.path}: no fs-verity digest recorded for it"
    if not hmac.compare_digest(measured, expected):
        return f"{entry.path} was changed (its fs-verity digest is not the signed one)"
    return None


def _extra(store: Store) -> str | None:
    known = {f.path for f in store.manifest.files}
    dirs = {"/".join(p.split("/")[:i]) for p in known for i in range(1, p.count("/") + 1)}
    for root, subdirs, names in os.walk(store.snapshot):
        rel_root = os.path.relpath(root, store.snapshot)
        for name in sorted(names + subdirs):
            rel = name if rel_root == "." else f"{rel_root}/{name}"
            if rel not in known and rel not in dirs:
                return f"{rel} is in the snapshot but not in the signed manifest"
    return None


def read_all(path: Path) -> None:
    """Read every byte of PATH (through fs-verity: each block checked against the Merkle tree)."""
    with open(path, "rb", buffering=0) as f:
        while f.read(READ_BYTES):
            pass


def check(store: Store, verity: Verity, deep: bool = False) -> ModelVerifyResult:
    """The result of the check: ok, the reason (one line), and what was checked."""
    manifest = store.manifest

    def result(ok: bool, reason: str, file: str | None = None) -> ModelVerifyResult:
        return ModelVerifyResult(ok, reason, manifest.revision, len(manifest.files), manifest.total_bytes, deep, file)

    recorded, corrupt = store.recorded(), store.corrupt()
    for entry in manifest.files:
        fault = _fault(entry, store, verity, recorded, corrupt)
        if fault is None and deep:
            target = store.target(entry.path)
            try:
                read_all(target)
            except OSError as e:
                fault = f"a block was refused on read ({e.strerror}): the file changed on the disk"
                store.mark_corrupt(entry.path, os.stat(target).st_ino, fault)
                fault = f"{entry.path}: {fault}"
        if fault is not None:
            return result(False, f"model weights: {fault}", entry.path)
    extra = _extra(store)
    if extra is not None:
        return result(False, f"model weights: {extra}", extra.split(" ")[0])
    return result(True, "")
