# SPDX-License-Identifier: MIT
"""GPU firmware in the image: what amdgpu.ko declares, and whether the image carries it.

check_image() reads each amdgpu module's .modinfo section and finds every MI300X (gfx942) blob it
declares under usr/lib/firmware, in the kernel's lookup order. check_pinned_blobs() checks the blobs
of firmware/amdgpu.sha256 in the image (the build does not call it; tests do).

Not kmod's `modinfo -F firmware` (measured, Debian 13's amdgpu.ko.xz: same 646 names, same time):
kmod is not on the build host by default, Debian 12's kmod cannot read .ko.gz, and a path it does
not recognise is looked up in the host's /lib/modules, silently reading the host's driver instead.
"""

from __future__ import annotations

import gzip
import lzma
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import UserError
from appliance.hashing import sha256_file
from appliance.run import call_bytes
from builder.pins import FIRMWARE_TARGET_DIR, read_firmware_pins

AMDGPU_DIR = "kernel/drivers/gpu/drm/amd/amdgpu"
MODULE_NAMES = ("amdgpu.ko", "amdgpu.ko.xz", "amdgpu.ko.zst", "amdgpu.ko.gz")
FIRMWARE_ROOT = "usr/lib/firmware"
COMPRESSED = ("", ".zst", ".xz")

# MI300X: GC 9.4.3 (gfx942), PSP 13.0.6, SMU (MP1) 13.0.6, SDMA 4.4.2, VCN 4.0.3.
MI300X_FIRMWARE = re.compile(
    r"^amdgpu/(?:(?:gc_9_4_3|psp_13_0_6|smu_13_0_6|sdma_4_4_2|vcn_4_0_3)[_.]|[a-z0-9]+_(?:9_4_3|13_0_6)[_.])"
)

MAX_MODULE_BYTES = 512 << 20


@dataclass(frozen=True)
class KernelFirmware:
    kernel_version: str
    module: str  # image path of amdgpu.ko*
    declared: tuple[str, ...]  # every firmware= name of the module
    mi300x: tuple[str, ...]  # the MI300X ones, each found in the image


# ----------------------------------------------------------------------------- modules


def read_module(path: Path) -> bytes:
    """The ELF bytes of a kernel module, decompressed if its name says so."""
    name = path.name
    try:
        if name.endswith(".xz"):
            with lzma.open(path) as f:
                return f.read(MAX_MODULE_BYTES)
        if name.endswith(".gz"):
            with gzip.open(path) as f:
                return f.read(MAX_MODULE_BYTES)
        if name.endswith(".zst"):
            return _zstd(path)
        return path.read_bytes()
    except (lzma.LZMAError, gzip.BadGzipFile, EOFError) as e:
        raise UserError(f"{path}: cannot decompress ({e})", hint="the module file is damaged") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})", hint="check the image tree") from None


def _zstd(path: Path) -> bytes:
    exe = shutil.which("zstd")
    if exe is None:
        raise UserError(f"{path}: zstd is needed to read it", hint="apt-get install zstd")
    proc = call_bytes([exe, "-q", "-d", "-c", "--", path], None)
    if proc.returncode != 0:
        message = proc.stderr.decode(errors="replace").strip().splitlines()
        raise UserError(
            f"{path}: zstd failed ({message[-1] if message else proc.returncode})", hint="the module file is damaged"
        )
    return proc.stdout


def modinfo(elf: bytes, name: str = "module") -> list[tuple[str, str]]:
    """The key=value strings of the ELF file's .modinfo section, in order."""
    section = elf_section(elf, ".modinfo", name)
    if section is None:
        raise UserError(f"{name}: no .modinfo section", hint="this is not a kernel module")
    out = []
    for item in section.split(b"\0"):
        if not item:
            continue
        key, sep, value = item.decode("utf-8", errors="replace").partition("=")
        if sep:
            out.append((key, value))
    return out


def declared_firmware(elf: bytes, name: str = "module") -> list[str]:
    return [value for key, value in modinfo(elf, name) if key == "firmware"]


def elf_section(elf: bytes, wanted: str, name: str = "module") -> bytes | None:
    """The contents of section WANTED of an ELF file (32/64-bit, either byte order), or None."""

    def bad(why: str) -> UserError:
        return UserError(f"{name}: not a valid ELF file ({why})", hint="the module file is damaged")

    if len(elf) < 16 or elf[:4] != b"\x7fELF":
        raise bad("no ELF magic")
    cls, order = elf[4], elf[5]
    if cls not in (1, 2) or order not in (1, 2):
        raise bad("unknown class or byte order")
    e = "<" if order == 1 else ">"
    try:
        if cls == 2:
            (shoff,) = struct.unpack_from(e + "Q", elf, 0x28)
            shentsize, shnum, shstrndx = struct.unpack_from(e + "HHH", elf, 0x3A)
            sh_format, sh_min = e + "IIQQQQIIQQ", 64
        else:
            (shoff,) = struct.unpack_from(e + "I", elf, 0x20)
            shentsize, shnum, shstrndx = struct.unpack_from(e + "HHH", elf, 0x2E)
            sh_format, sh_min = e + "IIIIIIIIII", 40
        if shoff == 0:
            raise bad("no section headers")
        if shentsize < sh_min:
            raise bad("section header too small")

        def header(index: int) -> tuple[int, ...]:
            at = shoff + index * shentsize
            if at + sh_min > len(elf):
                raise bad("section header past the end")
            return struct.unpack_from(sh_format, elf, at)

        first = header(0)
        if shnum == 0:  # extended numbering: the count is in section 0's sh_size
            shnum = first[5]
        if shstrndx == 0xFFFF:
            shstrndx = first[6]
        if shnum > 1 << 20 or shstrndx >= shnum:
            raise bad("bad section counts")

        def contents(h: tuple[int, ...]) -> bytes:
            offset, size = h[4], h[5]
            if h[1] == 8:  # SHT_NOBITS
                return b""
            if offset + size > len(elf):
                raise bad("section past the end")
            return elf[offset : offset + size]

        names = contents(header(shstrndx))
        for index in range(shnum):
            h = header(index)
            start = h[0]
            end = names.find(b"\0", start)
            if start >= len(names) or end < 0:
                continue
            if names[start:end].decode("ascii", errors="replace") == wanted:
                return contents(h)
    except struct.error:
        raise bad("truncated") from None
    return None


# ----------------------------------------------------------------------------- image tree


def find_modules(image_root: Path) -> list[tuple[str, Path]]:
    """(kernel version, module path) for each amdgpu module in the image tree."""
    found = []
    modules = image_root / "usr/lib/modules"
    for kdir in sorted(modules.iterdir()) if modules.is_dir() else []:
        for name in MODULE_NAMES:
            path = kdir / AMDGPU_DIR / name
            if path.is_file():
                found.append((kdir.name, path))
                break
    return found


def find_firmware(image_root: Path, name: str, kernel_version: str) -> Path | None:
    """Where the kernel would load firmware NAME from in the image, or None."""
    base = image_root / FIRMWARE_ROOT
    for prefix in (f"updates/{kernel_version}/", "updates/", f"{kernel_version}/", ""):
        for ext in COMPRESSED:
            path = base / f"{prefix}{name}{ext}"
            if path.is_file():
                return path
    return None


def check_image(image_root: Path) -> list[KernelFirmware]:
    """Every kernel's amdgpu module with the MI300X firmware it needs, all found; else UserError."""
    modules = find_modules(image_root)
    if not modules:
        raise UserError(
            f"{image_root}: no amdgpu module under usr/lib/modules/*/{AMDGPU_DIR}/",
            hint="the image needs a kernel with amdgpu (linux-image-amd64)",
        )
    out = []
    for kver, path in modules:
        shown = str(path.relative_to(image_root))
        declared = declared_firmware(read_module(path), shown)
        wanted = [n for n in declared if MI300X_FIRMWARE.match(n)]
        if not wanted:
            raise UserError(
                f"{shown}: declares no MI300X (gfx942) firmware",
                hint="the kernel is too old for MI300X; use 6.8 or later",
            )
        missing = [n for n in wanted if find_firmware(image_root, n, kver) is None]
        if missing:
            raise UserError(
                f"{FIRMWARE_ROOT} lacks MI300X firmware that {shown} needs: {' '.join(missing)}",
                hint="install firmware-amd-graphics (non-free-firmware) or supply the blobs (see firmware/README.md)",
            )
        out.append(KernelFirmware(kver, shown, tuple(declared), tuple(wanted)))
    return out


def check_pinned_blobs(image_root: Path, repo_root: Path) -> list[str]:
    """The names of firmware/amdgpu.sha256's blobs, each checked in the image against its hash."""
    names = []
    target_dir = image_root / FIRMWARE_TARGET_DIR.lstrip("/")
    for name, sha in read_firmware_pins(repo_root):
        path = target_dir / name
        shown = f"{FIRMWARE_TARGET_DIR}/{name}"
        if path.is_symlink() or not path.is_file():
            raise UserError(
                f"{shown}: missing from the image (pinned sha256 {sha})",
                hint="the build must copy firmware/amdgpu/ there",
            )
        actual = sha256_file(path)
        if actual != sha:
            raise UserError(
                f"{shown}: expected sha256 {sha}, actual {actual}", hint="the image carries a different blob"
            )
        names.append(name)
    return names
