"""Where the model's weights live on the device, and what the device knows about them.

- The signed weights manifest: /usr/lib/appliance/weights.json, whose SHA-256 the signed release
  manifest pins (model.weights_sha256); both are on the verity-protected /usr.
- The snapshot: config.model.weights_dir on /var (the Hugging Face cache layout the engine is
  given), each file sealed with fs-verity once its SHA-256 is proven.
- Partial downloads: CACHE_DIR/.partial/REVISION/ on the same file system, so that a finished file
  is renamed into place, never copied.
- The fs-verity digests the device measured for files whose manifest line has none:
  /var/lib/appliance/host/weights-verity.json (per-host state that survives upgrades).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from appliance import paths
from appliance import weights as wm
from appliance.atomic import write_record
from appliance.config import Config
from appliance.errors import UserError
from appliance.manifest import ManifestError
from appliance.schema import load_record
from applianctl.records import CorruptFile, WeightsCorrupt, WeightsVerity

RECORDED = "weights-verity.json"
CORRUPT = "weights-corrupt.json"  # files whose bytes the kernel refused on a read (model verify --deep)
HOST_SOURCE = "model-source"  # one line: the per-host default SOURCE for `applianctl model fetch`
FETCH_STATE = "weights-fetch.json"  # the last fetch: source, time (per-host state)


# Read at each call, so that tests (and APPLIANCE_* overrides) that move appliance.paths move these.
def weights_manifest() -> Path:
    return paths.LIB_DIR / wm.FILE_NAME


def host_dir() -> Path:
    return paths.STATE_DIR / "host"


def verify_result() -> Path:
    return paths.RUN_DIR / "model-verify.json"


@dataclass(frozen=True)
class Store:
    manifest: wm.WeightsManifest
    snapshot: Path
    partial: Path
    host_dir: Path

    def target(self, path: str) -> Path:
        return self.snapshot / path

    def recorded(self) -> dict[str, str]:
        """The digests this device measured for this revision ({} when none or another revision)."""
        try:
            data = load_record(WeightsVerity, self.host_dir / RECORDED, lenient=True)
        except UserError as e:
            raise UserError(e.message, hint="fetch the weights again: `applianctl model fetch`") from None
        if data is None or data.revision != self.manifest.revision:
            return {}
        return dict(data.files)

    def record(self, digests: dict[str, str]) -> None:
        write_record(self.host_dir / RECORDED, WeightsVerity(self.manifest.model, self.manifest.revision, dict(sorted(digests.items()))))

    def corrupt(self) -> dict[str, CorruptFile]:
        """Files a read through fs-verity refused, by path. They stay refused by the check before
        every start until fetched again (a new file, a new inode)."""
        try:
            data = load_record(WeightsCorrupt, self.host_dir / CORRUPT, lenient=True)
        except UserError:
            return {"?": CorruptFile(-1, f"{self.host_dir / CORRUPT} is unreadable")}
        return dict(data.files) if data is not None and data.revision == self.manifest.revision else {}

    def mark_corrupt(self, path: str, inode: int, reason: str) -> None:
        files = {**self.corrupt(), path: CorruptFile(inode, reason)}
        write_record(self.host_dir / CORRUPT, WeightsCorrupt(self.manifest.revision, files))

    def clear_corrupt(self, path: str) -> None:
        files = self.corrupt()
        if files.pop(path, None) is not None:
            write_record(self.host_dir / CORRUPT, WeightsCorrupt(self.manifest.revision, files))

    def default_source(self, config: Config) -> str:
        """The per-host setting if there is one, else the configuration's model.source."""
        try:
            line = (self.host_dir / HOST_SOURCE).read_text().strip()
        except FileNotFoundError:
            line = ""
        return line or config.model.source


def load_manifest(path: Path | None = None, release: Path | None = None) -> wm.WeightsManifest | None:
    """The image's weights manifest, None when the image ships none. Its SHA-256 must be the one the
    release manifest pins (appliance-verify checks that manifest's signature before every start)."""
    path = path or weights_manifest()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    release = release or paths.MANIFEST
    try:
        pinned = json.loads(release.read_bytes()).get("model", {}).get("weights_sha256", "")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{release}: unreadable ({e})", hint="the image is damaged") from None
    if pinned != wm.sha256(data):
        raise ManifestError(f"{path}: SHA-256 {wm.sha256(data)} is not the one the release manifest pins ({pinned or 'none'})",
                            hint="the image is damaged")
    return wm.loads(data, str(path))


def open_store(config: Config, manifest: wm.WeightsManifest) -> Store:
    if (manifest.model, manifest.revision) != (config.model.id, config.model.revision):
        raise UserError(f"{weights_manifest()}: pins {manifest.model}@{manifest.revision}, the configuration serves "
                        f"{config.model.id}@{config.model.revision}", hint="the image is damaged")
    cache = Path(config.model.cache_dir)
    return Store(manifest, Path(config.model.weights_dir), cache / ".partial" / manifest.revision, host_dir())
