# SPDX-License-Identifier: MIT
"""`python3 -m builder installer-uki`: the installer kernel image, built by mkosi from installer/mkosi/.

One UKI whose initrd is the whole installer system, run from RAM. The extra tree adds the appliance and
installer packages, this profile's release key, and the appliance's first-boot repart definitions under
usr/lib/appliance-installer/repart.d: not /usr/lib/repart.d, since the installer's own boot must not
repartition anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

from appliance import cli_help, paths
from appliance.config import Config
from appliance.errors import UserError
from appliance.run import checked
from builder import build, keys, render, secureboot
from builder.host_tools import MISSING_HINT, mkosi_command

PROJECT = build.ROOT / "installer" / "mkosi"
PACKAGES = ("appliance", "installer")
REPART_SOURCE = build.IMAGE_DIR / "mkosi.extra/usr/lib/repart.d"
REPART_IN_INSTALLER = "usr/lib/appliance-installer/repart.d"  # installer/install.py REPART_DEFINITIONS
SECUREBOOT_IN_INSTALLER = "usr/lib/appliance-installer/secureboot"  # installer/secureboot.py KEYS_DIR
PCR_KEY_IN_INSTALLER = "usr/lib/appliance-installer/tpm2-pcr-public-key.pem"  # installer/install.py PCR_PUBLIC_KEY
UKI_NAME = "appliance-installer.efi"
# mkosi names cached trees by distribution, release and architecture, not project: a shared cache
# directory would make each build discard the other's cached image
CACHE = build.MKOSI_CACHE.with_name("mkosi-cache-installer")


def default_path(config: Config) -> Path:
    return build.ROOT / "out" / "installer" / config.profile / UKI_NAME


def repart_definitions(config: Config, dest: Path) -> None:
    """The installer's first-boot repart definitions into DEST (bench/install.py uses them too)."""
    shutil.copytree(REPART_SOURCE, dest)
    render.first_boot_repart(config, dest)  # + the engine slots
    # the installer makes /var with a key file of its own (to write the plan), which it then
    # replaces with the recovery key; it adds the TPM2 slot itself (signed PCR 11 only)
    var = dest / "30-var.conf"
    text = var.read_text()
    if "\nEncrypt=tpm2\n" not in text:
        raise UserError(f"{REPART_SOURCE / var.name}: no Encrypt=tpm2 line", hint="/var must be encrypted (docs/disk-layout.md)")
    var.write_text(text.replace("\nEncrypt=tpm2\n", "\nEncrypt=key-file\n"))


def extra_tree(config: Config, signing_key: Path, tree: Path) -> None:
    shutil.rmtree(tree, ignore_errors=True)
    for name in PACKAGES:
        shutil.copytree(build.ROOT / name, tree / "usr/lib/python3/dist-packages" / name,
                        ignore=shutil.ignore_patterns("__pycache__", "mkosi"))
    public = signing_key.with_suffix(".pub")
    trusted = tree / paths.TRUSTED_KEYS_DIR.relative_to("/") / keys.trusted_name(public)
    trusted.parent.mkdir(parents=True)
    shutil.copyfile(public, trusted)
    repart_definitions(config, tree / REPART_IN_INSTALLER)
    boot = secureboot.boot_keys(config, signing_key)
    (tree / PCR_KEY_IN_INSTALLER).write_bytes(secureboot.public_key_pem(boot.pcr_cert))
    # the Secure Boot keys it enrolls into a firmware in setup mode
    secureboot.enrollment_set(boot, config.os.secure_boot_microsoft_ca,
                              tree / SECUREBOOT_IN_INSTALLER)


def build_uki(config: Config, signing_key: Path | None = None, output: Path | None = None) -> Path:
    key = build.signing_key_for(config, signing_key)
    work = build.work_dir(config) / "installer"
    tree, sandbox = work / "tree", work / "sandbox"
    extra_tree(config, key, tree)
    shutil.rmtree(sandbox, ignore_errors=True)
    build.write_sandbox(config, sandbox)
    final = (output or default_path(config)).resolve()
    # mkosi's output directory, beside the result: only the UKI is renamed out of it
    staging = final.parent / f".{final.name}.build"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        checked([*mkosi_command(), "-C", str(PROJECT), f"--extra-tree={tree}", f"--sandbox-tree={sandbox}",
                 f"--tools-tree-sandbox-tree={sandbox}", f"--cache-directory={CACHE}",
                 f"--output-directory={staging}",
                 *secureboot.mkosi_arguments(secureboot.boot_keys(config, key), pcr_policy=False), "build"],
                what="mkosi build (installer)", hint="see mkosi's output above; run again with --debug for the full command",
                timeout=None, capture=False, missing_hint=MISSING_HINT)  # its output streams to the terminal
        uki = staging / UKI_NAME
        if not uki.is_file():
            raise UserError(f"mkosi produced no installer kernel image at {uki}", hint="see mkosi's output above")
        os.replace(uki, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def cmd_installer_uki(args: argparse.Namespace) -> int:
    import appliance.config

    config = appliance.config.load(Path(args.config), args.profile)
    uki = build_uki(config, Path(args.signing_key) if args.signing_key else None, Path(args.output) if args.output else None)
    print(f"installer kernel image: {uki} ({uki.stat().st_size} bytes)")
    return 0


def add_parser(sub: Any) -> None:
    p = cli_help.verb_parser(
        sub, "installer-uki", "build the installer kernel image (installer/mkosi/) into out/installer/PROFILE/",
        examples=["python3 -m builder installer-uki", "python3 -m builder --profile demo installer-uki"],
        exit_codes=[(0, "the kernel image is written"), cli_help.FAILED_STEP],
    )
    p.add_argument("--signing-key", help="the release key whose public half the installer trusts (default: as build)")
    p.add_argument("--output", help=f"where to write it (default: out/installer/PROFILE/{UKI_NAME})")
    p.set_defaults(func=cmd_installer_uki)
