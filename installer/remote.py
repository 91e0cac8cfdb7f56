# SPDX-License-Identifier: MIT
"""The release from a bundle over HTTPS, for hosts booted from the installer UKI alone (no payload partition).

appliance.fetch downloads bundle.json and its signature, checks them against the trusted keys, then
fetches only the manifest, block map and zstd disk image, each bound to the index by size and SHA-256,
into RAM; bmaptool later checks every written range against the block map.
"""

from __future__ import annotations

import os
from pathlib import Path

from appliance import fetch
from appliance.atomic import atomic_write
from appliance.errors import UserError
from appliance.run import call
from appliance.signed import bundle_index

RELEASE_DIR = Path("/var/lib/installer/release")
CA_CREDENTIAL = "appliance.install-ca"
DEADLINE_S = 6 * 3600.0  # a production image is tens of GB
WAIT_ONLINE = "/usr/lib/systemd/systemd-networkd-wait-online"
SPACE_MARGIN_BYTES = 64 << 20


def credential_ca() -> str | None:
    """The PEM CA passed as credential appliance.install-ca, else None (the system's CAs)."""
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    path = Path(creds) / CA_CREDENTIAL if creds else None
    return str(path) if path is not None and path.is_file() else None


def wait_online(timeout_s: int = 120) -> None:
    """Give DHCP its time before the first request; the download's own errors say the rest."""
    if Path(WAIT_ONLINE).exists():
        call([WAIT_ONLINE, "--any", f"--timeout={timeout_s}"], None)


def download(spec: str, ca: str | None, trusted_keys: Path, directory: Path | None = None) -> Path:
    """The bundle at SPEC (https:// URL or directory) into DIRECTORY, verified; returns DIRECTORY."""
    directory = RELEASE_DIR if directory is None else directory
    if spec.startswith("https://"):
        wait_online()
    source = fetch.open_source(spec, ca, fetch.Deadline(DEADLINE_S))
    data = source.read_small(bundle_index.BUNDLE_INDEX, bundle_index.MAX_INDEX_BYTES)
    sig = source.read_small(bundle_index.BUNDLE_SIG, bundle_index.MAX_SIG_BYTES)
    index = bundle_index.verify_index(data, sig, trusted_keys)
    files = {f.name: f for f in index.files}
    names = bundle_index.payload_names(index.version, index.engine_digest, False, with_install=True)
    if names["install-image"] not in files:
        raise UserError(f"{spec}: bundle {index.version} carries no install image",
                        hint="release it with: python3 -m builder release --install-image, or install from the USB or ISO medium")
    wanted = [files[names[role]] for role in ("manifest", "manifest-sig", "install-bmap", "install-image")]
    directory.mkdir(parents=True, exist_ok=True)
    need = sum(fetch.missing_bytes(f.name, f.size, directory) for f in wanted)
    st = os.statvfs(directory)
    if st.f_bavail * st.f_frsize < need + SPACE_MARGIN_BYTES:
        raise UserError(f"{directory}: {st.f_bavail * st.f_frsize >> 20} MiB free in RAM, the release needs {need >> 20} MiB",
                        hint="give the machine more memory, or install from the USB or ISO medium")
    print(f"installer: downloading release {index.version} from {spec} ({need >> 20} MiB)", flush=True)
    for f in wanted:
        fetch.fetch_proven(source, f.name, f.size, f.sha256, directory)
    # load_payload checks these again, as on a medium
    atomic_write(directory / bundle_index.BUNDLE_INDEX, data)
    atomic_write(directory / bundle_index.BUNDLE_SIG, sig)
    return directory
