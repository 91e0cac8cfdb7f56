# SPDX-License-Identifier: MIT
"""The progress judge's judgement (applianctl/judge/progress.py) on sequences of /metrics read
from a recorded vLLM scrape, and engine.progress's validation."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from appliance import config
from appliance.errors import ConfigError
from applianctl.judge import progress
from applianctl.judge.progress import ALIVE, STALLED, Bounds, CanaryResult, Scrape, Track, judge
from applianctl.status import metrics

ROOT = Path(__file__).resolve().parents[1]
RECORDED = (ROOT / "tests/fixtures/vllm/metrics-v1-ngc-vllm25.09-qwen3-4b.prom").read_text()
BOUNDS = Bounds(interval_s=5, stall_after_s=180, canary_after_s=60, canary_timeout_s=30)


def recorded(generation: float | None = None, prompt: float | None = None, waiting: int | None = None,
             running: int | None = None) -> Scrape:
    """The recorded scrape with the given values written over its own, read as the judge reads it."""
    text = RECORDED
    for name, value in (("vllm:generation_tokens_total", generation), ("vllm:prompt_tokens_total", prompt),
                        ("vllm:num_requests_waiting", waiting), ("vllm:num_requests_running", running)):
        if value is not None:
            text, n = re.subn(rf"^({re.escape(name)}\{{[^}}]*\}}) \S+$", rf"\g<1> {float(value)}", text, flags=re.M)
            assert n == 1, name
    return progress.read_scrape(metrics.parse(text))


def run(sequence: list[tuple[float, Scrape | None]], bounds: Bounds = BOUNDS, track: Track | None = None,
        canaries: dict[float, CanaryResult] | None = None, answer: bool = False) -> list[tuple[float, progress.Verdict]]:
    """Judge each (time, scrape) in turn. CANARIES: results handed over at the given times; with
    ANSWER, any other canary is answered a second after it was sent (handed over the next round);
    without, it stays out."""
    t = track or Track()
    out = []
    sent: float | None = None
    for now, scrape in sequence:
        finished = (canaries or {}).get(now)
        if finished is None and answer and sent is not None:
            finished = CanaryResult(sent, sent + 1, True, 200)
        verdict = judge(t, scrape, now, bounds, canary=finished, canary_in_flight=sent is not None and finished is None)
        if finished is not None:
            sent = None
        if verdict.send_canary:
            sent = now
        t = verdict.track
        out.append((now, verdict))
    return out


def test_the_recorded_scrape_reads_as_vllms_counters_and_gauges() -> None:
    assert recorded() == Scrape(generation=1739.0, prompt=246.0, waiting=0, running=0)
    with pytest.raises(progress.NoCounters):
        progress.read_scrape(metrics.parse("# TYPE other counter\nother_total 1\n"))


def test_counters_that_advance_under_load_are_alive_and_send_no_canary() -> None:
    # 64 streams for 20 minutes, a few tokens each round
    seq = [(t * 5.0, recorded(generation=1739 + 300 * t, prompt=246 + 50 * t, waiting=8, running=64)) for t in range(240)]
    verdicts = [v for _, v in run(seq)]
    assert {v.state for v in verdicts} == {ALIVE}
    assert not any(v.send_canary for v in verdicts)


def test_frozen_counters_with_requests_waiting_stall_at_the_bound_not_before() -> None:
    seq = [(0.0, recorded(generation=1739, waiting=2, running=64)), (5.0, recorded(generation=1800, waiting=4, running=64))]
    seq += [(5.0 + 5 * t, recorded(generation=1800, waiting=4 + t, running=64)) for t in range(1, 40)]
    out = run(seq)
    first_stall = next((now, v) for now, v in out if v.state == STALLED)
    # counted from the last scrape that moved, two rounds early: the last token came after the scrape
    # before it (0.0), so the replica is out no later than the bound after that token
    assert first_stall[0] == 5.0 + BOUNDS.decide_after_s == BOUNDS.stall_after_s - BOUNDS.interval_s
    assert all(v.state == ALIVE for now, v in out if now < first_stall[0])
    assert first_stall[1].reason == "no tokens for 170 s with 38 requests waiting, 64 running"


def test_the_stall_reason_says_how_many_wait_when_none_run() -> None:
    out = run([(t * 5.0, recorded(generation=1739, waiting=12, running=0)) for t in range(0, 40)])
    reasons = [v.reason for _, v in out if v.state == STALLED]
    assert reasons[0] == "no tokens for 170 s with 12 requests waiting"


def test_an_idle_replica_is_alive_and_gets_a_canary_once_a_quiet_while() -> None:
    seq = [(t * 5.0, recorded()) for t in range(0, 50)]
    out = run(seq, answer=True)
    assert {v.state for _, v in out} == {ALIVE}
    sent = [now for now, v in out if v.send_canary]
    # the first after canary_after_s of quiet, the next canary_after_s after its answer: about one a minute
    assert sent == [60.0, 125.0, 190.0]
    # none while one is out
    assert [now for now, v in run(seq) if v.send_canary] == [60.0]


def test_a_canary_that_times_out_on_an_idle_replica_stalls_it() -> None:
    # a core frozen while idle: its gauges froze at zero, requests that came since are not counted
    seq = [(t * 5.0, recorded()) for t in range(0, 20)]
    timed_out = {95.0: CanaryResult(sent_at=60.0, finished_at=90.0, answered=False)}
    out = run(seq, canaries=timed_out)
    stalls = [(now, v.reason) for now, v in out if v.state == STALLED]
    assert stalls[0] == (95.0, "canary timed out after 30 s")


def test_a_long_prefill_alone_is_no_stall_and_its_slow_canary_no_verdict() -> None:
    # one prompt at --max-model-len: its tokens show only when its prefill ends (170 s here); the
    # canary sent meanwhile waits behind it (the prefill takes each step's token budget)
    seq = [(t * 5.0, recorded(generation=1739, prompt=246, waiting=0, running=1)) for t in range(0, 13)]
    seq += [(t * 5.0, recorded(generation=1739, prompt=246, waiting=1, running=1)) for t in range(13, 34)]  # the canary waits
    seq += [(170.0, recorded(generation=1740, prompt=246 + 262_000, waiting=1, running=1))]
    seq += [(170.0 + 5 * t, recorded(generation=1740 + 20 * t, prompt=262_246, waiting=0, running=1)) for t in range(1, 10)]
    timed_out = {95.0: CanaryResult(sent_at=60.0, finished_at=90.0, answered=False)}
    out = run(seq, canaries=timed_out)
    assert {v.state for _, v in out} == {ALIVE}


def test_a_canary_answered_with_a_server_error_stalls_at_once() -> None:
    failed = {65.0: CanaryResult(sent_at=60.0, finished_at=60.1, answered=False, status=500, what="HTTP 500 EngineDeadError")}
    out = run([(t * 5.0, recorded(waiting=3, running=2)) for t in range(0, 14)], canaries=failed)
    assert [(now, v.reason) for now, v in out if v.state == STALLED] == [(65.0, "canary failed: HTTP 500 EngineDeadError")]


def test_metrics_that_stop_answering_stall_after_the_bound_unless_a_canary_answers() -> None:
    seq: list[tuple[float, Scrape | None]] = [(0.0, recorded())] + [(t * 5.0, None) for t in range(1, 40)]
    out = run(seq)
    first = next(now for now, v in out if v.state == STALLED)
    assert first == 5.0 + BOUNDS.decide_after_s  # silent from the first read that got no answer
    assert next(v for _, v in out if v.state == STALLED).reason == "no answer on /metrics for 170 s and no canary answered"
    # the same silence with the canaries answering (a server too busy for /metrics, serving): alive
    assert {v.state for _, v in run(seq, answer=True)} == {ALIVE}


def test_a_request_after_a_long_idle_time_is_given_the_whole_bound() -> None:
    quiet = [(t * 5.0, recorded()) for t in range(0, 120)]  # ten minutes idle, the canaries unanswered yet no verdict
    busy = [(600.0 + 5 * t, recorded(waiting=1, running=0)) for t in range(0, 10)]
    out = run(quiet + busy, canaries={})
    assert all(v.state == ALIVE for _, v in out)


def test_counters_that_go_back_to_zero_are_a_new_process_not_a_stall() -> None:
    seq = [(t * 5.0, recorded(generation=1739, waiting=3, running=1)) for t in range(0, 30)]
    seq += [(150.0, recorded(generation=0, prompt=0, waiting=3, running=1))]
    seq += [(150.0 + 5 * t, recorded(generation=0, prompt=0, waiting=3, running=1)) for t in range(1, 10)]
    assert {v.state for _, v in run(seq)} == {ALIVE}


def test_the_first_sight_of_a_replica_gives_it_the_whole_bound() -> None:
    # the judge started (or the replica just became ready) with requests already waiting
    out = run([(1000.0 + 5 * t, recorded(waiting=5)) for t in range(0, 37)])
    assert next(now for now, v in out if v.state == STALLED) == 1000.0 + BOUNDS.decide_after_s


def test_the_defaults_suit_a_large_model_and_the_demo_keeps_the_canary_inside_its_bound() -> None:
    b = Bounds.of(config.load(ROOT / "appliance.toml", "production").engine.progress)
    assert b.stall_after_s >= 128  # a 262144-token prompt in 2048-token chunks, at least a second a chunk
    assert b.canary_after_s + b.canary_timeout_s <= b.stall_after_s
    assert 3600 / b.canary_after_s <= 60  # the canary's load on an idle replica, an hour
    demo = Bounds.of(config.load(ROOT / "appliance.toml", "demo").engine.progress)
    assert demo.canary_after_s + demo.canary_timeout_s <= demo.stall_after_s


@pytest.mark.parametrize(("changes", "words"), [
    ({"stall_after_s": 10, "interval_s": 5}, "3 x interval_s"),
    ({"canary_after_s": 5, "interval_s": 10, "stall_after_s": 60}, "less than interval_s"),
    ({"canary_after_s": 150, "canary_timeout_s": 60, "stall_after_s": 180}, "more than stall_after_s"),
])
def test_bounds_that_contradict_each_other_are_refused(changes: dict[str, int], words: str) -> None:
    from appliance.config import model

    c = config.load(ROOT / "appliance.toml", "production")
    bad = dataclasses.replace(c, engine=dataclasses.replace(c.engine, progress=dataclasses.replace(c.engine.progress, **changes)))
    with pytest.raises(ConfigError, match=re.escape(words)):
        model.cross_checks(Path("appliance.toml"), bad)
    model.cross_checks(Path("appliance.toml"), c)


def test_a_bound_out_of_its_range_is_refused(tmp_path: Path) -> None:
    data = config.load(ROOT / "appliance.toml", "production").to_json()
    data["engine"]["progress"]["interval_s"] = 0
    with pytest.raises(ConfigError, match="interval_s"):
        config.from_json(data, tmp_path / "appliance.json")
