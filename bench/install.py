"""`make bench`: installing the release onto a disk, against `bmaptool copy` of the same image.

Both write a loop device sized for the layout (the image, slot B, root's growth, /var's minimum).
Ours is what the installer runs: `systemd-repart --empty=force --copy-from=IMAGE` with the image's
repart.d, then a sync, using Debian 13's systemd-repart and mkfs.ext4 from mkosi's tools tree (the
host's systemd may predate --copy-from, 255; the appliance's /usr has no mkfs.ext4). The baseline:
`bmaptool copy` with a block map made beforehand, i.e. what flashing the disk image costs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from appliance import config
from bench.common import ROOT
from builder import build

GIB = 1 << 30
TOOLS_TREE = Path(os.environ.get("APPLIANCE_TOOLS_TREE", "/var/cache/appliance-host/mkosi-cache/tools.cache"))


def _sh(*argv: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} {argv[1] if len(argv) > 1 else ''} failed: {proc.stderr.strip()[-800:]}")
    return proc.stdout


def verify_usr(disk: str, uki: Path, work: Path) -> str:
    """`veritysetup verify` of the installed /usr against the usrhash= of the release's UKI, each
    partition through a loop device of its own (containers often get no partition nodes)."""
    from appliance import bundle

    usrhash = bundle.uki_facts(uki)["usrhash"]
    assert usrhash, f"{uki}: no usrhash="
    data_uuid, hash_uuid = bundle.partuuids_from_usrhash(usrhash)
    parts = json.loads(_sh("sfdisk", "-J", disk))["partitiontable"]
    sector = int(parts.get("sectorsize", 512))
    loops = []
    try:
        for uuid in (data_uuid, hash_uuid):
            p = next(p for p in parts["partitions"] if p["uuid"].lower() == uuid.lower())
            loops.append(_sh("losetup", "-f", "--show", "-r", "-o", str(int(p["start"]) * sector),
                             "--sizelimit", str(int(p["size"]) * sector), disk).strip())
        _sh("veritysetup", "verify", loops[0], loops[1], usrhash)
    finally:
        for loop in loops:
            subprocess.run(["losetup", "-d", loop], check=False)
    return f"/usr verified with veritysetup against usrhash {usrhash[:16]}... (partitions {data_uuid[:8]}, {hash_uuid[:8]})"


def bench_install(demo: config.Config) -> dict[str, float]:
    out = build.output_dir(demo)
    image = out / f"appliance_{demo.appliance.version}.raw"
    work = Path(tempfile.mkdtemp(prefix="bench-install-", dir="/var/tmp"))
    mounts: list[Path] = []
    loop = ""
    try:
        disk = work / "disk.img"
        with open(disk, "wb") as f:
            f.truncate(image.stat().st_size + 6 * GIB)
        loop = _sh("losetup", "-f", "--show", str(disk)).strip()
        bmap = work / "image.bmap"
        _sh("bmaptool", "create", "-o", str(bmap), str(image))

        root = work / "root"
        root.mkdir()
        # systemd-repart's copy step makes a mount namespace and wants / to be a mount point
        _sh("mount", "-t", "tmpfs", "tmpfs", str(root))
        mounts.append(root)
        for d in ("usr", "etc", "dev", "proc", "sys", "run", "tmp", "var/tmp", "src", "defs"):
            (root / d).mkdir(parents=True)
        _sh("mount", "--bind", "-o", "ro", str(TOOLS_TREE / "usr"), str(root / "usr"))
        mounts.append(root / "usr")
        for definition in sorted((ROOT / "image/mkosi.extra/usr/lib/repart.d").glob("*.conf")):
            shutil.copyfile(definition, root / "defs" / definition.name)
        for d in ("bin", "sbin", "lib", "lib64"):
            (root / d).symlink_to(f"usr/{d}")
        shutil.copyfile(root / "usr/lib/os-release", root / "etc/os-release")
        for src, dst in (("/dev", "dev"), ("/sys", "sys")):
            _sh("mount", "--rbind", src, str(root / dst))
            mounts.append(root / dst)
        _sh("mount", "-t", "proc", "proc", str(root / "proc"))
        mounts.append(root / "proc")
        (root / "src" / image.name).touch()
        _sh("mount", "--bind", str(image), str(root / "src" / image.name))
        mounts.append(root / "src" / image.name)

        def blank() -> None:
            _sh("blkdiscard", "--force", loop)

        def install() -> None:
            _sh("chroot", str(root), "systemd-repart", "--dry-run=no", "--empty=force", f"--copy-from=/src/{image.name}",
                "--definitions=/defs", *os.environ.get("BENCH_REPART_EXTRA", "").split(), loop)
            _sh("sync")

        def install_bmap() -> None:  # the image's used blocks, then the rest of the layout as a first boot makes it
            _sh("bmaptool", "copy", "--bmap", str(bmap), str(image), loop)
            _sh("chroot", str(root), "systemd-repart", "--dry-run=no", "--definitions=/defs", loop)
            _sh("sync")

        def flash() -> None:
            _sh("bmaptool", "copy", "--bmap", str(bmap), str(image), loop)
            _sh("sync")

        def timed(fn: Callable[[], None]) -> float:
            """The best of two runs on a blank device, the image's pages already cached (a warm-up
            flash first): what differs is the writing, not who read the image first."""
            best = float("inf")
            for _ in range(2):
                blank()
                started = time.monotonic()
                fn()
                best = min(best, time.monotonic() - started)
                if fn is not flash:  # the install made the whole layout, /var included
                    parts = _sh("sfdisk", "-J", loop)
                    assert "appliance-var" in parts and f"appliance_{demo.appliance.version}" in parts, parts
            return best

        blank()
        flash()  # warm-up
        base = timed(flash)
        ours = timed(install)
        ours_bmap = timed(install_bmap)
        verified = verify_usr(loop, out / f"appliance_{demo.appliance.version}.efi", work)
        print(f"{'install to a disk (repart --copy-from vs bmaptool copy)':<58} {ours:8.1f} s vs {base:8.1f} s"
              f" = {ours / base:.2f}x  (target <= 1.3x)")
        print(f"{'install to a disk (bmaptool copy + repart vs bmaptool copy)':<58} {ours_bmap:8.1f} s vs {base:8.1f} s"
              f" = {ours_bmap / base:.2f}x  (target <= 1.3x)")
        print(f"  after the install: {verified}")
        return {"install_s": ours, "install_bmap_s": ours_bmap, "bmaptool_s": base}
    finally:
        for m in reversed(mounts):
            subprocess.run(["umount", "-R", str(m)], check=False, capture_output=True)
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    bench_install(config.load(ROOT / "appliance.toml", "demo"))
