# SPDX-License-Identifier: MIT
"""appliance.progress: a bar on a terminal, periodic lines in the journal."""

from __future__ import annotations

import hashlib
import io
import threading
import time
from pathlib import Path

import pytest

from appliance import hashing, progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_journal_gets_one_line_every_period_and_one_at_the_end() -> None:
    out, clock = io.StringIO(), Clock()
    with progress.Progress("downloading usr.raw", total=4 * 1024**3, out=out, tty=False, every_s=10, clock=clock) as p:
        for _ in range(40):  # 40 chunks of 100 MiB, one a second
            clock.now += 1
            p.advance(100 * 1024**2)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5  # at 10, 20, 30, 40 s and the end
    assert lines[0] == "downloading usr.raw: 1000.0 MiB/4.0 GiB (24%), 100.0 MiB/s"
    assert lines[-1].endswith("(98%), 100.0 MiB/s, done in 40.0 s")
    assert "\r" not in out.getvalue()


def test_terminal_bar_is_redrawn_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm")  # NO_COLOR or TERM=dumb: no escape sequences (tests/test_cli_help.py)
    monkeypatch.delenv("NO_COLOR", raising=False)
    out, clock = io.StringIO(), Clock()
    with progress.Progress("hashing", total=10, unit="files", out=out, tty=True, clock=clock) as p:
        for _ in range(10):
            clock.now += 0.5
            p.advance(1)
    text = out.getvalue()
    assert text.count("\r\033[K") == 11 and text.endswith("\n") and text.count("\n") == 1
    assert "[" + "#" * 30 + "] 100%" in text


def test_unknown_total_and_failure() -> None:
    out, clock = io.StringIO(), Clock()
    with pytest.raises(RuntimeError), progress.Progress("packing", out=out, tty=False, clock=clock) as p:
        clock.now += 2
        p.advance(3 * 1024)
        raise RuntimeError("boom")
    assert out.getvalue() == "packing: 3.0 KiB, 1.5 KiB/s, failed\n"


def test_a_step_without_a_count_says_when_it_starts_while_it_runs_and_how_long_it_took() -> None:
    out, clock = io.StringIO(), Clock()
    with progress.step("packing engine.erofs", out=out, tty=False, every_s=0.01, clock=clock):
        clock.now += 42
        for _ in range(3000):  # the ticker thread writes while the step blocks (generous: loaded CI hosts)
            if out.getvalue().count("\n") >= 2:
                break
            time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert lines[0] == "packing engine.erofs ..."
    assert lines[1] == "packing engine.erofs: running for 42 s"
    assert lines[-1] == "packing engine.erofs: done in 42.0 s"


def test_a_failed_step_says_so_and_the_error_passes() -> None:
    out, clock = io.StringIO(), Clock()
    with pytest.raises(RuntimeError), progress.step("veritysetup format", out=out, tty=False, every_s=60, clock=clock):
        clock.now += 1.5
        raise RuntimeError("boom")
    assert out.getvalue() == "veritysetup format ...\nveritysetup format: failed after 1.5 s\n"


def test_hashing_a_file_reports_every_chunk(tmp_path: Path) -> None:
    path = tmp_path / "usr.raw"
    path.write_bytes(b"x" * (3 * hashing.CHUNK + 5))
    out, clock = io.StringIO(), Clock()
    with progress.Progress("hashing usr.raw", total=path.stat().st_size, out=out, tty=False, every_s=0, clock=clock) as p:
        digest = hashing.sha256_file(path, p.advance)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "hashing usr.raw: 1.0 MiB/3.0 MiB (33%)",
        "hashing usr.raw: 2.0 MiB/3.0 MiB (67%)",
        "hashing usr.raw: 3.0 MiB/3.0 MiB (100%)",
        "hashing usr.raw: 3.0 MiB/3.0 MiB (100%)",  # the last 5 bytes
        "hashing usr.raw: 3.0 MiB/3.0 MiB (100%)",  # the end
    ]
    assert lines[-1].endswith("done in 0.0 s")


def test_eta_is_from_this_runs_rate_and_a_resumed_part_does_not_count_in_it() -> None:
    out, clock = io.StringIO(), Clock()
    with progress.Progress("fetching", total=1000, unit="", eta=True, out=out, tty=False, every_s=10, clock=clock) as p:
        p.advance(600, resumed=True)  # found on disk: moves the bar, not the rate
        assert "ETA" not in p.line()
        clock.now += 10
        p.advance(100)  # 10 per second: 300 left take 30 s
    lines = out.getvalue().splitlines()
    assert lines[0] == "fetching: 700/1000 (70%), 70/s, ETA 0:00:30"
    assert (p.done, p.fresh) == (700, 100)


def test_reach_counts_only_an_increase() -> None:
    out, clock = io.StringIO(), Clock()
    with progress.Progress("downloading f", total=100, out=out, tty=False, clock=clock) as p:
        p.reach(40)
        p.reach(10)  # a restart from the beginning re-reads bytes already counted
        p.reach(40)
        p.reach(100)
    assert p.done == 100 and out.getvalue().startswith("downloading f: 100 B/100 B (100%)")


def test_advance_from_several_threads_loses_nothing() -> None:
    p = progress.Progress("fetching", total=None, out=io.StringIO(), tty=False, every_s=1e9)
    threads = [threading.Thread(target=lambda: [p.advance(1) for _ in range(20000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.done == p.fresh == 80000
