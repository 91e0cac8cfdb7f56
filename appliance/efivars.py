# SPDX-License-Identifier: MIT
"""EFI variables as Linux shows them in efivarfs (a file NAME-GUID: 4 bytes of little-endian
attributes, then the data), and the Secure Boot facts read from them: whether Secure Boot is on,
whether the firmware is in setup mode, and which X.509 certificates its signature database (db)
holds. Shared by the installer (enrolling the appliance's keys) and the device's status.
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import UserError
from appliance.safe_read import read_capped

EFIVARS = Path("/sys/firmware/efi/efivars")
GLOBAL_GUID = "8be4df61-93ca-11d2-aa0d-00e098032b8c"  # EFI_GLOBAL_VARIABLE: PK, KEK, SecureBoot, SetupMode
IMAGE_SECURITY_GUID = "d719b2cb-3d3a-4596-a3bc-dad00e67656f"  # EFI_IMAGE_SECURITY_DATABASE: db, dbx
CERT_X509_GUID = "a5c059a1-94e4-4aa7-87b5-ab155c2bf072"  # EFI_CERT_X509_GUID
# the whole variable store of a firmware is typically 64-256 KiB
MAX_VAR_BYTES = 1 << 20
_ESL_HEADER = struct.Struct("<16sIII")  # SignatureType, SignatureListSize, SignatureHeaderSize, SignatureSize
_OWNER = 16  # each signature starts with its owner's GUID

HINT = "the firmware's EFI variables are not as efivarfs shows them; check the firmware in its setup"


def var_path(name: str, guid: str, efivars: Path = EFIVARS) -> Path:
    return efivars / f"{name}-{guid}"


def read_var(name: str, guid: str, efivars: Path = EFIVARS) -> bytes | None:
    """The data of variable NAME (without its attributes), None when there is none. UserError when
    the file is not a regular one, larger than MAX_VAR_BYTES or shorter than its attributes."""
    path = var_path(name, guid, efivars)
    raw = read_capped(path, MAX_VAR_BYTES, what=f"the EFI variable {name}", hint=HINT)
    if raw is None:
        return None
    if len(raw) < 4:
        raise UserError(f"{path}: {len(raw)} bytes, shorter than the 4 bytes of its attributes", hint=HINT)
    return raw[4:]


def read_string(name: str, guid: str, efivars: Path = EFIVARS) -> str | None:
    """Variable NAME holding a string as systemd-boot sets them (UTF-16LE, up to its first NUL),
    None when there is none. UserError when read_var refuses it or its data is not UTF-16LE."""
    data = read_var(name, guid, efivars)
    if data is None:
        return None
    try:
        text = data.decode("utf-16-le")
    except UnicodeDecodeError as e:
        raise UserError(f"{var_path(name, guid, efivars)}: not UTF-16 text ({e.reason} at byte {e.start + 4})",
                        hint=HINT) from None
    return text.split("\0", 1)[0]


@dataclass(frozen=True)
class SecureBootState:
    efi: bool  # the efivars directory exists: booted through UEFI
    secure_boot: bool | None  # None: the firmware has no SecureBoot variable
    setup_mode: bool | None  # None: no SetupMode variable (firmware before UEFI 2.3.1, or no Secure Boot at all)


def _flag(name: str, efivars: Path) -> bool | None:
    data = read_var(name, GLOBAL_GUID, efivars)
    return None if not data else data[0] == 1  # a UINT8, 1 or 0


def secure_boot_state(efivars: Path = EFIVARS) -> SecureBootState:
    if not efivars.is_dir():
        return SecureBootState(efi=False, secure_boot=None, setup_mode=None)
    return SecureBootState(efi=True, secure_boot=_flag("SecureBoot", efivars), setup_mode=_flag("SetupMode", efivars))


def signature_list_sha256s(data: bytes) -> list[str]:
    """The SHA-256 (hex) of each X.509 certificate in DATA (signature_list_certificates)."""
    return [hashlib.sha256(der).hexdigest() for der in signature_list_certificates(data)]


def signature_list_certificates(data: bytes) -> list[bytes]:
    """Each X.509 certificate (DER) in DATA, a chain of EFI_SIGNATURE_LISTs (the value of db, KEK
    or PK); lists of other types (hashes of binaries) are skipped. ValueError (one line) on a
    malformed chain: each list's sizes are checked against what is left before use."""
    found: list[bytes] = []
    view = memoryview(data)
    offset = 0
    while offset < len(view):
        left = len(view) - offset
        if left < _ESL_HEADER.size:
            raise ValueError(f"signature list at byte {offset}: {left} bytes, shorter than its {_ESL_HEADER.size}-byte header")
        raw_type, list_size, header_size, sig_size = _ESL_HEADER.unpack_from(view, offset)
        if list_size > left:
            raise ValueError(f"signature list at byte {offset}: SignatureListSize {list_size} runs past the end ({left} bytes left)")
        body = list_size - _ESL_HEADER.size - header_size
        if body < 0:  # also a SignatureListSize of 0: the walk always advances
            raise ValueError(f"signature list at byte {offset}: SignatureListSize {list_size} is shorter than its "
                             f"headers ({_ESL_HEADER.size} + {header_size})")
        if sig_size <= _OWNER:
            raise ValueError(f"signature list at byte {offset}: SignatureSize {sig_size} leaves no data after the "
                             f"{_OWNER}-byte owner GUID")
        if body % sig_size:
            raise ValueError(f"signature list at byte {offset}: {body} bytes of signatures are not a whole number of "
                             f"SignatureSize {sig_size}")
        if str(uuid.UUID(bytes_le=bytes(raw_type))) == CERT_X509_GUID:
            start = offset + _ESL_HEADER.size + header_size
            for sig in range(start, start + body, sig_size):
                found.append(bytes(view[sig + _OWNER:sig + sig_size]))
        offset += list_size
    return found


def db_sha256s(efivars: Path = EFIVARS) -> list[str]:
    """The SHA-256s of the X.509 certificates in the firmware's db; [] when there is no db.
    ValueError when db is malformed."""
    data = read_var("db", IMAGE_SECURITY_GUID, efivars)
    return [] if data is None else signature_list_sha256s(data)


def db_certificates(efivars: Path = EFIVARS) -> list[bytes]:
    """The X.509 certificates (DER) in the firmware's db; [] when there is none. ValueError when
    db is malformed."""
    data = read_var("db", IMAGE_SECURITY_GUID, efivars)
    return [] if data is None else signature_list_certificates(data)


def enforcing(state: SecureBootState) -> bool:
    """The firmware checks every image it starts: Secure Boot on, not in setup mode."""
    return bool(state.secure_boot) and state.setup_mode is not True
