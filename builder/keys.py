"""Release signing keys (Ed25519): NAME.key (PKCS#8 PEM, 0600) and NAME.pub in keys/ (gitignored).

The private key is created 0600 with O_EXCL and then hard-linked to its name, so it is never readable
by others and an existing key is never overwritten.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from appliance.errors import UserError
from appliance.manifest import ManifestError, key_id, load_public_key

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "keys"
DEFAULT_NAME = "release"


def generate(directory: Path | None = None, name: str = DEFAULT_NAME) -> tuple[Path, Path]:
    """Make a new key pair; return (private, public). Refuses to overwrite a key."""
    directory = DEFAULT_DIR if directory is None else directory
    private_path = directory / f"{name}.key"
    public_path = directory / f"{name}.pub"
    for path in (private_path, public_path):
        if path.exists() or path.is_symlink():
            raise UserError(
                f"{path}: a key already exists",
                hint="keep it, or move it away to make a new one (rotate: trust the new .pub before dropping the old)",
            )
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_new(private_path, private_pem, 0o600)
    try:
        _write_new(public_path, public_pem, 0o644)
    except BaseException:
        private_path.unlink(missing_ok=True)
        raise
    return private_path, public_path


def _write_new(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise UserError(f"{path}: a key already exists", hint="move it away first to make a new one") from None
    finally:
        tmp.unlink(missing_ok=True)


def public_key_id(public_path: Path) -> str:
    """The key id (16 hex digits) of a public key file."""
    try:
        return key_id(load_public_key(public_path))
    except ManifestError as e:
        raise UserError(e.message, e.hint) from None


def trusted_name(public_path: Path) -> str:
    """The public key's file name in the image's trusted-keys directory: KEYID.pub."""
    return f"{public_key_id(public_path)}.pub"
