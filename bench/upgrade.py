"""`make bench`, upgrades: the bytes a bundle ships (engine digest unchanged; a new engine), and
writing a /usr slot the appliance's way against dd."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from appliance import bundle, config
from bench.common import ROOT, elapsed, image_root, row, sh, undo
from builder import build, release


def bench_bundle_bytes(demo: config.Config, engine_bytes: int = 2 * 1024**3) -> None:
    out = build.output_dir(demo)
    key = build.signing_key_for(demo, None)
    work = Path(tempfile.mkdtemp(prefix="bench-bundle-", dir="/var/tmp"))
    try:
        # the last build, with its engine partition image replaced by 2 GiB of random bytes
        build_copy = work / "build"
        shutil.copytree(out, build_copy, copy_function=os.link)
        engine = build_copy / f"appliance_{demo.appliance.version}.engine.raw"  # as mkosi splits it out
        engine.unlink()
        with open(engine, "wb") as f:
            for _ in range(engine_bytes // (64 * 1024**2)):
                f.write(os.urandom(64 * 1024**2))
        full = release.make_bundle(demo, build_copy, work / "full", key)
        same_engine = release.make_bundle(demo, build_copy, work / "upgrade", key, [demo.engine.digest])
        total = {name: sum(f.size for f in index.files) for name, index in (("full", full), ("upgrade", same_engine))}
        shipped_engine = sum(f.size for f in same_engine.files if f.name.startswith("engine_"))
        print(f"{'bundle, engine digest unchanged':<44} {total['upgrade'] / 1e6:8.1f} MB  full bundle {total['full'] / 1e6:8.1f} MB"
              f"  ratio {total['upgrade'] / total['full']:5.2f}x  engine bytes shipped: {shipped_engine} (target: 0)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_new_engine_bytes(demo: config.Config) -> None:
    """What an appliance downloads for a new engine: the bundle's engine images (erofs, lz4hc
    inside; shipped without the slot's trailing zeros) against the partition images they fill."""
    work = Path(tempfile.mkdtemp(prefix="bench-engine-bytes-", dir="/var/tmp"))
    try:
        index = release.make_bundle(demo, build.output_dir(demo), work / "bundle", build.signing_key_for(demo, None))
        shipped = sum(f.size for f in index.files if f.name.startswith("engine_"))
        full = sum(size for name, size in index.partition_sizes.items() if name.startswith("engine_"))
        print(f"{'new engine: bytes downloaded vs partition':<44} {shipped / 1e6:8.2f} MB  partition images {full / 1e6:8.2f} MB"
              f"  ratio {shipped / full:6.3f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_slot_write(demo: config.Config) -> None:
    """Write the last build's /usr and verity images into an empty slot on a loop device: plain
    dd of the partition images, then the appliance's way (blkdiscard --zeroout, then the image's
    own systemd-sysupdate in a chroot of its /usr, from the bundle's trimmed images)."""
    out = build.output_dir(demo)
    key = build.signing_key_for(demo, None)
    names = bundle.payload_names(demo.appliance.version, demo.engine.digest, with_engine=False)
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
        # slot A: a token older version (systemd-sysupdate wants two slots); slot B: empty, full size
        table = (f"label: gpt\nsize=2048, type={bundle.USR_TYPE}, name=appliance_0.0.1\n"
                 f"size=2048, type={bundle.USR_VERITY_TYPE}, name=appliance_0.0.1_verity\n"
                 f"size={usr.stat().st_size // 512}, type={bundle.USR_TYPE}, name=_empty\n"
                 f"size={verity.stat().st_size // 512}, type={bundle.USR_VERITY_TYPE}, name=_empty\n")
        subprocess.run(["sfdisk", "-q", str(disk)], input=table, text=True, check=True)
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
        for transfer in ("10-usr.transfer", "20-usr-verity.transfer"):
            text = (ROOT / "image/mkosi.extra/usr/lib/sysupdate.d" / transfer).read_text()
            text = text.replace("Path=auto", f"Path={loop}").replace("Path=/var/lib/appliance/update/source", "Path=/src")
            text = text.replace("ProtectVersion=%A", "")  # the chroot's os-release names the version it installs
            (root / "defs" / transfer).write_text(text)
        for staged, linked in bundle.source_names(index).items():
            if linked.endswith(".raw"):
                os.link(work / "bundle" / staged, root / "src" / linked)

        def ours() -> None:  # as applianctl.update.install.prepare_slot, then systemd-sysupdate
            for start, length in slot:
                sh("blkdiscard", "--force", "--zeroout", "--offset", str(start), "--length", str(length), loop)
            for i in (3, 4):
                sh("sfdisk", "-q", "--part-label", loop, str(i), "_empty")
            sh("chroot", str(root), "/usr/lib/systemd/systemd-sysupdate", "--definitions=/defs", "--no-pager", "update", index.version)
            sh("sync")

        base = elapsed(plain)
        mine = elapsed(ours)
        for src, (start, _) in zip(images, slot, strict=True):  # the slot holds exactly the signed bytes
            sh("cmp", f"--ignore-initial=0:{start}", "-n", str(src.stat().st_size), str(src), loop)
        row("write a /usr slot (blank + sysupdate vs dd)", mine, base, "target <= 1.3x")
    finally:
        undo(mounts, loop, work)
