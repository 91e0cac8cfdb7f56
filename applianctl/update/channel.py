# SPDX-License-Identifier: MIT
"""`applianctl update CHANNEL` where the SOURCE names a channel index (…/channel.json): which
release this appliance installs now, by its own place in each rollout (appliance/rollout.py), and
when. The index is verified against the release keys this version trusts, refused when signed
later than the clock allows or past its expiry, and never goes back: the highest sequence of every
index accepted is recorded (whatever it asks for, --check included), since an older index could
undo a pause or a stop; a damaged record refuses every index until it is removed. The bundle it
picks lies beside the index, so a channel is a plain static file tree like a bundle directory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from appliance import paths, rollout, schema
from appliance.atomic import record_lock, write_json_atomic
from appliance.errors import UserError
from appliance.fetch import Deadline, open_source
from appliance.safe_read import MAX_RECORD_BYTES, loads_bounded, read_capped
from appliance.signed import release_manifest, timestamp
from appliance.signed.bundle_index import MAX_SIG_BYTES

MACHINE_ID = Path("/etc/machine-id")
MAX_MACHINE_ID_BYTES = 64  # 32 hex digits and a newline


def is_channel(spec: str) -> bool:
    return spec.rstrip().endswith("/" + rollout.CHANNEL) or spec == rollout.CHANNEL


def machine_id(path: Path = MACHINE_ID) -> str:
    """The machine id, read as a file someone else could have written: a FIFO, a link (to /dev/zero)
    or a large file is refused at once, not waited on or read whole."""
    hint = "the machine id is set at first boot; check systemd-machine-id-setup"
    why = "this appliance's place in a rollout is made from it"
    try:
        data = read_capped(path, MAX_MACHINE_ID_BYTES, what="the machine id", hint=hint)
    except UserError as e:
        raise UserError(f"{e.message}: {why}", hint=e.hint) from None
    if data is None:
        raise UserError(f"{path}: no such file: {why}", hint=hint)
    try:
        value = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text: it holds no machine id (32 hex digits)", hint=hint) from None
    if len(value) != 32 or any(c not in "0123456789abcdef" for c in value):
        raise UserError(f"{path} does not hold a machine id (32 hex digits)", hint=hint)
    return value


def _record_fault(path: Path, what: str) -> UserError:
    return UserError(f"{path}: {what}: every channel index is refused (it records the highest index sequence "
                     "accepted, against an older index replayed)",
                     hint=f"to trust the next index this appliance verifies (of any sequence), remove {path}")


def accepted_sequences() -> dict[str, int]:
    """The highest sequence of each channel's index this appliance accepted ({} when there is no
    record yet). A record that is not as written (not JSON, not an object of channel names and
    sequences, not a regular file) is a UserError: taken as none, it would let any older index in."""
    path = paths.channel_path()
    try:
        data = read_capped(path, MAX_RECORD_BYTES, what="the channel record")
    except UserError as e:
        raise _record_fault(path, e.message.removeprefix(f"{path}: ")) from None
    if data is None:
        return {}
    try:
        doc = loads_bounded(data)
    except ValueError:
        raise _record_fault(path, "not JSON") from None
    if not isinstance(doc, dict):
        raise _record_fault(path, f"{schema.shown(doc, 40)} is not an object of channel names and sequences")
    for name, value in doc.items():
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= schema.MAX_INT:
            raise _record_fault(path, f"{schema.shown(name, 40)} = {schema.shown(value, 40)} is not a sequence")
    return doc


def accepted_sequence(channel: str) -> int | None:
    """The highest sequence of CHANNEL's index this appliance accepted, if any."""
    return accepted_sequences().get(channel)


def accept(channel: rollout.Channel) -> None:
    """Record CHANNEL's sequence as accepted; the record only goes up (the caller holds
    appliance.atomic.record_lock around its check and this)."""
    record = accepted_sequences()
    last = record.get(channel.channel)
    if last is not None and last >= channel.sequence:
        return
    record[channel.channel] = channel.sequence
    paths.channel_path().parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(paths.channel_path(), record)


@dataclass(frozen=True)
class Resolution:
    channel: rollout.Channel
    decision: rollout.Decision
    bundle: str | None  # the SOURCE of the bundle to install now, beside the index
    installs_at: int | None  # when this appliance installs (now, the next window, or its admission)
    in_window: bool

    def describe(self, now: float) -> str:
        lines = [f"channel {self.channel.channel} (index sequence {self.channel.sequence}, signed {self.channel.signed_at}, "
                 f"expires {self.channel.expires_at})",
                 *("  " + line for line in self.decision.describe().splitlines())]
        if self.installs_at is None:
            lines.append("  installs: not while the index stands (paused or stopped, or nothing newer)")
        elif self.installs_at <= now:
            lines.append("  installs: now")
        else:
            lines.append(f"  installs: at {timestamp.utc(self.installs_at)} (admission and maintenance window)")
        return "\n".join(lines)


def resolve(spec: str, *, ca: str | None, deadline: Deadline, keys_dir: Path, running_version: str, machine: str,
            now: float, windows: tuple[rollout.Window, ...]) -> Resolution:
    """Read and verify the index at SPEC, refuse one signed in the future, expired, or older than the
    last accepted, record it as accepted (whatever it asks for: a pause or a stop is what an older
    index would undo), and decide."""
    base = spec[: -len(rollout.CHANNEL)]
    source = open_source(base or ".", ca, deadline)
    data = source.read_small(rollout.CHANNEL, rollout.MAX_CHANNEL_BYTES)
    sig = source.read_small(rollout.CHANNEL_SIG, MAX_SIG_BYTES)
    keys = release_manifest.trusted_keys(keys_dir)
    if not keys:
        raise UserError(f"{keys_dir}: no trusted keys (*.pub)", hint="the image is damaged")
    channel = rollout.verify(data, sig, keys)
    rollout.check_clock(channel, now)
    with record_lock(paths.channel_path()):  # a --check beside the timer's update: the record only goes up
        rollout.check_sequence(channel, accepted_sequence(channel.channel))
        accept(channel)
    decision = rollout.decide(channel, running_version, machine, now)
    bundle = (base + decision.target.path) if decision.target is not None else None
    return Resolution(channel, decision, bundle, rollout.when(decision, windows, now), rollout.in_window(windows, now))


def system_clock() -> float:
    return time.time()


def maintenance_windows() -> tuple[rollout.Window, ...]:
    """update.maintenance_windows of the device's configuration (none: any time)."""
    from appliance.host_settings import load_device

    return load_device().update.maintenance_windows
