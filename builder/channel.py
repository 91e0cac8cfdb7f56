"""`python3 -m builder channel`: sign a channel index (appliance/rollout.py) for a static update
server. The operator keeps a small TOML file (the channel's name and its releases: bundle
directory, barrier, rollout start, duration and state); each run signs it again with the release
key into the server's directory, one sequence number higher than the index there, so that a
newly signed index can start, pause, resume or stop a rollout and the appliances never take an
older one again. Each release's bundle directory must already be beside the index, holding that
version.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from appliance import bundle, freshness, manifest, rollout
from appliance.atomic import atomic_write
from appliance.errors import Refused, UserError
from appliance.safe_read import read_capped

HINT = "see docs/fleet.md for the channel file's form"


def _previous_sequence(out: Path) -> int:
    try:
        data = read_capped(out / rollout.CHANNEL, rollout.MAX_CHANNEL_BYTES, what="the channel index there")
    except UserError:
        return 0
    if data is None:
        return 0
    try:
        return rollout.load(manifest.parse_canonical(data)).sequence
    except (Refused, manifest.ManifestError):
        return 0


def make(source: Path, out: Path, key: Path, *, now: float) -> rollout.Channel:
    """Sign SOURCE (the operator's TOML) into OUT/channel.json and .sig; return what was signed."""
    try:
        doc: dict[str, Any] = tomllib.loads(source.read_text())
    except OSError as e:
        raise UserError(f"{source}: {e.strerror}", hint=HINT) from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{source}: not TOML ({e})", hint=HINT) from None
    private = manifest.load_private_key(key)
    body = {"format": rollout.CHANNEL_FORMAT, "channel": doc.get("channel"), "sequence": _previous_sequence(out) + 1,
            "signed_at": freshness.utc(now), "releases": doc.get("releases", []),
            "signer": manifest.key_id(private.public_key())}
    unknown = sorted(set(doc) - {"channel", "releases"})
    if unknown:
        raise UserError(f"{source}: unknown key {unknown[0]!r}", hint="a channel file holds channel and [[releases]]")
    try:
        channel = rollout.load(body)
    except Refused as e:
        raise UserError(f"{source}: {e.message.removeprefix(rollout.CHANNEL + ': ')}", hint=HINT) from None
    for release in channel.releases:
        index = out / release.path / bundle.BUNDLE_INDEX
        try:
            data = read_capped(index, bundle.MAX_INDEX_BYTES, what="a bundle index")
        except UserError as e:
            raise UserError(f"release {release.version}: {e.message}", hint=HINT) from None
        if data is None:
            raise UserError(f"release {release.version}: no bundle at {out / release.path}",
                            hint="release it there first: python3 -m builder release --output DIR/PATH")
        version = manifest.parse_canonical(data).get("version")
        if version != release.version:
            raise UserError(f"release {release.version}: {out / release.path} holds version {version}", hint=HINT)
    data = rollout.dumps(body)
    out.mkdir(parents=True, exist_ok=True)
    # the signature first, then the index: a server read in between sees the old index refused, never a new one unsigned
    atomic_write(out / rollout.CHANNEL_SIG, manifest.encode_signature(private.sign(data)), 0o644)
    atomic_write(out / rollout.CHANNEL, data, 0o644)
    return channel


def cmd_channel(args: argparse.Namespace) -> int:
    from appliance import config as config_model
    from builder import build

    config = config_model.load(Path(args.config), args.profile)
    key = build.signing_key_for(config, Path(args.signing_key) if args.signing_key else None)
    channel = make(Path(args.channel_file), Path(args.output), key, now=freshness.system_clock())
    print(f"signed {args.output}/{rollout.CHANNEL}: channel {channel.channel}, sequence {channel.sequence}, "
          f"{len(channel.releases)} release(s)")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser("channel", help="sign a channel index (phased rollouts) into an update server's directory")
    p.add_argument("channel_file", metavar="CHANNEL_TOML", help="the channel: its name and [[releases]] (version, path, barrier, rollout)")
    p.add_argument("--output", required=True, help="the update server's directory for this channel (bundles beside the index)")
    p.add_argument("--signing-key", help="the release signing key (default: as for build)")
    p.set_defaults(func=cmd_channel)
    return p
