# SPDX-License-Identifier: MIT
"""Runs inside mkosi (image/mkosi.finalize) on the finished tree, before /usr is sealed.

With gpu.required, checks that the MI300X firmware amdgpu.ko declares is in the tree; records the
factory /etc (a copy in /usr/share/factory/etc, its description in /usr/lib/appliance: what
`applianctl verify` compares /etc with); then writes the signed release manifest into
/usr/lib/appliance and the output directory. The private key is mounted only for this step (a mkosi
build source) and never enters the image.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import appliance.signed.release_manifest
from appliance import factory_etc
from appliance.errors import UserError
from builder import firmware

LIB = Path("usr/lib/appliance")


def kernel_version(root: Path) -> str:
    versions = sorted(p.name for p in (root / "usr/lib/modules").iterdir() if (p / "modules.dep").exists() or p.is_dir())
    if len(versions) != 1:
        raise UserError(f"expected one kernel in the image, found {versions}", hint="install exactly one kernel package")
    return versions[0]


def release_manifest(root: Path, plan: dict[str, Any], signer: str) -> dict[str, Any]:
    return {
        "version": plan["version"],
        "min_version": plan["min_version"],
        "build_time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(os.environ.get("SOURCE_DATE_EPOCH", time.time())))),
        "profile": plan["profile"],
        "engine_image": plan["engine_image"],
        "model": plan["model"],
        "kernel_version": kernel_version(root),
        "files": plan["files"],
        "signer": signer,
    }


def main() -> int:
    root = Path(os.environ["BUILDROOT"])
    plan = json.loads((root / LIB / "release-plan.json").read_text())
    if plan["gpu_required"]:
        firmware.check_image(root)
    # mkosi has made /etc whole by now (presets, sysusers, tmpfiles, firstboot, RemoveFiles)
    recorded = factory_etc.write_factory(root)
    print(f"factory /etc: {recorded} paths in /{factory_etc.FACTORY_DIR}, described in /{factory_etc.RECORD}")
    key = Path(os.environ["APPLIANCE_SIGNING_KEY"])
    public = appliance.signed.release_manifest.key_id(appliance.signed.release_manifest.load_private_key(key).public_key())
    body = release_manifest(root, plan, public)
    data = appliance.signed.release_manifest.dumps(body)
    signature = appliance.signed.release_manifest.sign(body, key)
    (root / LIB / "release-plan.json").unlink()
    for directory in (root / LIB, Path(os.environ["OUTPUTDIR"])):
        (directory / "manifest.json").write_bytes(data)
        (directory / "manifest.json.sig").write_bytes(signature)
    # the signature must verify against the keys the image trusts
    appliance.signed.release_manifest.verify(data, signature, root / LIB / "keys")
    print(f"release manifest {body['version']} signed by {public}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"error: {e.message}\nhint: {e.hint}", file=sys.stderr)
        sys.exit(2)
