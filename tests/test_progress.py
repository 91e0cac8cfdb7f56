"""appliance.progress: a bar on a terminal, periodic lines in the journal."""

from __future__ import annotations

import io

import pytest

from appliance import progress


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


def test_terminal_bar_is_redrawn_in_place() -> None:
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
