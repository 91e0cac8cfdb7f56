# SPDX-License-Identifier: MIT
"""The firmware's TCG event log in the crypto-agile format (TCG PC Client Platform Firmware
Profile, section 10), as Linux shows it in /sys/kernel/security/tpm0/binary_bios_measurements,
little-endian:

- the first event in the SHA1 format (TCG_PCClientPCREvent): PCR 0, EV_NO_ACTION, a zero digest,
  and as its data the Spec ID event ("Spec ID Event03": the digest sizes of the log's banks)
- then TCG_PCR_EVENT2 events: PCR, type, a TPML_DIGEST_VALUES (one digest for each bank of the
  Spec ID event, each of its size), the event data

`parse` refuses what is not that (one `Refused` line: truncated, trailing, sizes or counts out of
bounds); `replay` recomputes a PCR of the sha256 bank; `secure_boot` reads PCR 7's events: the
SecureBoot variable, PK, KEK, db and dbx (EV_EFI_VARIABLE_DRIVER_CONFIG, a UEFI_VARIABLE_DATA) and
the certificates that allowed each boot image (EV_EFI_VARIABLE_AUTHORITY, an EFI_SIGNATURE_DATA).
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from dataclasses import dataclass

from appliance import efivars
from appliance.errors import Refused

HINT = "the event log is not the firmware's TCG crypto-agile log as Linux shows it: ask the device again"

MAX_EVENT_LOG_BYTES = 1 << 20
MAX_EVENTS = 4096  # a server's firmware logs a few hundred
MAX_ALGORITHMS = 8  # banks in the Spec ID event
MAX_VENDOR_INFO = 255  # a UINT8 size
MAX_NAME_CHARS = 1024  # a UEFI variable's name, in UTF-16 characters
PCRS = 24

# TPM_ALG_ID and the digest size the Spec ID event must give each known one
SHA1 = 0x0004
SHA256 = 0x000B
KNOWN_DIGEST_SIZES = {0x0004: 20, 0x000B: 32, 0x000C: 48, 0x000D: 64, 0x0012: 32}
MAX_DIGEST = 64

# event types (TCG PC Client Platform Firmware Profile, 10.4.1)
EV_POST_CODE = 0x00000001
EV_NO_ACTION = 0x00000003
EV_SEPARATOR = 0x00000004
EV_ACTION = 0x00000005
EV_S_CRTM_VERSION = 0x00000008
EV_EFI_VARIABLE_DRIVER_CONFIG = 0x80000001
EV_EFI_VARIABLE_BOOT = 0x80000002
EV_EFI_BOOT_SERVICES_APPLICATION = 0x80000003
EV_EFI_BOOT_SERVICES_DRIVER = 0x80000004
EV_EFI_GPT_EVENT = 0x80000006
EV_EFI_ACTION = 0x80000007
EV_EFI_PLATFORM_FIRMWARE_BLOB = 0x80000008
EV_EFI_HANDOFF_TABLES = 0x80000009
EV_EFI_VARIABLE_AUTHORITY = 0x800000E0
EVENT_NAMES = {
    EV_POST_CODE: "EV_POST_CODE", EV_NO_ACTION: "EV_NO_ACTION", EV_SEPARATOR: "EV_SEPARATOR", EV_ACTION: "EV_ACTION",
    EV_S_CRTM_VERSION: "EV_S_CRTM_VERSION", EV_EFI_VARIABLE_DRIVER_CONFIG: "EV_EFI_VARIABLE_DRIVER_CONFIG",
    EV_EFI_VARIABLE_BOOT: "EV_EFI_VARIABLE_BOOT", EV_EFI_BOOT_SERVICES_APPLICATION: "EV_EFI_BOOT_SERVICES_APPLICATION",
    EV_EFI_BOOT_SERVICES_DRIVER: "EV_EFI_BOOT_SERVICES_DRIVER", EV_EFI_GPT_EVENT: "EV_EFI_GPT_EVENT",
    EV_EFI_ACTION: "EV_EFI_ACTION", EV_EFI_PLATFORM_FIRMWARE_BLOB: "EV_EFI_PLATFORM_FIRMWARE_BLOB",
    EV_EFI_HANDOFF_TABLES: "EV_EFI_HANDOFF_TABLES", EV_EFI_VARIABLE_AUTHORITY: "EV_EFI_VARIABLE_AUTHORITY",
}

SPEC_ID_SIGNATURE = b"Spec ID Event03\0"
STARTUP_LOCALITY_SIGNATURE = b"StartupLocality\0"
_SPEC_ID_HEAD = struct.Struct("<16sIBBBBI")  # signature, platformClass, minor, major, errata, uintnSize, numberOfAlgorithms
_VARIABLE_HEAD = struct.Struct("<16sQQ")  # VariableName (a GUID), UnicodeNameLength, VariableDataLength

GLOBAL_GUID = uuid.UUID(efivars.GLOBAL_GUID)
IMAGE_SECURITY_GUID = uuid.UUID(efivars.IMAGE_SECURITY_GUID)
OWNER_BYTES = 16


@dataclass(frozen=True)
class Event:
    number: int  # its place in the log, from 0 (the Spec ID event)
    pcr: int
    type: int
    digests: tuple[tuple[int, bytes], ...]  # (TPM_ALG_ID, digest), in the log's order
    data: bytes

    def digest(self, alg: int) -> bytes | None:
        return next((d for a, d in self.digests if a == alg), None)

    def describe(self) -> str:
        return f"event {self.number} (PCR {self.pcr}, {EVENT_NAMES.get(self.type, f'type 0x{self.type:08x}')})"


class _Reader:
    """Little-endian fields off DATA, every read checked against what is left."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.offset = 0

    def left(self) -> int:
        return len(self.data) - self.offset

    def fail(self, message: str) -> Refused:
        return Refused(f"the event log: {message} (at byte {self.offset})", hint=HINT)

    def take(self, size: int, field: str) -> bytes:
        if size > self.left():
            raise self.fail(f"{field}: {size} bytes, only {self.left()} left (truncated)")
        chunk = self.data[self.offset:self.offset + size]
        self.offset += size
        return chunk

    def u32(self, field: str) -> int:
        value: int = struct.unpack("<I", self.take(4, field))[0]
        return value

    def u16(self, field: str) -> int:
        value: int = struct.unpack("<H", self.take(2, field))[0]
        return value


def _spec_id(data: bytes) -> dict[int, int]:
    """The banks of the Spec ID event's data: {TPM_ALG_ID: digest size}, in the log's order."""
    if len(data) < _SPEC_ID_HEAD.size or not data.startswith(SPEC_ID_SIGNATURE):
        raise Refused("the event log: its first event is not a Spec ID Event03 (not a crypto-agile log)", hint=HINT)
    _, _, _, major, _, uintn, count = _SPEC_ID_HEAD.unpack_from(data)
    if major != 2 or uintn not in (1, 2):
        raise Refused(f"the event log: Spec ID event of version {major} with uintnSize {uintn}, not a TPM 2.0 log",
                      hint=HINT)
    if not 1 <= count <= MAX_ALGORITHMS:
        raise Refused(f"the event log: the Spec ID event lists {count} banks, not 1 to {MAX_ALGORITHMS}", hint=HINT)
    r = _Reader(data)
    r.offset = _SPEC_ID_HEAD.size
    banks: dict[int, int] = {}
    for _ in range(count):
        alg, size = r.u16("algorithmId"), r.u16("digestSize")
        expected = KNOWN_DIGEST_SIZES.get(alg)
        if alg in banks or (expected is not None and size != expected) or not 1 <= size <= MAX_DIGEST:
            raise Refused(f"the event log: the Spec ID event gives bank 0x{alg:04x} a digest size of {size}"
                          + (" a second time" if alg in banks else f", expected {expected or f'at most {MAX_DIGEST}'}"),
                          hint=HINT)
        banks[alg] = size
    vendor = r.take(1, "vendorInfoSize")[0]
    r.take(vendor, "vendorInfo")
    if r.left():
        raise Refused(f"the event log: {r.left()} trailing bytes in the Spec ID event", hint=HINT)
    if SHA256 not in banks:
        raise Refused("the event log has no sha256 bank", hint=HINT)
    return banks


def parse(data: bytes) -> tuple[Event, ...]:
    """Every event of DATA, the Spec ID event first; Refused (one line) when DATA is not a whole
    crypto-agile log within MAX_EVENT_LOG_BYTES and MAX_EVENTS."""
    if len(data) > MAX_EVENT_LOG_BYTES:
        raise Refused(f"the event log: {len(data)} bytes, more than {MAX_EVENT_LOG_BYTES}", hint=HINT)
    r = _Reader(data)
    pcr, kind = r.u32("pcrIndex"), r.u32("eventType")
    first_digest = r.take(20, "the SHA1 digest")
    size = r.u32("eventDataSize")
    spec = r.take(size, "the Spec ID event")
    if (pcr, kind) != (0, EV_NO_ACTION) or any(first_digest):
        raise Refused("the event log: its first event is not EV_NO_ACTION in PCR 0 with a zero digest", hint=HINT)
    banks = _spec_id(spec)
    events = [Event(0, 0, EV_NO_ACTION, ((SHA1, first_digest),), spec)]
    while r.left():
        if len(events) >= MAX_EVENTS:
            raise r.fail(f"more than {MAX_EVENTS} events")
        number = len(events)
        pcr, kind = r.u32(f"event {number} pcrIndex"), r.u32(f"event {number} eventType")
        if pcr >= PCRS:
            raise r.fail(f"event {number}: PCR {pcr}, not one of the {PCRS} PCRs")
        count = r.u32(f"event {number} digest count")
        if count != len(banks):
            raise r.fail(f"event {number}: {count} digests, the Spec ID event lists {len(banks)} banks")
        digests: list[tuple[int, bytes]] = []
        for _ in range(count):
            alg = r.u16(f"event {number} hashAlg")
            if alg not in banks or any(a == alg for a, _ in digests):
                raise r.fail(f"event {number}: a digest of bank 0x{alg:04x}, "
                             + ("twice" if alg in banks else "which the Spec ID event does not list"))
            digests.append((alg, r.take(banks[alg], f"event {number} digest")))
        size = r.u32(f"event {number} eventSize")
        if size > r.left():
            raise r.fail(f"event {number}: eventSize {size}, only {r.left()} bytes left (truncated)")
        events.append(Event(number, pcr, kind, tuple(digests), r.take(size, f"event {number} data")))
    return tuple(events)


def replay(events: tuple[Event, ...], pcr: int) -> bytes:
    """PCR PCR of the sha256 bank as the log's events extend it (EV_NO_ACTION extends nothing; a
    StartupLocality event sets PCR 0's starting value)."""
    value = bytes(32)
    for event in events:
        if event.pcr != pcr:
            continue
        if event.type == EV_NO_ACTION:
            if pcr == 0 and event.data.startswith(STARTUP_LOCALITY_SIGNATURE) and len(event.data) == 17:
                value = bytes(31) + event.data[16:17]
            continue
        digest = event.digest(SHA256)
        assert digest is not None  # parse: every event has a digest for each bank, sha256 among them
        value = hashlib.sha256(value + digest).digest()
    return value


# ----------------------------------------------------------------------------------- Secure Boot


class Unmeasured(Refused):
    """An event's data is not what its digest measured: the log was changed after the fact."""


@dataclass(frozen=True)
class Variable:
    guid: uuid.UUID
    name: str
    data: bytes


def variable(event: Event) -> Variable:
    """EVENT's data as a UEFI_VARIABLE_DATA; Refused when it is not exactly one."""
    data = event.data
    if len(data) < _VARIABLE_HEAD.size:
        raise Refused(f"the event log: {event.describe()}: {len(data)} bytes, shorter than a UEFI_VARIABLE_DATA",
                      hint=HINT)
    raw_guid, name_chars, data_size = _VARIABLE_HEAD.unpack_from(data)
    left = len(data) - _VARIABLE_HEAD.size
    if name_chars > MAX_NAME_CHARS or name_chars * 2 + data_size != left:
        raise Refused(f"the event log: {event.describe()}: a name of {name_chars} characters and {data_size} bytes "
                      f"of data in {left} bytes", hint=HINT)
    raw_name = data[_VARIABLE_HEAD.size:_VARIABLE_HEAD.size + name_chars * 2]
    try:
        name = raw_name.decode("utf-16-le").rstrip("\0")
    except UnicodeDecodeError:
        raise Refused(f"the event log: {event.describe()}: the variable's name is not UTF-16", hint=HINT) from None
    return Variable(uuid.UUID(bytes_le=raw_guid), name, data[_VARIABLE_HEAD.size + name_chars * 2:])


@dataclass(frozen=True)
class SecureBootFacts:
    """What PCR 7's events say. Each event read here was first found to hash to its own sha256
    digest (the data of an event is not what the quote covers; its digest is)."""

    enabled: bool | None  # the SecureBoot variable's byte is 1; None: the log measures none
    pk: tuple[bytes, ...]  # X.509 certificates (DER)
    kek: tuple[bytes, ...]
    db: tuple[bytes, ...]
    dbx_measured: bool
    authorities: tuple[bytes, ...]  # the certificate (DER) that allowed each image, from the db
    other_authorities: tuple[str, ...]  # authorities from another variable than the db (shim's MokList...)


def _certificates(event: Event, var: Variable) -> tuple[bytes, ...]:
    try:
        return tuple(efivars.signature_list_certificates(var.data))
    except ValueError as e:
        raise Refused(f"the event log: {event.describe()} ({var.name}): {e}", hint=HINT) from None


def secure_boot(events: tuple[Event, ...]) -> SecureBootFacts:
    """The Secure Boot facts of PCR 7's events; Unmeasured when an event read here does not hash to
    its own sha256 digest, Refused when it is not the structure its type says."""
    enabled: bool | None = None
    lists: dict[str, tuple[bytes, ...]] = {"PK": (), "KEK": (), "db": ()}
    dbx = False
    authorities: list[bytes] = []
    others: list[str] = []
    for event in events:
        if event.pcr != 7 or event.type not in (EV_EFI_VARIABLE_DRIVER_CONFIG, EV_EFI_VARIABLE_AUTHORITY):
            continue
        if hashlib.sha256(event.data).digest() != event.digest(SHA256):
            raise Unmeasured(f"the event log: {event.describe()}: its data does not hash to its sha256 digest",
                             hint=HINT)
        var = variable(event)
        if event.type == EV_EFI_VARIABLE_AUTHORITY:
            if (var.guid, var.name) != (IMAGE_SECURITY_GUID, "db"):
                others.append(var.name)
            elif len(var.data) <= OWNER_BYTES:
                raise Refused(f"the event log: {event.describe()}: {len(var.data)} bytes, no certificate after the "
                              "owner GUID of its EFI_SIGNATURE_DATA", hint=HINT)
            else:
                authorities.append(var.data[OWNER_BYTES:])
        elif (var.guid, var.name) == (GLOBAL_GUID, "SecureBoot"):
            # an absent variable is measured with no data: Secure Boot is not on
            this = len(var.data) == 1 and var.data[0] == 1
            enabled = this if enabled is None else enabled and this
        elif (var.guid, var.name) in ((GLOBAL_GUID, "PK"), (GLOBAL_GUID, "KEK"), (IMAGE_SECURITY_GUID, "db")):
            lists[var.name] = lists[var.name] + _certificates(event, var)
        elif (var.guid, var.name) == (IMAGE_SECURITY_GUID, "dbx"):
            dbx = True
    return SecureBootFacts(enabled, lists["PK"], lists["KEK"], lists["db"], dbx, tuple(authorities), tuple(others))
