# SPDX-License-Identifier: MIT
"""The fleet's verifier store: a plain directory of signed records (`builder attest`).

    STORE/hosts/HOST.json + .sig      one enrolled appliance: its EK (for good) and its proven AK
    STORE/seen/HOST.json + .sig       the TPM clock of the last quote proven for HOST (replays)
    STORE/releases/VERSION.json + .sig  a release's PCR 11 policies, read once from its kernel image

Each record is canonical JSON (appliance/signed/release_manifest.py's rules) with a detached
Ed25519 signature by the release signing key, written atomically (the signature first, then the
record: a reader in between sees the old record refused, never a new one unsigned) and loaded
strictly through the core's schema loader: a record that does not verify is refused in one line,
never read as absent (that would let an EK be enrolled twice, or an old clock in again).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from appliance import schema
from appliance.atomic import atomic_write
from appliance.errors import UserError
from appliance.hashing import SHA256
from appliance.patterns import VERSION, VERSION_FORM
from appliance.safe_read import read_capped
from appliance.signed import release_manifest

FORMAT = 1
MAX_RECORD_BYTES = 64 << 10
MAX_SIG_BYTES = 256
MAX_HOSTS = 100_000
HOSTS, SEEN, RELEASES = "hosts", "seen", "releases"
# a host name or address, usable as a file name: no "/", no leading dot, no ".."
HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.:_-]{0,252}\Z")
_HEX = re.compile(r"^([0-9a-f]{2})+\Z")
_TIME = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z\Z")
TRUST = ("ek-ca", "software-tpm")
DAMAGED = "the verifier store was changed outside `builder attest`: restore it from a backup, or remove the file and enroll the host again"


def check_host(name: str) -> str:
    """NAME when it is a host name the store can hold; UserError otherwise."""
    if not HOST.match(name) or ".." in name:
        raise UserError(f"host {schema.shown(name, 60)}: not a host name or address",
                        hint="name the appliance by its DNS name or address, e.g. gpu-07.example.net")
    return name


def _match(regex: re.Pattern[str], expected: str) -> dict[str, Any]:
    return schema.check(lambda v: None if regex.match(v) else expected)


def _non_negative() -> dict[str, Any]:
    return schema.check(lambda v: None if v >= 0 else "0 or more")


@dataclass(frozen=True)
class HostRecord:
    """One enrolled appliance. The EK is the TPM's identity: bound to the host for good."""

    format: int = field(metadata=schema.check(lambda v: None if v == FORMAT else str(FORMAT)))
    host: str = field(metadata=_match(HOST, "a host name"))
    ek_fingerprint: str = field(metadata=_match(SHA256, "64 hex digits: SHA-256 of the EK's DER public key"))
    ek_public: str = field(metadata=schema.check(lambda v: None if v.startswith("-----BEGIN PUBLIC KEY-----") else "a PEM public key"))
    ek_certificate: str  # base64 DER, "" when the TPM has none
    ek_issuer: str  # the EK certificate's issuer, "" when none
    trust: str = field(metadata=schema.check(lambda v: None if v in TRUST else " or ".join(TRUST)))
    software_tpm: bool
    ak_public: str  # base64 TPM2B_PUBLIC
    ak_name: str = field(metadata=_match(_HEX, "hex digits"))
    enrolled_at: str = field(metadata=_match(_TIME, "a UTC time"))
    signer: str = field(metadata=_match(release_manifest.KEY_ID, "a key id of 16 hex digits"))


@dataclass(frozen=True)
class SeenRecord:
    """The TPM clock of the last quote proven for a host: a later proof never goes back."""

    format: int = field(metadata=schema.check(lambda v: None if v == FORMAT else str(FORMAT)))
    host: str = field(metadata=_match(HOST, "a host name"))
    ek_fingerprint: str = field(metadata=_match(SHA256, "64 hex digits"))
    reset_count: int = field(metadata=_non_negative())
    restart_count: int = field(metadata=_non_negative())
    clock_ms: int = field(metadata=_non_negative())
    checked_at: str = field(metadata=_match(_TIME, "a UTC time"))
    signer: str = field(metadata=_match(release_manifest.KEY_ID, "a key id of 16 hex digits"))


@dataclass(frozen=True)
class ReleaseRecord:
    """A release's PCR 11 policies (the `pol` values of its kernel image's .pcrsig, sha256 bank),
    valid for the kernel image whose SHA-256 it names."""

    format: int = field(metadata=schema.check(lambda v: None if v == FORMAT else str(FORMAT)))
    version: str = field(metadata=_match(VERSION, VERSION_FORM))
    uki: str  # the kernel image's file name in the bundle
    uki_sha256: str = field(metadata=_match(SHA256, "64 hex digits"))
    pcrpkey_sha256: str  # SHA-256 of the .pcrpkey section ("" when none)
    pcr11_policies: tuple[str, ...] = field(metadata=schema.each(lambda v: None if SHA256.match(v) else "64 hex digits"))
    signer: str = field(metadata=_match(release_manifest.KEY_ID, "a key id of 16 hex digits"))


R = TypeVar("R")


class _Loader(schema.Loader):
    def invalid(self, key: str, value: Any, expected: str) -> UserError:
        return UserError(f"{self.where}: {key or 'the record'} = {schema.shown(value, 60)}: expected {expected}", hint=DAMAGED)

    def unknown(self, key: str, value: Any, known: list[str]) -> UserError:
        return UserError(f"{self.where}: unknown field {key!r}", hint=DAMAGED)

    def missing(self, key: str, tp: Any) -> UserError:
        return UserError(f"{self.where}: missing field {key!r}", hint=DAMAGED)


class Store:
    """The store at ROOT; records signed with PRIVATE (None: read only) and verified against KEYS
    (key id -> public key: the release keys)."""

    def __init__(self, root: Path, keys: Mapping[str, Ed25519PublicKey], private: Ed25519PrivateKey | None = None) -> None:
        self.root = root
        self.keys = dict(keys)
        self.private = private
        if private is not None:
            self.keys.setdefault(release_manifest.key_id(private.public_key()), private.public_key())
        if not self.keys:
            raise UserError("no release key to verify the store's records with", hint="give --signing-key or --trusted-keys")

    # --- paths

    def path(self, kind: str, name: str) -> Path:
        return self.root / kind / f"{name}.json"

    @staticmethod
    def sig_path(path: Path) -> Path:
        return path.with_name(path.name + ".sig")

    # --- signed records

    @property
    def signer(self) -> str:
        if self.private is None:
            raise UserError("no signing key: the store cannot be written", hint="give --signing-key (default: as for build)")
        return release_manifest.key_id(self.private.public_key())

    def _write(self, path: Path, doc: dict[str, Any]) -> None:
        if self.private is None:
            raise UserError("no signing key: the store cannot be written", hint="give --signing-key (default: as for build)")
        data = release_manifest.canonical(doc)
        atomic_write(self.sig_path(path), release_manifest.encode_signature(self.private.sign(data)), 0o644)
        atomic_write(path, data, 0o644)

    def _read(self, cls: type[R], path: Path) -> R | None:
        data = read_capped(path, MAX_RECORD_BYTES, what="a verifier record", hint=DAMAGED)
        sig = read_capped(self.sig_path(path), MAX_SIG_BYTES, what="a verifier record's signature", hint=DAMAGED)
        if data is None and sig is None:
            return None
        if data is None or sig is None:
            raise UserError(f"{path if data is None else self.sig_path(path)}: missing (a record goes with its signature)", hint=DAMAGED)
        try:
            signed_by = release_manifest.signer_of(data, release_manifest.decode_signature(sig), self.keys)
            if signed_by is None:
                raise UserError(f"{path}: not signed by a release key", hint=DAMAGED)
            doc = release_manifest.parse_canonical(data)
        except release_manifest.ManifestError as e:
            raise UserError(f"{path}: {e.message}", hint=DAMAGED) from None
        record: R = _Loader(str(path)).load(cls, doc)
        if getattr(record, "signer", None) != signed_by:
            raise UserError(f"{path}: names another signer than the key that signed it", hint=DAMAGED)
        return record

    def _remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)  # the record first: a record without its signature is refused, never trusted
        self.sig_path(path).unlink(missing_ok=True)

    # --- hosts

    def host(self, name: str) -> HostRecord | None:
        record = self._read(HostRecord, self.path(HOSTS, check_host(name)))
        if record is not None and record.host != name:
            raise UserError(f"{self.path(HOSTS, name)}: holds host {record.host}", hint=DAMAGED)
        return record

    def hosts(self) -> list[HostRecord]:
        """Every enrolled host, each record verified."""
        directory = self.root / HOSTS
        try:
            names = sorted(p.name.removesuffix(".json") for p in directory.iterdir()
                           if p.name.endswith(".json") and not p.name.startswith("."))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise UserError(f"{directory}: cannot list ({e.strerror})", hint="check the store's permissions") from None
        if len(names) > MAX_HOSTS:
            raise UserError(f"{directory}: more than {MAX_HOSTS} records", hint=DAMAGED)
        out = []
        for name in names:
            record = self.host(check_host(name))
            if record is not None:
                out.append(record)
        return out

    def write_host(self, record: HostRecord) -> None:
        self._write(self.path(HOSTS, check_host(record.host)), schema.plain(record))

    def remove_host(self, name: str) -> None:
        """HOST's record and the clock seen for it, gone on purpose (`enroll --replace`)."""
        self._remove(self.path(HOSTS, check_host(name)))
        self._remove(self.path(SEEN, name))

    # --- seen clocks

    def seen(self, name: str) -> SeenRecord | None:
        record = self._read(SeenRecord, self.path(SEEN, check_host(name)))
        if record is not None and record.host != name:
            raise UserError(f"{self.path(SEEN, name)}: holds host {record.host}", hint=DAMAGED)
        return record

    def write_seen(self, record: SeenRecord) -> None:
        self._write(self.path(SEEN, check_host(record.host)), schema.plain(record))

    def forget_seen(self, name: str) -> None:
        self._remove(self.path(SEEN, check_host(name)))

    # --- release policies

    def release(self, version: str) -> ReleaseRecord | None:
        if not VERSION.match(version):
            raise UserError(f"version {schema.shown(version, 40)}: expected {VERSION_FORM}", hint=DAMAGED)
        record = self._read(ReleaseRecord, self.path(RELEASES, version))
        if record is not None and record.version != version:
            raise UserError(f"{self.path(RELEASES, version)}: holds version {record.version}", hint=DAMAGED)
        return record

    def write_release(self, record: ReleaseRecord) -> None:
        self._write(self.path(RELEASES, record.version), schema.plain(record))
