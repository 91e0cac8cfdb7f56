# SPDX-License-Identifier: MIT
"""The release bundle's format, shared by the builder (which writes it) and the updater (which
checks it): the signed index bundle.json, the payload file names, and the partition names and
types the payloads are written to.

bundle.json is canonical JSON (appliance.signed.release_manifest's rules) signed like the manifest (detached
Ed25519, bundle.json.sig). Nothing in a bundle is trusted before that one signature is checked.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import schema
from appliance.errors import Refused, UserError
from appliance.hashing import DIGEST, SHA256
from appliance.patterns import VERSION, VERSION_FORM
from appliance.safe_read import loads_bounded, read_capped
from appliance.signed import release_manifest
from appliance.signed.sums import SUMS_FILE, parse_sums

BUNDLE_INDEX = "bundle.json"
BUNDLE_SIG = "bundle.json.sig"
BUNDLE_FORMAT = 1
# byte caps for the two small files, read before anything is trusted
MAX_INDEX_BYTES = 1 << 16
MAX_SIG_BYTES = 256

# GPT partition types of the A/B /usr slots (the Discoverable Partitions Specification, x86-64)
USR_TYPE = "8484680C-9521-48C6-9C11-B0720656F69E"
USR_VERITY_TYPE = "77FF5F63-E7B6-4633-ACF4-1565B864C0E6"
USR_VERITY_SIG_TYPE = "E7BB33FB-06CF-4E81-8273-E543B413E2E2"  # the root hash's signature (image/initrd reads it)
# the engine slots' own types (docs/disk-layout.md): appliance-engine and appliance-engine-verity
ENGINE_TYPE = "344E5F5F-F1EA-455D-9D71-C82214F17CF1"
ENGINE_VERITY_TYPE = "E8587844-5270-4B6E-B69C-E9E0C63B1823"
EMPTY_LABEL = "_empty"  # a free slot (systemd-sysupdate's convention)
IMAGE_ID = "appliance"
# systemd-boot's default entry (loader.conf): the main profile of the newest kernel image with tries
# left. Each kernel image also carries the factory-reset boot menu entries (UKI profiles, ids
# "FILE.efi@PROFILE"), and systemd-boot 257 sorts a profile before its image's main entry: without
# this pattern, which no profile's id matches, a version's plain boot would be a factory reset.
DEFAULT_ENTRY = f"{IMAGE_ID}_*.efi"
# the partition images a bundle ships without their trailing zeros (the slot is zeroed first)
TRIMMED_ROLES = ("usr", "usr-verity", "usr-verity-sig", "engine", "engine-verity")
# the /usr slot's partitions an update writes, in the order it writes them (sysupdate.d)
USR_ROLES = ("usr", "usr-verity", "usr-verity-sig")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*\Z")

NOT_OURS = "the bundle was not written by python3 -m builder release"


# ----------------------------------------------------------------------------------- names


def payload_names(version: str, engine_digest: str, with_engine: bool, with_install: bool = False) -> dict[str, str]:
    """The files a bundle of VERSION holds, by role (mkosi's names for the OS parts)."""
    names = {
        "usr": f"appliance_{version}.usr.raw",
        "usr-verity": f"appliance_{version}.usr-verity.raw",
        "usr-verity-sig": f"appliance_{version}.usr-verity-sig.raw",
        "uki": f"appliance_{version}.efi",
        "manifest": "manifest.json",
        "manifest-sig": "manifest.json.sig",
        "sums": "SHA256SUMS",
    }
    if with_engine:
        short = engine_short(engine_digest)
        names["engine"] = f"engine_{short}.raw"
        names["engine-verity"] = f"engine_{short}.verity.raw"
    if with_install:
        names.update(install_names(version))
    return names


def install_names(version: str) -> dict[str, str]:
    """The whole disk image for installing over HTTPS (installer/, never fetched by the updater):
    zstd-compressed (bmaptool reads it as it is), and its block map, whose per-range SHA-256
    bmaptool checks while writing."""
    return {"install-image": f"appliance_{version}.raw.zst", "install-bmap": f"appliance_{version}.raw.bmap"}


def engine_short(digest: str) -> str:
    """engine_<first 12 hex digits of the digest>: the engine partition image's name."""
    return digest.removeprefix("sha256:")[:12]


def partuuids_from_usrhash(usrhash: str) -> tuple[str, str]:
    """systemd's convention (repart, gpt-auto): the /usr partition's UUID is the first 128 bits of
    the dm-verity root hash, the hash partition's UUID the last 128 bits."""
    if not SHA256.match(usrhash):
        raise ValueError(f"not a SHA-256 root hash: {usrhash!r}")

    def fmt(h: str) -> str:
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    return fmt(usrhash[:32]), fmt(usrhash[32:])


def source_names(index: BundleIndex) -> dict[str, str]:
    """Staged name -> the name systemd-sysupdate matches (sysupdate.d/*.transfer MatchPattern=):
    the partition UUIDs ride in the name (@u), derived from the root hash as systemd expects."""
    version = index.version
    usr_uuid, verity_uuid = partuuids_from_usrhash(index.usrhash)
    names = payload_names(version, index.engine_digest, False)
    return {
        names["usr"]: f"appliance_{version}_{usr_uuid}.usr.raw",
        names["usr-verity"]: f"appliance_{version}_{verity_uuid}.usr-verity.raw",
        names["usr-verity-sig"]: names["usr-verity-sig"],
        names["uki"]: f"appliance_{version}.efi",
    }


# ----------------------------------------------------------------------------------- bundle index


def _bad(field: str, value: Any, expected: str) -> Refused:
    return Refused(f"bundle.json: {field} = {schema.shown(value, 60)}: expected {expected}", hint=NOT_OURS)


class _Loader(schema.Loader):
    """bundle.json's wording of the loader's faults: every one refuses the bundle (exit 1)."""

    def invalid(self, key: str, value: Any, expected: str) -> Refused:
        return _bad(key or "bundle", value, expected)

    def unknown(self, key: str, value: Any, known: list[str]) -> Refused:
        return Refused(f"bundle.json: unknown field {key!r}", hint="the bundle was written by another version of the builder")

    def missing(self, key: str, tp: Any) -> Refused:
        return Refused(f"bundle.json: missing field {key!r}", hint="the bundle was written by another version of the builder")


def _string(regex: re.Pattern[str], expected: str) -> dict[str, Any]:
    return schema.check(lambda v: None if regex.match(v) else expected)


_SIZE = schema.check(lambda v: None if v >= 0 else "a size in bytes")


@dataclass(frozen=True)
class BundleFile:
    name: str = field(metadata=_string(_NAME, "a plain file name"))
    sha256: str = field(metadata=_string(SHA256, "64 hex digits"))
    size: int = field(metadata=_SIZE)


@dataclass(frozen=True)
class BundleIndex:
    """bundle.json, as the schema loader reads it."""

    format: int = field(metadata=schema.check(lambda v: None if v == BUNDLE_FORMAT else f"{BUNDLE_FORMAT}"))
    version: str = field(metadata=_string(VERSION, VERSION_FORM))
    min_version: str = field(metadata=_string(VERSION, VERSION_FORM))
    profile: str = field(
        metadata=schema.check(lambda v: None if v in release_manifest.PROFILES else "one of " + ", ".join(release_manifest.PROFILES))
    )
    engine_digest: str = field(metadata=_string(DIGEST, "sha256: and 64 hex digits"))
    usrhash: str = field(metadata=_string(SHA256, "64 hex digits"))
    files: tuple[BundleFile, ...]
    # the partition images are shipped without their trailing zeros; these are their full sizes
    partition_sizes: Mapping[str, int] = field(metadata=schema.each(lambda v: None if v >= 0 else "a size in bytes"))
    manifest_sha256: str = field(metadata=_string(SHA256, "64 hex digits"))
    signer: str = field(metadata=_string(release_manifest.KEY_ID, "a key id of 16 hex digits"))


def load_index(index: Any) -> BundleIndex:
    """A parsed bundle.json as the typed model: the schema loader, then the rules across fields."""
    model: BundleIndex = _Loader("bundle.json").load(BundleIndex, index)
    if release_manifest.version_tuple(model.min_version) > release_manifest.version_tuple(model.version):
        raise _bad("min_version", model.min_version, f"not newer than version {model.version}")
    if not model.files:
        raise _bad("files", [], "a list of files")
    names = [f.name for f in model.files]
    with_engine = f"engine_{engine_short(model.engine_digest)}.raw" in names
    with_install = install_names(model.version)["install-image"] in names
    wanted = set(payload_names(model.version, model.engine_digest, with_engine, with_install).values())
    if len(names) != len(set(names)) or set(names) != wanted:
        odd = sorted(set(names) ^ wanted)
        raise Refused(
            f"bundle.json: the file list is not that of a release bundle (differs in {', '.join(odd) or 'duplicates'})",
            hint=NOT_OURS,
        )
    all_names = payload_names(model.version, model.engine_digest, with_engine)
    trimmed = {all_names[r] for r in TRIMMED_ROLES if r in all_names}
    if set(model.partition_sizes) != trimmed:
        raise _bad("partition_sizes", dict(model.partition_sizes), f"the full sizes of {' and '.join(sorted(trimmed))}")
    by_name = {f.name: f.size for f in model.files}
    for name, size in model.partition_sizes.items():
        if size < by_name[name]:
            raise _bad(f"partition_sizes.{name}", size, f"a size of at least the file's {by_name[name]} bytes")
    return model


def validate_index(index: Any) -> dict[str, Any]:
    """Check the schema of a parsed bundle.json (unknown fields refused); return it."""
    load_index(index)
    assert isinstance(index, dict)
    return index


def verify_index(data: bytes, sig: bytes, keys_dir: Path) -> BundleIndex:
    """Check bundle.json's signature against the trusted keys FIRST, then its form and schema."""
    try:
        signature = release_manifest.decode_signature(sig)
    except release_manifest.ManifestError as e:
        raise Refused(f"bundle.json.sig: {e.message}", hint="download the bundle again; if it persists, it was tampered with") from None
    keys = release_manifest.trusted_keys(keys_dir)
    if not keys:
        raise UserError(f"{keys_dir}: no trusted keys (*.pub)", hint="the image is damaged")
    signed_by = release_manifest.signer_of(data, signature, keys)
    if signed_by is None:
        claimed = release_manifest.claimed_signer(data)
        if claimed is not None and claimed not in keys:
            raise Refused(
                f"bundle is signed by key {claimed}, which this version does not trust",
                hint=f"trusted keys: {', '.join(sorted(keys))}; a new key must be shipped in a release signed by an old one first",
            )
        raise Refused("bundle.json's signature does not match any trusted key", hint="the bundle or its signature was changed")
    try:
        index = load_index(release_manifest.parse_canonical(data))
    except release_manifest.ManifestError as e:
        raise Refused(f"bundle.json: {e.message}", hint=e.hint) from None
    if index.signer != signed_by:
        raise Refused(f"bundle.json names signer {index.signer} but was signed by {signed_by}", hint="the bundle is inconsistent")
    return index


# ----------------------------------------------------------------------------------- kernel image


def pe_sections(path: Path) -> dict[str, bytes]:
    """The sections of a PE file (a unified kernel image) by name; only the small ones are read."""
    with open(path, "rb") as f:
        head = f.read(4096)
        if head[:2] != b"MZ":
            raise ValueError("not a PE file")
        pe = struct.unpack_from("<I", head, 0x3C)[0]
        f.seek(pe)
        coff = f.read(24)
        if coff[:4] != b"PE\0\0":
            raise ValueError("not a PE file")
        count, opt_size = struct.unpack_from("<H", coff, 6)[0], struct.unpack_from("<H", coff, 20)[0]
        f.seek(pe + 24 + opt_size)
        table = f.read(40 * count)
        out = {}
        for i in range(count):
            raw = table[40 * i : 40 * (i + 1)]
            name = raw[:8].rstrip(b"\0").decode("ascii", "replace")
            vsize, _, rsize, rptr = struct.unpack_from("<IIII", raw, 8)
            length = min(vsize, rsize) if vsize else rsize
            # the first of each: a kernel image with boot menu profiles (UKI profiles, e.g. the
            # factory reset entries) repeats .cmdline and .osrel per profile; the first is the base's
            if name in (".cmdline", ".osrel", ".uname") and length < 65536 and name not in out:
                f.seek(rptr)
                out[name] = f.read(length)
        return out


def uki_facts(path: Path) -> dict[str, str | None]:
    """usrhash= from the kernel image's command line and IMAGE_VERSION from its os-release."""
    try:
        sections = pe_sections(path)
    except (OSError, ValueError, struct.error) as e:
        raise Refused(f"{path.name}: not a unified kernel image ({e})", hint="the bundle is damaged") from None
    cmdline = sections.get(".cmdline", b"").decode("utf-8", "replace").rstrip("\0").split()
    usrhash = next((a.split("=", 1)[1] for a in cmdline if a.startswith("usrhash=")), None)
    osrel = sections.get(".osrel", b"").decode("utf-8", "replace")
    m = re.search(r"^IMAGE_VERSION=\"?([^\"\n]*)\"?$", osrel, re.M)
    return {"usrhash": usrhash, "image_version": m.group(1) if m else None}


# ----------------------------------------------------------------------------------- /usr's signature

MAX_SIGNATURE_PARTITION = 64 << 10  # systemd-repart's JSON is about 1 KiB, the partition 16 KiB


def signed_root_hash(path: Path) -> str:
    """The root hash a usr-verity-sig partition image signs (systemd-repart's JSON: rootHash,
    certificateFingerprint, signature, then zeros). ValueError (one line) when it is not one."""
    with open(path, "rb") as f:
        data = f.read(MAX_SIGNATURE_PARTITION + 1)
    text = data.rstrip(b"\0")
    if len(text) > MAX_SIGNATURE_PARTITION:
        raise ValueError(f"more than {MAX_SIGNATURE_PARTITION} bytes before its zeros: not a root hash signature")
    try:
        doc = json.loads(text)
    except ValueError:
        raise ValueError("not the JSON of a root hash signature") from None
    root_hash, signature = (doc.get("rootHash"), doc.get("signature")) if isinstance(doc, dict) else (None, None)
    if not isinstance(root_hash, str) or not SHA256.match(root_hash) or not isinstance(signature, str) or not signature:
        raise ValueError("a root hash signature needs rootHash (64 hex digits) and signature")
    return root_hash


# ----------------------------------------------------------------------------------- package manifest

MAX_PACKAGES_BYTES = 16 << 20  # a Debian image's ~600 packages are about 100 KB
PACKAGES_FORMAT = 1  # mkosi's manifest_version ("bumped when incompatible changes are made")


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    architecture: str


def mkosi_manifest_name(version: str) -> str:
    """Where mkosi writes the image's package manifest (ManifestFormat=json): OUTPUT.manifest."""
    return f"appliance_{version}.manifest"


def packages_name(version: str) -> str:
    """The package manifest in a bundle: informational (the operator's, a scanner's), never fetched
    by the updater. It is not in bundle.json's file list, which every updater so far refuses to see
    grow (load_index); SHA256SUMS, listed there with its size and SHA-256, binds it."""
    return f"appliance_{version}.packages.json"


def load_packages(data: bytes, version: str | None = None) -> tuple[Package, ...]:
    """The packages of mkosi's JSON manifest (manifest_version 1: config {name, version, ...},
    packages [{type, name, version, architecture}]), of image VERSION when given (mkosi's own output;
    a release may relabel a build, bench/upgrade.py); ValueError (one line) when DATA is not one."""
    if len(data) > MAX_PACKAGES_BYTES:
        raise ValueError(f"more than {MAX_PACKAGES_BYTES} bytes: not a package manifest")
    try:
        doc = loads_bounded(data)
    except ValueError:
        raise ValueError("not JSON") from None
    if not isinstance(doc, dict) or type(doc.get("manifest_version")) is not int or doc["manifest_version"] != PACKAGES_FORMAT:
        raise ValueError(f"not mkosi's package manifest (manifest_version {PACKAGES_FORMAT} expected)")
    config, entries = doc.get("config"), doc.get("packages")
    if not isinstance(config, dict) or config.get("name") != IMAGE_ID:
        raise ValueError(f"config.name is not {IMAGE_ID!r}: not this image's package manifest")
    if version is not None and config.get("version") != version:
        raise ValueError(f"config.version = {schema.shown(config.get('version'), 40)}: the manifest of another build than {version}")
    if not isinstance(entries, list) or not entries:
        raise ValueError("packages is not a list of packages")
    out = []
    for i, entry in enumerate(entries):
        fields = [entry.get(k) for k in ("name", "version", "architecture")] if isinstance(entry, dict) else []
        if len(fields) != 3 or not all(isinstance(v, str) and v for v in fields):
            raise ValueError(f"packages[{i}] = {schema.shown(entry, 60)}: expected name, version and architecture")
        out.append(Package(entry["name"], entry["version"], entry["architecture"]))
    return tuple(out)


def read_packages(directory: Path, index: BundleIndex) -> tuple[Package, ...]:
    """The package manifest of the bundle in DIRECTORY, proven as the build host reads it: SHA256SUMS
    against the signed INDEX (size, SHA-256), the manifest against SHA256SUMS, then its form. Refused
    (one line) on any fault. The updater never calls this."""
    hint = "the bundle was changed after it was signed: release it again"

    def read(name: str, cap: int) -> bytes:
        try:
            data = read_capped(directory / name, cap, what=name, hint=hint)
        except UserError as e:
            raise Refused(e.message, hint=hint) from None
        if data is None:
            raise Refused(f"{directory / name}: no such file", hint=hint)
        return data

    listed = next((f for f in index.files if f.name == SUMS_FILE), None)
    if listed is None:
        raise Refused(f"bundle.json lists no {SUMS_FILE}", hint=NOT_OURS)
    sums_data = read(SUMS_FILE, MAX_INDEX_BYTES)
    if len(sums_data) != listed.size or hashlib.sha256(sums_data).hexdigest() != listed.sha256:
        raise Refused(f"{SUMS_FILE}: not the one the signed bundle index names (size or SHA-256 differs)", hint=hint)
    name = packages_name(index.version)
    try:
        entry = parse_sums(sums_data).get(name)
    except UserError as e:
        raise Refused(e.message, hint=hint) from None
    if entry is None:
        raise Refused(f"{SUMS_FILE} names no package manifest {name}", hint="a bundle released before package manifests has none")
    data = read(name, MAX_PACKAGES_BYTES)
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise Refused(f"{name}: its SHA-256 is not the one {SUMS_FILE} (signed through bundle.json) names", hint=hint)
    try:
        return load_packages(data)
    except ValueError as e:
        raise Refused(f"{name}: {e}", hint=hint) from None
