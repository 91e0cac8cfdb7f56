"""Release bundles (builder/release.py) and the helpers the update tests share.

A fake build output stands in for mkosi's: small partition images, a minimal PE file with the
.cmdline (usrhash=) and .osrel sections of a unified kernel image, and a manifest signed with a
throwaway key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from applianctl import manifest
from applianctl import update as device_update
from builder import keys
from builder import release as rel
from builder.config import Config, load
from builder.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def make_pe(path: Path, sections: dict[str, bytes]) -> None:
    """A minimal PE file with SECTIONS, enough for update.pe_sections (a stand-in UKI)."""
    pe_offset = 0x40
    table_offset = pe_offset + 24
    data_offset = table_offset + 40 * len(sections)
    head = bytearray(b"MZ" + b"\0" * (pe_offset - 2))
    struct.pack_into("<I", head, 0x3C, pe_offset)
    coff = b"PE\0\0" + struct.pack("<HHIIIHH", 0x8664, len(sections), 0, 0, 0, 0, 0)
    table, body = b"", b""
    for name, data in sections.items():
        header = struct.pack("<IIIIIIHHI", len(data), 0, len(data), data_offset + len(body), 0, 0, 0, 0, 0)
        table += name.encode().ljust(8, b"\0") + header
        body += data
    path.write_bytes(bytes(head) + coff + table + body + b"\0" * 512)


def usrhash_for(version: str) -> str:
    return hashlib.sha256(f"roothash {version}".encode()).hexdigest()


def demo_config(version: str, min_version: str = "0", digest: str | None = None) -> Config:
    config = load(REPO / "appliance.toml", "demo")
    engine = dataclasses.replace(config.engine, digest=digest) if digest else config.engine
    appliance = dataclasses.replace(config.appliance, version=version, min_version=min_version)
    return dataclasses.replace(config, appliance=appliance, engine=engine)


def fake_build(out: Path, config: Config, key: Path, engine: bool = False, usr_bytes: int = 4096) -> Path:
    """What `python3 -m builder build` leaves in out/PROFILE, in small."""
    out.mkdir(parents=True, exist_ok=True)
    v = config.appliance.version
    (out / f"appliance_{v}.usr.raw").write_bytes(bytes([7]) * usr_bytes + v.encode())
    (out / f"appliance_{v}.usr-verity.raw").write_bytes(b"verity" * 100 + v.encode())
    make_pe(
        out / f"appliance_{v}.efi",
        {
            ".osrel": f'ID=debian\nIMAGE_ID="appliance"\nIMAGE_VERSION="{v}"\n'.encode(),
            ".cmdline": f"usrhash={usrhash_for(v)} rw console=ttyS0,115200".encode(),
        },
    )
    if engine:
        short = device_update.engine_short(config.engine.digest)
        (out / f"engine_{short}.raw").write_bytes(b"engine" * 1000)
        (out / f"engine_{short}.verity.raw").write_bytes(b"engine-verity" * 10)
    signer = manifest.key_id(manifest.load_private_key(key).public_key())
    body: dict[str, Any] = {
        "version": v,
        "min_version": config.appliance.min_version,
        "build_time": "2026-01-01T00:00:00Z",
        "profile": config.profile,
        "engine_image": {
            "reference": config.engine.reference,
            "digest": config.engine.digest,
            "store_label": "engine_" + device_update.engine_short(config.engine.digest),
            "store_roothash": hashlib.sha256(config.engine.digest.encode()).hexdigest(),
        },
        "model": {"id": config.model.id, "revision": config.model.revision},
        "kernel_version": "6.12.38+deb13-amd64",
        "files": [],
        "signer": signer,
    }
    (out / "manifest.json").write_bytes(manifest.dumps(body))
    (out / "manifest.json.sig").write_bytes(manifest.sign(body, key))
    return out


def make_signing(tmp_path: Path) -> tuple[Path, Path]:
    """(private key, trusted keys directory holding its public key)."""
    private, public = keys.generate(tmp_path / "keys")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    (trusted / keys.trusted_name(public)).write_bytes(public.read_bytes())
    return private, trusted


@pytest.fixture
def signing(tmp_path: Path) -> tuple[Path, Path]:
    return make_signing(tmp_path)


def bundle(tmp_path: Path, key: Path, version: str = "2.0.0", **kw: Any) -> Path:
    engine = kw.pop("engine", False)
    config = demo_config(version, kw.pop("min_version", "0"), kw.pop("digest", None))
    out = fake_build(tmp_path / f"out-{version}", config, key, engine=engine, usr_bytes=kw.pop("usr_bytes", 4096))
    target = tmp_path / f"bundle-{version}"
    rel.make_bundle(config, out, target, key, **kw)
    return target


# ----------------------------------------------------------------------------------- tests


def test_bundle_round_trip(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, trusted = signing
    b = bundle(tmp_path, key)
    index = device_update.verify_index((b / "bundle.json").read_bytes(), (b / "bundle.json.sig").read_bytes(), trusted)
    assert index["version"] == "2.0.0" and index["profile"] == "demo"
    assert index["usrhash"] == usrhash_for("2.0.0")
    names = sorted(p.name for p in b.iterdir())
    assert names == sorted([f["name"] for f in index["files"]] + ["bundle.json", "bundle.json.sig"])
    for f in index["files"]:
        data = (b / f["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha256"] and len(data) == f["size"]
    sums = dict(reversed(line.split("  ")) for line in (b / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {f["name"] for f in index["files"]} - {"SHA256SUMS"}
    assert index["manifest_sha256"] == hashlib.sha256((b / "manifest.json").read_bytes()).hexdigest()
    assert (b / "bundle.json").read_bytes() == manifest.canonical(json.loads((b / "bundle.json").read_text()))
    assert not list(tmp_path.glob(".bundle-*"))  # no temporary directory left behind


def test_bundle_replaces_atomically_and_keeps_old_on_failure(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, _ = signing
    b = bundle(tmp_path, key)
    before = (b / "bundle.json").read_bytes()
    config = demo_config("2.0.0")
    broken = tmp_path / "broken"
    broken.mkdir()
    with pytest.raises(UserError):
        rel.make_bundle(config, broken, b, key)
    assert (b / "bundle.json").read_bytes() == before


def test_versions_increase_strictly(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, _ = signing
    first = bundle(tmp_path, key, "2.0.0")
    with pytest.raises(UserError, match="not greater"):
        bundle(tmp_path, key, "2.0.0", previous_version="2.0.0")
    with pytest.raises(UserError, match="not greater"):
        bundle(tmp_path, key, "1.9", previous_bundle_or_engine_digests=first)
    bundle(tmp_path, key, "2.0.1", previous_bundle_or_engine_digests=first)


def test_engine_image_only_when_its_digest_is_new(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, trusted = signing
    first = bundle(tmp_path, key, "2.0.0", engine=True)
    idx1 = json.loads((first / "bundle.json").read_text())
    assert any(f["name"].startswith("engine_") for f in idx1["files"])
    # same engine as the previous bundle: no engine bytes
    second = bundle(tmp_path, key, "2.1.0", engine=True, previous_bundle_or_engine_digests=first)
    idx2 = device_update.verify_index((second / "bundle.json").read_bytes(), (second / "bundle.json.sig").read_bytes(), trusted)
    assert not any(f["name"].startswith("engine_") for f in idx2["files"])
    assert idx2["engine_digest"] == idx1["engine_digest"]
    # a new engine digest: shipped
    new_digest = "sha256:" + "ab" * 32
    third = bundle(tmp_path, key, "2.2.0", engine=True, digest=new_digest, previous_bundle_or_engine_digests=[idx1["engine_digest"]])
    assert (third / "engine_abababababab.raw").is_file()


def test_release_refuses_a_build_of_another_version(tmp_path: Path, signing: tuple[Path, Path]) -> None:
    key, _ = signing
    out = fake_build(tmp_path / "out", demo_config("2.0.0"), key)
    with pytest.raises(UserError, match="version"):
        rel.make_bundle(demo_config("3.0.0"), out, tmp_path / "b", key)


def test_cli_parser_wires_release(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    rel.add_parser(sub)
    args = parser.parse_args(["release", "--output", str(tmp_path / "b"), "--previous", "1.0.0"])
    assert args.func is rel.cmd_release and args.previous == "1.0.0"
