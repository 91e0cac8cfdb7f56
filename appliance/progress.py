# SPDX-License-Identifier: MIT
"""Progress of a long step: a bar on a terminal, a line every few seconds anywhere else.

    with progress.Progress("downloading usr.raw", total=size, unit="B") as p:
        for chunk in chunks:
            p.advance(len(chunk))

On a tty the bar is redrawn at most ten times a second; elsewhere (the journal, a pipe) a line
every EVERY_S seconds and one at the end, so a journal shows a long step moving without flooding.
advance() may be called from several threads; step() is for work that cannot be counted.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TextIO

from appliance import terminal

EVERY_S = float(os.environ.get("APPLIANCE_PROGRESS_EVERY_S", "10"))
_REDRAW_S = 0.1
_BAR = 30


def _amount(value: float, unit: str) -> str:
    if unit != "B":
        return f"{value:g}{(' ' + unit) if unit else ''}"
    for name, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= size:
            return f"{value / size:.1f} {name}"
    return f"{value:.0f} B"


class Progress:
    """Progress of one step. With ETA the line ends in the time left at this run's rate; work found
    done (advance(n, resumed=True): a resumed download's prefix) moves the bar but not that rate."""

    def __init__(
        self,
        what: str,
        total: float | None = None,
        *,
        unit: str = "B",
        eta: bool = False,
        out: TextIO | None = None,
        tty: bool | None = None,
        every_s: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.what = what
        self.total = total
        self.unit = unit
        self.eta = eta
        self.done = 0.0
        self.fresh = 0.0  # done in this run (the ETA's rate): done less what advance(resumed=True) counted
        self.out = out or sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.every_s = EVERY_S if every_s is None else every_s
        self.clock = clock or time.monotonic
        self.started = self.clock()
        self._last = self.started
        self._lock = threading.Lock()
        self._line = _Line(self.out, self.tty)

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish(failed=kind is not None)

    def advance(self, amount: float, *, resumed: bool = False) -> None:
        with self._lock:
            self._add(amount, resumed)

    def reach(self, done: float) -> None:
        """DONE in all (an absolute count): only an increase counts, so bytes read again after a
        retry or a restart are not counted twice."""
        with self._lock:
            if done > self.done:
                self._add(done - self.done, False)

    def _add(self, amount: float, resumed: bool) -> None:
        self.done += amount
        if not resumed:
            self.fresh += amount
        now = self.clock()
        if now - self._last >= (_REDRAW_S if self.tty else self.every_s):
            self._last = now
            self._write(self.line(now))

    def line(self, now: float | None = None) -> str:
        """'WHAT: DONE/TOTAL (P%), RATE[, ETA H:MM:SS]' (the text written to the journal)."""
        now = now if now is not None else self.clock()
        elapsed = max(now - self.started, 1e-9)
        rate = f"{_amount(self.done / elapsed, self.unit)}/s"
        if not self.total:
            return f"{self.what}: {_amount(self.done, self.unit)}, {rate}"
        pct = min(100.0, 100.0 * self.done / self.total)
        text = f"{self.what}: {_amount(self.done, self.unit)}/{_amount(self.total, self.unit)} ({pct:.0f}%), {rate}"
        if self.tty:
            filled = int(_BAR * pct / 100)
            text = f"{self.what} [{'#' * filled}{'.' * (_BAR - filled)}] {pct:3.0f}% {rate}"
        if self.eta and self.fresh > 0:
            left = max(self.total - self.done, 0) / (self.fresh / elapsed)
            text += f", ETA {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"
        return text

    def finish(self, failed: bool = False) -> None:
        with self._lock:
            now = self.clock()
            end = "failed" if failed else f"done in {now - self.started:.1f} s"
            self._write(f"{self.line(now)}, {end}", final=True)

    def _write(self, text: str, final: bool = False) -> None:
        self._line.write(text, final)


class _Line:
    """Where a step's text goes. On a terminal TEXT replaces the line (ended when FINAL): erased by
    an escape sequence, or, with NO_COLOR or TERM=dumb, overwritten with spaces past its end;
    elsewhere each text is a line of its own."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out = out
        self.tty = tty
        self.erase = tty and not terminal.plain_text_asked()
        self.shown = 0  # the width of the text on the terminal's line now

    def write(self, text: str, final: bool = False) -> None:
        if not self.tty:
            self.out.write(text + "\n")
        elif self.erase:
            self.out.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.out.write("\r" + text.ljust(self.shown) + ("\n" if final else ""))
            self.shown = 0 if final else len(text)
        self.out.flush()


@contextmanager
def step(
    what: str,
    *,
    out: TextIO | None = None,
    tty: bool | None = None,
    every_s: float | None = None,
    clock: Callable[[], float] | None = None,
) -> Iterator[None]:
    """A step without a count: 'WHAT ...' when it starts, 'WHAT: running for N s' every EVERY_S
    seconds (a thread writes them while the step blocks in a subprocess), 'WHAT: done in N s'."""
    out = out or sys.stderr
    tty = out.isatty() if tty is None else tty
    every = every_s if every_s is not None else 1.0 if tty else EVERY_S
    clock = clock or time.monotonic
    started = clock()
    lock = threading.Lock()
    line = _Line(out, tty)

    def say(text: str, final: bool = False) -> None:
        with lock:  # the ticker thread and the step's end
            line.write(text, final)

    say(f"{what} ...")
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            say(f"{what}: running for {clock() - started:.0f} s")

    ticker = threading.Thread(target=tick, name=f"progress: {what}", daemon=True)
    ticker.start()
    failed = True
    try:
        yield
        failed = False
    finally:
        stop.set()
        ticker.join()
        elapsed = clock() - started
        say(f"{what}: failed after {elapsed:.1f} s" if failed else f"{what}: done in {elapsed:.1f} s", final=True)
