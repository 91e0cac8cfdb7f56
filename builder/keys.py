# SPDX-License-Identifier: MIT
"""Signing keys (Ed25519): NAME.key (PKCS#8 PEM, 0600) and NAME.pub in keys/ (gitignored): the
release key (release.key) and, beside it, the timestamp key (timestamp.key), a key of its own that
signs only the bundles' timestamps (appliance/signed/timestamp.py), with the counter of the sequence
numbers it signed (timestamp.key.sequence).

Beside them, two RSA-2048 keys with self-signed X.509 certificates (NAME.key, NAME.crt), since UEFI
and the TPM want RSA: secureboot (signs systemd-boot and every kernel image; its certificate goes
into the firmware's allowed-signatures list) and pcr-policy (signs the kernel images' expected PCR
11 values, the policy that unlocks the TPM-sealed /var). Two keys: the firmware trusting an image
and the TPM releasing /var's key are separate decisions.

The private key is created 0600 with O_EXCL and then hard-linked to its name, so it is never readable
by others and an existing key is never overwritten.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance.atomic import atomic_write
from appliance.errors import UserError
from appliance.safe_read import read_capped
from appliance.signed.release_manifest import ManifestError, key_id, load_public_key
from appliance.signed.timestamp import MAX_SEQUENCE

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "keys"
DEFAULT_NAME = "release"
TIMESTAMP_NAME = "timestamp"
SECURE_BOOT_NAME = "secureboot"
PCR_POLICY_NAME = "pcr-policy"
# (name, certificate common name) of the RSA keys, in the order `keys generate` makes them
BOOT_KEYS = ((SECURE_BOOT_NAME, "Appliance Secure Boot"), (PCR_POLICY_NAME, "Appliance PCR policy"))
CERTIFICATE_YEARS = 20  # firmware does not check expiry; a short one would only break rebuilding old versions


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


def generate_x509(directory: Path, name: str, common_name: str) -> tuple[Path, Path]:
    """Make an RSA-2048 key and a self-signed certificate for it; return (NAME.key, NAME.crt).
    Refuses to overwrite either."""
    private_path, cert_path = directory / f"{name}.key", directory / f"{name}.crt"
    for path in (private_path, cert_path):
        if path.exists() or path.is_symlink():
            raise UserError(f"{path}: a key already exists", hint="keep it, or move it away to make a new one")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365 * CERTIFICATE_YEARS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    private_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write_new(private_path, private_pem, 0o600)
    try:
        _write_new(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    except BaseException:
        private_path.unlink(missing_ok=True)
        raise
    return private_path, cert_path


def boot_keys(directory: Path, *, make: bool = False) -> tuple[tuple[Path, Path], tuple[Path, Path]]:
    """((secureboot.key, .crt), (pcr-policy.key, .crt)) in DIRECTORY; MAKE: generate what is missing
    (the demo). UserError (one line) when one is missing."""
    pairs = []
    for name, common_name in BOOT_KEYS:
        private, cert = directory / f"{name}.key", directory / f"{name}.crt"
        if make and not private.exists() and not cert.exists():
            generate_x509(directory, name, common_name)
        if not private.is_file() or not cert.is_file():
            where = "" if directory == DEFAULT_DIR else f" --directory {directory}"
            raise UserError(f"no {name} key and certificate in {directory}",
                            hint=f"make them with `python3 -m builder keys generate --boot`{where}")
        pairs.append((private.resolve(), cert.resolve()))
    return pairs[0], pairs[1]


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


# ----------------------------------------------------------------------------------- the timestamp key


def timestamp_key(path: Path, *, make: bool = False) -> Path:
    """The timestamp's private key at PATH; MAKE: generate the pair there when there is none (the
    demo, as for its release key). UserError (one line) when there is none."""
    if make and not path.exists() and not path.is_symlink():
        generate(path.parent, path.name.removesuffix(".key"))
    if not path.is_file():
        where = "" if path.parent == DEFAULT_DIR else f" (with --directory {path.parent})"
        raise UserError(f"no timestamp key at {path}", hint=f"make one with `python3 -m builder keys generate --timestamp`{where}")
    return path.resolve()


def sequence_path(private_key: Path) -> Path:
    return private_key.with_name(private_key.name + ".sequence")


def next_sequence(private_key: Path) -> int:
    """The sequence number of PRIVATE_KEY's next timestamp: one more than the last it signed,
    counted in KEY.sequence beside it. The counter is written (atomically) before the timestamp it
    numbers is: a failure skips a number, never hands one out twice; the key file's lock keeps two
    runs apart."""
    counter = sequence_path(private_key)
    fd = os.open(private_key, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        hint = f"{counter} holds the last sequence number {private_key.name} signed: put the highest one its timestamps carry there"
        raw = read_capped(counter, 64, what="a sequence counter", hint=hint)
        text = raw.decode("ascii", "replace").strip() if raw is not None else "0"
        if not text.isdigit() or len(text) > 10 or int(text) >= MAX_SEQUENCE:
            raise UserError(f"{counter}: {text[:20]!r} is not a sequence number below {MAX_SEQUENCE}", hint=hint)
        sequence = int(text) + 1
        atomic_write(counter, f"{sequence}\n".encode(), mode=0o600)
        return sequence
    finally:
        os.close(fd)  # and with it the lock
