# SPDX-License-Identifier: MIT
"""The freshness of a bundle's index, as TUF's timestamp role gives it for a static file tree:
timestamp.json names the one bundle.json it vouches for (SHA-256 and size), a sequence number and
an expiry, and is signed (timestamp.json.sig, detached Ed25519) by a key of its own, never the
release key, so it can be re-signed often on a host that holds no release key.

Shared by the builder (`builder release` writes one, `builder timestamp` signs it again) and the
updater (which refuses an expired timestamp, one signed later than its clock allows, one for
another bundle.json, and one older than the last it accepted). Canonical JSON, as
appliance.signed.release_manifest writes it; nothing in it is trusted before its signature is checked against the
timestamp keys of the running version.
"""

from __future__ import annotations

import calendar
import hashlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import schema
from appliance.errors import Refused, UserError
from appliance.hashing import SHA256
from appliance.patterns import VERSION, VERSION_FORM
from appliance.signed import release_manifest

TIMESTAMP = "timestamp.json"
TIMESTAMP_SIG = "timestamp.json.sig"
TIMESTAMP_FORMAT = 1
MAX_TIMESTAMP_BYTES = 4096  # a few hundred bytes as written; read before anything is trusted
DEFAULT_DAYS = 7
MAX_DAYS = 366  # a longer validity is no freshness
MAX_SEQUENCE = schema.MAX_INT
# how far a signing host's clock may run ahead of the appliance's: more, and a signature "from the
# future" would stretch its validity by as much (one signed for 2099 would never expire)
MAX_CLOCK_SKEW_S = 300

_TIME = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z\Z")
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
RESIGN = "sign a fresh timestamp on the build host: python3 -m builder timestamp BUNDLE_DIR"


def system_clock() -> float:
    """The clock the device judges expiry by: the system clock (set by NTP, or the RTC at boot)."""
    return time.time()


def utc(seconds: float) -> str:
    """SECONDS since the epoch as the timestamp writes times: 2026-12-01T13:00:00Z."""
    return time.strftime(_TIME_FORMAT, time.gmtime(int(seconds)))


def parse_utc(text: str) -> int:
    """A time as utc() writes it, in seconds since the epoch; ValueError when it is not one."""
    if not _TIME.match(text):
        raise ValueError(f"not a UTC time such as 2026-12-01T13:00:00Z: {text[:40]!r}")
    return calendar.timegm(time.strptime(text, _TIME_FORMAT))


def _is_time(value: str) -> str | None:
    try:
        parse_utc(value)
    except ValueError:
        return "a UTC time such as 2026-12-01T13:00:00Z"
    return None


def _string(regex: re.Pattern[str], expected: str) -> dict[str, Any]:
    return schema.check(lambda v: None if regex.match(v) else expected)


@dataclass(frozen=True)
class Timestamp:
    """timestamp.json, as the schema loader reads it."""

    format: int = field(metadata=schema.check(lambda v: None if v == TIMESTAMP_FORMAT else f"{TIMESTAMP_FORMAT}"))
    bundle_sha256: str = field(metadata=_string(SHA256, "64 hex digits"))  # of bundle.json as served
    bundle_size: int = field(metadata=schema.check(lambda v: None if 0 < v <= (1 << 16) else "a size of bundle.json in bytes"))
    version: str = field(metadata=_string(VERSION, VERSION_FORM))  # bundle.json's, to say which release it is
    sequence: int = field(metadata=schema.check(lambda v: None if 1 <= v <= MAX_SEQUENCE else f"a number from 1 to {MAX_SEQUENCE}"))
    signed_at: str = field(metadata=schema.check(_is_time))
    expires: str = field(metadata=schema.check(_is_time))
    signer: str = field(metadata=_string(release_manifest.KEY_ID, "a key id of 16 hex digits"))

    @property
    def expires_s(self) -> int:
        return parse_utc(self.expires)


class _Loader(schema.Loader):
    def invalid(self, key: str, value: Any, expected: str) -> Refused:
        return Refused(f"{TIMESTAMP}: {key or 'timestamp'} = {schema.shown(value, 60)}: expected {expected}", hint=RESIGN)

    def unknown(self, key: str, value: Any, known: list[str]) -> Refused:
        return Refused(f"{TIMESTAMP}: unknown field {key!r}", hint="the timestamp was written by another version of the builder")

    def missing(self, key: str, tp: Any) -> Refused:
        return Refused(f"{TIMESTAMP}: missing field {key!r}", hint="the timestamp was written by another version of the builder")


def load(value: Any) -> Timestamp:
    """A parsed timestamp.json as the typed model, with the rules across fields."""
    model: Timestamp = _Loader(TIMESTAMP).load(Timestamp, value)
    days = (model.expires_s - parse_utc(model.signed_at)) / 86400
    if not 0 < days <= MAX_DAYS:
        raise Refused(f"{TIMESTAMP}: valid for {days:g} days from {model.signed_at}: expected more than 0 and at most {MAX_DAYS}",
                      hint=RESIGN)
    return model


# ----------------------------------------------------------------------------------- writing


def make(index_data: bytes, version: str, sequence: int, signer: str, *, now: float, days: int = DEFAULT_DAYS) -> dict[str, Any]:
    """The timestamp for the bundle.json INDEX_DATA, signed NOW and valid for DAYS."""
    doc = {
        "format": TIMESTAMP_FORMAT,
        "bundle_sha256": hashlib.sha256(index_data).hexdigest(),
        "bundle_size": len(index_data),
        "version": version,
        "sequence": sequence,
        "signed_at": utc(now),
        "expires": utc(now + days * 86400),
        "signer": signer,
    }
    load(doc)  # what the updater will check, checked before signing
    return doc


def sign(doc: dict[str, Any], private_key_path: Path) -> tuple[bytes, bytes]:
    """timestamp.json and timestamp.json.sig for DOC (whose signer must be this key's id)."""
    key = release_manifest.load_private_key(private_key_path)
    kid = release_manifest.key_id(key.public_key())
    if doc["signer"] != kid:
        raise UserError(f"the timestamp names signer {doc['signer']} but {private_key_path} is key {kid}",
                        hint="set the timestamp's signer to the id of the key that signs it")
    data = release_manifest.canonical(doc)
    return data, release_manifest.encode_signature(key.sign(data))


# ----------------------------------------------------------------------------------- checking


def verify(data: bytes, sig: bytes, keys_dir: Path) -> Timestamp:
    """The signature against the timestamp keys in KEYS_DIR first, then the form and the schema."""
    try:
        signature = release_manifest.decode_signature(sig)
    except release_manifest.ManifestError as e:
        raise Refused(f"{TIMESTAMP_SIG}: {e.message}", hint="download the bundle again; if it persists, it was tampered with") from None
    keys = release_manifest.trusted_keys(keys_dir) if keys_dir.is_dir() else {}
    if not keys:
        raise UserError(f"{keys_dir}: no trusted timestamp keys (*.pub)", hint="the image is damaged, or was built before timestamps")
    signed_by = release_manifest.signer_of(data, signature, keys)
    if signed_by is None:
        claimed = release_manifest.claimed_signer(data)
        if claimed is not None and claimed not in keys:
            raise Refused(f"{TIMESTAMP} is signed by key {claimed}, which this version does not trust for timestamps",
                          hint=f"trusted timestamp keys: {', '.join(sorted(keys))}; {RESIGN}")
        raise Refused(f"{TIMESTAMP}'s signature does not match any trusted timestamp key",
                      hint=f"the timestamp or its signature was changed; {RESIGN}")
    try:
        model = load(release_manifest.parse_canonical(data))
    except release_manifest.ManifestError as e:
        raise Refused(f"{TIMESTAMP}: {e.message}", hint=e.hint) from None
    if model.signer != signed_by:
        raise Refused(f"{TIMESTAMP} names signer {model.signer} but was signed by {signed_by}", hint="the timestamp is inconsistent")
    return model


def check_names(ts: Timestamp, index_data: bytes, version: str) -> None:
    """TS vouches for exactly the bundle.json INDEX_DATA (of VERSION), not another one."""
    if len(index_data) != ts.bundle_size or hashlib.sha256(index_data).hexdigest() != ts.bundle_sha256:
        raise Refused(f"{TIMESTAMP} is for another bundle.json (version {ts.version}, sequence {ts.sequence})",
                      hint=f"the bundle directory was changed after its timestamp was signed; {RESIGN}")
    if ts.version != version:  # the hash matched: only a forged or damaged builder gets here
        raise Refused(f"{TIMESTAMP} says version {ts.version}, bundle.json {version}", hint="the timestamp is inconsistent")


def check_clock(ts: Timestamp, now: float, build_time: str) -> None:
    """The system clock is the one the device trusts. One earlier than the running release's build
    time is known wrong (refused on its own: every expiry judged by it would mean nothing); TS signed
    later than the clock (beyond MAX_CLOCK_SKEW_S) is refused, else its validity would count from a
    date to come; past TS's expiry, the index is expired."""
    built = parse_utc(build_time)
    if now < built:
        raise UserError(f"the clock says {utc(now)}, earlier than this release's build time {build_time}: it is wrong",
                        hint="set the clock (timedatectl set-ntp true, or timedatectl set-time), then run the same command again")
    check_signed_at(TIMESTAMP, ts.signed_at, now, RESIGN)
    if now >= ts.expires_s:
        raise Refused(f"the index expired at {ts.expires}; the clock says {utc(now)}",
                      hint=f"{RESIGN}; or, if the index is new, check the clock (timedatectl)")


def check_signed_at(what: str, signed_at: str, now: float, hint: str) -> None:
    """WHAT (a signed document) was signed at SIGNED_AT, no later than NOW plus MAX_CLOCK_SKEW_S."""
    if parse_utc(signed_at) > now + MAX_CLOCK_SKEW_S:
        raise Refused(f"{what} was signed at {signed_at}, later than the clock says ({utc(now)}) by more than "
                      f"{MAX_CLOCK_SKEW_S // 60} minutes", hint=f"check the clock (timedatectl); if it is right, {hint}")


def check_sequence(ts: Timestamp, last: int | None) -> None:
    """Not older than the last timestamp of this key the device accepted (LAST): a lower sequence
    is an index replayed, or one an attacker froze."""
    if last is not None and ts.sequence < last:
        raise Refused(f"{TIMESTAMP} has sequence {ts.sequence}, lower than the {last} this appliance accepted before "
                      f"(an older index replayed)", hint=f"fetch the current bundle; to offer this one again, {RESIGN}")
