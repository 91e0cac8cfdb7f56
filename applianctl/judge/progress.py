# SPDX-License-Identifier: MIT
"""The judgement of one replica from what the judge saw of it: pure, no clock, no network.

vLLM's /metrics are read by the API server, but its token counters and request gauges come from
the engine core: when the core deadlocks (vllm-project/vllm#39863, vllm-project/vllm#36451, vllm-project/vllm#17972) /health and
/metrics keep answering 200 while `vllm:generation_tokens_total` and `vllm:prompt_tokens_total`
freeze. So a replica is alive while those counters move, or while a one-token completion (the
canary, sent only when they do not) answers; it is stalled when

- requests are in flight (the gauges say waiting or running) and no token came for
  `stall_after_s`: "no tokens for 170 s with 12 requests waiting";
- or /metrics itself has not answered for `stall_after_s` and no canary answered meanwhile;
- or a canary timed out while the replica had nothing else in flight (a core frozen while idle
  shows frozen idle gauges; a live idle engine answers one token at once): "canary timed out
  after 30 s";
- or the canary was answered with a server error (a dead engine core answers 500, vLLM's
  EngineDeadError): a live engine queues a canary, it never refuses it.

A canary that times out on a busy replica is no verdict: with --max-num-seqs streams running, or
behind a long prefill (chunked: the running prefill takes each step's token budget, and its prompt
tokens are counted only once it ends), a new request waits. Only the stall bound decides there, and
it must be longer than the longest prefill (engine.progress).

The judge sees a replica once a round, so it decides two rounds early (`Bounds.decide_after_s`):
the last token came between the scrape before the one that showed it and that scrape, and the next
round may come a round late; deciding at `stall_after_s - 2 x interval_s` of observed silence takes
a frozen replica out no later than `stall_after_s` after its last token, and never before
`stall_after_s - 2 x interval_s` of real silence (the configuration keeps that at least one round).

Times are seconds on one monotonic clock; `Track` is what the judge keeps of a replica between
rounds, `judge` makes the next one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from applianctl.status import metrics

GENERATION = "vllm:generation_tokens"
PROMPT = "vllm:prompt_tokens"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"

ALIVE, STALLED = "alive", "stalled"


@dataclass(frozen=True)
class Bounds:
    """engine.progress, in seconds."""

    interval_s: float = 5
    stall_after_s: float = 180
    canary_after_s: float = 60
    canary_timeout_s: float = 30

    @property
    def decide_after_s(self) -> float:
        """The observed silence after which a replica is stalled (see the module's docstring)."""
        return self.stall_after_s - 2 * self.interval_s

    @classmethod
    def of(cls, progress: object) -> Bounds:
        """From the configuration's engine.progress."""
        return cls(**{f.name: float(getattr(progress, f.name)) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Scrape:
    """One /metrics read: the token counters (summed over label sets) and the request gauges."""

    generation: float
    prompt: float
    waiting: int
    running: int

    @property
    def in_flight(self) -> int:
        return self.waiting + self.running

    @property
    def counters(self) -> tuple[float, float]:
        return (self.generation, self.prompt)


class NoCounters(ValueError):
    """A /metrics that has no token counters: not vLLM's (or not yet)."""


def read_scrape(samples: Sequence[metrics.Sample]) -> Scrape:
    """The counters and gauges of a parsed /metrics (metrics.parse); NoCounters when it has none."""
    generation = metrics.total(samples, GENERATION)
    prompt = metrics.total(samples, PROMPT)
    if generation is None and prompt is None:
        raise NoCounters(f"no {GENERATION}_total or {PROMPT}_total")
    waiting = metrics.total(samples, WAITING) or 0.0
    running = metrics.total(samples, RUNNING) or 0.0
    return Scrape(generation or 0.0, prompt or 0.0, max(0, int(waiting)), max(0, int(running)))


@dataclass(frozen=True)
class CanaryResult:
    """A canary that finished: ANSWERED with a completion, or not (timed out, refused, an error);
    STATUS the HTTP status when there was one; WHAT says what happened in a few words."""

    sent_at: float
    finished_at: float
    answered: bool
    status: int | None = None
    what: str = ""

    @property
    def server_error(self) -> bool:
        return self.status is not None and self.status >= 500


@dataclass(frozen=True)
class Track:
    """What the judge keeps of one replica between rounds (None: not seen yet)."""

    counters: tuple[float, float] | None = None
    progress_at: float | None = None  # the first scrape that showed the current counters, or the last canary answer
    busy_since: float | None = None  # the first scrape of the current run with requests in flight
    silent_since: float | None = None  # the first /metrics read of the current run that got no answer
    canary_sent_at: float | None = None  # the last canary sent
    waiting: int = 0
    running: int = 0


@dataclass(frozen=True)
class Verdict:
    state: str  # ALIVE or STALLED
    reason: str  # empty when alive
    send_canary: bool  # the judge should send a canary now (none is in flight)
    track: Track


def _requests(waiting: int, running: int) -> str:
    said = f"{waiting} request{'' if waiting == 1 else 's'} waiting"
    return said + (f", {running} running" if running else "")


def judge(track: Track, scrape: Scrape | None, now: float, bounds: Bounds, *,
          canary: CanaryResult | None = None, canary_in_flight: bool = False) -> Verdict:
    """The next verdict on a ready replica. TRACK: what was known; SCRAPE: this round's /metrics
    (None: it did not answer, or was not vLLM's); CANARY: a canary that finished since the last
    round; CANARY_IN_FLIGHT: one is still out (no second one is asked for)."""
    t = track
    if t.progress_at is None:
        t = dataclasses.replace(t, progress_at=now)  # first sight (a start, the judge's own start): the full bound
    if scrape is not None:
        if t.counters is not None and scrape.counters != t.counters:
            t = dataclasses.replace(t, progress_at=now)  # tokens came since the last round (or a restart reset them)
        t = dataclasses.replace(
            t, counters=scrape.counters, silent_since=None, waiting=scrape.waiting, running=scrape.running,
            busy_since=(t.busy_since if t.busy_since is not None else now) if scrape.in_flight else None)
    elif t.silent_since is None:
        t = dataclasses.replace(t, silent_since=now)
    progress_at: float = now if t.progress_at is None else t.progress_at
    if canary is not None and canary.answered:
        progress_at = max(progress_at, canary.finished_at)
        t = dataclasses.replace(t, progress_at=progress_at)

    if canary is not None and not canary.answered:
        if canary.server_error:
            return Verdict(STALLED, f"canary failed: {canary.what or f'HTTP {canary.status}'}", False, t)
        # timed out (or no connection): a verdict only when the replica had nothing else to do
        progressed = progress_at > canary.sent_at
        if scrape is not None and scrape.in_flight <= 1 and not progressed:
            return Verdict(STALLED, f"canary timed out after {bounds.canary_timeout_s:g} s"
                           + (f" ({canary.what})" if canary.what else ""), False, t)
    if scrape is not None and t.busy_since is not None:
        stuck_for = now - max(progress_at, t.busy_since)
        if stuck_for >= bounds.decide_after_s:
            return Verdict(STALLED, f"no tokens for {stuck_for:.0f} s with {_requests(scrape.waiting, scrape.running)}", False, t)
    if scrape is None and t.silent_since is not None:
        silent_for = now - max(progress_at, t.silent_since)
        if silent_for >= bounds.decide_after_s:
            return Verdict(STALLED, f"no answer on /metrics for {now - t.silent_since:.0f} s and no canary answered", False, t)
    quiet_for = now - progress_at
    since_canary = None if t.canary_sent_at is None else now - t.canary_sent_at
    send = (not canary_in_flight and quiet_for >= bounds.canary_after_s
            and (since_canary is None or since_canary >= bounds.canary_after_s))
    if send:
        t = dataclasses.replace(t, canary_sent_at=now)
    return Verdict(ALIVE, "", send, t)
