# SPDX-License-Identifier: MIT
"""The device's side of the weights figures, in a fresh interpreter as on the device:
`python -m bench.weights_device fetch MANIFEST SNAPSHOT URL CA` or `... check MANIFEST SNAPSHOT`.
It prints {"elapsed_s": ...}: the device code's own time, interpreter start and imports left out.

A module, not a script in a string, so that strict mypy reads it against the model package: a
change to the store, the fetcher or the check's result breaks the type check, not a benchmark
run weeks later. The build host's kernel has no fs-verity, so the device code gets HostVerity: no
sealing, and a measurement is an open and fstat returning the manifest's digest.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from appliance.signed import weights_manifest
from applianctl.model import fetch, store, verify


class HostVerity:
    """fs-verity as the device code sees it, on a kernel without it: seal nothing, measure = open + fstat."""

    def __init__(self, snapshot: Path, manifest: weights_manifest.WeightsManifest) -> None:
        self.snapshot = snapshot
        self.digests = {f.path: f.fsverity for f in manifest.files}

    def enable(self, path: Path, dir_fd: int | None = None) -> None:
        pass

    def measure(self, path: Path, dir_fd: int | None = None) -> str | None:
        fd = os.open(path.name if dir_fd is not None else path, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            os.fstat(fd)
        finally:
            os.close(fd)
        rel = Path(path).relative_to(self.snapshot).as_posix() if Path(path).is_relative_to(self.snapshot) else Path(path).name
        return self.digests.get(rel) or None


def device_store(manifest: weights_manifest.WeightsManifest, snapshot: Path) -> store.Store:
    """The model store as the device lays it out: the snapshot, the partial files beside it, the host records."""
    return store.Store(manifest, snapshot, snapshot.parent / ".partial", snapshot.parent / "host")


def fetch_weights(manifest_path: Path, snapshot: Path, url: str, ca: str) -> float:
    """Seconds the device's fetcher takes for MANIFEST_PATH's files from URL into SNAPSHOT."""
    manifest = weights_manifest.loads(manifest_path.read_bytes())
    model_store = device_store(manifest, snapshot)
    started = time.monotonic()
    source = fetch.open_source(url, ca, "plain", manifest.model, manifest.revision)
    with open(os.devnull, "w") as quiet:
        fetch.fetch(model_store, source, HostVerity(snapshot, manifest), out=quiet)
    return time.monotonic() - started


def check_weights(manifest_path: Path, snapshot: Path) -> float:
    """Seconds the check before every start takes on SNAPSHOT; RuntimeError when it refuses the weights."""
    manifest = weights_manifest.loads(manifest_path.read_bytes())
    model_store = device_store(manifest, snapshot)
    started = time.monotonic()
    result = verify.check(model_store, HostVerity(snapshot, manifest))
    seconds = time.monotonic() - started
    if not result.ok:
        raise RuntimeError(f"the check refused the weights: {result.reason}")
    return seconds


def main(argv: list[str]) -> int:
    mode, manifest_path, snapshot = argv[0], Path(argv[1]), Path(argv[2])
    seconds = fetch_weights(manifest_path, snapshot, argv[3], argv[4]) if mode == "fetch" else check_weights(manifest_path, snapshot)
    print(json.dumps({"elapsed_s": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
