# SPDX-License-Identifier: MIT
"""Phased rollouts from a static update server, as Fedora CoreOS phases them from static metadata.

A channel index (channel.json, canonical JSON, signed by the release key like bundle.json, with
a sequence that only goes up and an expiry) lists the releases of a channel: where each bundle
lies (a path beside the index), whether it is a barrier (every appliance passes through it: it is
never skipped), and its rollout (a start, a duration, and a state an operator changes by signing
the index again: active, paused, stopped).

Each appliance computes its own place in a release's rollout from a hash of its machine id and the
version, uniform over [0, 1) across a fleet and different for each release (the same appliances are
not always first). The share of a rollout grows linearly from 0 at its start to 1 at its end; an
appliance is admitted once the share passes its place. Paused: the share stays where it was when
paused (a pause is signed when it takes effect: paused_at later than the index's signed_at is
refused). Stopped: the share is 0 (appliances that took it keep it; nobody else does). A release
without a rollout is open to all. The update server stays a plain file tree: no appliance tells
anyone anything.

Maintenance windows (per host, from the install plan) say when the update timer may install and
reboot; times are UTC, a window may run past midnight into the next day.
"""

from __future__ import annotations

import calendar
import hashlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

from appliance import schema
from appliance.config.model import DAYS, MaintenanceWindow
from appliance.errors import Refused, UserError
from appliance.patterns import VERSION, VERSION_FORM
from appliance.schema import optional
from appliance.signed import release_manifest, timestamp
from appliance.signed.timestamp import parse_utc, utc

CHANNEL = "channel.json"
CHANNEL_SIG = "channel.json.sig"
CHANNEL_FORMAT = 2  # 2: expires_at (an index of format 1 never expired: refused)
MAX_CHANNEL_BYTES = 256 << 10
MAX_RELEASES = 256
MAX_DURATION_S = 366 * 86400
STATES = ("active", "paused", "stopped")
_PLACE_DOMAIN = b"appliance-rollout\0"
_CHANNEL_NAME = re.compile(r"^[a-z][a-z0-9-]{0,31}\Z")
# a bundle directory beside the index: one or more plain path segments, ending in /
_BUNDLE_PATH = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,63}/){1,4}\Z")
RESIGN = "sign the channel index again on the build host: python3 -m builder channel"


def _time_check(value: str) -> str | None:
    try:
        parse_utc(value)
    except ValueError:
        return "a UTC time such as 2026-12-01T13:00:00Z"
    return None


def _string(regex: re.Pattern[str], expected: str) -> dict[str, Any]:
    return schema.check(lambda v: None if regex.match(v) else expected)


@dataclass(frozen=True)
class Rollout:
    start: str = field(metadata=schema.check(_time_check))
    duration_s: int = field(metadata=schema.check(lambda v: None if 0 <= v <= MAX_DURATION_S else f"0 to {MAX_DURATION_S} seconds"))
    state: str = field(default="active", metadata=schema.check(lambda v: None if v in STATES else " or ".join(STATES)))
    paused_at: str | None = optional(check=_time_check)  # when state is paused: the share stays as it was then

    def share(self, now: float) -> float:
        """The part of the fleet admitted at NOW, 0..1."""
        if self.state == "stopped":
            return 0.0
        # paused: never more than now, even when paused_at is later (within the clock skew allowed)
        at = now if self.state == "active" else min(now, parse_utc(self.paused_at or self.start))
        start = parse_utc(self.start)
        if at < start:
            return 0.0
        if self.duration_s == 0:
            return 1.0
        return min(1.0, (at - start) / self.duration_s)

    def admits_at(self, place: float) -> int | None:
        """When (seconds since the epoch) an appliance at PLACE is admitted, if the rollout goes on
        as signed; None when it is paused or stopped (only a newly signed index can say)."""
        if self.state != "active":
            return None
        return parse_utc(self.start) + int(place * self.duration_s)


@dataclass(frozen=True)
class Release:
    version: str = field(metadata=_string(VERSION, VERSION_FORM))
    path: str = field(metadata=_string(_BUNDLE_PATH, "a directory beside the index such as 1.2.0/ (plain names, ending in /)"))
    barrier: bool = False  # every appliance installs it on its way to anything newer
    rollout: Rollout | None = field(default=None, metadata={"omit": True})


@dataclass(frozen=True)
class Channel:
    format: int = field(metadata=schema.check(lambda v: None if v == CHANNEL_FORMAT else f"{CHANNEL_FORMAT}"))
    channel: str = field(metadata=_string(_CHANNEL_NAME, "a lower-case name such as stable"))
    sequence: int = field(metadata=schema.check(lambda v: None if 1 <= v <= schema.MAX_INT else f"1 to {schema.MAX_INT}"))
    signed_at: str = field(metadata=schema.check(_time_check))
    expires_at: str = field(metadata=schema.check(_time_check))  # past it, the index is stale: a freeze ends there
    releases: tuple[Release, ...]
    signer: str = field(metadata=_string(release_manifest.KEY_ID, "a key id of 16 hex digits"))


class _Loader(schema.Loader):
    def invalid(self, key: str, value: Any, expected: str) -> Refused:
        return Refused(f"{CHANNEL}: {key or 'channel'} = {schema.shown(value, 60)}: expected {expected}", hint=RESIGN)

    def unknown(self, key: str, value: Any, known: list[str]) -> Refused:
        return Refused(f"{CHANNEL}: unknown field {key!r}", hint="the index was written by another version of the builder")

    def missing(self, key: str, tp: Any) -> Refused:
        return Refused(f"{CHANNEL}: missing field {key!r}", hint="the index was written by another version of the builder")


def load(value: Any) -> Channel:
    """A parsed channel.json as the typed model, with the rules across fields."""
    model: Channel = _Loader(CHANNEL).load(Channel, value)
    if not 1 <= len(model.releases) <= MAX_RELEASES:
        raise Refused(f"{CHANNEL}: {len(model.releases)} releases: expected 1 to {MAX_RELEASES}", hint=RESIGN)
    versions = [release_manifest.version_tuple(r.version) for r in model.releases]
    if len(set(versions)) != len(versions):
        raise Refused(f"{CHANNEL}: a version is listed twice", hint=RESIGN)
    signed = parse_utc(model.signed_at)
    days = (parse_utc(model.expires_at) - signed) / 86400
    if not 0 < days <= timestamp.MAX_DAYS:
        raise Refused(f"{CHANNEL}: valid for {days:g} days from {model.signed_at}: expected more than 0 and at most "
                      f"{timestamp.MAX_DAYS}", hint=RESIGN)
    for r in model.releases:
        if r.rollout is not None and (r.rollout.state == "paused") != (r.rollout.paused_at is not None):
            raise Refused(f"{CHANNEL}: release {r.version}: paused_at goes with state paused, and only with it", hint=RESIGN)
        # a pause to come would admit more and more until then: a pause takes effect when it is signed
        if r.rollout is not None and r.rollout.paused_at is not None and parse_utc(r.rollout.paused_at) > signed:
            raise Refused(f"{CHANNEL}: release {r.version}: paused_at {r.rollout.paused_at} is later than the index's "
                          f"signed_at {model.signed_at}", hint=f"set paused_at to the time of signing or earlier; {RESIGN}")
    return model


def dumps(doc: dict[str, Any]) -> bytes:
    load(doc)  # what the appliance will check, checked before signing
    return release_manifest.canonical(doc)


def verify(data: bytes, sig: bytes, keys: dict[str, Any]) -> Channel:
    """The signature against KEYS (the release keys the running version trusts) first, then the
    form and the schema; the index names the key that signed it."""
    try:
        signature = release_manifest.decode_signature(sig)
    except release_manifest.ManifestError as e:
        raise Refused(f"{CHANNEL_SIG}: {e.message}", hint="fetch the index again; if it persists, it was tampered with") from None
    signed_by = release_manifest.signer_of(data, signature, keys)
    if signed_by is None:
        raise Refused(f"{CHANNEL}'s signature does not match any key this version trusts",
                      hint=f"trusted keys: {', '.join(sorted(keys)) or 'none'}; {RESIGN}")
    try:
        model = load(release_manifest.parse_canonical(data))
    except release_manifest.ManifestError as e:
        raise Refused(f"{CHANNEL}: {e.message}", hint=e.hint) from None
    if model.signer != signed_by:
        raise Refused(f"{CHANNEL} names signer {model.signer} but was signed by {signed_by}", hint="the index is inconsistent")
    return model


def check_clock(channel: Channel, now: float) -> None:
    """CHANNEL was signed no later than NOW (within the clock skew allowed) and has not expired: an
    index kept from long ago (one that hides the releases since) is stale, not "nothing newer"."""
    timestamp.check_signed_at(CHANNEL, channel.signed_at, now, RESIGN)
    if now >= parse_utc(channel.expires_at):
        raise Refused(f"{CHANNEL} expired at {channel.expires_at}; the clock says {utc(now)}",
                      hint=f"{RESIGN} (it signs for --days, default {timestamp.DEFAULT_DAYS}); or, if the index is new, "
                           "check the clock (timedatectl)")


def check_sequence(channel: Channel, last: int | None) -> None:
    """An index older than the last one accepted is a replay (it could undo a pause or a stop)."""
    if last is not None and channel.sequence < last:
        raise Refused(f"{CHANNEL} has sequence {channel.sequence}, lower than the {last} this appliance accepted before "
                      "(an older index replayed)", hint=f"fetch the current index; {RESIGN}")


# ----------------------------------------------------------------------------------- places


def place(machine_id: str, version: str) -> float:
    """This appliance's place in VERSION's rollout, uniform over [0, 1) across machine ids."""
    digest = hashlib.sha256(_PLACE_DOMAIN + machine_id.encode() + b"\0" + version.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True)
class Standing:
    """Where one appliance stands in one release's rollout."""

    version: str
    barrier: bool
    place: float
    share: float
    state: str  # active, paused, stopped, or open (no rollout)
    admits_at: int | None  # when the rollout reaches this place, if it goes on as signed

    @property
    def admitted(self) -> bool:
        return self.place < self.share

    def describe(self) -> str:
        where = f"place {self.place:.3f} in {self.version}'s rollout, now at {self.share:.1%} ({self.state})"
        if self.admitted:
            return f"{where}: admitted"
        if self.admits_at is not None:
            return f"{where}: admitted at {utc(self.admits_at)}"
        return f"{where}: waits until a newly signed index resumes it"


@dataclass(frozen=True)
class Decision:
    target: Release | None  # the release to install now (None: nothing, now)
    standings: tuple[Standing, ...]  # every release newer than the running one, oldest first, up to the first barrier
    waiting_for: Standing | None  # without a target: the release that will admit it first

    def describe(self) -> str:
        lines = [s.describe() for s in self.standings]
        if self.target is not None:
            lines.append(f"next: {self.target.version}")
        elif self.waiting_for is not None:
            lines.append(f"next: nothing yet; waiting for {self.waiting_for.version}")
        else:
            lines.append("next: nothing (this is the newest release of the channel)")
        return "\n".join(lines)


def standing(release: Release, machine_id: str, now: float) -> Standing:
    p = place(machine_id, release.version)
    r = release.rollout
    if r is None:
        return Standing(release.version, release.barrier, p, 1.0, "open", None)
    return Standing(release.version, release.barrier, p, r.share(now), r.state, r.admits_at(p))


def decide(channel: Channel, running: str, machine_id: str, now: float) -> Decision:
    """The newest release newer than RUNNING that admits this appliance, never past a barrier
    it has not installed: a barrier that does not admit it yet stops the walk there."""
    newer = sorted((r for r in channel.releases if release_manifest.version_tuple(r.version) > release_manifest.version_tuple(running)),
                   key=lambda r: release_manifest.version_tuple(r.version))
    target, seen = None, []
    for release in newer:
        s = standing(release, machine_id, now)
        seen.append(s)
        if s.admitted:
            target = release
        if release.barrier:
            break
    waiting = None
    if target is None and seen:  # the release that will admit it first, as the index stands
        waiting = min(seen, key=lambda s: (s.admits_at is None, s.admits_at or 0))
    return Decision(target, tuple(seen), waiting)


# ----------------------------------------------------------------------------------- maintenance windows


Window = MaintenanceWindow  # the configuration's (update.maintenance_windows)


def _midnight(now: float) -> int:
    return int(now) - int(now) % 86400


def _weekday(day_start: int) -> str:
    return DAYS[calendar.weekday(*_ymd(day_start))]


def _ymd(seconds: int) -> tuple[int, int, int]:
    t = time.gmtime(seconds)
    return t.tm_year, t.tm_mon, t.tm_mday


def _openings(window: Window, around: float, days_back: int, days_ahead: int) -> list[tuple[int, int]]:
    """(start, end) of each of WINDOW's openings on the days around AROUND."""
    out = []
    today = _midnight(around)
    for offset in range(-days_back, days_ahead + 1):
        day = today + offset * 86400
        if _weekday(day) in window.days:
            start = day + window.start_min * 60
            out.append((start, start + window.duration_min * 60))
    return out


def in_window(windows: tuple[Window, ...], now: float) -> bool:
    """Whether NOW lies in a maintenance window; with none configured, always."""
    if not windows:
        return True
    return any(start <= now < end for w in windows for start, end in _openings(w, now, 1, 0))


def next_opening(windows: tuple[Window, ...], after: float) -> int:
    """The first moment at or after AFTER inside a window (AFTER itself when it is inside one)."""
    if in_window(windows, after):
        return int(after)
    starts = [start for w in windows for start, _ in _openings(w, after, 0, 7) if start >= after]
    if not starts:
        raise UserError("no maintenance window opens within a week", hint="check maintenance_windows in the install plan")
    return min(starts)


def when(decision: Decision, windows: tuple[Window, ...], now: float) -> int | None:
    """When this appliance will install: the target now (or at the next window), else when the
    release it waits for admits it (at the window after that); None when only a newly signed index can say."""
    if decision.target is not None:
        return next_opening(windows, now)
    if decision.waiting_for is None or decision.waiting_for.admits_at is None:
        return None
    return next_opening(windows, max(now, decision.waiting_for.admits_at))
