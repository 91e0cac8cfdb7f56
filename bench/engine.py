# SPDX-License-Identifier: MIT
"""`make bench`, engine slots: writing an engine store into a free engine slot against
`dd bs=4M conv=fsync` of the same bytes (target: at most 1.3x).

"Ours" is what `applianctl update` does: blank the slot and label it `_empty`, then the built
image's own systemd-sysupdate (chroot of its /usr) with the engine component's transfers, on a loop
device over a GPT file holding both slots. The bytes: the last demo build's engine partition
images, else a generated erofs. Writes to the running engine partition are counted in the QEMU
journey (no loop partitions here); this run checks slot A's bytes unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from appliance import config
from appliance.signed import bundle_index
from appliance.signed.bundle_index import ENGINE_TYPE, ENGINE_VERITY_TYPE
from bench.common import ROOT, Figure, elapsed, image_root, measured, sh, sysupdate_argv, undo
from builder import build

MIB = 1 << 20
SLOT_GOAL = 1.3  # ours / dd, at most
# The image's engine component, when it has one (what `applianctl update` runs); else the
# transfers docs/disk-layout.md describes.
IMAGE_TRANSFERS = ROOT / "image/mkosi.extra/usr/lib/sysupdate.engine.d"
DESCRIBED = {
    "10-engine.transfer": ("engine_@v.raw", ENGINE_TYPE, "engine_@v"),
    "20-engine-verity.transfer": ("engine_@v.verity.raw", ENGINE_VERITY_TYPE, "engine_@v-verity"),
}


def transfer(source_pattern: str, partition_type: str, target_pattern: str, device: str) -> str:
    """An engine component's transfer definition as docs/disk-layout.md describes it, aimed at DEVICE."""
    return (
        "[Transfer]\nVerify=no\n\n"
        f"[Source]\nType=regular-file\nPath=/src\nMatchPattern={source_pattern}\n\n"
        f"[Target]\nType=partition\nPath={device}\nMatchPartitionType={partition_type.lower()}\n"
        f"MatchPattern={target_pattern}\nInstancesMax=2\n"
    )


def transfers(device: str) -> tuple[dict[str, str], str]:
    """The engine component's transfer definitions aimed at DEVICE and /src, and where they came from."""
    shipped = sorted(IMAGE_TRANSFERS.glob("*.transfer"))
    if shipped:
        return {p.name: p.read_text().replace("Path=auto", f"Path={device}").replace(
            "Path=/var/lib/appliance/update/source", "Path=/src") for p in shipped}, "the image's"
    return {name: transfer(*spec, device) for name, spec in DESCRIBED.items()}, "docs/disk-layout.md's"


def generated_store(work: Path, size: int) -> tuple[Path, Path]:
    """An erofs of SIZE random bytes (incompressible, like image layers) and its hash tree."""
    tree = work / "tree"
    tree.mkdir()
    (tree / "layer").write_bytes(os.urandom(size))
    erofs, verity = work / "engine.erofs", work / "engine.verity"
    sh("mkfs.erofs", "-T0", "--all-root", str(erofs), str(tree))
    sh("veritysetup", "format", str(erofs), str(verity))
    return erofs, verity


def _digest(device: str, start: int, length: int) -> str:
    h = hashlib.sha256()
    with open(device, "rb") as f:
        f.seek(start)
        left = length
        while left:
            chunk = f.read(min(left, 4 * MIB))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def slot_table(sizes: list[int]) -> str:
    """The sfdisk script of a disk holding both engine slots, each a store and its hash tree of
    SIZES bytes: slot A another engine (the running one, as far as this bench goes), slot B free."""
    return "label: gpt\n" + "".join(
        f"size={size // 512}, type={kind}, name={name}\n"
        for name, kind, size in (
            ("engine_000000000000", ENGINE_TYPE, sizes[0]), ("engine_000000000000-verity", ENGINE_VERITY_TYPE, sizes[1]),
            ("_empty", ENGINE_TYPE, sizes[0]), ("_empty", ENGINE_VERITY_TYPE, sizes[1]),
        )
    )


def bench_engine_slot_write(demo: config.Config, generated: tuple[int, ...] = (0, 1 << 30)) -> list[Figure]:
    """For each of GENERATED: 0, the demo's own store (tiny: the fixed costs of blkdiscard and
    systemd-sysupdate dominate); else a generated store of that many bytes (1 GiB: the cost per
    byte, which is what a production engine of tens of GB pays)."""
    return [engine_slot_write(demo, size) for size in generated]


def engine_slot_write(demo: config.Config, generated: int) -> Figure:
    out = build.output_dir(demo)
    version = demo.appliance.version
    usr = out / f"appliance_{version}.usr.raw"
    if not usr.is_file():
        raise FileNotFoundError(f"{usr}: build the demo first (its systemd-sysupdate writes the slot)")
    work = Path(tempfile.mkdtemp(prefix="bench-engine-slot-", dir="/var/tmp"))
    mounts: list[Path] = []
    loop = ""
    try:
        images = [out / f"appliance_{version}.engine.raw", out / f"appliance_{version}.engine-verity.raw"]
        if generated or not all(p.is_file() for p in images):
            images = list(generated_store(work, generated or demo.engine.slot_bytes // 2))
        short = bundle_index.engine_short(demo.engine.digest)
        disk = work / "disk.img"
        sizes = [-(-p.stat().st_size // MIB) * MIB for p in images]
        with open(disk, "wb") as f:
            f.truncate(2 * sum(sizes) + 4 * MIB)
        subprocess.run(["sfdisk", "-q", str(disk)], input=slot_table(sizes), text=True, check=True)
        loop = sh("losetup", "-f", "--show", str(disk)).strip()
        parts = json.loads(sh("sfdisk", "-J", loop))["partitiontable"]["partitions"]
        slot_a = [(int(p["start"]) * 512, int(p["size"]) * 512) for p in parts[:2]]
        slot_b = [(int(p["start"]) * 512, int(p["size"]) * 512) for p in parts[2:]]
        for start, length in slot_a:  # something to keep: the running engine's bytes
            sh("dd", "if=/dev/urandom", f"of={loop}", "bs=1M", f"count={length // MIB}", "oflag=seek_bytes",
                f"seek={start}", "conv=notrunc", "status=none")
        before = [_digest(loop, s, n) for s, n in slot_a]

        def plain() -> None:
            for src, (start, _) in zip(images, slot_b, strict=True):
                sh("dd", f"if={src}", f"of={loop}", "bs=4M", "oflag=seek_bytes", f"seek={start}", "conv=fsync,notrunc", "status=none")

        root = image_root(usr, work / "root", mounts)
        defs, origin = transfers(loop)
        for name, text in defs.items():
            (root / "defs" / name).write_text(text)
        for src, name in zip(images, (f"engine_{short}.raw", f"engine_{short}.verity.raw"), strict=True):
            shutil.copyfile(src, root / "src" / name)

        def ours() -> None:  # blank the chosen slot, then the engine component
            for start, length in slot_b:
                sh("blkdiscard", "--force", "--zeroout", "--offset", str(start), "--length", str(length), loop)
            for i in (3, 4):
                sh("sfdisk", "-q", "--part-label", loop, str(i), "_empty")
            sh(*sysupdate_argv(root, short))
            sh("sync")

        base = elapsed(plain)
        mine = elapsed(ours)
        for src, (start, _) in zip(images, slot_b, strict=True):  # slot B holds exactly the store's bytes
            sh("cmp", f"--ignore-initial=0:{start}", "-n", str(src.stat().st_size), str(src), loop)
        labels = [p.get("name") for p in json.loads(sh("sfdisk", "-J", loop))["partitiontable"]["partitions"]]
        if labels[2:] != [f"engine_{short}", f"engine_{short}-verity"]:
            raise RuntimeError(f"systemd-sysupdate labelled slot B {labels[2:]}")
        if [_digest(loop, s, n) for s, n in slot_a] != before:
            raise RuntimeError("writing slot B changed slot A")
        mib = sum(p.stat().st_size for p in images) / MIB
        what = "generated" if images[0].parent == work else "demo"
        # this host has no loop partitions to count writes through; the QEMU journey counts them on
        # the guest's own partitions (testkit/bootcheck.py, tests/integration/test_image_upgrade.py)
        return measured(f"write an engine slot, {what} {mib:.0f} MiB (vs dd)", mine, base, "s", at_most=SLOT_GOAL,
                        note=f"with {origin} engine transfers; slot A (the running engine) meanwhile: SHA-256 unchanged")
    finally:
        undo(mounts, loop, work)


if __name__ == "__main__":  # one size: python3 -m bench.engine [BYTES] (0: the demo's store)
    import sys

    engine_slot_write(config.load(ROOT / "appliance.toml", "demo"), int(sys.argv[1]) if len(sys.argv) > 1 else 0)
