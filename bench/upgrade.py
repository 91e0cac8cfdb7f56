# SPDX-License-Identifier: MIT
"""`make bench`, upgrades: the bytes a bundle ships (two releases sharing an engine; a new engine), and
writing a /usr slot the appliance's way against dd."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from appliance import config
from appliance.config import with_version
from appliance.signed import bundle_index, release_manifest
from bench.common import ROOT, Figure, elapsed, image_root, measured, sh, sysupdate_argv, undo
from builder import build, release

SLOT_GOAL = 1.3  # the appliance's way / dd, at most


def next_version(version: str) -> str:
    """The release after VERSION: its last number raised by one."""
    *head, last = version.split(".")
    return ".".join([*head, str(int(last) + 1)])


def as_next_release(demo: config.Config, build_dir: Path, dest: Path, key: Path) -> config.Config:
    """BUILD_DIR's build as the next release in DEST: each file linked under the next version's
    name, its manifest saying that version and signed again. What a rebuild with an unchanged
    engine pin ships, without a second mkosi build."""
    version, nxt = demo.appliance.version, next_version(demo.appliance.version)
    dest.mkdir()
    for f in sorted(build_dir.iterdir()):
        if f.is_file() and not f.is_symlink() and f.name.startswith(f"appliance_{version}."):
            os.link(f, dest / f.name.replace(f"appliance_{version}.", f"appliance_{nxt}.", 1))
    body = release_manifest.loads((build_dir / "manifest.json").read_bytes())
    body["version"] = nxt
    (dest / "manifest.json").write_bytes(release_manifest.dumps(body))
    (dest / "manifest.json.sig").write_bytes(release_manifest.sign(body, key))
    return with_version(demo, nxt)


def as_built(demo: config.Config, build_dir: Path) -> config.Config:
    """DEMO with the engine BUILD_DIR's signed manifest names: the pin the build was made with,
    should appliance.toml have moved on since."""
    engine = release_manifest.load(release_manifest.parse_canonical((build_dir / "manifest.json").read_bytes())).engine_image
    return dataclasses.replace(demo, engine=dataclasses.replace(demo.engine, digest=engine.digest))


def two_releases(demo: config.Config, build_dir: Path, work: Path, key: Path) -> tuple[bundle_index.BundleIndex, bundle_index.BundleIndex]:
    """Release N of BUILD_DIR, then N+1 of the same build (the same engine) with `--previous` N's
    bundle directory, as docs/upgrades.md does it: release.py reads the engine N ships from N's
    index and decides on its own whether N+1 ships it again. Their indexes."""
    full = release.make_bundle(demo, build_dir, work / f"bundle-{demo.appliance.version}", key)
    nxt = as_next_release(demo, build_dir, work / "build-next", key)
    upgrade = release.make_bundle(nxt, work / "build-next", work / f"bundle-{nxt.appliance.version}", key,
                                  work / f"bundle-{demo.appliance.version}")
    return full, upgrade


def engine_bytes_of(index: bundle_index.BundleIndex) -> int:
    return sum(f.size for f in index.files if f.name.startswith("engine_"))


def bundle_figures(full: bundle_index.BundleIndex, upgrade: bundle_index.BundleIndex) -> tuple[int, int, int]:
    """(bytes of the upgrade, of the full bundle, engine bytes the upgrade ships). A full bundle
    without an engine measured nothing: the comparison would be true by construction."""
    if engine_bytes_of(full) == 0:
        raise RuntimeError(f"the full bundle {full.version} ships no engine image: nothing to compare the upgrade with")
    total = {name: sum(f.size for f in index.files) for name, index in (("full", full), ("upgrade", upgrade))}
    return total["upgrade"], total["full"], engine_bytes_of(upgrade)


def bench_bundle_bytes(demo: config.Config, engine_bytes: int = 2 * 1024**3, out: Path | None = None,
                       key: Path | None = None) -> list[Figure]:
    """Two real releases that share an engine (two_releases), with the build in OUT (the last demo
    build) signed with KEY (the demo's) and its engine partition image replaced by ENGINE_BYTES of
    random bytes in both (a real engine's size; the demo's is a few MB)."""
    out = build.output_dir(demo) if out is None else out
    key = build.signing_key_for(demo, None) if key is None else key
    work = Path(tempfile.mkdtemp(prefix="bench-bundle-", dir="/var/tmp"))
    try:
        build_copy = work / "build"
        shutil.copytree(out, build_copy, copy_function=os.link)
        engine = build_copy / f"appliance_{demo.appliance.version}.engine.raw"  # as mkosi splits it out
        engine.unlink()
        with open(engine, "wb") as f:
            for start in range(0, engine_bytes, 64 * 1024**2):
                f.write(os.urandom(min(64 * 1024**2, engine_bytes - start)))
        full, upgrade = two_releases(as_built(demo, out), build_copy, work, key)
        upgrade_bytes, full_bytes, shipped_engine = bundle_figures(full, upgrade)
        return [measured(f"bundle {upgrade.version} after {full.version}, same engine (vs full)", upgrade_bytes / 1e6,
                         full_bytes / 1e6, "MB", note="smaller is better"),
                # the goal is no engine bytes at all: a ratio of 0
                measured(f"engine bytes shipped by {upgrade.version} (vs {full.version}'s)", shipped_engine / 1e6,
                         engine_bytes_of(full) / 1e6, "MB", at_most=0.0)]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_new_engine_bytes(demo: config.Config, out: Path | None = None, key: Path | None = None) -> list[Figure]:
    """What an appliance downloads for a new engine: the bundle's engine images (erofs, lz4hc
    inside; shipped without the slot's trailing zeros) against the partition images they fill;
    of the build in OUT (the last demo build) signed with KEY (the demo's)."""
    out = build.output_dir(demo) if out is None else out
    key = build.signing_key_for(demo, None) if key is None else key
    work = Path(tempfile.mkdtemp(prefix="bench-engine-bytes-", dir="/var/tmp"))
    try:
        index = release.make_bundle(demo, out, work / "bundle", key)
        shipped = sum(f.size for f in index.files if f.name.startswith("engine_"))
        full = sum(size for name, size in index.partition_sizes.items() if name.startswith("engine_"))
        return [measured("new engine: bytes downloaded (vs its partition images)", shipped / 1e6, full / 1e6, "MB")]
    finally:
        shutil.rmtree(work, ignore_errors=True)


def usr_slot_table(usr_bytes: int, verity_bytes: int) -> str:
    """The sfdisk script of a disk with two /usr slots: A a token older version (systemd-sysupdate
    wants two slots), B empty and of the sizes of the images it receives."""
    return (f"label: gpt\nsize=2048, type={bundle_index.USR_TYPE}, name=appliance_0.0.1\n"
            f"size=2048, type={bundle_index.USR_VERITY_TYPE}, name=appliance_0.0.1_verity\n"
            f"size={usr_bytes // 512}, type={bundle_index.USR_TYPE}, name=_empty\n"
            f"size={verity_bytes // 512}, type={bundle_index.USR_VERITY_TYPE}, name=_empty\n")


USR_TRANSFERS = ("10-usr.transfer", "20-usr-verity.transfer")


def usr_transfers(device: str) -> dict[str, str]:
    """The image's /usr transfer definitions aimed at DEVICE, their source at /src (the chroot's)."""
    texts = {}
    for transfer in USR_TRANSFERS:
        text = (ROOT / "image/mkosi.extra/usr/lib/sysupdate.d" / transfer).read_text()
        text = text.replace("Path=auto", f"Path={device}").replace("Path=/var/lib/appliance/update/source", "Path=/src")
        texts[transfer] = text.replace("ProtectVersion=%A", "")  # the chroot's os-release names the version it installs
    return texts


def bench_slot_write(demo: config.Config) -> list[Figure]:
    """Write the last build's /usr and verity images into an empty slot on a loop device: plain
    dd of the partition images, then the appliance's way (blkdiscard --zeroout, then the image's
    own systemd-sysupdate in a chroot of its /usr, from the bundle's trimmed images)."""
    out = build.output_dir(demo)
    key = build.signing_key_for(demo, None)
    names = bundle_index.payload_names(demo.appliance.version, demo.engine.digest, with_engine=False)
    usr, verity = out / names["usr"], out / names["usr-verity"]
    work = Path(tempfile.mkdtemp(prefix="bench-slot-", dir="/var/tmp"))
    mounts: list[Path] = []
    loop = ""
    try:
        index = release.make_bundle(demo, out, work / "bundle", key, [demo.engine.digest])
        disk = work / "disk.img"
        mib = 1024**2
        size = usr.stat().st_size + verity.stat().st_size + 8 * mib
        with open(disk, "wb") as f:
            f.truncate(size)
        subprocess.run(["sfdisk", "-q", str(disk)], input=usr_slot_table(usr.stat().st_size, verity.stat().st_size), text=True,
                       check=True)
        loop = sh("losetup", "-f", "--show", str(disk)).strip()
        # offsets on the loop device: build hosts in containers often get no partition nodes
        table_json = json.loads(sh("sfdisk", "-J", loop))["partitiontable"]["partitions"]
        slot = [(int(p["start"]) * 512, int(p["size"]) * 512) for p in table_json[2:]]
        images = [usr, verity]

        def plain() -> None:
            for src, (start, _) in zip(images, slot, strict=True):
                sh("dd", f"if={src}", f"of={loop}", "bs=4M", "oflag=seek_bytes", f"seek={start}", "conv=fsync,notrunc", "status=none")

        # a chroot of the image's own /usr, with the shipped transfer definitions aimed at the loop device
        root = image_root(usr, work / "root", mounts)
        for transfer, text in usr_transfers(loop).items():
            (root / "defs" / transfer).write_text(text)
        for staged, linked in bundle_index.source_names(index).items():
            if linked.endswith(".raw"):
                os.link(work / "bundle" / staged, root / "src" / linked)

        def ours() -> None:  # as applianctl.update.install.prepare_slot, then systemd-sysupdate
            for start, length in slot:
                sh("blkdiscard", "--force", "--zeroout", "--offset", str(start), "--length", str(length), loop)
            for i in (3, 4):
                sh("sfdisk", "-q", "--part-label", loop, str(i), "_empty")
            sh(*sysupdate_argv(root, index.version))
            sh("sync")

        base = elapsed(plain)
        mine = elapsed(ours)
        for src, (start, _) in zip(images, slot, strict=True):  # the slot holds exactly the signed bytes
            sh("cmp", f"--ignore-initial=0:{start}", "-n", str(src.stat().st_size), str(src), loop)
        return [measured("write a /usr slot (blank + sysupdate vs dd)", mine, base, "s", at_most=SLOT_GOAL)]
    finally:
        undo(mounts, loop, work)
