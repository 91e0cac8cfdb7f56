"""`applianctl update CHANNEL` where the SOURCE names a channel index (…/channel.json): which
release this appliance installs now, by its own place in each rollout (appliance/rollout.py), and
when. The index is verified against the release keys this version trusts and never goes back (its
sequence is recorded once acted on: an older index could undo a pause or a stop). The bundle it
picks lies beside the index, so a channel is a plain static file tree like a bundle directory.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from appliance import freshness, manifest, paths, rollout
from appliance.atomic import write_json_atomic
from appliance.bundle import MAX_SIG_BYTES
from appliance.errors import UserError
from appliance.fetch import Deadline, open_source
from appliance.safe_read import MAX_RECORD_BYTES, loads_bounded, read_capped

MACHINE_ID = Path("/etc/machine-id")


def is_channel(spec: str) -> bool:
    return spec.rstrip().endswith("/" + rollout.CHANNEL) or spec == rollout.CHANNEL


def machine_id(path: Path = MACHINE_ID) -> str:
    try:
        value = path.read_text().strip()
    except OSError as e:
        raise UserError(f"{path}: {e.strerror}: this appliance's place in a rollout is made from it",
                        hint="the machine id is set at first boot; check systemd-machine-id-setup") from None
    if len(value) != 32 or any(c not in "0123456789abcdef" for c in value):
        raise UserError(f"{path} does not hold a machine id (32 hex digits)", hint="check systemd-machine-id-setup")
    return value


def accepted_sequence(channel: str) -> int | None:
    """The highest sequence of CHANNEL's index this appliance acted on, if any."""
    try:
        data = read_capped(paths.channel_path(), MAX_RECORD_BYTES, what="the channel record")
        doc = loads_bounded(data) if data is not None else None
    except (UserError, ValueError):
        return None
    value = doc.get(channel) if isinstance(doc, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def accept(channel: rollout.Channel) -> None:
    """Record CHANNEL's sequence as acted on; the record only goes up."""
    last = accepted_sequence(channel.channel)
    if last is not None and last >= channel.sequence:
        return
    try:
        data = read_capped(paths.channel_path(), MAX_RECORD_BYTES, what="the channel record")
        doc = loads_bounded(data) if data is not None else {}
    except (UserError, ValueError):
        doc = {}
    record = dict(doc) if isinstance(doc, dict) else {}
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
        lines = [f"channel {self.channel.channel} (index sequence {self.channel.sequence}, signed {self.channel.signed_at})",
                 *("  " + line for line in self.decision.describe().splitlines())]
        if self.installs_at is None:
            lines.append("  installs: not while the index stands (paused or stopped, or nothing newer)")
        elif self.installs_at <= now:
            lines.append("  installs: now")
        else:
            lines.append(f"  installs: at {freshness.utc(self.installs_at)} (admission and maintenance window)")
        return "\n".join(lines)


def resolve(spec: str, *, ca: str | None, deadline: Deadline, keys_dir: Path, running_version: str, machine: str,
            now: float, windows: tuple[rollout.Window, ...]) -> Resolution:
    """Read and verify the index at SPEC, refuse one older than the last acted on, and decide."""
    base = spec[: -len(rollout.CHANNEL)]
    source = open_source(base or ".", ca, deadline)
    data = source.read_small(rollout.CHANNEL, rollout.MAX_CHANNEL_BYTES)
    sig = source.read_small(rollout.CHANNEL_SIG, MAX_SIG_BYTES)
    keys = manifest.trusted_keys(keys_dir)
    if not keys:
        raise UserError(f"{keys_dir}: no trusted keys (*.pub)", hint="the image is damaged")
    channel = rollout.verify(data, sig, keys)
    rollout.check_sequence(channel, accepted_sequence(channel.channel))
    decision = rollout.decide(channel, running_version, machine, now)
    bundle = (base + decision.target.path) if decision.target is not None else None
    return Resolution(channel, decision, bundle, rollout.when(decision, windows, now), rollout.in_window(windows, now))


def system_clock() -> float:
    return time.time()


def maintenance_windows() -> tuple[rollout.Window, ...]:
    """update.maintenance_windows of the device's configuration (none: any time)."""
    from appliance.host_settings import load_device

    return load_device().update.maintenance_windows
