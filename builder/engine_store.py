# SPDX-License-Identifier: MIT
"""The engine image as a read-only podman image store (erofs + dm-verity) on a partition of its own.

The partition is labelled by the image digest, so a release that keeps the digest ships no engine
bytes. The root hash is computed before mkosi runs so that it can go into the signed manifest and
the unit that opens the partition. Cached by digest on the build host.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from appliance import progress
from appliance.config import Config
from appliance.errors import UserError
from appliance.run import checked
from builder.host_tools import FAILED_HINT, HOST_CACHE, MISSING_HINT

CACHE = HOST_CACHE / "engine-stores"
MIB = 1 << 20
VERITY_BLOCK = 4096  # veritysetup format's default data and hash block size (sha256: 32-byte digests)
# Where the guest mounts the store; podman's storage.conf names it in additionalimagestores.
MOUNT_POINT = "/run/appliance/engine-store"


@dataclass(frozen=True)
class EngineStore:
    erofs: Path
    verity: Path
    roothash: str
    label: str
    # The engine slot this store was checked to fit (engine.slot_size_gib); 0: not checked (previews).
    slot_bytes: int = 0

    @property
    def verity_label(self) -> str:
        return self.label + "-verity"


def hash_tree_bytes(data_bytes: int) -> int:
    """The size `veritysetup format` writes for DATA_BYTES: a superblock, then hash levels of
    128 digests a block down to a single block."""
    blocks, total = -(-data_bytes // VERITY_BLOCK), 0
    while blocks > 1:
        blocks = -(-blocks // (VERITY_BLOCK // 32))
        total += blocks
    return (total + 1) * VERITY_BLOCK


def verity_slot_bytes(slot_bytes: int) -> int:
    """The verity partition of an engine slot: a full slot's hash tree, in whole MiB."""
    return -(-hash_tree_bytes(slot_bytes) // MIB) * MIB


def check_fits(store: EngineStore, config: Config) -> EngineStore:
    """STORE marked as fitting CONFIG's engine slot; UserError saying by how much it does not."""
    slot = config.engine.slot_bytes
    size = store.erofs.stat().st_size
    if size > slot:
        raise UserError(
            f"engine store {store.label} is {size / MIB:.1f} MiB, more than an engine slot "
            f"(engine.slot_size_gib = {config.engine.slot_size_gib:g}, {slot // MIB} MiB)",
            hint=f"raise engine.slot_size_gib in appliance.toml to at least {-(-size // MIB) / 1024} "
            "(installed disks keep their slot size: they need a re-install to run a larger engine)",
        )
    verity = store.verity.stat().st_size
    if verity > verity_slot_bytes(slot):  # cannot happen for a hash tree of at most a slot's data
        raise UserError(f"engine store {store.label}: its hash tree ({verity} bytes) exceeds its partition",
                        hint="the verity image is not the one veritysetup made for this store; delete the cached store")
    return dataclasses.replace(store, slot_bytes=slot)


def built(config: Config) -> EngineStore | None:
    digest = config.engine.digest
    return _load(CACHE / digest.replace(":", "-"), digest)


def label_for(digest: str) -> str:
    """GPT partition label of the engine store: the image digest's first 12 hex digits."""
    return "engine_" + digest.removeprefix("sha256:")[:12]


def _stable_uuid(digest: str, purpose: str) -> str:
    return str(uuid.UUID(bytes=hashlib.sha256(f"{purpose}:{digest}".encode()).digest()[:16]))


def _salt(digest: str) -> str:
    return hashlib.sha256(f"appliance-engine-store-salt:{digest}".encode()).hexdigest()


def _load(cached: Path, digest: str) -> EngineStore | None:
    meta = cached / "store.json"
    if not meta.is_file():
        return None
    data = json.loads(meta.read_text())
    return EngineStore(cached / "engine.erofs", cached / "engine.verity", data["roothash"], label_for(digest))


def make(config: Config, layout: Path) -> EngineStore:
    """The engine store for CONFIG's pinned image at LAYOUT, built once per digest."""
    digest = config.engine.digest
    cached = CACHE / digest.replace(":", "-")
    found = _load(cached, digest)
    if found is not None:
        return check_fits(found, config)
    staging = cached.with_name(cached.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with tempfile.TemporaryDirectory(prefix="engine-store-", dir="/var/tmp") as tmp:
            store, runroot = Path(tmp) / "store", Path(tmp) / "run"
            with progress.step("copying the engine image into its store"):
                checked(
                    [
                        "skopeo", "copy", "--quiet", "--preserve-digests", f"oci:{layout}:appliance",
                        f"containers-storage:[overlay@{store}+{runroot}]{config.engine.image}:appliance",
                    ],
                    what="skopeo copy into the engine store",
                    hint="run `make setup` (skopeo); the store is written with podman's overlay driver",
                    timeout=None, capture=False, missing_hint=MISSING_HINT,
                )
            # containers/storage leaves its driver directory bind-mounted onto itself.
            checked(["umount", "--recursive", "--quiet", store / "overlay"], what="umount the store", hint=FAILED_HINT,
                    timeout=None, capture=False, missing_hint=MISSING_HINT)
            # podman recreates lock files and scratch space as needed.
            for transient in ("tmp", "mounts", "storage.lock", "userns.lock"):
                target = store / transient
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink(missing_ok=True)
            with progress.step("packing the engine store (mkfs.erofs)"):
                checked(
                    ["mkfs.erofs", "-T0", f"-U{_stable_uuid(digest, 'erofs')}", "--all-root", "-zlz4hc",
                     staging / "engine.erofs", store],
                    what="mkfs.erofs", hint="run `make setup` (erofs-utils)", timeout=None, missing_hint=MISSING_HINT,
                )
        with progress.step("hashing the engine store (veritysetup format)"):
            result = checked(
                ["veritysetup", "format", f"--salt={_salt(digest)}", f"--uuid={_stable_uuid(digest, 'verity')}",
                 staging / "engine.erofs", staging / "engine.verity"],
                what="veritysetup format", hint="run `make setup` (cryptsetup-bin)", timeout=None, missing_hint=MISSING_HINT,
            )
        roothash = next(
            (line.split(":", 1)[1].strip() for line in result.stdout.splitlines() if line.startswith("Root hash:")), ""
        )
        if len(roothash) != 64:
            raise UserError("veritysetup printed no root hash for the engine store", hint="run again with --debug")
        (staging / "store.json").write_text(json.dumps({"digest": digest, "roothash": roothash}) + "\n")
        shutil.rmtree(cached, ignore_errors=True)
        staging.rename(cached)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    store_found = _load(cached, digest)
    assert store_found is not None
    return check_fits(store_found, config)
