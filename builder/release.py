# SPDX-License-Identifier: MIT
"""`python3 -m builder release`: a signed release bundle (a directory any static web server can serve).

The bundle holds the /usr and verity images, the UKI, the engine images unless the target has that
digest, with --install-image the zstd disk image and its block map (for installer/), the signed
manifest, the image's package manifest (informational: in SHA256SUMS, not in the index's file list),
SHA256SUMS, bundle.json(.sig), the signed index binding every file by size and SHA-256, and
timestamp.json(.sig), signed by the timestamp key: the index's expiry and sequence number (appliance/
freshness.py), signed again by `builder timestamp` before it expires.
Partition images stop at their last non-zero block (the updater zeroes the slot before writing), so a
slow-linked appliance does not download and hash gigabytes of zeros.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from appliance import cli_help, progress, schema
from appliance.atomic import atomic_write, replace_dir
from appliance.config import Config
from appliance.errors import UserError
from appliance.hashing import CHUNK, sha256_file
from appliance.patterns import VERSION
from appliance.run import call, checked
from appliance.signed import bundle_index, release_manifest, timestamp
from builder import keys
from builder.host_tools import FAILED_HINT, MISSING_HINT


def _copy(src: Path, dst: Path) -> None:
    """Copy keeping holes (the /usr image is sparse); reflink where the file system can."""
    if shutil.which("cp"):
        proc = call(["cp", "--reflink=auto", "--sparse=always", src, dst], None)
        if proc.returncode == 0:
            return
    shutil.copyfile(src, dst)


def data_end(path: Path) -> int:
    """PATH's length without its trailing zeros, rounded up to 4 KiB. SEEK_DATA/SEEK_HOLE skip the holes,
    so a sparse image costs a read of its last extent."""
    with open(path, "rb") as f:
        fd, size = f.fileno(), os.fstat(f.fileno()).st_size
        end, pos = 0, 0
        try:
            while pos < size:
                start = os.lseek(fd, pos, os.SEEK_DATA)
                pos = end = os.lseek(fd, start, os.SEEK_HOLE)
        except OSError:  # ENXIO: no data after POS
            pass
        while end > 0:
            begin = max(0, end - CHUNK)
            f.seek(begin)
            kept = f.read(end - begin).rstrip(b"\0")
            if kept:
                return min(size, -(-(begin + len(kept)) // 4096) * 4096)
            end = begin
        return 0


def _copy_trimmed(src: Path, dst: Path) -> int:
    """Copy SRC to DST without its trailing zeros; return SRC's full size."""
    _copy(src, dst)
    os.truncate(dst, data_end(src))
    return src.stat().st_size


def _known_engine_digests(previous: Path | Iterable[str] | None) -> tuple[set[str], str | None]:
    """The engine digests the target already has, and the previous bundle's version if a directory was given."""
    if previous is None:
        return set(), None
    if isinstance(previous, str | os.PathLike):
        index_path = Path(previous) / bundle_index.BUNDLE_INDEX
        try:
            index = bundle_index.load_index(release_manifest.parse_canonical(index_path.read_bytes()))
        except FileNotFoundError:
            raise UserError(f"{index_path}: no such file", hint="--previous takes a bundle directory or a version") from None
        except release_manifest.ManifestError as e:
            raise UserError(f"{index_path}: {e.message}", hint=e.hint) from None
        return {index.engine_digest}, index.version
    return {str(d) for d in previous}, None


def _check_newer(config: Config, previous: str | None) -> None:
    """A release must be newer than the previous one (PREVIOUS, a version, None when none was given)."""
    if previous is None:
        return
    version = config.appliance.version
    if release_manifest.version_tuple(version) > release_manifest.version_tuple(previous):
        return
    if release_manifest.version_tuple(version) == release_manifest.version_tuple(previous):
        what = f"version {version} is the same as the previous release {previous}: appliance.version was not raised"
    else:
        what = f"version {version} is older than the previous release {previous}"
    raise UserError(
        what, hint=f"raise appliance.version in appliance.toml above {previous}, then `python3 -m builder --profile {config.profile} build`"
    )


def make_bundle(
    config: Config,
    build_output_dir: Path,
    bundle_dir: Path,
    signing_key: Path,
    previous_bundle_or_engine_digests: Path | Iterable[str] | None = None,
    previous_version: str | None = None,
    with_install_image: bool = False,
    timestamp_key: Path | None = None,
    timestamp_days: int = timestamp.DEFAULT_DAYS,
) -> bundle_index.BundleIndex:
    """Write the bundle for the build in BUILD_OUTPUT_DIR to BUNDLE_DIR; return its index.

    PREVIOUS_BUNDLE_OR_ENGINE_DIGESTS: the target's bundle directory or engine digests (no engine image
    then if its digest is among them). The version must be greater than PREVIOUS_VERSION and the previous bundle's.
    TIMESTAMP_KEY (default: timestamp.key beside SIGNING_KEY; the demo makes one) signs its first
    timestamp, valid for TIMESTAMP_DAYS."""
    version = config.appliance.version
    timestamp_key = timestamp_key or keys.timestamp_key(signing_key.with_name(f"{keys.TIMESTAMP_NAME}.key"),
                                                        make=config.profile == "demo")
    _check_days(timestamp_days)
    known_digests, prev_bundle_version = _known_engine_digests(previous_bundle_or_engine_digests)
    for prev in (previous_version, prev_bundle_version):
        _check_newer(config, prev)
    out = build_output_dir
    manifest_data = _read(out / "manifest.json")
    manifest_sig = _read(out / "manifest.json.sig")
    signer = release_manifest.key_id(release_manifest.load_private_key(signing_key).public_key())
    if release_manifest.key_id(release_manifest.load_private_key(timestamp_key).public_key()) == signer:
        raise UserError(f"{timestamp_key} is the release key {signer}: timestamps need a key of their own",
                        hint="make one with: python3 -m builder keys generate --timestamp")
    try:
        release = release_manifest.load(release_manifest.parse_canonical(manifest_data))
        release_manifest.decode_signature(manifest_sig)
    except release_manifest.ManifestError as e:
        raise UserError(f"{out / 'release_manifest.json'}: {e.message}", hint=e.hint) from None
    for key, got, want in (
        ("version", release.version, version),
        ("profile", release.profile, config.profile),
        ("min_version", release.min_version, config.appliance.min_version),
    ):
        if got != want:
            raise UserError(
                f"{out}: the build is {key} {got}, the configuration says {want}",
                hint=f"build it again: python3 -m builder --profile {config.profile} build",
            )
    if release.engine_image.digest != config.engine.digest:
        raise UserError(f"{out}: the build's engine image is not {config.engine.digest}", hint="build it again")

    names = bundle_index.payload_names(version, config.engine.digest, with_engine=False)
    sources = {names[r]: out / names[r] for r in (*bundle_index.USR_ROLES, "uki")}
    if config.engine.digest not in known_digests:
        # mkosi's split engine partitions (SplitName=engine, engine-verity), shipped under the digest's name
        engine_names = bundle_index.payload_names(version, config.engine.digest, with_engine=True)
        sources[engine_names["engine"]] = out / f"appliance_{version}.engine.raw"
        sources[engine_names["engine-verity"]] = out / f"appliance_{version}.engine-verity.raw"
    disk_image = out / f"appliance_{version}.raw"
    for path in [*sources.values(), *([disk_image] if with_install_image else [])]:
        if not path.is_file():
            hint = f"build first: python3 -m builder --profile {config.profile} build"
            raise UserError(f"{path}: missing from the build output", hint=hint)
    usrhash = bundle_index.uki_facts(sources[names["uki"]])["usrhash"]
    if not usrhash:
        raise UserError(f"{sources[names['uki']]}: its command line has no usrhash=", hint="the image must boot a verity-protected /usr")
    try:
        signed = bundle_index.signed_root_hash(sources[names["usr-verity-sig"]])
    except ValueError as e:
        raise UserError(f"{sources[names['usr-verity-sig']]}: {e}", hint="build it again") from None
    if signed != usrhash:
        raise UserError(f"{sources[names['usr-verity-sig']]} signs root hash {signed[:16]}…, the kernel image boots {usrhash[:16]}…",
                        hint="build it again: the two come from one build")
    packages = _package_manifest(out / bundle_index.mkosi_manifest_name(version), config.profile)

    bundle_dir = bundle_dir.resolve()
    bundle_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{bundle_dir.name}.", suffix=".tmp", dir=bundle_dir.parent))
    try:
        tmp.chmod(0o755)
        partition_sizes = {}
        all_names = bundle_index.payload_names(version, config.engine.digest, with_engine=True)
        trimmed = {all_names[r] for r in bundle_index.TRIMMED_ROLES}
        # the bar counts apparent sizes, mostly holes that cost nothing
        with progress.Progress("copying payloads", total=sum(src.stat().st_size for src in sources.values())) as p:
            for name, src in sources.items():
                if name in trimmed:
                    partition_sizes[name] = _copy_trimmed(src, tmp / name)
                else:
                    _copy(src, tmp / name)
                p.advance(src.stat().st_size)
        (tmp / "manifest.json").write_bytes(manifest_data)
        (tmp / "manifest.json.sig").write_bytes(manifest_sig)
        # the package manifest: in SHA256SUMS only, so that an updater neither fetches it nor
        # refuses an index whose file list it does not know (bundle_index.load_index)
        (tmp / bundle_index.packages_name(version)).write_bytes(packages)
        installable = _install_image(disk_image, tmp, version) if with_install_image else []
        listed = sorted([*sources, *installable, "manifest.json", "manifest.json.sig"])
        summed = sorted([*listed, bundle_index.packages_name(version)])
        with progress.Progress("hashing payloads", total=sum((tmp / name).stat().st_size for name in summed)) as p:
            sums = {name: sha256_file(tmp / name, p.advance) for name in summed}
        (tmp / "SHA256SUMS").write_text("".join(f"{sums[n]}  {n}\n" for n in summed))
        listed.append("SHA256SUMS")
        sums["SHA256SUMS"] = sha256_file(tmp / "SHA256SUMS")
        index = {
            "format": bundle_index.BUNDLE_FORMAT,
            "version": version,
            "min_version": config.appliance.min_version,
            "profile": config.profile,
            "engine_digest": config.engine.digest,
            "usrhash": usrhash,
            "files": [{"name": n, "sha256": sums[n], "size": (tmp / n).stat().st_size} for n in sorted(listed)],
            "partition_sizes": partition_sizes,
            "manifest_sha256": hashlib.sha256(manifest_data).hexdigest(),
            "signer": signer,
        }
        model = bundle_index.load_index(index)  # what the updater will check, checked before signing
        bundle_index.read_packages(tmp, model)  # and the package manifest as the build host reads it back
        data = release_manifest.canonical(index)
        signature = release_manifest.encode_signature(release_manifest.load_private_key(signing_key).sign(data))
        (tmp / bundle_index.BUNDLE_INDEX).write_bytes(data)
        (tmp / bundle_index.BUNDLE_SIG).write_bytes(signature)
        _write_timestamp(tmp, data, version, timestamp_key, timestamp_days)
        for f in tmp.iterdir():
            f.chmod(0o644)
        replace_dir(tmp, bundle_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return model


def _check_days(days: int) -> None:
    if not 1 <= days <= timestamp.MAX_DAYS:
        raise UserError(f"--days {days}: expected a number of days from 1 to {timestamp.MAX_DAYS}",
                        hint=f"the index expires that many days after it is signed (default {timestamp.DEFAULT_DAYS}); sign again before")


def _write_timestamp(directory: Path, index_data: bytes, version: str, key: Path, days: int) -> timestamp.Timestamp:
    """A timestamp for INDEX_DATA signed by KEY with its next sequence number, into DIRECTORY: each
    file replaced whole (a reader between the two renames sees a mismatched pair, refused, and
    reads it again on its next run)."""
    signer = release_manifest.key_id(release_manifest.load_private_key(key).public_key())
    doc = timestamp.make(index_data, version, keys.next_sequence(key), signer, now=time.time(), days=days)
    data, sig = timestamp.sign(doc, key)
    atomic_write(directory / timestamp.TIMESTAMP, data)
    atomic_write(directory / timestamp.TIMESTAMP_SIG, sig)
    return timestamp.load(doc)


def sign_timestamp(bundle_dir: Path, key: Path, days: int = timestamp.DEFAULT_DAYS) -> timestamp.Timestamp:
    """`builder timestamp`: a fresh timestamp for the bundle in BUNDLE_DIR, its sequence the next
    KEY signs. The index is read as the updater reads it (canonical form, schema), not re-signed."""
    _check_days(days)
    index_path = bundle_dir / bundle_index.BUNDLE_INDEX
    hint = "give a bundle directory written by python3 -m builder release"
    if not bundle_dir.is_dir():
        raise UserError(f"{bundle_dir}: no such directory", hint=hint)
    try:
        data = index_path.read_bytes()
        if len(data) > bundle_index.MAX_INDEX_BYTES:
            raise UserError(f"{index_path}: {len(data)} bytes, more than a bundle index has ({bundle_index.MAX_INDEX_BYTES})", hint=hint)
        index = bundle_index.load_index(release_manifest.parse_canonical(data))
    except FileNotFoundError:
        raise UserError(f"{bundle_dir}: not a bundle directory (no {bundle_index.BUNDLE_INDEX})", hint=hint) from None
    except OSError as e:
        raise UserError(f"{index_path}: cannot read ({e.strerror})", hint=hint) from None
    except release_manifest.ManifestError as e:
        raise UserError(f"{index_path}: {e.message}", hint=e.hint) from None
    return _write_timestamp(bundle_dir, data, index.version, keys.timestamp_key(key), days)


def _install_image(disk_image: Path, directory: Path, version: str) -> list[str]:
    """The disk image zstd-compressed and its block map, into DIRECTORY."""
    names = bundle_index.install_names(version)
    with progress.step("compressing the install image"):
        checked(["bmaptool", "create", "-o", directory / names["install-bmap"], disk_image], what="bmaptool create", hint=FAILED_HINT,
                timeout=None, missing_hint=MISSING_HINT)
        checked(["zstd", "-q", "-T0", "-6", "-o", directory / names["install-image"], disk_image], what="zstd", hint=FAILED_HINT,
                timeout=None, missing_hint=MISSING_HINT)
    return list(names.values())


def _package_manifest(path: Path, profile: str) -> bytes:
    """The build's package manifest (mkosi's, ManifestFormat=json), checked for its form. Its
    config.version is not compared: bench/upgrade.py releases one build under the next version."""
    hint = f"build again with image/mkosi.conf's ManifestFormat=json: python3 -m builder --profile {profile} build"
    if not path.is_file():
        raise UserError(f"{path}: missing from the build output (no package manifest)", hint=hint)
    data = path.read_bytes()
    try:
        bundle_index.load_packages(data)
    except ValueError as e:
        raise UserError(f"{path}: {e}", hint=hint) from None
    return data


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file", hint="build the image first: python3 -m builder build") from None


# ----------------------------------------------------------------------------------- CLI glue


def _is_dir(name: str) -> bool:
    try:
        return Path(name).is_dir()
    except OSError:  # e.g. a name too long to be a path
        return False


def cmd_release(args: argparse.Namespace) -> int:
    import appliance.config
    from builder import build

    config = appliance.config.load(Path(args.config), args.profile)
    out = Path(args.build_output) if args.build_output else build.output_dir(config)
    bundle_dir = Path(args.output) if args.output else build.ROOT / "out" / "bundles" / f"{config.profile}-{config.appliance.version}"
    previous: Path | list[str] | None = None
    previous_version = None
    if args.previous:
        if _is_dir(args.previous):
            previous = Path(args.previous)
        elif VERSION.fullmatch(args.previous):
            previous_version = args.previous
            _check_newer(config, previous_version)  # before the keys: the first thing to fix
        else:
            raise UserError(
                f"--previous {schema.shown(args.previous)}: no such bundle directory, and not a version",
                hint="give the previous release's bundle directory (out/bundles/PROFILE-VERSION) or its version, e.g. --previous 1.0.0",
            )
    if args.engine_digest:
        previous = [*(previous if isinstance(previous, list) else []), *args.engine_digest]
        if args.previous and _is_dir(args.previous):
            raise UserError("--engine-digest and a --previous bundle directory exclude each other", hint="give one of them")
    key = build.signing_key_for(config, Path(args.signing_key) if args.signing_key else None)
    index = make_bundle(config, out, bundle_dir, key, previous, previous_version, with_install_image=args.install_image)
    total = sum(f.size for f in index.files)
    engine = "with" if any(f.name.startswith("engine_") for f in index.files) else "without"
    print(f"bundle {index.version} ({config.profile}) at {bundle_dir}: {len(index.files)} files, {total} bytes, {engine} an engine image")
    return 0


def default_timestamp_key(config: Config) -> Path:
    """keys/timestamp.key; the demo's beside its release key (build.signing_key_for)."""
    from builder import build

    directory = build.work_dir(config) / "keys" if config.profile == "demo" else keys.DEFAULT_DIR
    return directory / f"{keys.TIMESTAMP_NAME}.key"


def cmd_timestamp(args: argparse.Namespace) -> int:
    import appliance.config

    key = Path(args.key) if args.key else default_timestamp_key(appliance.config.load(Path(args.config), args.profile))
    ts = sign_timestamp(Path(args.bundle_dir), key, args.days)
    print(f"timestamp {ts.sequence} for bundle {ts.version} at {args.bundle_dir}: signed {ts.signed_at} by {ts.signer}, "
          f"expires {ts.expires}")
    return 0


def add_timestamp_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `timestamp` on the builder's subparsers."""
    p = cli_help.verb_parser(
        sub, "timestamp", "sign a bundle's timestamp again (its index expires without one; run before it expires)",
        examples=["python3 -m builder timestamp out/bundles/production-1.4.0 --days 30"],
        exit_codes=[(0, "the timestamp is signed"), cli_help.BAD_INPUT],
    )
    p.add_argument("bundle_dir", metavar="BUNDLE_DIR", help="a bundle directory written by release")
    p.add_argument("--days", type=int, default=timestamp.DEFAULT_DAYS,
                   help=f"days until the index expires (1 to {timestamp.MAX_DAYS}, default {timestamp.DEFAULT_DAYS})")
    p.add_argument("--key", help="the timestamp key (default: keys/timestamp.key; the demo's beside its release key)")
    p.set_defaults(func=cmd_timestamp)
    return p


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `release` on the builder's subparsers."""
    p = cli_help.verb_parser(
        sub, "release", "write a signed release bundle from the last build",
        examples=["python3 -m builder release", "python3 -m builder --profile demo release --previous 1.3.0 --install-image"],
        exit_codes=[(0, "the bundle is written (its directory on stdout)"),
                    (2, "bad input, no build to release, or a version not greater than --previous (one line and a hint)")],
    )
    p.add_argument("--output", help="the bundle directory (default: out/bundles/PROFILE-VERSION)")
    p.add_argument("--build-output", help="the build's output directory (default: out/PROFILE)")
    p.add_argument("--signing-key", help="the release signing key (default: as for build)")
    p.add_argument("--previous", help="the previous release: its bundle directory or its version; the new one must be greater")
    p.add_argument("--engine-digest", action="append", help="an engine digest the target has already (repeatable): no engine image then")
    p.add_argument("--install-image", action="store_true",
                   help="add the whole disk image (zstd) and its block map, so that the installer can install a bare host over HTTPS")
    p.set_defaults(func=cmd_release)
    return p

