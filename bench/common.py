# SPDX-License-Identifier: MIT
"""What the benchmarks share: timing, the result row, commands, and a chroot of the built image's /usr."""

from __future__ import annotations

import dataclasses
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from appliance.errors import UserError
from appliance.run import checked
from builder.host_tools import FAILED_HINT, MISSING_HINT

ROOT = Path(__file__).resolve().parents[1]


def elapsed(fn: Callable[[], object]) -> float:
    """How long FN takes, in seconds."""
    start = time.monotonic()
    fn()
    return time.monotonic() - start


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


@dataclasses.dataclass(frozen=True)
class Figure:
    """One measured figure: OURS against BASELINE (both in UNIT), their ratio, the goal ("" when the
    figure has none) and whether it was met ("met", "NOT met"; "" without a goal). BENCH is the
    benchmark that measured it (BENCH_ONLY's name), filled in by the runner."""

    name: str
    ours: float
    baseline: float
    unit: str
    ratio: float
    goal: str = ""
    verdict: str = ""
    note: str = ""
    bench: str = ""

    def line(self) -> str:
        """The figure as `make bench` prints it."""
        goal = f"goal {self.goal}: {self.verdict}" if self.goal else "no goal"
        return (f"{self.name:<52} {shown(self.ours):>8} {self.unit:<5} baseline {shown(self.baseline):>8} {self.unit:<5} "
                f"ratio {self.ratio:5.2f}x  ({goal}{'; ' + self.note if self.note else ''})")


def shown(value: float) -> str:
    """VALUE with the digits that say something: 1234, 12.34, 0.0123."""
    if value == 0 or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def size_label(n: int) -> str:
    """N bytes in the largest binary unit that leaves at least 1: 2 GiB, 128 MiB, 64 KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def measured(name: str, ours: float, base: float, unit: str, *, at_most: float | None = None, at_least: float | None = None,
             under: float | None = None, note: str = "") -> Figure:
    """The figure OURS against BASE in UNIT, printed; its goal: the ratio AT_MOST or AT_LEAST, and/or
    OURS UNDER a bound (in UNIT). A baseline of zero measured nothing: no figure (ValueError)."""
    value = ratio(ours, base)
    goals, met = [], []
    if at_most is not None:
        goals.append(f"<= {at_most:.2f}x")
        met.append(value <= at_most)
    if at_least is not None:
        goals.append(f">= {at_least:.2f}x")
        met.append(value >= at_least)
    if under is not None:
        goals.append(f"under {under:g} {unit}")
        met.append(ours < under)
    figure = Figure(name, ours, base, unit, value, " and ".join(goals), ("met" if all(met) else "NOT met") if goals else "", note)
    print(figure.line())
    return figure


def sh(*argv: str) -> str:
    """ARGV's standard output; a failure raises (as the builder's commands do)."""
    return checked(argv, argv[0], FAILED_HINT, None, missing_hint=MISSING_HINT).stdout


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


def sysupdate_argv(root: Path, version: str) -> list[str]:
    """The image's own systemd-sysupdate in the chroot ROOT, with the definitions at /defs, installing VERSION."""
    return ["chroot", str(root), "/usr/lib/systemd/systemd-sysupdate", "--definitions=/defs", "--no-pager", "update", version]


def undo(mounts: list[Path], loop: str, work: Path) -> None:
    """Unmount MOUNTS (last first), detach LOOP (if any), remove WORK: a bench's cleanup."""
    for m in reversed(mounts):
        subprocess.run(["umount", "-R", str(m)], check=False, capture_output=True)
    if loop:
        subprocess.run(["losetup", "-d", loop], check=False)
    shutil.rmtree(work, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a run measured: every figure, each benchmark not measured with why, the names of those
    run, and the exit status (0: all measured; 1: any not; 2: BENCH_ONLY named no benchmark)."""

    figures: list[Figure]
    not_measured: dict[str, str]
    ran: list[str]
    status: int


def measure(benches: Sequence[Callable[[Any], object]], config: Any, only: str = "") -> Outcome:
    """Run each of BENCHES (ONLY: comma-separated names, only those) on CONFIG, collecting the
    figures each returns. A benchmark that raises does not stop the others; each one not measured is
    named, and the run then fails (1). ONLY naming no benchmark is a usage fault (2): a run that
    measures nothing must not pass."""
    names = [b.__name__ for b in benches]
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        print(f"BENCH_ONLY: no benchmark {', '.join(unknown)}", file=sys.stderr)
        print(f"hint: one of: {', '.join(names)}", file=sys.stderr)
        return Outcome([], {}, [], 2)
    figures: list[Figure] = []
    failed: dict[str, str] = {}
    ran: list[str] = []
    for bench in benches:
        if wanted and bench.__name__ not in wanted:
            continue
        ran.append(bench.__name__)
        try:
            result = bench(config)
        except Exception as e:  # a benchmark that cannot run says so and the others still run
            why = (e.message if isinstance(e, UserError) else f"{type(e).__name__}: {e}").strip().splitlines()
            print(f"{bench.__name__}: not measured: {why[0] if why else type(e).__name__}")
            failed[bench.__name__] = why[0] if why else type(e).__name__
        else:
            returned = result if isinstance(result, (list, tuple)) else []
            figures += [dataclasses.replace(f, bench=bench.__name__) for f in returned if isinstance(f, Figure)]
        sys.stdout.flush()
    if failed:
        print(f"bench: {len(failed)} figure(s) not measured: {', '.join(failed)}", file=sys.stderr)
    return Outcome(figures, failed, ran, 1 if failed else 0)


def run_benches(benches: Sequence[Callable[[Any], object]], config: Any, only: str = "") -> int:
    """measure(), its exit status only."""
    return measure(benches, config, only).status
