# SPDX-License-Identifier: MIT
"""The fs-verity file digest, computed in user space (the kernel's Documentation/filesystems/fsverity.rst).

The builder records it per weight file (`builder weights pin --from DIR`); the device compares it
with the kernel's (FS_IOC_MEASURE_VERITY), so the parameters are those of `fsverity enable`'s
default and the device's seal: SHA-256, 4096-byte blocks, no salt. The digest is the SHA-256 of the
256-byte descriptor holding the Merkle root (an empty file's: all zeros) and the file size.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from pathlib import Path

BLOCK = 4096
HASH_ALG_SHA256 = 1  # FS_VERITY_HASH_ALG_SHA256
LOG_BLOCK = 12
_HASH = 32
_READ = 1 << 20  # bytes read at a time: a multiple of BLOCK


def _pad(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % BLOCK)


def _level(hashes: Iterable[bytes]) -> list[bytes]:
    """The hashes of the blocks that pack HASHES (128 per 4096-byte block)."""
    out, block = [], bytearray()
    for h in hashes:
        block += h
        if len(block) == BLOCK:
            out.append(hashlib.sha256(block).digest())
            block.clear()
    if block:
        out.append(hashlib.sha256(_pad(bytes(block))).digest())
    return out


def root_hash(blocks: list[bytes], size: int) -> bytes:
    """The Merkle tree root over the data blocks' hashes BLOCKS of a SIZE-byte file."""
    if size == 0:
        return b"\0" * _HASH
    level = blocks
    while len(level) > 1:
        level = _level(level)
    return level[0]


def descriptor(size: int, root: bytes) -> bytes:
    """struct fsverity_descriptor: version 1, SHA-256, 4096-byte blocks, no salt, no signature."""
    head = struct.pack("<BBBBIQ", 1, HASH_ALG_SHA256, LOG_BLOCK, 0, 0, size)
    return head + root.ljust(64, b"\0") + b"\0" * 32 + b"\0" * 144


def digest_file(path: Path) -> str:
    """The hex fs-verity digest of the file at PATH (what `fsverity digest` prints after 'sha256:')."""
    blocks: list[bytes] = []
    size = 0
    with open(path, "rb") as f:
        while data := f.read(_READ):
            size += len(data)
            view = memoryview(_pad(data) if len(data) % BLOCK else data)
            blocks.extend(hashlib.sha256(view[i : i + BLOCK]).digest() for i in range(0, len(view), BLOCK))
    return hashlib.sha256(descriptor(size, root_hash(blocks, size))).hexdigest()


def digest_bytes(data: bytes) -> str:
    """The fs-verity digest of a file holding DATA (tests and generated demo weights)."""
    padded = memoryview(_pad(data))
    blocks = [hashlib.sha256(padded[i : i + BLOCK]).digest() for i in range(0, len(padded), BLOCK)]
    return hashlib.sha256(descriptor(len(data), root_hash(blocks, len(data)))).hexdigest()
