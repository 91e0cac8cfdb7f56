# SPDX-License-Identifier: MIT
"""What a run of `make bench` leaves behind: every figure with its baseline, ratio, goal and
verdict, the machine it ran on (cores, load average at the start and at the end, kernel) and the
commit, as out/bench.json and as a Markdown table in out/bench.md; after a full run (no
BENCH_ONLY) the same table replaces what stands between the markers of docs/benchmarks.md, which
nobody edits by hand. The commit stays out of the docs: they name no commit of their own history."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from appliance.atomic import atomic_write, write_json_atomic
from bench.common import ROOT, Outcome, shown

FORMAT = 1
JSON_NAME, MARKDOWN_NAME = "bench.json", "bench.md"
DOCS = ROOT / "docs" / "benchmarks.md"
START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
HEADER = ("figure", "benchmark", "ours", "baseline", "ratio", "goal", "verdict")
VERDICTS = ("met", "NOT met", "no goal", "not measured")


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where a run measured: its cores, the load average (1, 5, 15 min) at its start and end, the kernel."""

    cores: int
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float]
    kernel: str

    def line(self) -> str:
        def load(values: tuple[float, float, float]) -> str:
            return " ".join(f"{v:.2f}" for v in values)

        return (f"{self.cores} cores, load average {load(self.load_start)} at the start and {load(self.load_end)} at the end, "
                f"kernel {self.kernel}")


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def machine(load_start: tuple[float, float, float]) -> Machine:
    """This machine, with LOAD_START taken before the first figure and the load now as the end."""
    return Machine(os.cpu_count() or 0, load_start, load_average(), platform.release())


def commit(root: Path = ROOT) -> str:
    """The commit ROOT is checked out at (`git rev-parse HEAD`); "unknown" outside git or without git."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    head = proc.stdout.strip()
    return head if proc.returncode == 0 and head else "unknown"


def document(outcome: Outcome, where: Machine, revision: str) -> dict[str, Any]:
    """out/bench.json: the run, the machine, the commit, every figure and every benchmark not measured."""
    return {
        "format": FORMAT,
        "commit": revision,
        "machine": dataclasses.asdict(where),
        "status": outcome.status,
        "ran": outcome.ran,
        "figures": [dataclasses.asdict(f) for f in outcome.figures],
        "not_measured": outcome.not_measured,
    }


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def table(outcome: Outcome) -> str:
    """The Markdown table of OUTCOME: a row per figure, then a row per benchmark not measured."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for f in outcome.figures:
        cells = (f.name + (f" ({f.note})" if f.note else ""), f"`{f.bench}`", f"{shown(f.ours)} {f.unit}",
                 f"{shown(f.baseline)} {f.unit}", f"{f.ratio:.2f}x", f.goal or "—", f.verdict or "no goal")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    for bench, why in outcome.not_measured.items():
        lines.append("| " + " | ".join(_cell(c) for c in (why, f"`{bench}`", "—", "—", "—", "—", "not measured")) + " |")
    return "\n".join(lines) + "\n"


def markdown(outcome: Outcome, where: Machine, revision: str) -> str:
    """out/bench.md: the commit, the machine and the table."""
    return f"# `make bench`\n\nCommit {revision}; {where.line()}.\n\n{table(outcome)}"


def docs_block(outcome: Outcome, where: Machine) -> str:
    """What stands between the markers of docs/benchmarks.md: the machine and the table (no commit);
    before any full run, the empty table."""
    said = f"Measured on {where.line()}." if outcome.ran else "No full run recorded yet: `make bench` writes this table."
    return f"{START}\n{said}\n\n{table(outcome)}{END}"


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of the first table in TEXT, by column; ValueError unless it is the format table() writes."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    if len(lines) < 2:
        raise ValueError("no table")
    header = tuple(c.strip() for c in lines[0].strip("|").split("|"))
    if header != HEADER:
        raise ValueError(f"header {header}: not {HEADER}")
    if lines[1] != "|" + "---|" * len(HEADER):
        raise ValueError(f"second line {lines[1]!r}: not the separator")
    rows = []
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().removeprefix("|").removesuffix("|").split("|")]
        if len(cells) != len(HEADER):
            raise ValueError(f"{line!r}: {len(cells)} cells, not {len(HEADER)}")
        row = dict(zip(HEADER, cells, strict=True))
        if not (row["benchmark"].startswith("`bench_") and row["benchmark"].endswith("`")):
            raise ValueError(f"{line!r}: no benchmark's name")
        if row["verdict"] not in VERDICTS:
            raise ValueError(f"{line!r}: verdict {row['verdict']!r} is none of {VERDICTS}")
        if row["verdict"] != "not measured":
            for column in ("ours", "baseline"):
                float(row[column].split(" ", 1)[0])
            if not row["ratio"].endswith("x"):
                raise ValueError(f"{line!r}: ratio {row['ratio']!r}")
            float(row["ratio"].removesuffix("x"))
        rows.append(row)
    return rows


def block_of(text: str) -> str:
    """What stands between the markers in TEXT (the markers included); ValueError unless each is there once, in order."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"not one {START} then one {END}")
    return text[text.index(START):text.index(END) + len(END)]


def write(outcome: Outcome, where: Machine, revision: str, out: Path, docs: Path | None) -> None:
    """OUT/bench.json and OUT/bench.md, each whole or not at all; DOCS' table too when given (a full run)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / JSON_NAME, document(outcome, where, revision))
    atomic_write(out / MARKDOWN_NAME, markdown(outcome, where, revision).encode())
    if docs is not None:
        text = docs.read_text()
        atomic_write(docs, text.replace(block_of(text), docs_block(outcome, where)).encode())
