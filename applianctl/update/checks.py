# SPDX-License-Identifier: MIT
"""Whether a bundle may be installed here, and whether what was downloaded is what it claims.

Before any download: the running version is judged good, the version is newer (older only with
--allow-downgrade, the same never), min_version is met, the profile and the engine image fit this
appliance, the partition images fit the inactive slot. After every file's SHA-256 matched: the
inner release manifest agrees with bundle.json, the kernel image boots its usrhash, and the engine
images about to be written hash to the root hash and label the manifest pins.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509

import applianctl.slots.view
from appliance import authenticode, efivars
from appliance.errors import Refused, UserError
from appliance.run import CompletedProcess, TimeoutExpired, call
from appliance.safe_read import read_capped
from appliance.signed import release_manifest
from appliance.signed.bundle_index import MAX_SIG_BYTES, NOT_OURS, BundleIndex, engine_short, payload_names, signed_root_hash, uki_facts
from applianctl.slots.engine import EngineChoice
from applianctl.slots.entries import BAD, GOOD, ON_TRIAL
from applianctl.slots.partitions import Slot


def check_judged(view: applianctl.slots.view.View) -> None:
    """Writing the inactive slot is safe only when the running version is judged good (its entry
    carries no boot counter): while it is on trial the other slot may hold the only good version."""
    state, why = view.running_state()
    running = view.running_version
    other = view.other
    if state == GOOD:
        return
    if state == ON_TRIAL:
        raise UserError(
            f"refused: the running version {running} is on trial ({why}); slot {other.name if other else '?'} "
            "may hold the only version known to be good",
            hint="wait until this boot's assessment has passed (`applianctl slots` shows it judged good), then run the same command again",
        )
    if state == BAD:
        raise UserError(
            f"refused: the running version {running} is marked bad ({why}); "
            f"slot {other.name if other else '?'} holds the version to fall back to",
            hint="reboot into the other slot first (it is the default now), then update from there",
        )
    raise UserError(f"refused: cannot tell whether the running version is judged good ({why})", hint="see applianctl slots")


def inactive_slot(view: applianctl.slots.view.View) -> Slot:
    booted = [s for s in view.slots if s.booted]
    if len(view.slots) != 2 or len(booted) != 1:
        errors = f" ({'; '.join(view.errors)})" if view.errors else ""
        raise UserError(
            f"expected two /usr slots, one of them booted; found {len(view.slots)} slot(s), {len(booted)} booted{errors}",
            hint="the second slot is made by systemd-repart on first boot; check `sfdisk -l` of the disk",
        )
    other = view.other
    assert other is not None
    return other


def check_staged_newer(index: BundleIndex, running: release_manifest.Manifest, allow_downgrade: bool) -> None:
    """--apply, before check_policy: a staged bundle no longer newer than the running version (which
    changed since it was staged) is a usage error (exit 2), not a bad bundle."""
    new, cur = release_manifest.version_tuple(index.version), release_manifest.version_tuple(running.version)
    if new == cur or (new < cur and not allow_downgrade):
        raise UserError(
            f"the staged bundle {index.version} is not newer than the running version {running.version}",
            hint="stage a newer one: `applianctl update --download-only SOURCE` (an older one only with --allow-downgrade)",
        )


def check_policy(index: BundleIndex, running: release_manifest.Manifest, allow_downgrade: bool) -> bool:
    """Refuse a bundle the running version must not take; True when it is a downgrade."""
    new, cur = index.version, running.version
    if release_manifest.version_tuple(new) == release_manifest.version_tuple(cur):
        raise Refused(f"bundle version {new} is the running version", hint="nothing to do; a newer bundle is needed to upgrade")
    downgrade = release_manifest.version_tuple(new) < release_manifest.version_tuple(cur)
    if downgrade and not allow_downgrade:
        raise Refused(f"bundle version {new} is older than the running version {cur}", hint="to go back on purpose, add --allow-downgrade")
    if release_manifest.version_tuple(index.min_version) > release_manifest.version_tuple(cur):
        raise Refused(
            f"bundle {new} may only be installed over {index.min_version} or newer; this is {cur}",
            hint=f"install an intermediate release (at least {index.min_version}) first",
        )
    if index.profile != running.profile:
        raise Refused(
            f"bundle is for the {index.profile} profile; this appliance runs {running.profile}",
            hint="use a bundle built with the same --profile",
        )
    return downgrade


def check_engine(index: BundleIndex, running: release_manifest.Manifest, view: applianctl.slots.view.View) -> EngineChoice | None:
    """Where the new version's engine comes from, before anything is downloaded: None when it runs
    the running engine; else the engine slot that holds it or that it is written to
    (slots.engine.choose_engine_slot: every bootable entry's engine stays, the running one is never
    written). Refused in one line when no slot may be written, or when the engine is needed and
    the bundle does not carry it."""
    if index.engine_digest == running.engine_image.digest:
        return None
    choice = view.engine_slot_for(index.engine_digest)
    carried = payload_names(index.version, index.engine_digest, True)["engine"] in {f.name for f in index.files}
    if not choice.already_present and not carried:
        raise Refused(
            f"bundle {index.version} runs engine image {engine_short(index.engine_digest)}, which this appliance does not have, "
            "and does not carry it",
            hint="release it again so that it carries its engine image (do not name that digest with --engine-digest)",
        )
    return choice


def writes_engine(choice: EngineChoice | None) -> bool:
    return choice is not None and not choice.already_present


def check_fits(index: BundleIndex, inactive: Slot) -> None:
    sizes = index.partition_sizes
    names = payload_names(index.version, index.engine_digest, False)
    if inactive.signature is None:
        raise Refused(f"slot {inactive.name} has no partition for /usr's root hash signature (usr-verity-sig): this disk was "
                      "installed before releases were signed that way, and nothing was written",
                      hint="re-install the appliance from an installer medium (docs/upgrades.md, \"Disks installed before\")")
    targets = [("usr", inactive.usr), ("usr-verity", inactive.verity), ("usr-verity-sig", inactive.signature)]
    for role, part in targets:
        if part is None:
            raise Refused(f"slot {inactive.name} has no {role} partition", hint="the disk was not set up by this image (repart.d)")
        size = sizes[names[role]]
        if size > part.size_bytes:
            raise Refused(
                f"{names[role]} is {size} bytes, larger than slot {inactive.name}'s {role} partition ({part.size_bytes} bytes)",
                hint="this bundle does not fit this appliance's disk layout",
            )


def check_staged(index: BundleIndex, staging: Path, keys_dir: Path, engine_written: bool = False,
                 running_engine: release_manifest.EngineImage | None = None, efivars_dir: Path | None = None) -> None:
    """What is inside the verified files agrees with the signed index; with ENGINE_WRITTEN (the
    plan writes the engine slot), the staged engine images hash to what the manifest pins; when the
    new version runs the RUNNING_ENGINE's image, its manifest pins the running engine store's root
    hash (the slot it will open, unwritten). With EFIVARS_DIR, a kernel image the firmware would
    refuse (check_kernel_trusted)."""
    names = payload_names(index.version, index.engine_digest, False)
    # On /var: regular files, capped before reading (the hashes below are checked after).
    again = "fetch the bundle again: applianctl update SOURCE (or --download-only SOURCE)"
    try:
        data = read_capped(staging / names["manifest"], release_manifest.MAX_MANIFEST_BYTES, what="a release manifest")
        sig = read_capped(staging / names["manifest-sig"], MAX_SIG_BYTES, what="a signature")
    except UserError as e:
        raise Refused(f"the staged bundle: {e.message}", hint=again) from None
    if data is None or sig is None:
        raise Refused(f"the staged bundle has no {names['manifest'] if data is None else names['manifest-sig']}", hint=again)
    if hashlib.sha256(data).hexdigest() != index.manifest_sha256:
        raise Refused("manifest.json does not match bundle.json's manifest_sha256", hint="the bundle is inconsistent")
    try:
        release = release_manifest.verify(data, sig, keys_dir)
    except release_manifest.ManifestError as e:
        raise Refused(f"the bundle's release manifest: {e.message}", hint=e.hint) from None
    for key, got, want in (
        ("version", release.version, index.version),
        ("min_version", release.min_version, index.min_version),
        ("profile", release.profile, index.profile),
    ):
        if got != want:
            raise Refused(f"the release manifest says {key} {got}, bundle.json {want}", hint="the bundle is inconsistent")
    if release.engine_image.digest != index.engine_digest:
        raise Refused("the release manifest names another engine image than bundle.json", hint="the bundle is inconsistent")
    # The new version's engine-store unit opens the slot by this label: the one the updater writes or finds.
    label = "engine_" + engine_short(release.engine_image.digest)
    if release.engine_image.store_label != label:
        raise Refused(f"the release manifest labels its engine store {release.engine_image.store_label}, not {label} "
                      "(engine_ and its digest's first 12 hex digits)", hint="the bundle is inconsistent")
    if engine_written:
        check_engine_images(index, release.engine_image, staging)
    elif running_engine is not None and release.engine_image.digest == running_engine.digest \
            and release.engine_image.store_roothash != running_engine.store_roothash:
        raise Refused(f"the release manifest pins engine store {label} at root hash {release.engine_image.store_roothash[:16]}…, "
                      f"the running one (which it would open, unwritten) has {running_engine.store_roothash[:16]}…: "
                      "the new version could not open its engine",
                      hint="release it again from the build that made the running engine store")
    try:
        signed = signed_root_hash(staging / names["usr-verity-sig"])
    except (OSError, ValueError) as e:
        raise Refused(f"{names['usr-verity-sig']}: {e}", hint="the bundle is inconsistent") from None
    if signed != index.usrhash:
        raise Refused(f"{names['usr-verity-sig']} signs another root hash than bundle.json's usrhash", hint="the bundle is inconsistent")
    facts = uki_facts(staging / names["uki"])
    if facts["usrhash"] != index.usrhash:
        raise Refused(f"{names['uki']} boots usrhash {facts['usrhash']}, not bundle.json's", hint="the bundle is inconsistent")
    if facts["image_version"] not in (None, index.version):
        raise Refused(f"{names['uki']} is version {facts['image_version']}, not {index.version}", hint="the bundle is inconsistent")
    if efivars_dir is not None:
        check_kernel_trusted(staging / names["uki"], efivars_dir)


def check_kernel_trusted(uki: Path, efivars_dir: Path) -> None:
    """Under Secure Boot, a kernel image whose signer the firmware's db does not trust is refused
    before anything is written: the firmware would refuse to start it, and its boot manager then
    stays in its own menu with nobody to choose the previous version (seen in QEMU with OVMF).
    Without Secure Boot enforcing the firmware checks nothing, and neither does this."""
    state = efivars.secure_boot_state(efivars_dir)
    if not efivars.enforcing(state):
        return
    try:
        db = [x509.load_der_x509_certificate(der) for der in efivars.db_certificates(efivars_dir)]
    except ValueError as e:
        raise Refused(f"the firmware's db cannot be read ({e}), so {uki.name}'s signer cannot be checked",
                      hint="check the firmware's Secure Boot keys in its setup (or enroll the appliance's keys again)") from None
    try:
        found = authenticode.signers(uki)
    except (OSError, authenticode.NotSigned) as e:
        raise Refused(f"{uki.name} has no signature this firmware could check ({e}); under Secure Boot it would never start",
                      hint="release it again from a build signed with the appliance's Secure Boot key") from None
    if not any(authenticode.trusted_by(s, db) for s in found):
        raise Refused(f"{uki.name} is signed by {found[0].subject} (certificate SHA-256 {found[0].fingerprint[:16]}…), "
                      "which this firmware's db does not trust; "
                      "under Secure Boot it would never start",
                      hint="release it again with the Secure Boot key whose certificate is enrolled here "
                           "(or enroll that key's certificate in db first)")


VERITYSETUP = "veritysetup"
HASH_BYTES_PER_S = 20 << 20  # a slow disk's read and SHA-256 rate: veritysetup's time limit scales with the image
HASH_BASE_S = 60.0
_SUPERBLOCK_FIELD = re.compile(r"^(Data blocks|Data block size):\s*([0-9]{1,20})\s*$", re.M)


def check_engine_images(index: BundleIndex, engine: release_manifest.EngineImage, staging: Path) -> None:
    """The staged engine image and its hash tree must hash (veritysetup verify, in user space on
    the files) to ENGINE's store_roothash from the signed manifest: the check the new version's
    engine-store unit makes at boot, made before any slot is touched. The verity superblock names
    how much data the tree covers; an image shipped without its trailing zeros that ends before
    that is checked padded with zeros to it, as the zeroed slot will hold it."""
    names = payload_names(index.version, index.engine_digest, True)
    data, tree = staging / names["engine"], staging / names["engine-verity"]
    full = index.partition_sizes.get(names["engine"], 0)
    again = "the bundle is inconsistent: nothing was written; release it again (python3 -m builder release)"
    limit = HASH_BASE_S + full / HASH_BYTES_PER_S
    dump = _veritysetup(["dump", tree], limit)
    fields = dict(_SUPERBLOCK_FIELD.findall(dump.stdout))
    if dump.returncode != 0 or len(fields) != 2:
        raise Refused(f"{names['engine-verity']} is not a dm-verity hash tree with a superblock", hint=again)
    covered = int(fields["Data blocks"]) * int(fields["Data block size"])
    if covered > full:
        raise Refused(f"{names['engine-verity']} covers {covered} bytes of data, more than the engine partition's {full}",
                      hint=again)
    with _padded(data, covered) as checked:
        verify = _veritysetup(["verify", checked, tree, engine.store_roothash], limit)
    if verify.returncode != 0:
        raise Refused("the bundle's engine image does not hash to the root hash its release manifest pins", hint=again)


def _veritysetup(args: list[str | Path], limit: float) -> CompletedProcess[str]:
    try:
        return call([VERITYSETUP, *args], timeout=limit)
    except FileNotFoundError:
        raise UserError(f"{VERITYSETUP} is not installed: the engine image cannot be checked", hint="the image is damaged") from None
    except TimeoutExpired:
        raise UserError(f"{VERITYSETUP} {args[0]} did not finish within {limit:g} s", hint="run the same command again") from None


@contextlib.contextmanager
def _padded(path: Path, size: int) -> Iterator[Path]:
    """PATH, or when it is shorter than SIZE a sparse copy beside it padded with zeros to SIZE
    (only the blocks that are not zero take space), removed afterwards."""
    if path.stat().st_size >= size:
        yield path
        return
    copy = path.with_name(f".{path.name}.padded")
    try:
        try:
            with open(path, "rb") as src, open(copy, "wb") as dst:
                while block := src.read(1 << 20):
                    if block.count(0) == len(block):
                        dst.seek(len(block), os.SEEK_CUR)
                    else:
                        dst.write(block)
                dst.truncate(size)
        except OSError as e:
            raise UserError(f"{copy}: the zero-padded copy of {path.name} for its check cannot be written ({e.strerror})",
                            hint=f"free {path.stat().st_size >> 20} MiB on {path.parent}, then run the same command again") from None
        yield copy
    finally:
        copy.unlink(missing_ok=True)


_STRICT_VERSION = re.compile(r"^(0|[1-9][0-9]{0,8})(\.(0|[1-9][0-9]{0,8})){0,3}\Z")
MAX_NAME = 128


def check_strict(index: BundleIndex) -> None:
    """Versions without leading zeros or huge numbers (1.02 and 1.2 would be one version to some
    tools and two to others), file names of bounded length."""
    for key, value in (("version", index.version), ("min_version", index.min_version)):
        if not _STRICT_VERSION.match(value):
            raise Refused(f"bundle.json: {key} {value[:40]!r} is not N[.N[.N[.N]]] (no leading zeros, at most 9 digits)",
                          hint=NOT_OURS)
    for f in index.files:
        if len(f.name) > MAX_NAME:
            raise Refused(f"bundle.json: a file name is longer than {MAX_NAME} characters", hint=NOT_OURS)
