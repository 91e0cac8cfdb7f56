# SPDX-License-Identifier: MIT
"""What a run of `make bench` records (bench/report.py): out/bench.json with every figure, the
machine and the commit, out/bench.md, and the table of docs/benchmarks.md, which only the tool
writes: it must stand between its markers in the generator's format."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import report
from bench.common import Figure, Outcome

ROOT = Path(__file__).resolve().parents[1]
MACHINE = report.Machine(2, (0.5, 0.25, 0.125), (1.5, 0.75, 0.5), "6.1.0-test")


def _outcome() -> Outcome:
    figures = [
        Figure("install to a disk", 12.5, 10.0, "s", 1.25, "<= 1.30x", "met", "stood in for: efibootmgr", "bench_install"),
        Figure("proxy, answers/s", 240.0, 250.0, "req/s", 0.96, ">= 0.95x", "met", "", "bench_proxy_rps"),
        Figure("new engine: bytes downloaded", 0.04, 64.0, "MB", 0.000625, "", "", "", "bench_new_engine_bytes"),
        Figure("a | piped name", 2.0, 1.0, "s", 2.0, "<= 1.30x", "NOT met", "", "bench_status"),
    ]
    return Outcome(figures, {"bench_boot": "no image at out/demo"}, ["bench_install", "bench_boot"], 1)


def test_the_json_holds_every_figure_the_machine_and_the_commit(tmp_path: Path) -> None:
    report.write(_outcome(), MACHINE, "0" * 40, tmp_path / "out", None)
    recorded = json.loads((tmp_path / "out/bench.json").read_text())
    assert recorded["commit"] == "0" * 40 and recorded["status"] == 1
    assert recorded["machine"] == {"cores": 2, "load_start": [0.5, 0.25, 0.125], "load_end": [1.5, 0.75, 0.5], "kernel": "6.1.0-test"}
    first = recorded["figures"][0]
    assert {k: first[k] for k in ("name", "ours", "baseline", "unit", "ratio", "goal", "verdict", "bench")} == {
        "name": "install to a disk", "ours": 12.5, "baseline": 10.0, "unit": "s", "ratio": 1.25, "goal": "<= 1.30x",
        "verdict": "met", "bench": "bench_install"}
    assert recorded["not_measured"] == {"bench_boot": "no image at out/demo"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench.json", "bench.md"]  # no temporary left


def test_the_markdown_has_the_commit_the_machine_and_a_row_per_figure(tmp_path: Path) -> None:
    report.write(_outcome(), MACHINE, "0" * 40, tmp_path, None)
    text = (tmp_path / "bench.md").read_text()
    assert f"Commit {'0' * 40}; 2 cores, load average 0.50 0.25 0.12 at the start and 1.50 0.75 0.50 at the end" in text
    rows = report.parse_table(text)
    assert [(r["benchmark"], r["ours"], r["baseline"], r["ratio"], r["goal"], r["verdict"]) for r in rows] == [
        ("`bench_install`", "12.50 s", "10.00 s", "1.25x", "<= 1.30x", "met"),
        ("`bench_proxy_rps`", "240 req/s", "250 req/s", "0.96x", ">= 0.95x", "met"),
        ("`bench_new_engine_bytes`", "0.04 MB", "64.00 MB", "0.00x", "—", "no goal"),
        ("`bench_status`", "2.00 s", "1.00 s", "2.00x", "<= 1.30x", "NOT met"),
        ("`bench_boot`", "—", "—", "—", "—", "not measured"),
    ]
    assert rows[0]["figure"] == "install to a disk (stood in for: efibootmgr)" and rows[3]["figure"] == "a / piped name"


@pytest.mark.parametrize("broken", [
    "| figure | benchmark | ours |\n|---|---|---|\n",  # another header
    "| figure | benchmark | ours | baseline | ratio | goal | verdict |\n|---|---|\n",  # another separator
    "| figure | benchmark | ours | baseline | ratio | goal | verdict |\n|---|---|---|---|---|---|---|\n| a | `bench_x` | 1 s |\n",
    "| figure | benchmark | ours | baseline | ratio | goal | verdict |\n|---|---|---|---|---|---|---|\n"
    "| a | `bench_x` | 1 s | 1 s | 1.00x | — | fine |\n",  # a verdict the generator never writes
    "| figure | benchmark | ours | baseline | ratio | goal | verdict |\n|---|---|---|---|---|---|---|\n"
    "| a | `bench_x` | fast | 1 s | 1.00x | — | met |\n",  # a figure that is no number
    "| figure | benchmark | ours | baseline | ratio | goal | verdict |\n|---|---|---|---|---|---|---|\n"
    "| a | x | 1 s | 1 s | 1.00x | — | met |\n",  # no benchmark's name
    "no table at all\n",
])
def test_a_table_not_in_the_generators_format_is_refused(broken: str) -> None:
    with pytest.raises(ValueError):
        report.parse_table(broken)


def test_the_docs_table_stands_between_its_markers_in_the_generators_format() -> None:
    block = report.block_of(report.DOCS.read_text())
    report.parse_table(block)  # its numbers are the last run's; its format is the generator's
    assert block.splitlines()[-1] == report.END
    assert block.splitlines()[-2].startswith("|")  # nothing typed after the table


@pytest.mark.parametrize("text", [
    "no markers\n",
    f"{report.START}\n",
    f"{report.END}\n{report.START}\n",
    f"{report.START}\n{report.START}\n{report.END}\n",
])
def test_markers_missing_doubled_or_reversed_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        report.block_of(text)


def test_a_full_run_replaces_only_what_stands_between_the_markers(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\nprose before\n\n{report.START}\nan old table\n{report.END}\n\nprose after\n")
    report.write(_outcome(), MACHINE, "0" * 40, tmp_path / "out", docs)
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nprose before\n\n") and text.endswith(f"{report.END}\n\nprose after\n")
    block = report.block_of(text)
    assert "an old table" not in block and "0" * 40 not in block  # the docs name no commit
    assert "Measured on 2 cores" in block and len(report.parse_table(block)) == 5
    docs.write_text("no markers\n")
    with pytest.raises(ValueError):
        report.write(_outcome(), MACHINE, "0" * 40, tmp_path / "out", docs)


@pytest.mark.programs
def test_the_commit_is_heads_and_unknown_outside_git(tmp_path: Path) -> None:
    if (ROOT / ".git").exists():
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
        assert report.commit(ROOT) == (head or "unknown")
    assert report.commit(tmp_path) == "unknown"


def test_the_machine_is_this_one() -> None:
    here = report.machine((0.0, 0.0, 0.0))
    assert here.cores >= 1 and here.kernel and len(here.load_end) == 3 and here.load_start == (0.0, 0.0, 0.0)
