# SPDX-License-Identifier: MIT
"""A fake build output standing in for mkosi's, and release bundles made from it: small
partition images, a minimal PE file with the .cmdline (usrhash=) and .osrel sections of a unified
kernel image, and a manifest signed with a throwaway key."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import struct
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import Config, load
from appliance.signed import bundle_index, release_manifest
from builder import keys, release

REPO = Path(__file__).resolve().parents[1]


def make_pe(path: Path, sections: dict[str, bytes]) -> None:
    """A small PE32+ image with SECTIONS: enough for update.pe_sections (a stand-in UKI), and for
    sbsign to sign (an optional header with 16 data directories, aligned sections)."""
    pe_offset, file_align, section_align, opt_size = 0x80, 0x200, 0x1000, 112 + 16 * 8
    headers = -(-(pe_offset + 24 + opt_size + 40 * len(sections)) // file_align) * file_align
    dos = bytearray(b"MZ" + b"\0" * (pe_offset - 2))
    struct.pack_into("<I", dos, 0x3C, pe_offset)
    coff = b"PE\0\0" + struct.pack("<HHIIIHH", 0x8664, len(sections), 0, 0, 0, opt_size, 0x22)
    table, body, rva = b"", b"", section_align
    for name, data in sections.items():
        raw_size = -(-len(data) // file_align) * file_align
        table += name.encode().ljust(8, b"\0") + struct.pack("<IIIIIIHHI", len(data), rva, raw_size, headers + len(body),
                                                             0, 0, 0, 0, 0x40000040)
        body += data.ljust(raw_size, b"\0")
        rva += -(-len(data) // section_align) * section_align
    optional = struct.pack("<HBBIIIIIQIIHHHHHHIIIIHHQQQQII", 0x20B, 0, 0, 0, 0, 0, 0, section_align, 0x10000000,
                           section_align, file_align, 0, 0, 0, 0, 0, 0, 0, rva, headers, 0, 10, 0, 0, 0, 0, 0, 0, 16)
    path.write_bytes((bytes(dos) + coff + optional + b"\0" * (16 * 8) + table).ljust(headers, b"\0") + body)


def sign_pe(path: Path, key: Path, cert: Path, *extra_certs: Path) -> None:
    """Sign PATH in place for Secure Boot with sbsign (KEY, CERT; EXTRA_CERTS ride in the signature)."""
    command = ["sbsign", "--key", str(key), "--cert", str(cert), "--output", str(path), str(path)]
    for extra in extra_certs:
        command[1:1] = ["--addcert", str(extra)]
    subprocess.run(command, check=True, capture_output=True)


def signature_partition(root_hash: str, size: int = 16384) -> bytes:
    """A usr-verity-sig partition image as systemd-repart writes it: its JSON, then zeros."""
    doc = {"rootHash": root_hash, "certificateFingerprint": "ab" * 32, "signature": "MIIB" + "A" * 60}
    return json.dumps(doc, separators=(",", ":")).encode().ljust(size, b"\0")


def package_manifest(version: str) -> dict[str, Any]:
    """mkosi's package manifest (ManifestFormat=json) of image VERSION, in small."""
    packages = [("systemd", "257.7-1"), ("linux-image-6.12.38+deb13-amd64", "6.12.38-1"), ("python3", "3.13.5-1")]
    return {
        "manifest_version": 1,
        "config": {"name": "appliance", "distribution": "debian", "architecture": "x86-64", "version": version, "release": "trixie"},
        "packages": [{"type": "deb", "name": n, "version": v, "architecture": "amd64"} for n, v in packages],
    }


def usrhash_for(version: str) -> str:
    return hashlib.sha256(f"roothash {version}".encode()).hexdigest()


def demo_config(version: str, min_version: str = "0", digest: str | None = None) -> Config:
    config = load(REPO / "appliance.toml", "demo")
    engine = dataclasses.replace(config.engine, digest=digest) if digest else config.engine
    appliance = dataclasses.replace(config.appliance, version=version, min_version=min_version)
    return dataclasses.replace(config, appliance=appliance, engine=engine)


VERITY_SALT = b"\x5a" * 32
VERITY_UUID = "00000000-0000-4000-8000-000000000001"


def verity_format(data: Path, tree: Path, block: int = 4096) -> str:
    """What `veritysetup format --salt=5a.. --uuid=VERITY_UUID DATA TREE` writes, byte for byte,
    computed here (no program runs; test_engine_checks.py compares it with the real tool's): a
    superblock in the first hash block, then the levels of the SHA-256 hash tree, the root's first.
    The root hash."""
    salt, per_block = VERITY_SALT, block // 32
    digests = []
    with open(data, "rb") as f:
        while chunk := f.read(block):
            digests.append(hashlib.sha256(salt + chunk.ljust(block, b"\0")).digest())
    data_blocks = len(digests)
    levels: list[bytes] = []
    while len(digests) > 1:
        level = b"".join(b"".join(digests[i:i + per_block]).ljust(block, b"\0") for i in range(0, len(digests), per_block))
        levels.append(level)
        digests = [hashlib.sha256(salt + level[i:i + block]).digest() for i in range(0, len(level), block)]
    superblock = struct.pack("<8sII16s32sIIQH6s256s168s", b"verity", 1, 1, uuid.UUID(VERITY_UUID).bytes, b"sha256",
                             block, block, data_blocks, len(salt), b"", salt, b"")
    tree.write_bytes(superblock.ljust(block, b"\0") + b"".join(reversed(levels)))
    return digests[0].hex()


def fake_engine_store(data: Path, tree: Path, digest: str) -> str:
    """The engine store partition of DIGEST as mkosi splits it out (zero blocks at its end, which
    the bundle drops) and its real dm-verity tree; the root hash. The same for every build of one
    digest, as the builder's engine store cache makes it (builder/engine_store.py)."""
    data.write_bytes((b"engine " + digest.encode()).ljust(4096, b".") * 2 + bytes(8192))
    return verity_format(data, tree)


@functools.cache
def store_roothash_for(digest: str) -> str:
    """The root hash fake_build pins for an engine store of DIGEST (a running manifest's)."""
    with tempfile.TemporaryDirectory() as work:
        return fake_engine_store(Path(work) / "engine.raw", Path(work) / "engine.verity", digest)


def fake_build(out: Path, config: Config, key: Path, usr_bytes: int = 4096) -> Path:
    """What `python3 -m builder build` leaves in out/PROFILE, in small."""
    out.mkdir(parents=True, exist_ok=True)
    v = config.appliance.version
    (out / f"appliance_{v}.usr.raw").write_bytes(bytes([7]) * usr_bytes + v.encode())
    (out / f"appliance_{v}.usr-verity.raw").write_bytes(b"verity" * 100 + v.encode())
    (out / f"appliance_{v}.usr-verity-sig.raw").write_bytes(signature_partition(usrhash_for(v)))
    (out / bundle_index.mkosi_manifest_name(v)).write_text(json.dumps(package_manifest(v), indent=2))
    make_pe(
        out / f"appliance_{v}.efi",
        {
            ".osrel": f'ID=debian\nIMAGE_ID="appliance"\nIMAGE_VERSION="{v}"\n'.encode(),
            ".cmdline": f"usrhash={usrhash_for(v)} rw console=ttyS0,115200".encode(),
        },
    )
    # the whole disk image (sparse: a few blocks of data in 8 MiB), as `builder installer` and
    # `release --install-image` take it
    with open(out / f"appliance_{v}.raw", "wb") as disk:
        disk.write(b"GPT" + v.encode())
        disk.seek(4 << 20)
        disk.write(b"usr" * 1000)
        disk.truncate(8 << 20)
    # the engine store partition, as mkosi splits it out (zero blocks at its end, which the bundle
    # drops), and its real dm-verity hash tree: the updater checks the root hash the manifest pins
    engine_raw = out / f"appliance_{v}.engine.raw"
    store_roothash = fake_engine_store(engine_raw, out / f"appliance_{v}.engine-verity.raw", config.engine.digest)
    signer = release_manifest.key_id(release_manifest.load_private_key(key).public_key())
    body: dict[str, Any] = {
        "version": v,
        "min_version": config.appliance.min_version,
        "build_time": "2026-01-01T00:00:00Z",
        "profile": config.profile,
        "engine_image": {
            "reference": config.engine.reference,
            "digest": config.engine.digest,
            "store_label": "engine_" + bundle_index.engine_short(config.engine.digest),
            "store_roothash": store_roothash,
        },
        "model": {"id": config.model.id, "revision": config.model.revision},
        "kernel_version": "6.12.38+deb13-amd64",
        "files": [],
        "signer": signer,
    }
    (out / "manifest.json").write_bytes(release_manifest.dumps(body))
    (out / "manifest.json.sig").write_bytes(release_manifest.sign(body, key))
    return out


def make_signing(tmp_path: Path) -> tuple[Path, Path]:
    """(private key, trusted keys directory holding its public key); beside them the timestamp key
    (keys/timestamp.key) and the timestamp keys directory holding its public key, where the updater
    finds it beside the trusted keys (paths.timestamp_keys_dir)."""
    private, public = keys.generate(tmp_path / "keys")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / keys.trusted_name(public)).write_bytes(public.read_bytes())
    _, timestamp_public = keys.generate(tmp_path / "keys", keys.TIMESTAMP_NAME)
    timestamp_trusted = paths.timestamp_keys_dir(trusted)
    timestamp_trusted.mkdir()
    (timestamp_trusted / keys.trusted_name(timestamp_public)).write_bytes(timestamp_public.read_bytes())
    return private, trusted


def bundle(tmp_path: Path, key: Path, version: str = "2.0.0", **kw: Any) -> Path:
    engine = kw.pop("engine", False)
    config = demo_config(version, kw.pop("min_version", "0"), kw.pop("digest", None))
    uki_signer = kw.pop("uki_signer", None)  # (key, certificate): the kernel image signed for Secure Boot
    out = fake_build(tmp_path / f"out-{version}", config, key, usr_bytes=kw.pop("usr_bytes", 4096))
    if uki_signer is not None:
        sign_pe(out / f"appliance_{version}.efi", *uki_signer)
    if not engine:  # released for a target that has this engine already
        kw.setdefault("previous_bundle_or_engine_digests", [config.engine.digest])
    target = tmp_path / f"bundle-{version}"
    release.make_bundle(config, out, target, key, **kw)
    return target
