# SPDX-License-Identifier: MIT
"""/var's recovery key sealed to the operator: what the installer's report carries instead of the
key itself, so that only the holder of one private key (`python3 -m builder recovery-key new`) can
read it, wherever the report is kept.

X25519 + HKDF-SHA256 + AES-256-GCM with an ephemeral key per seal (ECIES, as HPKE's base mode
does): the shared secret of the ephemeral key and the recipient's public key, through HKDF (salt:
the ephemeral public key then the recipient's, info: the scheme's name), is the AEAD key; CONTEXT is
the AEAD's associated data, so that a sealed key moved into another host's report does not open
(`report_context`: the host and its signed plan's SHA-256). Every field of a sealed document is
checked, and bounded, before anything is decrypted; no error carries key material or plaintext.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from typing import Any

from cryptography.exceptions import InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

SCHEME = "x25519-hkdf-sha256-aes256gcm"
FIELDS = ("scheme", "ephemeral", "nonce", "ciphertext")
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_PLAINTEXT = 512            # a recovery key is 71 characters
MAX_CIPHERTEXT = MAX_PLAINTEXT + TAG_BYTES
MAX_PEM_BYTES = 4096           # an X25519 public key's PEM is 113 bytes, its private key's 119
_PUBLIC_PEM = re.compile(r"-----BEGIN PUBLIC KEY-----\n[A-Za-z0-9+/=\n]{1,512}-----END PUBLIC KEY-----\n?")
RECIPIENT_HINT = ("one X25519 public key in PEM (-----BEGIN PUBLIC KEY----- ...), nothing else, as "
                  "`python3 -m builder recovery-key new --out DIR` writes it")


def report_context(host: str, plan_sha256: str) -> bytes:
    """The associated data of a report's sealed recovery key: the report's host and its plan's SHA-256."""
    return b"appliance-recovery-key\0" + host.encode("utf-8") + b"\0" + plan_sha256.encode("ascii")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _public_key(pem: str) -> X25519PublicKey | None:
    if not isinstance(pem, str) or len(pem) > MAX_PEM_BYTES or not _PUBLIC_PEM.fullmatch(pem.strip() + "\n"):
        return None
    try:
        key = serialization.load_pem_public_key(pem.encode("ascii"))
    except (ValueError, UnsupportedAlgorithm, UnicodeEncodeError):
        return None
    return key if isinstance(key, X25519PublicKey) else None


def check_recipient(pem: str) -> str | None:
    """None when PEM is one X25519 public key (SubjectPublicKeyInfo), else a hint."""
    return None if _public_key(pem) is not None else RECIPIENT_HINT


def _raw(key: X25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _aead_key(shared: bytes, ephemeral: bytes, recipient: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=ephemeral + recipient,
                info=SCHEME.encode("ascii")).derive(shared)


def seal(recipient_pem: str, plaintext: bytes, context: bytes) -> dict[str, str]:
    """PLAINTEXT sealed to the X25519 public key RECIPIENT_PEM, bound to CONTEXT (JSON-safe).
    ValueError when the recipient is not such a key or PLAINTEXT is longer than MAX_PLAINTEXT."""
    recipient = _public_key(recipient_pem)
    if recipient is None:
        raise ValueError(f"the recipient is not {RECIPIENT_HINT}")
    if len(plaintext) > MAX_PLAINTEXT:
        raise ValueError(f"more than {MAX_PLAINTEXT} bytes to seal")
    ephemeral = X25519PrivateKey.generate()
    ephemeral_raw = _raw(ephemeral.public_key())
    key = _aead_key(ephemeral.exchange(recipient), ephemeral_raw, _raw(recipient))
    nonce = os.urandom(NONCE_BYTES)
    return {"scheme": SCHEME, "ephemeral": _b64(ephemeral_raw), "nonce": _b64(nonce),
            "ciphertext": _b64(AESGCM(key).encrypt(nonce, plaintext, context))}


def _decoded(value: Any, what: str, low: int, high: int) -> bytes:
    """VALUE as strict base64 (canonical, padded) of LOW to HIGH bytes; ValueError naming WHAT."""
    if not isinstance(value, str) or len(value) > 4 * (high + 2) // 3 + 4:
        raise ValueError(f"{what} is not base64 of at most {high} bytes")
    try:
        data = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError(f"{what} is not base64") from None
    if _b64(data) != value:
        raise ValueError(f"{what} is not base64 in its one padded form")
    if not low <= len(data) <= high:
        raise ValueError(f"{what} is {len(data)} bytes, not {low}" + (f" to {high}" if high != low else ""))
    return data


def _fields(sealed: Any) -> tuple[bytes, bytes, bytes]:
    """(ephemeral, nonce, ciphertext) of SEALED, every field checked; ValueError otherwise."""
    if not isinstance(sealed, dict):
        raise ValueError("the sealed key is not a JSON object")
    if set(sealed) != set(FIELDS):
        wrong = sorted(set(sealed) ^ set(FIELDS), key=str)[0]
        raise ValueError(f"the sealed key has {'an unknown' if wrong in sealed else 'no'} field {str(wrong)[:40]!r}")
    if sealed["scheme"] != SCHEME:
        raise ValueError(f"the sealed key's scheme is not {SCHEME}")
    return (_decoded(sealed["ephemeral"], "ephemeral", KEY_BYTES, KEY_BYTES),
            _decoded(sealed["nonce"], "nonce", NONCE_BYTES, NONCE_BYTES),
            _decoded(sealed["ciphertext"], "ciphertext", TAG_BYTES, MAX_CIPHERTEXT))


def problem(sealed: Any) -> str:
    """What is wrong with SEALED's shape (scheme, fields, base64, lengths); "" when nothing is."""
    try:
        _fields(sealed)
    except ValueError as e:
        return str(e)
    return ""


def open_sealed(private_key_pem: bytes, sealed: Any, context: bytes) -> bytes:
    """The plaintext of SEALED, opened with the X25519 private key PRIVATE_KEY_PEM (PKCS8, no
    passphrase) and CONTEXT. ValueError in one line, never with key material, when a field is wrong,
    the key is another, the context is another or a byte was changed."""
    ephemeral_raw, nonce, ciphertext = _fields(sealed)
    try:
        private = serialization.load_pem_private_key(private_key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError("the private key is not a PEM private key without a passphrase") from None
    if not isinstance(private, X25519PrivateKey):
        raise ValueError("the private key is not an X25519 key")
    try:
        ephemeral = X25519PublicKey.from_public_bytes(ephemeral_raw)
        shared = private.exchange(ephemeral)
    except ValueError:  # a low-order point: no shared secret
        raise ValueError("the sealed key's ephemeral key is not a usable X25519 key") from None
    key = _aead_key(shared, ephemeral_raw, _raw(private.public_key()))
    try:
        return AESGCM(key).decrypt(nonce, ciphertext, context)
    except InvalidTag:
        raise ValueError("the sealed key does not open: another private key, another host or plan, "
                         "or a changed byte") from None


def new_keypair() -> tuple[bytes, bytes]:
    """(private key PEM (PKCS8, no passphrase), public key PEM (SubjectPublicKeyInfo)), X25519."""
    key = X25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public
