"""Whether a bundle may be installed here, and whether what was downloaded is what it claims.

Policy (before any download): the version is newer than the running one (older only with
--allow-downgrade, the same never), min_version is not newer than the running version, the profile
is the running one, the engine image is one the appliance has or may write to a free engine slot,
and the partition images fit the inactive slot. Content (after every file's SHA-256 matched): the inner release manifest
verifies on its own and agrees with bundle.json, and the kernel image boots bundle.json's usrhash.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from appliance import manifest
from appliance.bundle import NOT_OURS, BundleIndex, engine_short, payload_names, uki_facts
from appliance.errors import Refused, UserError
from applianctl.slots import view as slots
from applianctl.slots.engine import EngineChoice


def check_policy(index: BundleIndex, running: manifest.Manifest, allow_downgrade: bool) -> bool:
    """Refuse a bundle the running version must not take; True when it is a downgrade."""
    new, cur = index.version, running.version
    if manifest.version_tuple(new) == manifest.version_tuple(cur):
        raise Refused(f"bundle version {new} is the running version", hint="nothing to do; a newer bundle is needed to upgrade")
    downgrade = manifest.version_tuple(new) < manifest.version_tuple(cur)
    if downgrade and not allow_downgrade:
        raise Refused(f"bundle version {new} is older than the running version {cur}", hint="to go back on purpose, add --allow-downgrade")
    if manifest.version_tuple(index.min_version) > manifest.version_tuple(cur):
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


def check_engine(index: BundleIndex, running: manifest.Manifest, view: slots.View) -> EngineChoice | None:
    """Where the new version's engine comes from, before anything is downloaded: None when it runs
    the running engine; else the engine slot that holds it or that it is written to
    (engine_slots.choose_engine_slot: every bootable entry's engine stays, the running one is never
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


def check_fits(index: BundleIndex, inactive: slots.Slot) -> None:
    sizes = index.partition_sizes
    names = payload_names(index.version, index.engine_digest, False)
    targets = [("usr", inactive.usr), ("usr-verity", inactive.verity)]
    for role, part in targets:
        if part is None:
            raise Refused(f"slot {inactive.name} has no {role} partition", hint="the disk was not set up by this image (repart.d)")
        size = sizes[names[role]]
        if size > part.size_bytes:
            raise Refused(
                f"{names[role]} is {size} bytes, larger than slot {inactive.name}'s {role} partition ({part.size_bytes} bytes)",
                hint="this bundle does not fit this appliance's disk layout",
            )


def inactive_slot(host: slots.Host, running_version: str) -> slots.Slot:
    found = slots.slots(host, running_version)
    booted = [s for s in found if s.booted]
    others = [s for s in found if not s.booted]
    if len(found) != 2 or len(booted) != 1:
        raise UserError(
            f"expected two /usr slots, one of them booted; found {len(found)} slot(s), {len(booted)} booted",
            hint="the second slot is made by systemd-repart on first boot; check `sfdisk -l` of the disk",
        )
    return others[0]


def check_staged(index: BundleIndex, staging: Path, keys_dir: Path) -> None:
    """What is inside the verified files agrees with the signed index."""
    names = payload_names(index.version, index.engine_digest, False)
    data, sig = (staging / names["manifest"]).read_bytes(), (staging / names["manifest-sig"]).read_bytes()
    if hashlib.sha256(data).hexdigest() != index.manifest_sha256:
        raise Refused("manifest.json does not match bundle.json's manifest_sha256", hint="the bundle is inconsistent")
    try:
        release = manifest.verify(data, sig, keys_dir)
    except manifest.ManifestError as e:
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
    facts = uki_facts(staging / names["uki"])
    if facts["usrhash"] != index.usrhash:
        raise Refused(f"{names['uki']} boots usrhash {facts['usrhash']}, not bundle.json's", hint="the bundle is inconsistent")
    if facts["image_version"] not in (None, index.version):
        raise Refused(f"{names['uki']} is version {facts['image_version']}, not {index.version}", hint="the bundle is inconsistent")


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
