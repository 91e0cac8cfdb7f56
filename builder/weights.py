# SPDX-License-Identifier: MIT
"""`python3 -m builder weights pin|demo`: the weights manifest of the configured model and revision.

The manifest pins SHA-256s. The Hub's tree gives them for LFS files only; small files have a git blob
SHA-1 there, so their SHA-256 is computed from the --from copy or a download checked against that SHA-1.
--from must match the Hub's tree unless --offline. huggingface_hub runs on the build host only.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import appliance.config
from appliance import cli_help, fsverity
from appliance.atomic import atomic_write
from appliance.errors import UserError
from appliance.hashing import sha256_file
from appliance.signed import weights_manifest

ROOT = Path(__file__).resolve().parents[1]
HUB_HINT = "check the model id and revision in appliance.toml and the network; or pin a local copy with --from DIR --offline"


@dataclass(frozen=True)
class HubFile:

    path: str
    size: int
    blob_id: str
    lfs_sha256: str | None


def hub_files(model_id: str, revision: str, api: Any = None) -> list[HubFile]:
    """The snapshot's files as the Hub lists them (recursive)."""
    import logging

    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # hide its retries
    api = api or HfApi()
    try:
        entries = list(api.list_repo_tree(model_id, recursive=True, revision=revision))
    except Exception as e:  # the library raises its own HTTP errors and its HTTP client's (httpx2.ConnectError)
        why = str(e).splitlines()[0][:200]
        raise UserError(f"{model_id}@{revision}: the Hub's file list is not available ({why})", hint=HUB_HINT) from None
    files = [
        HubFile(e.path, e.size, e.blob_id, e.lfs.sha256 if e.lfs is not None else None) for e in entries if isinstance(e, RepoFile)
    ]
    if not files:
        raise UserError(f"{model_id}@{revision}: the Hub lists no files", hint=HUB_HINT)
    return files


def git_blob_sha1(path: Path) -> str:
    """The git blob id of a file: what the Hub reports for small (non-LFS) files."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _download_small(model_id: str, revision: str, entry: HubFile, directory: Path) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(model_id, entry.path, revision=revision, local_dir=directory))
    except Exception as e:  # the library raises many types (HTTP, offline, entry not found)
        raise UserError(f"{entry.path}: download from the Hub failed ({str(e).splitlines()[0][:200]})", hint=HUB_HINT) from None


def local_files(directory: Path) -> dict[str, Path]:
    """Every regular file under DIRECTORY by relative path, links followed (a Hugging Face cache snapshot
    links into its blobs), huggingface_hub's .cache/ left out."""
    if not directory.is_dir():
        raise UserError(f"{directory}: no such directory", hint="--from takes the snapshot directory (the files the engine loads)")
    out: dict[str, Path] = {}
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if rel == ".cache" or rel.startswith(".cache/") or not path.is_file():
            continue
        out[rel] = path
    if not out:
        raise UserError(f"{directory}: no files", hint="--from takes the snapshot directory (the files the engine loads)")
    return out


def pin(model_id: str, revision: str, source: Path | None, offline: bool, api: Any = None) -> weights_manifest.WeightsManifest:
    """The weights manifest from the Hub's tree and/or a local copy (see the module docstring)."""
    local = local_files(source) if source is not None else None
    if offline:
        if local is None:
            raise UserError("--offline needs --from DIR", hint="pin a local copy of the snapshot: --from DIR --offline")
        return weights_manifest.make(model_id, revision, [_local_entry(rel, p) for rel, p in local.items()])
    hub = hub_files(model_id, revision, api)
    if local is not None:
        missing = sorted({f.path for f in hub} - set(local))
        extra = sorted(set(local) - {f.path for f in hub})
        if missing or extra:
            what = f"{missing[0]} is missing" if missing else f"{extra[0]} is not in the Hub's snapshot"
            hint = "--from takes exactly the snapshot at the pinned revision"
            raise UserError(f"{source}: {what} ({len(missing)} missing, {len(extra)} extra)", hint=hint)
    files = []
    with tempfile.TemporaryDirectory(prefix="weights-pin-") as tmp:
        for entry in hub:
            path = local[entry.path] if local is not None else None
            if path is None and entry.lfs_sha256 is None:
                path = _download_small(model_id, revision, entry, Path(tmp))
            files.append(_checked_entry(entry, path))
    return weights_manifest.make(model_id, revision, files)


def _local_entry(rel: str, path: Path) -> weights_manifest.WeightFile:
    return weights_manifest.WeightFile(rel, path.stat().st_size, sha256_file(path), fsverity.digest_file(path))


def _checked_entry(entry: HubFile, path: Path | None) -> weights_manifest.WeightFile:
    """ENTRY's manifest line; a local copy at PATH must match the Hub's size and hashes."""
    if path is None:
        assert entry.lfs_sha256 is not None
        return weights_manifest.WeightFile(entry.path, entry.size, entry.lfs_sha256)
    size = path.stat().st_size
    if size != entry.size:
        raise UserError(f"{entry.path}: {size} bytes here, {entry.size} on the Hub", hint="copy the snapshot again")
    line = _local_entry(entry.path, path)
    if entry.lfs_sha256 is not None and line.sha256 != entry.lfs_sha256:
        raise UserError(f"{entry.path}: SHA-256 {line.sha256} differs from the Hub's {entry.lfs_sha256}", hint="copy the snapshot again")
    if entry.lfs_sha256 is None and git_blob_sha1(path) != entry.blob_id:
        raise UserError(f"{entry.path}: git blob id differs from the Hub's {entry.blob_id}", hint="copy the snapshot again")
    return line


# ----------------------------------------------------------------------------------- demo weights

DEMO_SEED = 14
MIB = 1 << 20
# About 128 MiB; sizes deliberately not multiples of a block or a fetch chunk.
DEMO_SIZES = {
    "model-00001-of-00003.safetensors": 48 * MIB + 1234,
    "model-00002-of-00003.safetensors": 48 * MIB - 777,
    "model-00003-of-00003.safetensors": 32 * MIB + 4097,
}


def demo_files() -> Iterable[tuple[str, bytes]]:
    """The demo's weights: the same bytes on every machine (seeded generator)."""
    yield "config.json", b'{"architectures": ["StandinForCausalLM"], "model_type": "standin"}\n'
    index = "".join(f'"{name}": {size},' for name, size in DEMO_SIZES.items())
    yield "model.safetensors.index.json", ('{"sizes": {' + index.rstrip(",") + "}}\n").encode()
    rng = random.Random(DEMO_SEED)
    for name, size in DEMO_SIZES.items():
        yield name, rng.randbytes(size)


def demo_manifest(model_id: str, revision: str) -> weights_manifest.WeightsManifest:
    files = [weights_manifest.WeightFile(n, len(d), hashlib.sha256(d).hexdigest(), fsverity.digest_bytes(d)) for n, d in demo_files()]
    return weights_manifest.make(model_id, revision, files)


def write_demo(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in demo_files():
        atomic_write(directory / name, data)


# ----------------------------------------------------------------------------------- command


def default_output(config: appliance.config.Config) -> Path:
    return ROOT / (config.model.weights_manifest or f"weights/{config.profile}.json")


def cmd_weights(args: argparse.Namespace) -> int:
    config = appliance.config.load(Path(args.config), args.profile)
    output = Path(args.output_manifest) if args.output_manifest else default_output(config)
    if args.action == "demo":
        model = demo_manifest(config.model.id, config.model.revision)
        if args.output:
            write_demo(Path(args.output))
    else:
        model = pin(config.model.id, config.model.revision, Path(args.source) if args.source else None, args.offline)
    data = weights_manifest.dumps(model)
    atomic_write(output, data)
    digest = weights_manifest.sha256(data)
    print(f"{output}: {model.model}@{model.revision}, {len(model.files)} files, {model.total_bytes} bytes, sha256 {digest}")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = cli_help.verb_parser(
        sub, "weights", "pin the model's weights: write the weights manifest",
        examples=["python3 -m builder weights pin --from /srv/models/snapshot", "python3 -m builder --profile demo weights demo"],
        exit_codes=[(0, "the manifest is written"), cli_help.FAILED_STEP],
    )
    p.add_argument("action", choices=["pin", "demo"], help="pin: the configured model and revision; demo: the demo's generated weights")
    p.add_argument("--from", dest="source", help="pin: a local copy of the snapshot (adds each file's fs-verity digest)")
    p.add_argument("--offline", action="store_true", help="pin: do not ask the Hub; pin the --from directory as it is")
    p.add_argument("--output", help="demo: also write the generated weights into this directory")
    p.add_argument("--manifest", dest="output_manifest",
                   help="where to write the manifest (default: model.weights_manifest, else weights/PROFILE.json)")
    p.set_defaults(func=cmd_weights)
    return p


# ----------------------------------------------------------------------------------- into the image


def manifest_bytes(config: appliance.config.Config, root: Path = ROOT) -> bytes | None:
    """The configured weights manifest, checked to load and to pin the configured model and revision; None if none."""
    if not config.model.weights_manifest:
        return None
    path = root / config.model.weights_manifest
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise _write_manifest(config, f"{path}: no such file (model.weights_manifest)") from None
    model = weights_manifest.loads(data, str(path))
    if (model.model, model.revision) != (config.model.id, config.model.revision):
        raise _write_manifest(config,
                              f"{path} pins {model.model}@{model.revision}, the configuration {config.model.id}@{config.model.revision}")
    return data


def _write_manifest(config: appliance.config.Config, message: str) -> UserError:
    """MESSAGE with the command that writes the profile's weights manifest: the demo's weights are
    generated (`weights demo`), every other profile's pinned from the Hub (`weights pin`)."""
    if config.profile == "demo":
        return UserError(message, hint="write it with `python3 -m builder --profile demo weights demo`")
    return UserError(message, hint=f"write it with `python3 -m builder --profile {config.profile} weights pin`")


def problems(config: appliance.config.Config, root: Path) -> list[UserError]:
    try:
        manifest_bytes(config, root)
    except UserError as e:
        return [e]
    return []


def install(config: appliance.config.Config, tree: Path) -> None:
    data = manifest_bytes(config)
    if data is not None:
        atomic_write(tree / "usr/lib/appliance" / weights_manifest.FILE_NAME, data)


def release_pin(config: appliance.config.Config) -> dict[str, str]:
    """The weights manifest's SHA-256 for the signed release manifest's model entry."""
    data = manifest_bytes(config)
    return {"weights_sha256": weights_manifest.sha256(data)} if data is not None else {}
