# SPDX-License-Identifier: MIT
"""fs-verity through the kernel: seal a weight file, ask for its digest.

Sealing (appliance/fsverity.py's parameters) makes the file read-only for good; the kernel then
checks every page read against the Merkle tree, mmap included (a changed block reads as EIO), and
returns the digest in constant time, which keeps the check before every start cheap. The commands
take a `Verity`: unit tests pass a fake (the build host's kernel has no fs-verity).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path
from typing import Protocol

from appliance.errors import UserError

# <linux/fsverity.h>: _IOW('f', 133, struct fsverity_enable_arg) (128 bytes),
# _IOWR('f', 134, struct fsverity_digest) (4 bytes + the digest)
FS_IOC_ENABLE_VERITY = 0x40806685
FS_IOC_MEASURE_VERITY = 0xC0046686
HASH_ALG_SHA256 = 1
BLOCK_SIZE = 4096
MAX_DIGEST = 64

NO_VERITY_HINT = ("/var needs the ext4 verity feature: appliance-var-verity.service sets it before /var is mounted; "
                  "reboot once (see systemctl status appliance-var-verity.service)")
# Present when the running kernel's ext4 can do fs-verity (fs/ext4/sysfs.c, under CONFIG_FS_VERITY).
EXT4_VERITY_FEATURE = Path("/sys/fs/ext4/features/verity")


class Verity(Protocol):
    """With DIR_FD, PATH's last name is opened in that directory (the model store's descriptors:
    no link followed on the way); PATH itself is for messages."""

    def enable(self, path: Path, dir_fd: int | None = None) -> None:
        """Seal PATH (no writer may hold it open); an already sealed file is left as it is."""

    def measure(self, path: Path, dir_fd: int | None = None) -> str | None:
        """PATH's fs-verity digest (hex), or None when it is not sealed."""


def _open(path: Path, flags: int, dir_fd: int | None) -> int:
    return os.open(path.name if dir_fd is not None else path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)


def _enable_arg() -> bytes:
    # version, hash_algorithm, block_size, salt_size, salt_ptr, sig_size, reserved, sig_ptr, reserved[11]
    return struct.pack("=IIIIQIIQ88x", 1, HASH_ALG_SHA256, BLOCK_SIZE, 0, 0, 0, 0, 0)


def unsupported(path: Path, err: int) -> UserError:
    """Why the kernel refused to seal PATH (Documentation/filesystems/fsverity.rst): ENOTTY, the
    file system type has no fs-verity at all; EOPNOTSUPP, the kernel was built without
    CONFIG_FS_VERITY, or it has it and this file system has the verity feature off."""
    if err == errno.ENOTTY:
        return UserError(f"{path}: its file system type does not implement fs-verity",
                         hint="the weights must be on /var's ext4 file system (model.cache_dir under /var); "
                              f"`findmnt -T {path.parent}` shows which file system holds them")
    if not EXT4_VERITY_FEATURE.exists():
        return UserError(f"{path}: the running kernel has no fs-verity (built without CONFIG_FS_VERITY)",
                         hint="boot a kernel built with CONFIG_FS_VERITY=y (the image's Debian kernel is); "
                              "`uname -r` names the running one")
    return UserError(f"{path}: its file system does not have the ext4 verity feature turned on", hint=NO_VERITY_HINT)


class Kernel:
    """fs-verity through the ioctls (no program needed)."""

    def enable(self, path: Path, dir_fd: int | None = None) -> None:
        fd = _open(path, os.O_RDONLY, dir_fd)
        try:
            fcntl.ioctl(fd, FS_IOC_ENABLE_VERITY, _enable_arg())
        except OSError as e:
            if e.errno == errno.EEXIST:
                return
            if e.errno in (errno.EOPNOTSUPP, errno.ENOTTY):
                raise unsupported(path, e.errno) from None
            raise UserError(f"{path}: cannot seal with fs-verity ({e.strerror})", hint="run the same command again") from None
        finally:
            os.close(fd)

    def measure(self, path: Path, dir_fd: int | None = None) -> str | None:
        fd = _open(path, os.O_RDONLY | os.O_NONBLOCK, dir_fd)
        try:
            buf = bytearray(struct.pack("=HH", 0, MAX_DIGEST) + b"\0" * MAX_DIGEST)
            fcntl.ioctl(fd, FS_IOC_MEASURE_VERITY, buf, True)
        except OSError as e:
            if e.errno in (errno.ENODATA, errno.EOPNOTSUPP, errno.ENOTTY):
                return None
            raise
        finally:
            os.close(fd)
        algorithm, size = struct.unpack_from("=HH", buf)
        if algorithm != HASH_ALG_SHA256:
            return None  # sealed with other parameters than the manifest's: not this digest
        return bytes(buf[4 : 4 + size]).hex()
