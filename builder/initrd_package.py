# SPDX-License-Identifier: MIT
"""What the appliance adds to mkosi's default initrd, as a Debian package of its own.

The kernel command line has no room for it (2,048 bytes on x86, most of them taken by the
credentials of builder/build.py), and mkosi's default initrd takes extra packages from a local
package directory. The package holds image/initrd/package/ (the reader of /usr's root hash
signature and its unit); its version is the hash of what it holds, and mkosi installs it as a
volatile package, so a changed file is never hidden by mkosi's cached initrd.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from appliance.run import checked
from builder.host_tools import MISSING_HINT

NAME = "appliance-initrd"
DIRECTORY = "initrd-packages"  # beside build/PROFILE/generated
SOURCE = Path(__file__).resolve().parents[1] / "image/initrd/package"
# a fixed time for every file and the archive: the same tree makes the same package
EPOCH = "1700000000"


def content_hash(source: Path = SOURCE) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(source)).encode() + b"\0")
        digest.update(oct(path.stat().st_mode & 0o777).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def make(directory: Path, source: Path = SOURCE) -> Path:
    """Build the package from SOURCE into DIRECTORY (emptied first); return its path."""
    version = f"1+{content_hash(source)}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    out = directory / f"{NAME}_{version}_all.deb"
    with tempfile.TemporaryDirectory(prefix="appliance-initrd-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(source, tree, symlinks=True)
        (tree / "DEBIAN").mkdir()
        (tree / "DEBIAN/control").write_text(
            f"Package: {NAME}\nVersion: {version}\nSection: admin\nPriority: optional\nArchitecture: all\n"
            "Maintainer: appliance builder <root@localhost>\n"
            "Depends: bash, util-linux, udev\n"
            "Description: the appliance's additions to its initrd\n /usr opened only with its root hash signature.\n")
        checked(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(tree), str(out)], what="dpkg-deb --build",
                hint="run `make setup` (dpkg-deb comes with dpkg)", timeout=None, env={**os.environ, "SOURCE_DATE_EPOCH": EPOCH},
                missing_hint=MISSING_HINT)
    return out
