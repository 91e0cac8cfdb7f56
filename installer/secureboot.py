# SPDX-License-Identifier: MIT
"""The appliance's Secure Boot keys: enrolled by the installer when the firmware is in setup mode.

The builder puts into the installer's file system, in KEYS_DIR, PK.auth, KEK.auth and db.auth (time-
based authenticated variable payloads, as sbvarsign writes them) and enroll.json (which certificate
each carries, and which one signs the appliance). Before the first write to the disk the installer
decides what the firmware needs (`prepare`): keys to enroll (setup mode), nothing (Secure Boot on and
db trusts the appliance), nothing but a loud summary line (Secure Boot off), or a refusal (Secure
Boot on and db does not trust the appliance: the installed disk could never boot). After the boot
entry is made, `enroll` writes db, KEK and PK (PK last: it ends setup mode) and reads back that the
firmware took them.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import os
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import appliance.efivars
from appliance import hashing
from appliance.errors import UserError
from appliance.safe_read import loads_bounded, read_capped

# the builder imports this (builder/installer_uki.py puts the keys there)
KEYS_DIR = Path("/usr/lib/appliance-installer/secureboot")
ENROLL_JSON = "enroll.json"
VARIABLES = ("db", "KEK", "PK")  # the order of writing: PK ends setup mode, so it goes last
GUIDS = {"db": appliance.efivars.IMAGE_SECURITY_GUID, "KEK": appliance.efivars.GLOBAL_GUID, "PK": appliance.efivars.GLOBAL_GUID}
# NON_VOLATILE | BOOTSERVICE_ACCESS | RUNTIME_ACCESS | TIME_BASED_AUTHENTICATED_WRITE_ACCESS
ATTRIBUTES = 0x27
MAX_AUTH_BYTES = 256 << 10  # db with four certificates and its signature is under 16 KiB
MAX_ENROLL_JSON_BYTES = 64 << 10
MAX_NAME_CHARS = 256  # the builder names the appliance's entries by their subject DN
PKCS7_GUID = "4aafd29d-68df-49ee-8aa9-347d375665a7"  # EFI_CERT_TYPE_PKCS7_GUID
# EFI_TIME, then WIN_CERTIFICATE_UEFI_GUID: dwLength, wRevision, wCertificateType, CertType
_AUTH = struct.Struct("<16sIHH16s")
_TIME = 16
_WIN_CERT_HEADER = 24
# linux/fs.h; efivarfs marks the variables it does not know as removable immutable
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x10

DAMAGED = ("the installer medium is damaged: make it again with python3 -m builder installer "
           "and write it with python3 -m builder flash")
README = 'see README "Secure Boot"'

Action = Literal["enroll", "trusted", "off", "refuse", "no-efi"]


@dataclass(frozen=True)
class Cert:
    name: str
    sha256: str  # of its DER


@dataclass(frozen=True)
class EnrollSet:
    """What the builder left in KEYS_DIR, checked: each payload carries the certificates enroll.json
    names for it, and db the appliance's."""

    keys_dir: Path
    appliance_sha256: str
    payloads: Mapping[str, bytes]  # "db", "KEK", "PK": the .auth bytes
    certs: Mapping[str, tuple[Cert, ...]]


@dataclass(frozen=True)
class Decision:
    action: Action
    db_trusts: bool = False  # db holds the appliance's certificate already (said when Secure Boot is off)


def auth_signature_lists(data: bytes) -> bytes:
    """The EFI_SIGNATURE_LIST chain after DATA's EFI_VARIABLE_AUTHENTICATION_2 header. ValueError
    when the header is not one (sbvarsign's: a PKCS#7 WIN_CERTIFICATE_UEFI_GUID)."""
    if len(data) < _AUTH.size:
        raise ValueError(f"{len(data)} bytes, shorter than an EFI_VARIABLE_AUTHENTICATION_2 header")
    _, length, revision, cert_type, cert_guid = _AUTH.unpack_from(data)
    if revision != 0x0200 or cert_type != 0x0EF1 or str(uuid.UUID(bytes_le=cert_guid)) != PKCS7_GUID:
        raise ValueError("not a time-based authenticated variable (no PKCS#7 WIN_CERTIFICATE_UEFI_GUID after its EFI_TIME)")
    if length < _WIN_CERT_HEADER or _TIME + length > len(data):
        raise ValueError(f"its WIN_CERTIFICATE's dwLength {length} does not fit its {len(data)} bytes")
    return data[_TIME + length:]


def _read(keys_dir: Path, name: str, max_bytes: int) -> bytes:
    data = read_capped(keys_dir / name, max_bytes, what=f"the Secure Boot keys' {name}", hint=DAMAGED)
    if data is None:
        raise UserError(f"{keys_dir / name}: missing: this installer has no Secure Boot keys to check or enroll", hint=DAMAGED)
    return data


def _certs(doc: dict[str, Any], var: str, where: Path) -> tuple[Cert, ...]:
    entries = doc[var]
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{where}: {var} is not a non-empty list of certificates", hint=DAMAGED)
    certs = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"name", "sha256"}:
            raise UserError(f"{where}: an entry of {var} is not {{\"name\", \"sha256\"}}", hint=DAMAGED)
        name, sha = entry["name"], entry["sha256"]
        # the names go onto the console in the summary
        if (not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS
                or any(ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f for c in name)):
            raise UserError(f"{where}: a name in {var} is not 1 to {MAX_NAME_CHARS} printable characters", hint=DAMAGED)
        if not isinstance(sha, str) or not hashing.SHA256.match(sha):
            raise UserError(f"{where}: {name}'s sha256 in {var} is not a lowercase hex SHA-256", hint=DAMAGED)
        certs.append(Cert(name, sha))
    return tuple(certs)


def load(keys_dir: Path = KEYS_DIR) -> EnrollSet:
    """The three payloads and enroll.json from KEYS_DIR, each read with its size capped, each
    payload's certificates checked against what enroll.json names. UserError (one line) when
    anything is missing or malformed: the medium is damaged."""
    if not keys_dir.is_dir():
        raise UserError(f"{keys_dir}: missing: this installer has no Secure Boot keys to check or enroll", hint=DAMAGED)
    where = keys_dir / ENROLL_JSON
    try:
        doc = loads_bounded(_read(keys_dir, ENROLL_JSON, MAX_ENROLL_JSON_BYTES))
    except ValueError as e:
        raise UserError(f"{where}: not JSON ({str(e).splitlines()[0]})", hint=DAMAGED) from None
    if not isinstance(doc, dict) or set(doc) != {"appliance_sha256", *VARIABLES}:
        raise UserError(f"{where}: not an object of exactly appliance_sha256, db, KEK and PK", hint=DAMAGED)
    appliance_sha256 = doc["appliance_sha256"]
    if not isinstance(appliance_sha256, str) or not hashing.SHA256.match(appliance_sha256):
        raise UserError(f"{where}: appliance_sha256 is not a lowercase hex SHA-256", hint=DAMAGED)
    payloads: dict[str, bytes] = {}
    certs: dict[str, tuple[Cert, ...]] = {}
    for var in VARIABLES:
        certs[var] = _certs(doc, var, where)
        payloads[var] = _read(keys_dir, f"{var}.auth", MAX_AUTH_BYTES)
        try:
            carried = appliance.efivars.signature_list_sha256s(auth_signature_lists(payloads[var]))
        except ValueError as e:
            raise UserError(f"{keys_dir / var}.auth: {e}", hint=DAMAGED) from None
        if sorted(carried) != sorted(c.sha256 for c in certs[var]):
            raise UserError(f"{keys_dir / var}.auth: its {len(carried)} certificates are not the {len(certs[var])} "
                            f"{where.name} names for {var}", hint=DAMAGED)
    if len(certs["PK"]) != 1:
        raise UserError(f"{keys_dir}/PK.auth: {len(certs['PK'])} certificates; a platform key is exactly one", hint=DAMAGED)
    if appliance_sha256 not in {c.sha256 for c in certs["db"]}:
        raise UserError(f"{keys_dir}/db.auth: does not carry the appliance's certificate ({appliance_sha256[:16]}...)", hint=DAMAGED)
    return EnrollSet(keys_dir, appliance_sha256, payloads, certs)


def decide(state: appliance.efivars.SecureBootState, db_hashes: list[str], enroll_set: EnrollSet) -> Decision:
    """What the firmware needs before anything is written. A firmware without a SetupMode or
    SecureBoot variable is taken as neither in setup mode nor enforcing."""
    if not state.efi:
        return Decision("no-efi")
    if state.setup_mode:
        return Decision("enroll")
    trusts = enroll_set.appliance_sha256 in db_hashes
    if state.secure_boot:
        return Decision("trusted" if trusts else "refuse")
    return Decision("off", db_trusts=trusts)


def refusal(enroll_set: EnrollSet) -> UserError:
    return UserError(
        "Secure Boot is on and the firmware is not in setup mode, but its db does not hold this appliance's certificate "
        f"(SHA-256 {enroll_set.appliance_sha256[:16]}...): the installed disk could never boot; nothing written",
        hint="enroll the appliance's Secure Boot keys (PK.auth, KEK.auth, db.auth as the build made them) through the BMC, "
             f"or put the firmware in Secure Boot setup mode (clear its keys) and run the installer again; {README}")


def _db(efivars: Path, when: str) -> list[str]:
    try:
        return appliance.efivars.db_sha256s(efivars)
    except ValueError as e:
        raise UserError(f"the firmware's db variable{when}: {e}",
                        hint=f"clear the firmware's Secure Boot keys (setup mode), or enroll the appliance's through the BMC; {README}",
                        ) from None


def prepare(efivars: Path = appliance.efivars.EFIVARS, keys_dir: Path = KEYS_DIR) -> tuple[Decision, EnrollSet | None]:
    """The decision for this machine's firmware (no EnrollSet without EFI); UserError when the install
    must stop before it writes anything: a refusal, or keys missing from the installer."""
    state = appliance.efivars.secure_boot_state(efivars)
    if not state.efi:
        return Decision("no-efi"), None
    enroll_set = load(keys_dir)
    db: list[str] = []  # in setup mode: replaced by the enrollment
    if not state.setup_mode and state.secure_boot:
        db = _db(efivars, "")
    elif not state.setup_mode:  # only for the summary's note: a malformed db does not stop an unsealed install
        with contextlib.suppress(ValueError):
            db = appliance.efivars.db_sha256s(efivars)
    decision = decide(state, db, enroll_set)
    if decision.action == "refuse":
        raise refusal(enroll_set)
    if decision.action == "enroll" and not os.access(efivars, os.W_OK):
        raise UserError(f"{efivars}: not writable (read-only efivarfs?): the Secure Boot keys could not be enrolled; nothing written",
                        hint=f"mount efivarfs read-write (the installer's own boot does), or enroll the keys through the BMC; {README}")
    return decision, enroll_set


def _clear_immutable(path: Path) -> None:
    """efivarfs makes a variable it finds at mount immutable unless it is on its short list (db and
    KEK can exist in setup mode); the flag is in memory only, set again at the next mount."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return  # none yet, or the write that follows says what is wrong
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        if flags[0] & FS_IMMUTABLE_FL:
            flags[0] &= ~FS_IMMUTABLE_FL
            fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
    except OSError:
        pass  # a file system without these flags: the write says the rest
    finally:
        os.close(fd)


def _write_var(path: Path, data: bytes) -> None:
    """DATA (attributes + payload) in ONE write(): efivarfs hands each write to SetVariable whole."""
    _clear_immutable(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        written = os.write(fd, data)
    finally:
        os.close(fd)
    if written != len(data):
        raise OSError(errno.EIO, f"{written} of {len(data)} bytes written")


def _not_enrolled(message: str, enroll_set: EnrollSet) -> UserError:
    return UserError(f"{message}: the appliance's Secure Boot keys are not enrolled (the disk is written)",
                     hint="enroll them (PK.auth, KEK.auth, db.auth as the build made them) through the BMC, or put the "
                          f"firmware in setup mode again and run the installer again; {README}")


def write_keys(enroll_set: EnrollSet, efivars: Path = appliance.efivars.EFIVARS) -> None:
    """db, KEK, then PK, each as its attributes and its .auth bytes; a write the firmware refuses
    (EINVAL, EACCES, EIO from SetVariable) is a UserError naming the variable."""
    done: list[str] = []
    for var in VARIABLES:
        try:
            _write_var(appliance.efivars.var_path(var, GUIDS[var], efivars), struct.pack("<I", ATTRIBUTES) + enroll_set.payloads[var])
        except OSError as e:
            wrote = f"; {', '.join(done)} written before it" if done else ""
            raise _not_enrolled(f"the firmware refused {var} ({e.strerror or e}){wrote}", enroll_set) from None
        done.append(var)


def verify_enrolled(enroll_set: EnrollSet, efivars: Path = appliance.efivars.EFIVARS) -> None:
    """After write_keys: the firmware has left setup mode (it took PK) and its db holds the appliance's
    certificate; else UserError."""
    state = appliance.efivars.secure_boot_state(efivars)
    if state.setup_mode is not False:
        raise _not_enrolled("db, KEK and PK written but the firmware is still in setup mode (it did not take PK)", enroll_set)
    if enroll_set.appliance_sha256 not in _db(efivars, " after enrolling"):
        raise _not_enrolled("db, KEK and PK written but the firmware's db does not hold the appliance's certificate", enroll_set)


def enroll(enroll_set: EnrollSet, efivars: Path = appliance.efivars.EFIVARS) -> None:
    write_keys(enroll_set, efivars)
    verify_enrolled(enroll_set, efivars)


def describe(enroll_set: EnrollSet) -> str:
    """ "PK, KEK, db: appliance + Microsoft UEFI CA 2011, UEFI CA 2023" """
    others = [c.name for c in enroll_set.certs["db"] if c.sha256 != enroll_set.appliance_sha256]
    if not others:
        return "PK, KEK, db: appliance only"
    prefix = "Microsoft "  # said once for all of Microsoft's CAs
    named = prefix + ", ".join(n.removeprefix(prefix) for n in others) if all(n.startswith(prefix) for n in others) else ", ".join(others)
    return f"PK, KEK, db: appliance + {named}"


OFF = 'secure boot OFF and the firmware is not in setup mode: this appliance boots unsealed (see README "Secure Boot")'


def summary_line(decision: Decision, enroll_set: EnrollSet | None) -> str:
    """The install summary's line for DECISION (after enroll() for "enroll")."""
    if decision.action == "enroll" and enroll_set is not None:
        return f"secure boot keys enrolled ({describe(enroll_set)}): the next boot enforces"
    if decision.action == "trusted":
        return "secure boot enforcing; the firmware already trusts this appliance's certificate"
    if decision.action == "off":
        return OFF + ("; its db trusts this appliance: turn Secure Boot on in the firmware setup" if decision.db_trusts else "")
    if decision.action == "refuse" and enroll_set is not None:
        return refusal(enroll_set).message
    return "no EFI variables: secure boot keys not enrolled"


def dry_run_line(decision: Decision, enroll_set: EnrollSet | None) -> str:
    if decision.action == "enroll" and enroll_set is not None:
        return f"dry run: would enroll the secure boot keys ({describe(enroll_set)}) after writing: the next boot enforces"
    return f"dry run: {summary_line(decision, enroll_set)}"
