"""What the benchmarks share: timing, the result row, commands, and a chroot of the built image's /usr."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from builder.run import run

ROOT = Path(__file__).resolve().parents[1]


def elapsed(fn: Callable[[], object]) -> float:
    """How long FN takes, in seconds."""
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def row(name: str, ours: float, base: float, target: str) -> None:
    print(f"{name:<44} {ours:8.2f} s  baseline {base:8.2f} s  ratio {ours / base:5.2f}x  ({target})")


def sh(*argv: str) -> str:
    """ARGV's standard output; a failure raises (the builder's runner)."""
    return run(argv, capture=True).stdout


def image_root(usr: Path, root: Path, mounts: list[Path]) -> Path:
    """ROOT: a chroot of the built image's own /usr (its systemd-sysupdate, not the host's), with
    empty /src and /defs for a bundle's files and transfer definitions; each mount is added to
    MOUNTS for the caller to undo."""
    for d in ("usr", "etc", "dev", "proc", "sys", "run", "tmp", "var/tmp", "src", "defs"):
        (root / d).mkdir(parents=True)
    sh("mount", "-o", "loop,ro", str(usr), str(root / "usr"))
    mounts.append(root / "usr")
    for d in ("bin", "sbin", "lib", "lib64"):
        (root / d).symlink_to(f"usr/{d}")
    shutil.copyfile(root / "usr/lib/os-release", root / "etc/os-release")
    sh("mount", "--rbind", "/dev", str(root / "dev"))
    mounts.append(root / "dev")
    sh("mount", "-t", "proc", "proc", str(root / "proc"))
    mounts.append(root / "proc")
    sh("mount", "--rbind", "/sys", str(root / "sys"))
    mounts.append(root / "sys")
    return root


def undo(mounts: list[Path], loop: str, work: Path) -> None:
    """Unmount MOUNTS (last first), detach LOOP (if any), remove WORK: a bench's cleanup."""
    for m in reversed(mounts):
        subprocess.run(["umount", "-R", str(m)], check=False, capture_output=True)
    if loop:
        subprocess.run(["losetup", "-d", loop], check=False)
    shutil.rmtree(work, ignore_errors=True)
