"""Progress of a long step: a bar on a terminal, a line every few seconds anywhere else.

    from appliance import progress

    with progress.Progress("downloading usr.raw", total=size, unit="B") as p:
        for chunk in chunks:
            p.advance(len(chunk))

On a terminal (stderr is a tty) the bar is redrawn in place at most ten times a second. In the
journal, a pipe or a log file, one line is written every EVERY_S seconds ("downloading usr.raw:
1.2/4.0 GiB (30%), 95.3 MiB/s") and one when the step ends, so a unit's journal shows a long
download or hash moving without flooding it. TOTAL may be None when the size is unknown.

A step whose amount cannot be counted (an external tool packing or hashing) uses step():

    with progress.step("packing engine.erofs"):
        run(["mkfs.erofs", ...])

It says when the step starts, how long it has been running every EVERY_S seconds (on a terminal,
every second in place), and how long it took.
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
    """Progress of one step; use as a context manager and call advance() as work is done."""

    def __init__(
        self,
        what: str,
        total: float | None = None,
        *,
        unit: str = "B",
        out: TextIO | None = None,
        tty: bool | None = None,
        every_s: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.what = what
        self.total = total
        self.unit = unit
        self.done = 0.0
        self.out = out or sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.every_s = EVERY_S if every_s is None else every_s
        self.clock = clock or time.monotonic
        self.started = self.clock()
        self._last = self.started

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.finish(failed=kind is not None)

    def advance(self, amount: float) -> None:
        self.done += amount
        now = self.clock()
        if now - self._last >= (_REDRAW_S if self.tty else self.every_s):
            self._last = now
            self._write(self.line(now))

    def line(self, now: float | None = None) -> str:
        """'WHAT: DONE/TOTAL (P%), RATE' (the text written to the journal)."""
        elapsed = max((now if now is not None else self.clock()) - self.started, 1e-9)
        rate = f"{_amount(self.done / elapsed, self.unit)}/s"
        if self.total:
            pct = min(100.0, 100.0 * self.done / self.total)
            text = f"{self.what}: {_amount(self.done, self.unit)}/{_amount(self.total, self.unit)} ({pct:.0f}%), {rate}"
            if self.tty:
                filled = int(_BAR * pct / 100)
                text = f"{self.what} [{'#' * filled}{'.' * (_BAR - filled)}] {pct:3.0f}% {rate}"
            return text
        return f"{self.what}: {_amount(self.done, self.unit)}, {rate}"

    def finish(self, failed: bool = False) -> None:
        now = self.clock()
        end = "failed" if failed else f"done in {now - self.started:.1f} s"
        self._write(f"{self.line(now)}, {end}", final=True)

    def _write(self, text: str, final: bool = False) -> None:
        _write(self.out, self.tty, text, final)


def _write(out: TextIO, tty: bool, text: str, final: bool) -> None:
    """On a terminal TEXT replaces the line (ended when FINAL); elsewhere it is a line of its own."""
    if tty:
        out.write("\r\033[K" + text + ("\n" if final else ""))
    else:
        out.write(text + "\n")
    out.flush()


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

    def say(text: str, final: bool = False) -> None:
        with lock:  # the ticker thread and the step's end
            _write(out, tty, text, final)

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
