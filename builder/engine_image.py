# SPDX-License-Identifier: MIT
"""The engine's container image as an OCI layout, obtained by the digest pinned in appliance.toml.

Sources: an OCI layout or archive given on the command line; for the demo, the stand-in built from
standin/ (reproducibly, so its digest can be pinned); else a registry through skopeo. An image whose
manifest digest differs from the pin is refused; the host cache is keyed by digest.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from appliance import progress
from appliance.config import Config
from appliance.errors import UserError
from appliance.run import checked
from builder.host_tools import HOST_CACHE, MISSING_HINT

ROOT = Path(__file__).resolve().parents[1]
CACHE = HOST_CACHE / "engine-images"
REF_NAME = "appliance"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blob_path(layout: Path, digest: str) -> Path:
    algo, _, hexdigest = digest.partition(":")
    return layout / "blobs" / algo / hexdigest


def _write_blob(layout: Path, data: bytes) -> dict[str, Any]:
    digest = _sha256(data)
    path = _blob_path(layout, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


# ------------------------------------------------------------------------- the stand-in image


def _standin_layer() -> bytes:
    """The stand-in's code under /opt/standin, plus usr-merge symlinks: the demo profile mounts the
    appliance's own /usr read-only into the container, which provides python3."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime, info.uid, info.gid = kind, mode, 0, 0, 0
            info.uname = info.gname = "root"
            info.linkname, info.size = link, len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        for d in ("dev", "etc", "opt", "opt/standin", "opt/standin/standin", "proc", "root", "run", "sys", "usr", "var"):
            add(d, tarfile.DIRTYPE, 0o755)
        add("tmp", tarfile.DIRTYPE, 0o1777)
        for link, target in (("bin", "usr/bin"), ("lib", "usr/lib"), ("lib64", "usr/lib64"), ("sbin", "usr/sbin")):
            add(link, tarfile.SYMTYPE, 0o777, link=target)
        add("etc/passwd", tarfile.REGTYPE, 0o644, b"root:x:0:0:root:/root:/bin/sh\n")
        add("etc/group", tarfile.REGTYPE, 0o644, b"root:x:0:\n")
        for source in sorted((ROOT / "standin").glob("*.py")):
            add(f"opt/standin/standin/{source.name}", tarfile.REGTYPE, 0o644, source.read_bytes())
    return buf.getvalue()


def build_standin_layout(layout: Path, entrypoint: tuple[str, ...]) -> str:
    """Write the stand-in engine as an OCI layout; return its manifest digest (reproducible)."""
    return _single_layer_layout(layout, _standin_layer(), entrypoint)


def write_layout(layout: Path, layer_file: Path) -> str:
    """An OCI layout of one uncompressed tar layer, for benchmarks."""
    return _single_layer_layout(layout, layer_file.read_bytes(), ("/bin/true",))


def _single_layer_layout(layout: Path, layer: bytes, entrypoint: tuple[str, ...]) -> str:
    layer_desc = {"mediaType": "application/vnd.oci.image.layer.v1.tar", **_write_blob(layout, layer)}
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": list(entrypoint),
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin", "PYTHONPATH=/opt/standin"],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [_sha256(layer)]},
    }
    config_desc = {"mediaType": "application/vnd.oci.image.config.v1+json", **_write_blob(layout, _canonical(image_config))}
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": config_desc, "layers": [layer_desc]}
    manifest_desc = {"mediaType": MANIFEST_TYPE, **_write_blob(layout, _canonical(manifest))}
    manifest_desc["annotations"] = {"org.opencontainers.image.ref.name": REF_NAME}
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [manifest_desc]}))
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    return str(manifest_desc["digest"])


# ------------------------------------------------------------------------- any OCI layout


def layout_digest(layout: Path) -> str:
    """The manifest digest of the single image in an OCI layout, checked against its blob."""
    try:
        index = json.loads((layout / "index.json").read_text())
        (desc,) = [m for m in index["manifests"] if m.get("mediaType", MANIFEST_TYPE) == MANIFEST_TYPE]
        digest = str(desc["digest"])
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{layout}: not an OCI layout with one image ({e})", hint="pass an OCI layout directory or archive") from None
    if _sha256(_blob_path(layout, digest).read_bytes()) != digest:
        raise UserError(f"{layout}: manifest blob does not match its digest {digest}", hint="the layout is damaged")
    return digest


def _check_pin(config: Config, got: str, source: str) -> None:
    if got != config.engine.digest:
        raise UserError(
            f"engine image from {source}: expected {config.engine.digest}, got {got}",
            hint="use the image pinned in appliance.toml (engine.digest), or change the pin on purpose",
        )


def _copy_layout(source: Path, staging: Path) -> None:
    files = [f for f in source.rglob("*") if f.is_file()]
    with progress.Progress(f"copying {source.name}", total=sum(f.stat().st_size for f in files)) as p:

        def copy(src: str, dst: str) -> str:
            shutil.copy2(src, dst)
            p.advance(Path(src).stat().st_size)
            return dst

        shutil.copytree(source, staging, dirs_exist_ok=True, copy_function=copy)


def _unpack_layout(source: Path, staging: Path) -> None:
    with tarfile.open(source) as tar:
        members = tar.getmembers()
        # Checked by hand: Debian 12's Python 3.11.2 predates extractall's filter= (3.11.4).
        for member in members:
            if not (member.isfile() or member.isdir()) or member.name.startswith("/") or ".." in member.name.split("/"):
                raise UserError(
                    f"{source}: {member.name} is not a file or directory inside the archive",
                    hint="pass an OCI layout archive (skopeo copy ... oci-archive:PATH) or directory",
                )
        with progress.Progress(f"unpacking {source.name}", total=sum(m.size for m in members)) as p:

            def counted() -> Iterator[tarfile.TarInfo]:
                for member in members:
                    yield member
                    p.advance(member.size)

            if hasattr(tarfile, "data_filter"):
                tar.extractall(staging, members=counted(), filter="data")
            else:
                tar.extractall(staging, members=counted())


def obtain(config: Config, source: Path | None = None) -> Path:
    """The pinned engine image as an OCI layout in the host cache, fetched and checked once."""
    cached = CACHE / config.engine.digest.replace(":", "-")
    if (cached / "index.json").is_file():
        return cached  # verified when it entered the cache; never copied twice
    staging = cached.with_name(cached.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if source is not None:
            if source.is_dir():
                _copy_layout(source, staging)
            elif source.is_file():
                _unpack_layout(source, staging)
            else:
                raise UserError(f"{source}: no such OCI layout or archive", hint="check the --engine-image path")
            got, where = layout_digest(staging), str(source)
        elif config.profile == "demo":
            got, where = build_standin_layout(staging, config.engine.entrypoint), "the stand-in engine (standin/)"
        else:
            with progress.step(f"fetching {config.engine.reference}"):  # skopeo --quiet: no byte count to show
                checked(
                    ["skopeo", "copy", "--quiet", f"docker://{config.engine.reference}", f"oci:{staging}:{REF_NAME}"],
                    what=f"skopeo copy {config.engine.reference}",
                    hint="no registry is reachable: pass the image as an OCI layout or archive with --engine-image PATH",
                    timeout=None, capture=False, missing_hint=MISSING_HINT,
                )
            got, where = layout_digest(staging), "the registry"
        _check_pin(config, got, where)
        staging.rename(cached)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return cached
