# SPDX-License-Identifier: MIT
"""`python3 -m builder channel`: sign a channel index (appliance/rollout.py) for a static update
server. The operator keeps a small TOML file (the channel's name and its releases: bundle
directory, barrier, rollout start, duration and state); each run signs it again with the release
key into the server's directory, one sequence number higher than the index there and valid for
--days (7 by default), so that a newly signed index can start, pause, resume or stop a rollout,
the appliances never take an older one again, and one kept from long ago is refused as stale: sign
it again well inside its validity, changed or not. Each release's bundle directory must already be
beside the index, holding that version.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from appliance import cli_help, rollout, schema
from appliance.atomic import atomic_write
from appliance.errors import Refused, UserError
from appliance.safe_read import read_capped
from appliance.signed import bundle_index, release_manifest, timestamp

HINT = "see docs/fleet.md for the channel file's form"


def _previous_sequence(out: Path) -> int:
    """The sequence of the index in OUT (0: none there). Read from any format, so that the count
    goes on across a format change; an index there whose sequence cannot be read is refused, never
    counted from 0 again (appliances would refuse every index below the one they accepted)."""
    path = out / rollout.CHANNEL
    hint = (f"put the last index signed back into {path}; or remove it to count from 1 again "
            "(appliances that accepted a higher sequence then refuse the new index)")
    data = read_capped(path, rollout.MAX_CHANNEL_BYTES, what="the channel index there", hint=hint)
    if data is None:
        return 0
    try:
        doc = release_manifest.parse_canonical(data)
    except release_manifest.ManifestError as e:
        raise UserError(f"{path}: {e.message}: its sequence cannot be read", hint=hint) from None
    sequence = doc.get("sequence") if isinstance(doc, dict) else None
    if not isinstance(sequence, int) or isinstance(sequence, bool) or not 1 <= sequence < schema.MAX_INT:
        raise UserError(f"{path}: sequence = {schema.shown(sequence, 40)}: expected a number from 1 to {schema.MAX_INT - 1}",
                        hint=hint)
    return sequence


def make(source: Path, out: Path, key: Path, *, now: float, days: int = timestamp.DEFAULT_DAYS) -> rollout.Channel:
    """Sign SOURCE (the operator's TOML) into OUT/channel.json and .sig, valid DAYS from NOW;
    return what was signed."""
    if isinstance(days, bool) or not 1 <= days <= timestamp.MAX_DAYS:
        raise UserError(f"--days {days}: expected a number of days from 1 to {timestamp.MAX_DAYS}",
                        hint=f"the index expires that many days after it is signed (default {timestamp.DEFAULT_DAYS}); sign again before")
    try:
        doc: dict[str, Any] = tomllib.loads(source.read_text())
    except OSError as e:
        raise UserError(f"{source}: {e.strerror}", hint=HINT) from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{source}: not TOML ({e})", hint=HINT) from None
    private = release_manifest.load_private_key(key)
    body = {"format": rollout.CHANNEL_FORMAT, "channel": doc.get("channel"), "sequence": _previous_sequence(out) + 1,
            "signed_at": timestamp.utc(now), "expires_at": timestamp.utc(now + days * 86400), "releases": doc.get("releases", []),
            "signer": release_manifest.key_id(private.public_key())}
    unknown = sorted(set(doc) - {"channel", "releases"})
    if unknown:
        raise UserError(f"{source}: unknown key {unknown[0]!r}", hint="a channel file holds channel and [[releases]]")
    try:
        channel = rollout.load(body)
    except Refused as e:
        raise UserError(f"{source}: {e.message.removeprefix(rollout.CHANNEL + ': ')}", hint=HINT) from None
    for release in channel.releases:
        index = out / release.path / bundle_index.BUNDLE_INDEX
        try:
            data = read_capped(index, bundle_index.MAX_INDEX_BYTES, what="a bundle index")
        except UserError as e:
            raise UserError(f"release {release.version}: {e.message}", hint=HINT) from None
        if data is None:
            raise UserError(f"release {release.version}: no bundle at {out / release.path}",
                            hint="release it there first: python3 -m builder release --output DIR/PATH")
        version = release_manifest.parse_canonical(data).get("version")
        if version != release.version:
            raise UserError(f"release {release.version}: {out / release.path} holds version {version}", hint=HINT)
    data = rollout.dumps(body)
    out.mkdir(parents=True, exist_ok=True)
    # the signature first, then the index: a server read in between sees the old index refused, never a new one unsigned
    atomic_write(out / rollout.CHANNEL_SIG, release_manifest.encode_signature(private.sign(data)), 0o644)
    atomic_write(out / rollout.CHANNEL, data, 0o644)
    return channel


def cmd_channel(args: argparse.Namespace) -> int:
    import appliance.config
    from builder import build

    config = appliance.config.load(Path(args.config), args.profile)
    key = build.signing_key_for(config, Path(args.signing_key) if args.signing_key else None)
    channel = make(Path(args.channel_file), Path(args.output), key, now=timestamp.system_clock(), days=args.days)
    print(f"signed {args.output}/{rollout.CHANNEL}: channel {channel.channel}, sequence {channel.sequence}, "
          f"{len(channel.releases)} release(s), expires {channel.expires_at}")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = cli_help.verb_parser(
        sub, "channel", "sign a channel index (phased rollouts) into an update server's directory",
        examples=["python3 -m builder channel stable.toml --output /srv/updates/stable"],
        exit_codes=[(0, "the index is signed"), cli_help.BAD_INPUT],
        details="docs/fleet.md describes the channel file.",
    )
    p.add_argument("channel_file", metavar="CHANNEL_TOML", help="the channel: its name and [[releases]] (version, path, barrier, rollout)")
    p.add_argument("--output", required=True, help="the update server's directory for this channel (bundles beside the index)")
    p.add_argument("--signing-key", help="the release signing key (default: as for build)")
    p.add_argument("--days", type=int, default=timestamp.DEFAULT_DAYS,
                   help=f"days until the index expires (1 to {timestamp.MAX_DAYS}, default {timestamp.DEFAULT_DAYS}); "
                        "appliances refuse it after that: sign it again before")
    p.set_defaults(func=cmd_channel)
    return p
