# SPDX-License-Identifier: MIT
"""What the benchmarks share: timing, the result row, commands, and a chroot of the built image's /usr."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from appliance.errors import UserError
from builder.run import run

ROOT = Path(__file__).resolve().parents[1]


def elapsed(fn: Callable[[], object]) -> float:
    """How long FN takes, in seconds."""
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def row(name: str, ours: float, base: float, target: str) -> None:
    print(f"{name:<44} {ours:8.2f} s  baseline {base:8.2f} s  ratio {ratio(ours, base):5.2f}x  ({target})")


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank Q-th percentile of VALUES (p50: the median sample, p100: the largest)."""
    if not values:
        raise ValueError("no samples")
    if not 0 < q <= 100:
        raise ValueError(f"percentile {q}: not in (0, 100]")
    ordered = sorted(values)
    return ordered[math.ceil(q / 100 * len(ordered)) - 1]


def ratio(ours: float, base: float) -> float:
    """OURS / BASE; a baseline of zero or less measured nothing, so there is no ratio."""
    if not base > 0:
        raise ValueError(f"baseline {base}: nothing measured, no ratio")
    return ours / base


def verdict(value: float, *, at_most: float | None = None, at_least: float | None = None) -> str:
    """The goal for a ratio and whether VALUE meets it, e.g. "goal <= 1.05x: met"."""
    if (at_most is None) == (at_least is None):
        raise ValueError("one goal: at_most or at_least")
    if at_most is not None:
        return f"goal <= {at_most:.2f}x: {'met' if value <= at_most else 'NOT met'}"
    assert at_least is not None
    return f"goal >= {at_least:.2f}x: {'met' if value >= at_least else 'NOT met'}"


def ratio_row(name: str, ours: float, base: float, unit: str, goal: str) -> str:
    """One printed figure against its baseline: OURS and BASE in UNIT, their ratio, GOAL (from verdict)."""
    return f"{name:<52} {ours:8.2f} {unit:<5} baseline {base:8.2f} {unit:<5} ratio {ratio(ours, base):5.2f}x  ({goal})"


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


def run_benches(benches: Sequence[Callable[[Any], object]], config: Any, only: str = "") -> int:
    """Run each of BENCHES (ONLY: comma-separated names, only those) on CONFIG. A benchmark that
    raises does not stop the others; each one not measured is named, and the run then fails (1).
    ONLY naming no benchmark is a usage fault (2): a run that measures nothing must not pass."""
    names = [b.__name__ for b in benches]
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(f"BENCH_ONLY: no benchmark {', '.join(unknown)}", file=sys.stderr)
        print(f"hint: one of: {', '.join(names)}", file=sys.stderr)
        return 2
    failed = []
    for bench in benches:
        if wanted and bench.__name__ not in wanted:
            continue
        try:
            bench(config)
        except Exception as e:  # a benchmark that cannot run says so and the others still run
            why = e.message if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
            print(f"{bench.__name__}: not measured: {why}".splitlines()[0])
            failed.append(bench.__name__)
        sys.stdout.flush()
    if failed:
        print(f"bench: {len(failed)} figure(s) not measured: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
