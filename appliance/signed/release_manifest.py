# SPDX-License-Identifier: MIT
"""The signed release manifest: what a release contains and who vouched for it.

Canonical JSON (sorted keys, no whitespace, UTF-8, no floats or NaN, no duplicate keys), and the
signed bytes must be exactly `canonical(manifest)`: one byte string per manifest, so nothing
outside the signature can change its meaning. `manifest.json.sig`: the 64-byte Ed25519 signature
in padded base64 and one newline. Trusted keys are `*.pub` (PEM) files in the trusted-keys
directory; keys rotate by adding the new one in one release and removing the old in a later one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from appliance import schema
from appliance.errors import UserError
from appliance.hashing import DIGEST, SHA256
from appliance.patterns import MODEL_ID as _MODEL_ID
from appliance.patterns import REVISION as _REVISION
from appliance.patterns import VERSION, VERSION_FORM
from appliance.safe_read import loads_bounded

KINDS = ("overlay", "tuning", "firmware", "diff")
PROFILES = ("production", "demo")
# Where the image carries each kind of file on the device (under paths.ENGINE_FILES_DIR for
# overlays and tuning tables; firmware goes to the kernel's firmware update directory). Diffs
# document the overlays and are not installed.
DEVICE_SUBDIRS = {"overlay": "overlays", "tuning": "tuning"}
FIRMWARE_UPDATES_DIR = "/usr/lib/firmware/updates/amdgpu"

SIGNATURE_BYTES = 64
MAX_MANIFEST_BYTES = 1 << 20

_TIME = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z\Z")
KEY_ID = re.compile(r"^[0-9a-f]{16}\Z")
_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*\Z")
_TEXT = re.compile(r"^[\x21-\x7e]([\x20-\x7e]*[\x21-\x7e])?\Z")
_SEGMENT = re.compile(r"^[A-Za-z0-9_+-][A-Za-z0-9._+-]*\Z")


class ManifestError(UserError):
    """The manifest or its signature is not acceptable."""


# ----------------------------------------------------------------------------- canonical JSON


def canonical(value: Any) -> bytes:
    """The one byte form of VALUE: sorted keys, no whitespace, UTF-8; floats are refused."""
    _check_json(value, "manifest")
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return text.encode("utf-8")
    except (UnicodeEncodeError, ValueError) as e:
        raise ManifestError(f"manifest cannot be written as canonical JSON: {e}", hint="use only valid text") from None


def _check_json(value: Any, where: str) -> None:
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        raise ManifestError(
            f"{where}: floats are not allowed in the manifest", hint="write the number as a string or an integer"
        )
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_json(item, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ManifestError(f"{where}: key {key!r} is not a string", hint="manifest keys are strings")
            _check_json(item, f"{where}.{key}")
        return
    raise ManifestError(
        f"{where}: {type(value).__name__} is not a JSON value", hint="use strings, integers, lists and objects"
    )


def parse_canonical(data: bytes) -> Any:
    """Parse DATA, refusing anything that is not exactly the canonical form of what it holds."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"manifest is {len(data)} bytes, more than {MAX_MANIFEST_BYTES}", hint="the file is damaged"
        )
    try:
        text = data.decode("utf-8")
        # Depth and number sizes bounded: refused in one line, never a RecursionError or a slow int.
        value = loads_bounded(text, object_pairs_hook=_no_duplicates, parse_float=_no_float, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ManifestError("manifest is not UTF-8", hint="the file is damaged") from None
    except ValueError as e:
        raise ManifestError(f"manifest is not valid JSON ({e})", hint="the file is damaged") from None
    if canonical(value) != data:
        raise ManifestError("manifest is not in canonical form", hint="the file was changed after it was written")
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ManifestError(f"manifest repeats the key {key!r}", hint="the file is damaged")
        out[key] = value
    return out


def _no_float(text: str) -> Any:
    raise ManifestError(f"manifest holds the float {text}", hint="floats are not allowed in the manifest")


def _no_constant(text: str) -> Any:
    raise ManifestError(f"manifest holds {text}", hint="NaN and Infinity are not allowed in the manifest")


# ----------------------------------------------------------------------------- schema


def version_tuple(version: str) -> tuple[int, ...]:
    """1.2 -> (1, 2, 0, 0): versions compare numerically, missing parts are 0. Anything but a
    VERSION (e.g. a number too long for int()) is refused before any conversion."""
    if not isinstance(version, str) or not VERSION.fullmatch(version):
        raise ManifestError(
            f"version {schema.shown(version, 40)}: expected {VERSION_FORM}, e.g. 1.4.0",
            hint="the version was not written by this builder",
        )
    parts = tuple(int(p) for p in version.split("."))
    return parts + (0,) * (4 - len(parts))


def _fail(field: str, value: Any, expected: str) -> ManifestError:
    return ManifestError(
        f"manifest: {field} = {schema.shown(value)}: expected {expected}", hint="the manifest was not written by this builder"
    )


class _Loader(schema.Loader):
    """The manifest's wording of the loader's faults."""

    def invalid(self, key: str, value: Any, expected: str) -> ManifestError:
        return _fail(key, value, expected)

    def unknown(self, key: str, value: Any, known: list[str]) -> ManifestError:
        return ManifestError(f"manifest: unknown field {key!r}", hint="known fields here: " + ", ".join(sorted(known)))

    def missing(self, key: str, tp: Any) -> ManifestError:
        return ManifestError(f"manifest: missing field {key!r}", hint="the manifest is incomplete")


def _string(regex: re.Pattern[str], expected: str) -> dict[str, Any]:
    return schema.check(lambda v: None if regex.match(v) else expected)


def _one_of(*choices: str) -> dict[str, Any]:
    return schema.check(lambda v: None if v in choices else "one of " + ", ".join(choices))


def is_repo_path(value: str) -> bool:
    parts = value.split("/")
    return all(_SEGMENT.match(p) and p not in (".", "..") for p in parts)


def is_abs_path(value: str) -> bool:
    if not value.startswith("/") or value == "/":
        return False
    return is_repo_path(value[1:])


@dataclass(frozen=True)
class File:
    """A file the release carries: where it comes from in the project, where it goes, its hash."""

    kind: str = field(metadata=_one_of(*KINDS))
    path: str = field(
        metadata=schema.check(lambda v: None if is_repo_path(v) else "a path relative to the project root, without '..'")
    )
    target: str = field(
        metadata=schema.check(lambda v: None if v == "" or is_abs_path(v) else "an absolute path without '..' (or \"\" for a diff)")
    )
    sha256: str = field(metadata=_string(SHA256, "64 lower-case hex digits"))


@dataclass(frozen=True)
class EngineImage:
    reference: str = field(metadata=_string(_REF, "an image reference such as vllm/vllm-openai-rocm@sha256:..."))
    digest: str = field(metadata=_string(DIGEST, "'sha256:' and 64 lower-case hex digits"))
    # the read-only image store on its own partition (builder/engine_store.py)
    store_label: str = field(metadata=_string(re.compile(r"^engine_[0-9a-f]{12}\Z"), "engine_ and 12 hex digits"))
    store_roothash: str = field(metadata=_string(SHA256, "the store's dm-verity root hash: 64 lower-case hex digits"))


@dataclass(frozen=True)
class ModelRef:
    id: str = field(metadata=_string(_MODEL_ID, "a model id such as org/name"))
    revision: str = field(metadata=_string(_REVISION, "40 lower-case hex digits"))
    # SHA-256 of the weights manifest the image carries (appliance/signed/weights_manifest.py); absent: none
    weights_sha256: str = field(default="", metadata=schema.check(lambda v: None if SHA256.match(v) else "64 lower-case hex digits"))


@dataclass(frozen=True)
class Manifest:
    """The signed release manifest, as the schema loader reads it."""

    version: str = field(metadata=_string(VERSION, f"{VERSION_FORM}, e.g. 1.4.0"))
    min_version: str = field(metadata=_string(VERSION, f"{VERSION_FORM}, e.g. 1.0.0"))
    build_time: str = field(metadata=_string(_TIME, "a UTC time such as 2026-08-04T12:00:00Z"))
    profile: str = field(metadata=_one_of(*PROFILES))
    engine_image: EngineImage
    model: ModelRef
    kernel_version: str = field(metadata=_string(_TEXT, "a kernel release such as 6.12.38+deb13-amd64"))
    files: tuple[File, ...]
    signer: str = field(metadata=_string(KEY_ID, "a key id: 16 lower-case hex digits"))


def _check_files(files: tuple[File, ...]) -> None:
    """Rules across the file list: each file once, unique device names and targets, firmware in place."""
    seen: set[tuple[str, str]] = set()
    device_names: set[tuple[str, str]] = set()
    targets: set[str] = set()
    for i, entry in enumerate(files):
        where = f"files[{i}]"
        kind, path, target = entry.kind, entry.path, entry.target
        if (kind, path) in seen:
            raise ManifestError(f"manifest: {where}: {kind} {path} is listed twice", hint="list each file once")
        seen.add((kind, path))
        if kind == "diff":
            continue
        if target == "":
            raise _fail(f"{where}.target", target, "an absolute path")
        name = PurePosixPath(path).name
        if (kind, name) in device_names:
            raise ManifestError(
                f"manifest: {where}: a second {kind} named {name}", hint="file names must be unique per kind"
            )
        device_names.add((kind, name))
        if kind == "firmware" and target != f"{FIRMWARE_UPDATES_DIR}/{name}":
            raise _fail(f"{where}.target", target, f"{FIRMWARE_UPDATES_DIR}/{name}")
        if target in targets:
            raise ManifestError(
                f"manifest: {where}: target {target} is used twice", hint="each file needs its own target"
            )
        targets.add(target)


def load(manifest: Any) -> Manifest:
    """MANIFEST (parsed JSON) as the typed model, checked by the schema loader (unknown fields refused)."""
    model: Manifest = _Loader("manifest").load(Manifest, manifest)
    _check_files(model.files)
    if version_tuple(model.min_version) > version_tuple(model.version):
        raise ManifestError(
            f"manifest: min_version {model.min_version} is newer than version {model.version}",
            hint="min_version is the oldest version this release may be installed over",
        )
    return model


def validate(manifest: Any) -> dict[str, Any]:
    """Check MANIFEST against the schema (unknown fields refused); return it."""
    load(manifest)
    assert isinstance(manifest, dict)
    return manifest


def dumps(manifest: Mapping[str, Any]) -> bytes:
    """The bytes of manifest.json: the schema checked, in canonical form."""
    validate(dict(manifest))
    return canonical(manifest)


def loads(data: bytes) -> dict[str, Any]:
    """Parse and check manifest bytes (canonical form and schema); the parsed JSON (the typed
    model: load(parse_canonical(DATA))). This does NOT check a signature."""
    return validate(parse_canonical(data))


def device_path(entry: File, engine_files_dir: Path, firmware_dir: Path | None = None) -> Path | None:
    """Where the device carries ENTRY; None for a diff (not installed)."""
    kind = entry.kind
    name = PurePosixPath(entry.path).name
    if kind in DEVICE_SUBDIRS:
        return engine_files_dir / DEVICE_SUBDIRS[kind] / name
    if kind == "firmware":
        return (firmware_dir or Path(FIRMWARE_UPDATES_DIR)) / name
    return None


# ----------------------------------------------------------------------------- keys


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey) -> str:
    """First 16 hex digits of the SHA-256 of the raw public key."""
    return hashlib.sha256(raw_public(key)).hexdigest()[:16]


def load_public_key(path: Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except OSError as e:
        raise ManifestError(
            f"{path}: cannot read public key ({e.strerror})", hint="check the trusted keys directory"
        ) from None
    except ValueError:
        raise ManifestError(
            f"{path}: not a PEM public key", hint="trusted keys are PEM Ed25519 public keys (*.pub)"
        ) from None
    if not isinstance(key, Ed25519PublicKey):
        raise ManifestError(f"{path}: not an Ed25519 public key", hint="release keys are Ed25519")
    return key


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as e:
        raise ManifestError(
            f"{path}: cannot read private key ({e.strerror})", hint="create one with python3 -m builder keys generate"
        ) from None
    if mode & 0o077:
        raise ManifestError(
            f"{path}: private key is readable by others (mode {mode & 0o777:o})", hint=f"chmod 600 {path}"
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ManifestError(
            f"{path}: not an unencrypted PEM private key", hint="release keys are PEM PKCS#8 Ed25519 keys"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ManifestError(f"{path}: not an Ed25519 private key", hint="release keys are Ed25519")
    return key


def trusted_keys(directory: Path) -> dict[str, Ed25519PublicKey]:
    """The keys in DIRECTORY/*.pub, by key id."""
    try:
        files = sorted(p for p in directory.iterdir() if p.name.endswith(".pub"))
    except OSError as e:
        raise ManifestError(
            f"{directory}: cannot list trusted keys ({e.strerror})", hint="the image is damaged"
        ) from None
    keys: dict[str, Ed25519PublicKey] = {}
    for path in files:
        key = load_public_key(path)
        keys[key_id(key)] = key
    return keys


# ----------------------------------------------------------------------------- signatures


def encode_signature(signature: bytes) -> bytes:
    return base64.b64encode(signature) + b"\n"


def decode_signature(data: bytes) -> bytes:
    """The 64 signature bytes of a signature file; anything but the exact written form is refused."""
    text = data[:-1] if data.endswith(b"\n") else data
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ManifestError("signature is malformed (not base64)", hint="the signature file is damaged") from None
    if len(raw) != SIGNATURE_BYTES:
        raise ManifestError(
            f"signature is truncated or malformed ({len(raw)} bytes, expected {SIGNATURE_BYTES})",
            hint="the signature file is damaged",
        )
    if base64.b64encode(raw) != text:
        raise ManifestError("signature is malformed (not in canonical base64)", hint="the signature file is damaged")
    return raw


def sign(manifest: Mapping[str, Any], private_key_path: Path) -> bytes:
    """The detached signature file for MANIFEST (whose `signer` must be this key's id)."""
    data = dumps(manifest)
    key = load_private_key(private_key_path)
    kid = key_id(key.public_key())
    if manifest["signer"] != kid:
        raise ManifestError(
            f"manifest names signer {manifest['signer']} but {private_key_path} is key {kid}",
            hint="set the manifest's signer to the id of the key that signs it",
        )
    return encode_signature(key.sign(data))


def signer_of(data: bytes, signature: bytes, keys: Mapping[str, Ed25519PublicKey]) -> str | None:
    """The id of the trusted key whose signature over DATA this is; None when none of them made it."""
    for kid, key in keys.items():
        try:
            key.verify(signature, data)
        except InvalidSignature:
            continue
        return kid
    return None


def verify(manifest_bytes: bytes, sig_bytes: bytes, trusted_keys_dir: Path) -> Manifest:
    """Check the signature against the trusted keys, then the manifest; return the typed manifest."""
    signature = decode_signature(sig_bytes)
    keys = trusted_keys(trusted_keys_dir)
    if not keys:
        raise ManifestError(f"{trusted_keys_dir}: no trusted keys (*.pub)", hint="the image is damaged")
    signed_by = signer_of(manifest_bytes, signature, keys)
    if signed_by is None:
        claimed = claimed_signer(manifest_bytes)
        if claimed is not None and claimed not in keys:
            raise ManifestError(
                f"manifest is signed by key {claimed}, which is not trusted",
                hint=f"trusted keys: {', '.join(sorted(keys))}; add the new key's .pub in an earlier release first",
            )
        raise ManifestError(
            "manifest signature does not match any trusted key", hint="the manifest or its signature was changed"
        )
    manifest = load(parse_canonical(manifest_bytes))
    if manifest.signer != signed_by:
        raise ManifestError(
            f"manifest names signer {manifest.signer} but was signed by key {signed_by}",
            hint="the manifest is inconsistent",
        )
    return manifest


def claimed_signer(manifest_bytes: bytes) -> str | None:
    try:
        value = json.loads(manifest_bytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    signer = value.get("signer") if isinstance(value, dict) else None
    return signer if isinstance(signer, str) and KEY_ID.match(signer) else None
