# SPDX-License-Identifier: MIT
"""amdgpu firmware declared vs carried (builder/firmware.py)."""

from __future__ import annotations

import hashlib
import lzma
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from appliance.errors import UserError
from builder import firmware, pins

KVER = "6.12.38+deb13-amd64"
MI300X = [
    "amdgpu/gc_9_4_3_mec.bin",
    "amdgpu/gc_9_4_3_rlc.bin",
    "amdgpu/psp_13_0_6_sos.bin",
    "amdgpu/psp_13_0_6_ta.bin",
    "amdgpu/smu_13_0_6.bin",
    "amdgpu/sdma_4_4_2.bin",
    "amdgpu/vcn_4_0_3.bin",
]
OTHER = ["amdgpu/navi10_smc.bin", "amdgpu/gc_11_0_0_mes.bin", "amdgpu/psp_13_0_0_sos.bin", "amdgpu/vcn_4_0_0.bin"]


def make_elf(strings: list[str], cls: int = 2, order: str = "<") -> bytes:
    """A minimal relocatable ELF with .modinfo, .text and .shstrtab sections."""
    modinfo = b"".join(s.encode() + b"\0" for s in strings) + b"\0\0"
    text = b"\xc3" * 16
    shstrtab = b"\0.modinfo\0.text\0.shstrtab\0"
    names = {".modinfo": 1, ".text": 10, ".shstrtab": 16}
    ehsize = 64 if cls == 2 else 52
    body = bytearray(ehsize)
    offsets = {}
    for name, data in ((".text", text), (".modinfo", modinfo), (".shstrtab", shstrtab)):
        offsets[name] = len(body)
        body += data
    while len(body) % 8:
        body += b"\0"
    shoff = len(body)
    e = order
    if cls == 2:
        fmt, entsize = e + "IIQQQQIIQQ", 64
    else:
        fmt, entsize = e + "IIIIIIIIII", 40
    body += struct.pack(fmt, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    for name, data, sh_type in ((".text", text, 1), (".modinfo", modinfo, 1), (".shstrtab", shstrtab, 3)):
        body += struct.pack(fmt, names[name], sh_type, 0, 0, offsets[name], len(data), 0, 0, 1, 0)
    ident = b"\x7fELF" + bytes([cls, 1 if order == "<" else 2, 1, 0]) + b"\0" * 8
    if cls == 2:
        header = ident + struct.pack(e + "HHIQQQIHHHHHH", 1, 62, 1, 0, 0, shoff, 0, ehsize, 0, 0, entsize, 4, 3)
    else:
        header = ident + struct.pack(e + "HHIIIIIHHHHHH", 1, 3, 1, 0, 0, shoff, 0, ehsize, 0, 0, entsize, 4, 3)
    body[:ehsize] = header
    return bytes(body)


def modinfo_strings(names: list[str]) -> list[str]:
    return [
        "license=GPL and additional rights",
        "description=AMD GPU",
        *(f"firmware={n}" for n in names),
        "vermagic=6.12",
    ]


def image(tmp_path: Path, declared: list[str], carried: list[str], compress: str = "") -> Path:
    root = tmp_path / "image"
    mod_dir = root / "usr/lib/modules" / KVER / firmware.AMDGPU_DIR
    mod_dir.mkdir(parents=True)
    elf = make_elf(modinfo_strings(declared))
    if compress == ".xz":
        (mod_dir / "amdgpu.ko.xz").write_bytes(lzma.compress(elf, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32))
    elif compress == ".zst":
        (mod_dir / "amdgpu.ko").write_bytes(elf)
        subprocess.run(["zstd", "-q", "--rm", str(mod_dir / "amdgpu.ko")], check=True)
    else:
        (mod_dir / "amdgpu.ko").write_bytes(elf)
    for name in carried:
        path = root / "usr/lib/firmware" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"blob " + name.encode())
    return root


@pytest.mark.parametrize(("cls", "order"), [(2, "<"), (1, "<"), (2, ">")])
def test_modinfo_parser(cls: int, order: str) -> None:
    elf = make_elf(modinfo_strings(MI300X), cls, order)
    assert firmware.declared_firmware(elf) == MI300X
    assert ("license", "GPL and additional rights") in firmware.modinfo(elf)


@pytest.mark.programs
@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_modinfo_of_a_real_compiler_object(tmp_path: Path) -> None:
    """The way the kernel's MODULE_FIRMWARE() lays out .modinfo, compiled by gcc."""
    decls = "\n".join(
        f'static const char fw{i}[] __attribute__((section(".modinfo"), used, aligned(1))) = "firmware={n}";'
        for i, n in enumerate(MI300X + OTHER)
    )
    (tmp_path / "m.c").write_text(decls + "\nint f(void) { return 1; }\n")
    subprocess.run(["gcc", "-c", "-O2", "-o", str(tmp_path / "m.o"), str(tmp_path / "m.c")], check=True)
    assert sorted(firmware.declared_firmware((tmp_path / "m.o").read_bytes())) == sorted(MI300X + OTHER)


def test_mi300x_filter() -> None:
    names = MI300X + OTHER + ["amdgpu/mmhub_9_4_3.bin", "amdgpu/gc_9_4_4_mec.bin", "amdgpu/sdma_4_4_0.bin"]
    picked = [n for n in names if firmware.MI300X_FIRMWARE.match(n)]
    assert picked == [*MI300X, "amdgpu/mmhub_9_4_3.bin"]


@pytest.mark.programs
@pytest.mark.parametrize(
    "compress",
    ["", ".xz", pytest.param(".zst", marks=pytest.mark.skipif(shutil.which("zstd") is None, reason="no zstd"))],
)
def test_image_with_all_firmware_passes(tmp_path: Path, compress: str) -> None:
    root = image(tmp_path, MI300X + OTHER, MI300X, compress)
    [result] = firmware.check_image(root)
    assert result.kernel_version == KVER
    assert result.mi300x == tuple(MI300X)
    assert result.module.endswith("amdgpu.ko" + compress)


def test_compressed_and_updates_firmware_count(tmp_path: Path) -> None:
    root = image(tmp_path, MI300X, MI300X[2:])
    fw = root / "usr/lib/firmware"
    (fw / "amdgpu/gc_9_4_3_mec.bin.zst").write_bytes(b"z")
    (fw / "updates/amdgpu").mkdir(parents=True)
    (fw / "updates/amdgpu/gc_9_4_3_rlc.bin.xz").write_bytes(b"x")
    firmware.check_image(root)
    assert firmware.find_firmware(root, "amdgpu/gc_9_4_3_rlc.bin", KVER) == fw / "updates/amdgpu/gc_9_4_3_rlc.bin.xz"


def test_missing_firmware_is_named(tmp_path: Path) -> None:
    root = image(tmp_path, MI300X + OTHER, [n for n in MI300X if "psp" not in n and "vcn" not in n])
    with pytest.raises(UserError) as info:
        firmware.check_image(root)
    assert "amdgpu/psp_13_0_6_sos.bin amdgpu/psp_13_0_6_ta.bin amdgpu/vcn_4_0_3.bin" in info.value.message
    assert "navi10" not in info.value.message


def test_no_module(tmp_path: Path) -> None:
    (tmp_path / "usr/lib/modules" / KVER).mkdir(parents=True)
    with pytest.raises(UserError, match="no amdgpu module"):
        firmware.check_image(tmp_path)


def test_kernel_without_mi300x_support(tmp_path: Path) -> None:
    root = image(tmp_path, OTHER, [])
    with pytest.raises(UserError, match="no MI300X"):
        firmware.check_image(root)


@pytest.mark.parametrize(
    "data",
    [b"", b"not an elf", b"\x7fELF\x02\x01\x01" + b"\0" * 9, make_elf(["firmware=x"])[:80], lzma.compress(b"x")],
)
def test_broken_modules_are_refused(data: bytes) -> None:
    with pytest.raises(UserError, match=r"amdgpu.ko"):
        firmware.declared_firmware(data, "amdgpu.ko")


def test_damaged_xz_module(tmp_path: Path) -> None:
    root = image(tmp_path, MI300X, MI300X, ".xz")
    path = root / "usr/lib/modules" / KVER / firmware.AMDGPU_DIR / "amdgpu.ko.xz"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(UserError, match="cannot decompress"):
        firmware.check_image(root)


def test_pinned_blobs_in_the_image(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    blob = b"psp blob"
    (repo / "firmware").mkdir(parents=True)
    (repo / pins.FIRMWARE_PINS).write_text(f"{hashlib.sha256(blob).hexdigest()}  psp_13_0_6_sos.bin\n")
    root = tmp_path / "image"
    with pytest.raises(UserError, match=r"psp_13_0_6_sos.bin: missing from the image"):
        firmware.check_pinned_blobs(root, repo)
    target = root / "usr/lib/firmware/updates/amdgpu/psp_13_0_6_sos.bin"
    target.parent.mkdir(parents=True)
    target.write_bytes(blob)
    assert firmware.check_pinned_blobs(root, repo) == ["psp_13_0_6_sos.bin"]
    target.write_bytes(b"other")
    with pytest.raises(UserError, match="expected sha256"):
        firmware.check_pinned_blobs(root, repo)


def test_the_committed_pin_list_parses() -> None:
    repo = Path(__file__).resolve().parents[1]
    assert isinstance(pins.read_firmware_pins(repo), list)
