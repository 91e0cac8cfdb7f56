# SPDX-License-Identifier: MIT
"""`make bench`: installing the release onto a disk the installer's way, against the same two
writing commands run by hand.

Ours is installer/install.py `install()` itself, on a real runner, from the install image and block
map `builder release --install-image` ships (zstd; made once, not timed): choosing the disk, the image
checked against its SHA-256 in the index, `bmaptool copy --bmap`, `systemd-repart --dry-run=no
--definitions=` (the installer's definitions: the image's repart.d plus both engine slots, as
builder/installer_uki.py puts them), `verify_written` (`veritysetup verify` of /usr and of the engine
store against the signed root hashes), the signed plan written onto the new /var and read back,
the boot entry, the summary. The baseline: `bmaptool copy` of the same image then `systemd-repart`
by hand, then a sync. So the ratio is what the installer's own work costs on top of writing the
disk.

All on a loop device over a file of the size the installer asks for (`required_bytes`), with
Debian 13's systemd-repart and mkfs.ext4 from mkosi's tools tree in a chroot (the host's systemd
may predate the image's definitions; the appliance's /usr has no mkfs.ext4). What this host cannot
give the installer is stood in for by the runner, and is named there: partition nodes and udev
(containers have neither), the TPM2 enrollment of /var (no TPM; /var is made with the installer's
key file and gets its recovery key for real) and the firmware's boot entries and Secure Boot keys
(efibootmgr would change this host's). The definitions are the installer's own
(builder/installer_uki.py `repart_definitions`: /var with a key file, not the image's Encrypt=tpm2).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from appliance import config
from appliance.signed import bundle_index, install_plan, release_manifest
from bench.common import ROOT, Figure, measured, sh
from builder import build, installer_uki, release
from installer import install

TOOLS_TREE = Path(os.environ.get("APPLIANCE_TOOLS_TREE", "/var/cache/appliance-host/mkosi-cache/tools.cache"))
INSTALL_GOAL = 1.3  # installer / by hand, at most
SERIAL = "BENCH-LOOP-DISK"
CHROOT_KEY = "/run/var.key"  # where the chroot's systemd-repart reads the install's key file
RUNS = 3


class LoopRunner:
    """The installer's Runner for loop device DISK on a build host. systemd-repart runs from the
    chroot ROOT (definitions at /defs, the install's key file copied to CHROOT_KEY: the chroot sees
    neither of the host's paths); `lsblk` of DISK is answered from its partition table, with a loop
    device per partition (made then, counted in the time; containers get no partition nodes);
    `udevadm` and `partx` have nothing to do (no udev); the TPM2 enrollment is skipped (a build
    host has no TPM to seal /var to; the recovery key is enrolled for real); `efibootmgr` edits a
    boot list of its own instead of this host's firmware. Every other command runs as given, and
    SKIPPED names what was stood in for."""

    def __init__(self, root: Path, disk: str) -> None:
        self.root, self.disk = root, disk
        self.partitions: dict[tuple[int, int], str] = {}
        self.boot = {"0000": "debian"}
        self.order = ["0000"]
        self.skipped: list[str] = []

    def command(self, argv: Sequence[str]) -> list[str] | None:
        """What runs for ARGV on this host: the chroot's systemd-repart for the installer's, None
        for what is stood in for here, ARGV itself for the rest."""
        argv = list(argv)
        if argv[0] == "systemd-repart":
            args = []
            for a in argv[1:]:
                if a.startswith("--definitions="):
                    a = "--definitions=/defs"
                elif a.startswith("--key-file="):
                    shutil.copyfile(a.split("=", 1)[1], self.root / CHROOT_KEY.lstrip("/"))
                    a = f"--key-file={CHROOT_KEY}"
                args.append(a)
            return ["chroot", str(self.root), "systemd-repart", *args]
        if argv[0] in ("udevadm", "partx") or argv[0] == "efibootmgr" or (
                argv[0] == "systemd-cryptenroll" and any(a.startswith("--tpm2-device=") for a in argv)):
            return None
        return argv

    def __call__(self, argv: Sequence[str]) -> str:
        argv = list(argv)
        if argv[0] == "efibootmgr":
            return self.efibootmgr(argv[1:])
        if argv[:4] == ["lsblk", "--json", "-O", "-b"] and argv[4:] == [self.disk]:
            return json.dumps(self.lsblk())
        command = self.command(argv)
        if command is None:
            self.skipped.append(argv[0])
            return ""
        return sh(*command)

    def lsblk(self) -> dict[str, Any]:
        table = json.loads(sh("sfdisk", "-J", self.disk))["partitiontable"]
        sector = int(table.get("sectorsize", 512))
        children = []
        for n, p in enumerate(table.get("partitions", []), 1):
            span = (int(p["start"]) * sector, int(p["size"]) * sector)
            if span not in self.partitions:
                self.partitions[span] = sh("losetup", "-f", "--show", "-o", str(span[0]), "--sizelimit", str(span[1]),
                                            self.disk).strip()
            children.append({"path": self.partitions[span], "type": "part", "partn": n, "partuuid": p["uuid"].lower(),
                             "partlabel": p.get("name", ""), "parttype": p["type"].lower()})
        return {"blockdevices": [{"path": self.disk, "type": "disk", "children": children}]}

    def listing(self, size: int) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
        """What `lsblk --json -O -b` would list for DISK as a fixed, blank disk with serial SERIAL."""
        node = {"name": "benchdisk", "path": self.disk, "type": "disk", "serial": SERIAL, "model": "bench loop disk",
                "size": size, "rm": False, "hotplug": False, "ro": False, "tran": "sata", "children": []}
        return {"blockdevices": [node]}, {}

    def efibootmgr(self, args: list[str]) -> str:
        if "--delete-bootnum" in args:
            number = args[args.index("--bootnum") + 1]
            self.boot.pop(number, None)
            self.order = [b for b in self.order if b != number]
        elif "--create" in args:
            number = f"{max(int(n, 16) for n in self.boot) + 1:04X}" if self.boot else "0000"
            self.boot[number] = args[args.index("--label") + 1]
            self.order.insert(0, number)
        elif "--bootorder" in args:
            self.order = args[args.index("--bootorder") + 1].split(",")
        return f"BootCurrent: 0000\nBootOrder: {','.join(self.order)}\n" + "".join(
            f"Boot{n}* {label}\n" for n, label in sorted(self.boot.items()))

    def close(self) -> None:
        """Detach the partitions' loop devices: the next write changes what is under them."""
        for loop in self.partitions.values():
            subprocess.run(["losetup", "-d", loop], check=False)
        self.partitions.clear()


def install_payload(out: Path, version: str, work: Path) -> install.Payload:
    """The last build as `builder release --install-image` ships it to the installer: the disk
    image zstd-compressed with its block map (release.py's own step), its size and SHA-256 as the
    signed index would list them, and the signed manifest's engine facts."""
    release._install_image(out / f"appliance_{version}.raw", work, version)
    names = bundle_index.install_names(version)
    image = work / names["install-image"]
    digest = hashlib.sha256()
    with open(image, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    man = release_manifest.load(release_manifest.parse_canonical((out / "manifest.json").read_bytes()))
    usrhash = bundle_index.uki_facts(out / f"appliance_{version}.efi")["usrhash"]
    if not usrhash:
        raise RuntimeError(f"{out}: the kernel image's command line has no usrhash=")
    return install.Payload(image=image, bmap=work / names["install-bmap"], version=version, usrhash=usrhash,
                             engine_label=man.engine_image.store_label, engine_roothash=man.engine_image.store_roothash,
                             image_file=bundle_index.BundleFile(image.name, digest.hexdigest(), image.stat().st_size))


def signed_plan(key: Path, work: Path) -> tuple[install_plan.Plan, Path, Path]:
    """A plan naming the bench's disk, signed with KEY (the demo's release key); its directory and the trusted keys."""
    host_plan = install_plan.from_plain({"hostname": "bench-install", "target": {"serial": SERIAL}}, "the bench's plan")
    plan_dir, trusted = work / "plan", work / "trusted"
    plan_dir.mkdir()
    trusted.mkdir()
    data, signature = install_plan.sign(host_plan, key)
    (plan_dir / install_plan.PLAN_JSON).write_bytes(data)
    (plan_dir / install_plan.PLAN_SIG).write_bytes(signature)
    shutil.copyfile(key.with_suffix(".pub"), trusted / "release.pub")
    return host_plan, plan_dir, trusted


def host_stand_ins(work: Path) -> tuple[Path, Path, Path]:
    """What the installer reads of the machine, as a build host stands in for it: sysfs with nothing
    stacked on the blank loop disk, a TPM 2.0 (the check passes; the enrollment is LoopRunner's to
    skip), and no EFI variables (no Secure Boot keys to enroll, this host's firmware left alone)."""
    sys_root, tpm, efivars = work / "sys", work / "tpm", work / "no-efivars"  # no directory: a machine without EFI
    for d in (sys_root, tpm):
        d.mkdir(parents=True)
    (tpm / "tpm_version_major").write_text("2\n")
    return sys_root, tpm, efivars


def by_hand_argv(payload: install.Payload, root: Path, disk: str) -> list[list[str]]:
    """The baseline: the same two writing commands the installer runs, by hand."""
    return [["bmaptool", "copy", "--bmap", str(payload.bmap), str(payload.image), disk],
            ["chroot", str(root), "systemd-repart", "--dry-run=no", "--definitions=/defs", f"--key-file={CHROOT_KEY}", disk],
            ["sync"]]


def _chroot(root: Path, defs: Path, mounts: list[Path]) -> None:
    """ROOT: mkosi's tools tree as /usr, the installer's definitions at /defs."""
    # systemd-repart's copy step makes a mount namespace and wants / to be a mount point
    sh("mount", "-t", "tmpfs", "tmpfs", str(root))
    mounts.append(root)
    for d in ("usr", "etc", "dev", "proc", "sys", "run", "tmp", "var/tmp", "defs"):
        (root / d).mkdir(parents=True)
    sh("mount", "--bind", "-o", "ro", str(TOOLS_TREE / "usr"), str(root / "usr"))
    mounts.append(root / "usr")
    for definition in sorted(defs.glob("*.conf")):
        shutil.copyfile(definition, root / "defs" / definition.name)
    for d in ("bin", "sbin", "lib", "lib64"):
        (root / d).symlink_to(f"usr/{d}")
    shutil.copyfile(root / "usr/lib/os-release", root / "etc/os-release")
    for src, dst in (("/dev", "dev"), ("/sys", "sys")):
        sh("mount", "--rbind", src, str(root / dst))
        mounts.append(root / dst)
    sh("mount", "-t", "proc", "proc", str(root / "proc"))
    mounts.append(root / "proc")


def bench_install(demo: config.Config, runs: int = RUNS) -> list[Figure]:
    out = build.output_dir(demo)
    version = demo.appliance.version
    raw = out / f"appliance_{version}.raw"
    if not raw.is_file():
        raise FileNotFoundError(f"{raw}: build the demo first (make build-demo)")
    if not (TOOLS_TREE / "usr/bin/systemd-repart").is_file():
        raise FileNotFoundError(f"{TOOLS_TREE}: no mkosi tools tree (APPLIANCE_TOOLS_TREE); a demo build makes it")
    if subprocess.run(["dmsetup", "version"], capture_output=True, check=False).returncode != 0:
        raise RuntimeError("this host's kernel has no device-mapper (`dmsetup version` fails): /var cannot be made in LUKS2, "
                           "by the installer or by hand")
    work = Path(tempfile.mkdtemp(prefix="bench-install-", dir="/var/tmp"))
    mounts: list[Path] = []
    loop = ""
    runner: LoopRunner | None = None
    try:
        defs = work / "defs"
        installer_uki.repart_definitions(demo, defs)  # what the installer's medium carries
        payload = install_payload(out, version, work)
        host_plan, plan_dir, trusted = signed_plan(build.signing_key_for(demo, None), work)
        size = install.required_bytes(payload, defs)  # the smallest disk the installer takes
        disk = work / "disk.img"
        with open(disk, "wb") as f:
            f.truncate(size)
        loop = sh("losetup", "-f", "--show", str(disk)).strip()
        root = work / "root"
        root.mkdir()
        _chroot(root, defs, mounts)
        runner = LoopRunner(root, loop)
        sys_root, tpm, efivars = host_stand_ins(work)
        (root / CHROOT_KEY.lstrip("/")).write_bytes(os.urandom(64))  # the baseline's key file
        summary: list[str] = []

        def ours() -> None:
            assert runner is not None
            summary[:] = []
            install.install(payload, host_plan, plan_dir, runner=runner, listing=runner.listing(size), sys_root=sys_root,
                            boot_partuuid="", trusted_keys=trusted, signer="bench", reboot=False, out=summary.append,
                            efivars=efivars, tpm=tpm)

        def by_hand() -> None:
            for argv in by_hand_argv(payload, root, loop):
                sh(*argv)

        def timed(fn: Callable[[], None]) -> float:
            """One run on a blank device; the layout checked after it (slot B and /var made)."""
            assert runner is not None
            sh("blkdiscard", "--force", loop)
            started = time.monotonic()
            fn()
            seconds = time.monotonic() - started
            runner.close()
            labels = [p.get("name", "") for p in json.loads(sh("sfdisk", "-J", loop))["partitiontable"]["partitions"]]
            if "appliance-var" not in labels or f"appliance_{version}" not in labels or labels.count(bundle_index.EMPTY_LABEL) < 4:
                raise RuntimeError(f"{fn.__name__}: the disk lacks the first-boot layout (slot B, /var): {', '.join(labels)}")
            return seconds

        by_hand()  # warm-up: the image's pages cached for every run
        times: dict[Callable[[], None], list[float]] = {by_hand: [], ours: []}
        for _ in range(runs):  # alternated, the best of RUNS each: what differs is the work, not who ran first
            for fn, seconds in times.items():
                seconds.append(timed(fn))
        base, mine = min(times[by_hand]), min(times[ours])
        checked = [line.split("checked", 1)[1].strip() for text in summary for line in text.splitlines() if " checked " in line]
        if len(checked) < 3:
            raise RuntimeError("the installer's summary names fewer than three checks:\n" + "\n".join(summary[-1:]))
        return [measured("install to a disk (installer vs bmaptool + repart)", mine, base, "s", at_most=INSTALL_GOAL,
                         note=f"on a {size / 2**30:.1f} GiB disk; stood in for: {', '.join(sorted(set(runner.skipped)))}; "
                              f"the installer checked: {'; '.join(checked)}")]
    finally:
        if runner is not None:
            runner.close()
        with contextlib.suppress(OSError):  # the install's key file, left by a run that stopped before the recovery key
            (install.KEY_DIR / "var.key").unlink(missing_ok=True)
            install.KEY_DIR.rmdir()
        for m in reversed(mounts):
            subprocess.run(["umount", "-R", str(m)], check=False, capture_output=True)
        if loop:
            subprocess.run(["losetup", "-d", loop], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    bench_install(config.load(ROOT / "appliance.toml", "demo"))
