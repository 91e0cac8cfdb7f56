"""Build outputs changed after the build, for scenarios the signed chain must refuse."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from builder import keys


def foreign_signed(out: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the build output OUT (hard links) whose kernel image is signed again by a Secure
    Boot key made here, which no firmware's db holds."""
    copy = tmp_path_factory.mktemp("foreign-signed") / "out"
    shutil.copytree(out, copy, copy_function=os.link)
    (sb_key, sb_cert), _ = keys.boot_keys(tmp_path_factory.mktemp("foreign-keys"), make=True)
    (uki,) = copy.glob("*.efi")
    data = uki.read_bytes()
    uki.unlink()  # a link to OUT's own kernel image: write a file of its own
    uki.write_bytes(data)
    subprocess.run(["sbattach", "--remove", str(uki)], check=True, capture_output=True)
    subprocess.run(["sbsign", "--key", str(sb_key), "--cert", str(sb_cert), "--output", str(uki), str(uki)], check=True,
                   capture_output=True)
    return copy
