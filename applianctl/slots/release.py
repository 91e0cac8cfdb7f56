# SPDX-License-Identifier: MIT
"""The running release: its signed manifest on the verity-protected /usr."""

from __future__ import annotations

from appliance import paths
from appliance.errors import UserError
from appliance.signed import release_manifest


def running_manifest() -> release_manifest.Manifest:
    """The running version's release manifest."""
    try:
        return release_manifest.load(release_manifest.parse_canonical(paths.MANIFEST.read_bytes()))
    except FileNotFoundError:
        raise UserError(f"{paths.MANIFEST}: no release manifest", hint="this command runs on the appliance") from None


def running_engine_digest(running_version: str | None) -> str | None:
    """The running version's engine digest, from its manifest; None when it cannot be read or is
    another version's."""
    try:
        running = running_manifest()
    except (UserError, OSError, ValueError):
        return None
    return running.engine_image.digest if running_version in (None, running.version) else None
