# SPDX-License-Identifier: MIT
"""`python3 -m builder installer` and `flash DEVICE`: installer media from a built release, and a USB stick.

Each form boots the same installer UKI (the release's kernel, the installer in its initrd, run from RAM):
installer_VERSION.raw (+ .bmap) for USB: an ESP with EFI/BOOT/BOOTX64.EFI and an ext4 payload partition
(appliance-payload) with the release bundle's install image (the zstd disk image and its block map,
both listed with their size and SHA-256 in the signed bundle index), the signed manifest and bundle
index, and the optional signed plan;
installer_VERSION.iso for BMC virtual media: the same as ISO 9660 with an El Torito EFI image;
installer_VERSION.efi for UEFI HTTP boot: the UKI alone, fetching the release over HTTPS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from appliance import cli_help
from appliance.errors import UserError
from appliance.run import run
from appliance.signed import bundle_index, install_plan

MIB = 1 << 20
PAYLOAD_LABEL = "appliance-payload"
ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
LINUX_TYPE = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"


def _run(argv: Sequence[str | Path], what: str, hint: str, input_text: str | None = None) -> str:
    """ARGV's output, with no timeout: writing a stick or an image takes as long as it takes."""
    return run(argv, what, hint, None, input=input_text)


TOOLS_HINT = "install the media tools: apt-get install dosfstools mtools e2fsprogs xorriso bmap-tools"


def esp_image(uki: Path, path: Path) -> None:
    """A FAT image whose EFI/BOOT/BOOTX64.EFI (the firmware's removable-media path) is UKI."""
    size_mib = (uki.stat().st_size + 8 * MIB) // MIB + 8
    with open(path, "wb") as f:
        f.truncate(size_mib * MIB)
    _run(["mkfs.vfat", "-F", "32" if size_mib >= 64 else "16", "-n", "INSTALLER", path], "making the ESP", TOOLS_HINT)
    _run(["mmd", "-i", path, "::EFI", "::EFI/BOOT"], "making the ESP", TOOLS_HINT)
    _run(["mcopy", "-i", path, uki, "::EFI/BOOT/BOOTX64.EFI"], "copying the installer UKI", TOOLS_HINT)


def payload_files(build_out: Path, version: str, plan_dir: Path | None, bundle_dir: Path) -> dict[str, Path]:
    """NAME ON THE MEDIUM -> SOURCE: the release bundle's signed index, manifest and install image
    (what the installer checks against that index before it writes anything), and the plan. The
    bundle must be the release of the build in BUILD_OUT: the same signed manifest."""
    install = bundle_index.install_names(version)
    files = {name: bundle_dir / name for name in (*install.values(), "manifest.json", "manifest.json.sig",
                                                  bundle_index.BUNDLE_INDEX, bundle_index.BUNDLE_SIG)}
    if plan_dir is not None:
        files[f"plan/{install_plan.PLAN_JSON}"] = plan_dir / install_plan.PLAN_JSON
        files[f"plan/{install_plan.PLAN_SIG}"] = plan_dir / install_plan.PLAN_SIG
    for name, src in files.items():
        if not src.is_file():
            hint = ("release the build with its install image: python3 -m builder release --install-image"
                    if name in install.values() else
                    "build the release (python3 -m builder build), make its bundle (python3 -m builder release --install-image) "
                    "and sign the plan (python3 -m builder plan PLAN.toml)")
            raise UserError(f"{src}: no such file (needed on the medium as {name})", hint=hint)
    built = build_out / "manifest.json"
    if not built.is_file() or built.read_bytes() != files["manifest.json"].read_bytes():
        raise UserError(f"{bundle_dir}: not the release of the build in {build_out} (another manifest.json)",
                        hint="release this build: python3 -m builder release --install-image (or give --bundle)")
    return files


def _stage(files: dict[str, Path], directory: Path) -> None:
    for name, src in files.items():
        dst = directory / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        # keep any holes (a plan or an index has none; a copy is cheap where the file system reflinks)
        _run(["cp", "--sparse=always", "--reflink=auto", src, dst], f"staging {name}", "check the free space in out/")


def _apparent(files: dict[str, Path]) -> int:
    return sum(p.stat().st_size for p in files.values())


def usb_image(esp: Path, files: dict[str, Path], out: Path, work: Path) -> None:
    """GPT: the ESP, then the payload partition (ext4 made from the staged files)."""
    stage = work / "payload"
    _stage(files, stage)
    payload = work / "payload.ext4"
    size = (_apparent(files) * 11 // 10 + 64 * MIB) // MIB * MIB
    with open(payload, "wb") as f:
        f.truncate(size)
    _run(["mkfs.ext4", "-q", "-F", "-L", PAYLOAD_LABEL, "-d", stage, "-O", "^has_journal", "-E", "root_owner=0:0", payload],
         "making the payload file system", TOOLS_HINT)
    esp_mib, payload_mib = esp.stat().st_size // MIB, size // MIB
    with open(out, "wb") as f:
        f.truncate((1 + esp_mib + payload_mib + 1) * MIB)
    table = (f"label: gpt\nstart=2048, size={esp_mib * 2048}, type={ESP_TYPE}, name=INSTALLER\n"
             f"size={payload_mib * 2048}, type={LINUX_TYPE}, name={PAYLOAD_LABEL}\n")
    _run(["sfdisk", "-q", out], "writing the partition table", TOOLS_HINT, input_text=table)
    for src, offset_mib in ((esp, 1), (payload, 1 + esp_mib)):
        _run(["dd", f"if={src}", f"of={out}", "bs=1M", f"seek={offset_mib}", "conv=notrunc,sparse", "status=none"],
             "writing a partition", TOOLS_HINT)


def iso_image(esp: Path, files: dict[str, Path], out: Path, work: Path) -> None:
    """ISO 9660 (Rock Ridge, Joliet) with an El Torito EFI boot image for BMC virtual media."""
    stage = work / "iso"
    _stage(files, stage)
    shutil.copyfile(esp, stage / "efiboot.img")
    _run(["xorriso", "-as", "mkisofs", "-iso-level", "3", "-R", "-J", "-V", "APPLIANCE_INSTALLER",
          "-e", "efiboot.img", "-no-emul-boot", "-isohybrid-gpt-basdat", "-o", out, stage],
         "making the ISO", TOOLS_HINT)


def make(build_out: Path, version: str, uki: Path, plan_dir: Path | None, output: Path, forms: Sequence[str],
         bundle_dir: Path) -> dict[str, Path]:
    """Write each of FORMS (usb, iso, efi) into OUTPUT under a temporary name; return what was written."""
    if not uki.is_file():
        raise UserError(f"{uki}: no installer kernel image", hint="build it: python3 -m builder installer-uki (or give --installer-uki)")
    files = payload_files(build_out, version, plan_dir, bundle_dir)
    output.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix=".installer-", dir=output) as tmp:
        work = Path(tmp)
        esp = work / "esp.img"
        esp_image(uki, esp)
        for form in forms:
            final = output / f"installer_{version}.{ {'usb': 'raw', 'iso': 'iso', 'efi': 'efi'}[form] }"
            part = work / final.name
            if form == "usb":
                usb_image(esp, files, part, work)
                bmap = work / (final.name + ".bmap")
                _run(["bmaptool", "create", "-o", bmap, part], "making the block map", TOOLS_HINT)
                os.replace(bmap, output / bmap.name)
                written["bmap"] = output / bmap.name
            elif form == "iso":
                iso_image(esp, files, part, work)
            else:
                shutil.copyfile(uki, part)
            os.replace(part, final)
            written[form] = final
    return written


# ------------------------------------------------------------------------------ flash


def flash_refusal(device: str, doc: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """Why DEVICE may not be flashed ("" when it may), and its lsblk node. DOC: `lsblk --json -O -b`."""
    node = next((n for n in doc.get("blockdevices", []) if n.get("path") == device or f"/dev/{n.get('name')}" == device), None)
    if node is None:
        return f"{device} is not a whole disk", None
    if node.get("type") != "disk":
        return f"{device} is a {node.get('type')}, not a whole disk", node

    def mounts(n: dict[str, Any]) -> list[str]:
        own = [m for m in (n.get("mountpoints") or [n.get("mountpoint")]) if m]
        return own + [m for c in n.get("children") or [] for m in mounts(c)]

    used = mounts(node)
    if used:
        system = [m for m in used if m in ("/", "/usr", "/boot", "/boot/efi", "/efi", "/var", "[SWAP]")]
        kind = "a system disk" if system else "mounted"
        return f"{device} is {kind} (mounted at {', '.join(used)})", node
    if node.get("ro"):
        return f"{device} is read-only", node
    return "", node


def describe(node: dict[str, Any]) -> str:
    size = int(node.get("size") or 0)
    what = " ".join(str(node.get(k) or "").strip() for k in ("vendor", "model") if node.get(k)).strip() or "unknown model"
    serial = str(node.get("serial") or "-").strip()
    removable = ", removable" if node.get("rm") or node.get("hotplug") else ""
    return f"{node.get('path')}: {what}, serial {serial}, {size / (1 << 30):.1f} GiB, {node.get('tran') or 'no transport'}{removable}"


def flash(image: Path, device: str, yes: bool, lsblk_json: str | None = None) -> int:
    bmap = image.with_name(image.name + ".bmap")
    if not image.is_file() or not bmap.is_file():
        raise UserError(f"{image} or {bmap.name} is missing", hint="make them: python3 -m builder installer")
    doc = json.loads(lsblk_json if lsblk_json is not None else _run(["lsblk", "--json", "-O", "-b"], "listing disks", TOOLS_HINT))
    why, node = flash_refusal(device, doc)
    if why:
        raise UserError(f"refusing to write {device}: {why}", hint="name the USB stick (lsblk -o PATH,MODEL,SIZE,TRAN,MOUNTPOINTS)")
    assert node is not None
    print(f"about to overwrite {describe(node)}")
    if int(node.get("size") or 0) < image.stat().st_size:
        raise UserError(f"{device} is smaller than {image.name}", hint="use a larger stick")
    if not yes:
        answer = input(f"type the device name ({device}) to write it: ")
        if answer.strip() != device:
            print("nothing written")
            return 1
    _run(["bmaptool", "copy", "--bmap", bmap, image, device], f"writing {device}", "check the stick and try again")
    print(f"{device}: written and verified against {bmap.name}")
    return 0


# ------------------------------------------------------------------------------ CLI glue


def cmd_installer(args: argparse.Namespace) -> int:
    import appliance.config
    from builder import build, installer_uki

    config = appliance.config.load(Path(args.config), args.profile)
    uki = Path(args.installer_uki) if args.installer_uki else installer_uki.default_path(config)
    out = Path(args.build_output) if args.build_output else build.output_dir(config)
    output = Path(args.output) if args.output else build.ROOT / "out" / "installer" / f"{config.profile}-{config.appliance.version}"
    bundle_dir = Path(args.bundle) if args.bundle else build.ROOT / "out" / "bundles" / f"{config.profile}-{config.appliance.version}"
    written = make(out, config.appliance.version, uki, Path(args.plan) if args.plan else None, output,
                   args.form or ["usb", "iso", "efi"], bundle_dir)
    for form, path in written.items():
        print(f"{form}: {path} ({path.stat().st_size} bytes)")
    return 0


def cmd_flash(args: argparse.Namespace) -> int:
    if args.bmc:
        from builder import flash_bmc

        if args.device or args.image:
            raise UserError("flash takes a DEVICE and --image, or --bmc FLEET.toml, not both", hint="python3 -m builder flash --help")
        return flash_bmc.cmd_flash_bmc(args)
    if not args.device or not args.image:
        raise UserError("flash needs a DEVICE and --image (or --bmc FLEET.toml)", hint="python3 -m builder flash --help")
    return flash(Path(args.image), args.device, args.yes)


def add_parsers(sub: Any) -> None:
    """Register `installer` and `flash` on the builder's subparsers."""
    p = cli_help.verb_parser(
        sub, "installer", "make installer media (USB image + bmap, ISO, HTTP-boot UKI) from the last build",
        examples=["python3 -m builder installer --plan hosts/gpu-07", "python3 -m builder --profile demo installer --form usb"],
        exit_codes=[(0, "the media are written"), cli_help.FAILED_STEP],
    )
    p.add_argument("--installer-uki", help="the installer kernel image (default: what `installer-uki` built for the profile)")
    p.add_argument("--plan", help="a signed plan directory (python3 -m builder plan) to put on the medium")
    p.add_argument("--form", action="append", choices=["usb", "iso", "efi"], help="only these forms (repeatable; default: all)")
    p.add_argument("--build-output", help="the build's output directory (default: out/PROFILE)")
    p.add_argument("--bundle", help="the release bundle (python3 -m builder release; default: out/bundles/PROFILE-VERSION)")
    p.add_argument("--output", help="where to write the media (default: out/installer/PROFILE-VERSION)")
    p.set_defaults(func=cmd_installer)

    from builder import flash_bmc

    p = cli_help.verb_parser(
        sub, "flash", "write an installer USB image to a stick with bmaptool, or install a fleet through its BMCs (--bmc)",
        examples=["python3 -m builder flash /dev/sdb --image out/installer/production-1.4.0/installer_1.4.0.raw",
                  *flash_bmc.EXAMPLES],
        exit_codes=[(0, "the stick is written; with --bmc: every host is installed (or was already)"),
                    (1, "with --bmc: some host failed (its line says at which step, what the BMC answered and what to do)"),
                    (2, "bad input, a disk it refuses, not confirmed, or bmaptool failed (one line and a hint)")],
    )
    p.add_argument("device", nargs="?", help="the whole stick, e.g. /dev/sdb")
    p.add_argument("--image", help="installer_VERSION.raw (its .bmap beside it)")
    p.add_argument("--yes", action="store_true", help="do not ask before writing (the model and size are still shown)")
    flash_bmc.add_arguments(p)
    p.set_defaults(func=cmd_flash)
