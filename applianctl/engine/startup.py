# SPDX-License-Identifier: MIT
"""The startup report (`applianctl startup-report`): vLLM's startup lines turned into figures.

A healthy start shows, in order (docs/reference-stack.md, the runbook): `Model loading took 156.67 GiB`,
`DSpark draft model loaded: 96 params`, `GPU KV cache size: 1,927,444 tokens`, `Maximum
concurrency for 262,144 tokens per request: 7.35x`, `Created mmap file ... (103.08 GB)`,
`Capturing CUDA graphs`, `Application startup complete`. A figure below the configuration's
`expected`, or missing at startup complete, makes the start "degraded" (paths.STARTUP_REPORT).
Times are seconds since the first line, from vLLM's own stamps where lines have them (a replayed
log gives the original start's times), else from the clock.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from appliance import cli_help, paths
from appliance.atomic import write_record
from appliance.errors import UserError
from appliance.host_settings import load_device
from appliance.run import PIPE, start
from appliance.schema import dump_record
from applianctl.records import StartupFigures, StartupReport

# The first replica's start (every replica runs the same engine on the same weights; the others
# start after it, appliance-engine@.container.j2).
JOURNAL_FOLLOW = ["journalctl", "-u", paths.engine_unit(0), "-f", "-o", "cat", "--since", "now"]
JOURNAL_BOOT = ["journalctl", "-u", paths.engine_unit(0), "-o", "cat", "-b", "--no-pager"]

_NUM = r"(\d[\d,]*(?:\.\d+)?)"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


# figure name -> (pattern, value from the match); in the order a healthy start reaches them
PATTERNS: dict[str, tuple[re.Pattern[str], Callable[[re.Match[str]], float | int | bool]]] = {
    "model_memory_gib": (re.compile(rf"Model loading took {_NUM} GiB"), lambda m: _number(m[1])),
    "draft_params": (re.compile(rf"DSpark draft model loaded: {_NUM} params"), lambda m: int(_number(m[1]))),
    "kv_cache_tokens": (re.compile(rf"GPU KV cache size: {_NUM} tokens"), lambda m: int(_number(m[1]))),
    "max_concurrency": (
        re.compile(rf"Maximum concurrency for {_NUM} tokens per request: {_NUM}x"), lambda m: _number(m[2])
    ),
    "offload_mmap_gb": (re.compile(rf"Created mmap file \S+ \({_NUM} GB\)"), lambda m: _number(m[1])),
    "cuda_graphs": (re.compile(r"Capturing (?:CUDA graph|cudagraphs)", re.IGNORECASE), lambda m: True),
    "ready": (re.compile(r"Application startup complete"), lambda m: True),
}
NUMERIC = ("model_memory_gib", "draft_params", "kv_cache_tokens", "max_concurrency", "offload_mmap_gb")
DESCRIPTION = {  # name -> (what, unit)
    "model_memory_gib": ("model memory", " GiB"),
    "draft_params": ("DSpark draft model", " params"),
    "kv_cache_tokens": ("GPU KV cache", " tokens"),
    "max_concurrency": ("maximum concurrency", "x"),
    "offload_mmap_gb": ("KV offload mmap", " GB"),
}
# Lines that open a new engine start (after figures were seen, they reset the report).
_RESTART = re.compile(r"vLLM API server version|Automatically detected platform|Model loading took")
# vLLM's logger prefix: `INFO 09-25 13:39:07 [file.py:NN]`
_STAMP = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[")


def _stamp(line: str) -> float | None:
    m = _STAMP.search(line)
    if not m:
        return None
    month, day, hour, minute, second = (int(g) for g in m.groups())
    try:  # vLLM's stamps have no year; 2000 is a leap year, so 02-29 parses
        when = datetime.datetime(2000, month, day, hour, minute, second)
    except ValueError:
        return None
    return when.timestamp()


@dataclass
class Report:
    expected: dict[str, Any]
    clock: Callable[[], float] = time.monotonic
    figures: dict[str, Any] = field(default_factory=dict)
    reached_s: dict[str, float] = field(default_factory=dict)
    _first_clock: float | None = None
    _first_stamp: float | None = None
    _stamp_offset: float = 0.0
    _last_s: float = 0.0

    def reset(self) -> None:
        self.figures.clear()
        self.reached_s.clear()
        self._first_clock = self._first_stamp = None
        self._stamp_offset = self._last_s = 0.0

    def _elapsed(self, line: str) -> float:
        now = self.clock()
        if self._first_clock is None:
            self._first_clock = now
        by_clock = now - self._first_clock
        stamp = _stamp(line)
        if stamp is not None:
            if self._first_stamp is None:
                self._first_stamp, self._stamp_offset = stamp, by_clock
            delta = stamp - self._first_stamp
            if delta < -180 * 86400:  # the log crossed new year
                delta += 366 * 86400
            self._last_s = self._stamp_offset + delta
        else:  # no stamp (a progress bar): not before the last stamped line, nor before the clock
            self._last_s = max(self._last_s, by_clock)
        return round(self._last_s, 3)

    def feed(self, line: str) -> bool:
        """Take one log line; True when it was a startup line (the report changed)."""
        if self.figures and _RESTART.search(line):
            self.reset()
        elapsed = self._elapsed(line)
        recognised = False
        for name, (pattern, value) in PATTERNS.items():
            if m := pattern.search(line):
                if name in ("cuda_graphs", "ready") and name in self.figures:
                    continue  # the first of the graph-capture bars counts
                self.figures[name] = value(m)
                self.reached_s[name] = elapsed
                recognised = True
        return recognised

    def shortfalls(self) -> list[str]:
        out = []
        for name in NUMERIC:
            want = self.expected.get(name)
            if want is None:
                continue
            got = self.figures.get(name)
            what, unit = DESCRIPTION[name]
            if got is None:
                if self.figures.get("ready"):
                    out.append(f"no {what} line before startup completed (expected {want}{unit})")
            elif got < want:
                out.append(f"{what} {got}{unit} is below the expected {want}{unit}")
        return out

    @property
    def state(self) -> str:
        if self.shortfalls():
            return "degraded"
        return "ok" if self.figures.get("ready") else "loading"

    @property
    def reason(self) -> str:
        if short := self.shortfalls():
            return "; ".join(short)
        if self.figures.get("ready"):
            return f"startup complete after {self.reached_s['ready']:g} s; every figure meets its expectation"
        if not self.reached_s:
            return "waiting for the engine's startup lines"
        last = max(self.reached_s, key=lambda k: self.reached_s[k])
        return f"engine loading: last step {last} at {self.reached_s[last]:g} s"

    def record(self) -> StartupReport:
        state = self.state
        return StartupReport(state, state == "ok", self.reason, StartupFigures(**self.figures), dict(self.reached_s),
                             StartupFigures(**self.expected))

    def to_json(self) -> dict[str, Any]:
        return dump_record(self.record())


def parse(lines: Iterable[str], expected: dict[str, Any], clock: Callable[[], float] = time.monotonic) -> Report:
    report = Report(expected=expected, clock=clock)
    for line in lines:
        report.feed(line)
    return report



def _follow_file(f: IO[str], poll_s: float = 0.5) -> Iterator[str]:
    """Lines of F as they are written, like `tail -f`; never ends."""
    pending = ""
    while True:
        chunk = f.readline()
        if not chunk:
            time.sleep(poll_s)
            continue
        pending += chunk
        if pending.endswith("\n"):
            yield pending
            pending = ""


def _lines(args: argparse.Namespace) -> Iterator[str]:
    if args.source == "-":
        yield from sys.stdin
        return
    if args.source is not None:
        try:
            f = open(args.source, errors="replace")  # noqa: SIM115 - closed below
        except OSError as e:
            raise UserError(f"{args.source}: {e.strerror}", hint="name a log file, or - for stdin") from None
        with f:
            yield from (_follow_file(f) if args.follow else f)
        return
    command = JOURNAL_FOLLOW if args.follow else JOURNAL_BOOT
    try:
        proc = start(command, stdout=PIPE, stderr=None)
    except FileNotFoundError:
        raise UserError("journalctl not found", hint="use --from FILE or --from - (stdin)") from None
    assert proc.stdout is not None
    try:
        yield from io.TextIOWrapper(proc.stdout, errors="replace")  # as Popen's text mode reads it
    finally:
        proc.terminate()
        proc.wait()


def run(args: argparse.Namespace) -> int:
    expected = {k: v for k, v in vars(load_device().expected).items() if v is not None}
    report = Report(expected=expected)
    out = paths.STARTUP_REPORT
    if args.follow:
        write_record(out, report.record())
    for line in _lines(args):
        if report.feed(line) and args.follow:
            write_record(out, report.record())
            if not getattr(args, "json", False):  # one document, at the end
                print(f"{report.state}: {report.reason}", flush=True)
    result = report.record()
    write_record(out, result)
    if getattr(args, "json", False):
        print(json.dumps(dump_record(result), indent=2))
    else:
        print(f"{result.state}: {result.reason}", file=sys.stdout if result.ok else sys.stderr)
    return 0 if result.ok else 1


def add_parser(subparsers: Any) -> None:
    parser = cli_help.verb_parser(
        subparsers, "startup-report", "turn the engine's startup lines into figures and compare them with expectations",
        examples=["applianctl startup-report", "applianctl startup-report --from engine.log --json"],
        exit_codes=[(0, "the start is ok"), (1, "it is still loading, or degraded (the reason on stderr)"), cli_help.BAD_INPUT],
        details="Read vLLM's log lines and write the startup report "
        f"({paths.STARTUP_REPORT}): loading, ok, or degraded with a reason. Reads from the journal of "
        f"{paths.engine_unit(0)} (the first replica) unless --from is given.",
    )
    parser.add_argument("--json", action="store_true", help="print the final report (the record status reads) as JSON")
    parser.add_argument("--follow", action="store_true",
                        help="keep reading and rewrite the report after every startup line")
    parser.add_argument("--from", dest="source", metavar="FILE", help="read FILE (- for stdin) instead of the journal")
    parser.set_defaults(func=run)
