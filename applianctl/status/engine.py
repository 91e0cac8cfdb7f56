# SPDX-License-Identifier: MIT
"""Status parts `engine` (health, served models and /metrics on loopback, each replica's
progress as the judge last saw it) and `startup` (the startup report the engine's first minutes
left).

/health and the rest are readiness; liveness is the progress judge's (appliance-judge.service,
paths.JUDGE_STATE): a replica it judged stalled, restarting or held is down whatever its /health
answers, since vLLM's /health stays 200 while its engine core is deadlocked (vllm-project/vllm#39863,
vllm-project/vllm#36451)."""

from __future__ import annotations

import dataclasses
import datetime
import http.client
import json
import time
import urllib.parse
from pathlib import Path

from appliance import paths
from appliance.config import Config
from appliance.errors import UserError
from appliance.schema import load_record, plain
from applianctl.records import JudgeState, ReplicaJudgement, StartupReport
from applianctl.status import probes
from applianctl.status.document import (
    EngineDetails,
    EngineMetrics,
    Figure,
    JudgeSummary,
    ReplicaJudged,
    ReplicaStatus,
    StartupDetails,
)
from applianctl.status.probes import DEGRADED, DOWN, NOT_CONFIGURED, OK, Part, Sources

FIGURES = ("model_memory_gib", "draft_params", "kv_cache_tokens", "max_concurrency", "offload_mmap_gb")


def engine_url(config: Config, src: Sources, replica: int = 0) -> str:
    if replica == 0 and src.engine_url:
        return src.engine_url
    if 0 < replica <= len(src.replica_urls):
        return src.replica_urls[replica - 1]
    return f"http://127.0.0.1:{config.replica_port(replica)}"


MAX_BODY = 8 * 1024 * 1024  # /metrics of a large engine is a few hundred KiB


class _Engine:
    """GETs on one keep-alive loopback connection, each within what is left of the budget.
    The standard library's http.client, not requests: status is timed from interpreter start,
    and importing requests costs more than all the engine's answers."""

    def __init__(self, base: str, http_timeout: float, budget_s: float) -> None:
        url = urllib.parse.urlsplit(base)
        self.conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=http_timeout)
        self.http_timeout = http_timeout
        self.end = time.monotonic() + budget_s

    def _left(self, path: str) -> float:
        left = min(self.http_timeout, self.end - time.monotonic())
        if left <= 0:
            raise TimeoutError(f"no time left for {path}")
        return left

    def connect(self) -> None:
        self.conn.timeout = self._left("connect")
        self.conn.connect()

    def get(self, path: str) -> tuple[int, str, bytes]:
        left = self._left(path)
        if self.conn.sock is not None:
            self.conn.sock.settimeout(left)
        self.conn.timeout = left
        self.conn.request("GET", path)
        response = self.conn.getresponse()
        body = response.read(MAX_BODY)
        return response.status, response.getheader("Content-Type") or "", body


def probe_engine(config: Config, src: Sources, judge_path: Path | None = None,
                 now: datetime.datetime | None = None) -> Part:
    """Every replica, at once: the first one's details (health, models, metrics), and with several
    replicas each one's state in `replicas`, the judge's verdict over its readiness. Down when none
    serves, degraded while some do not."""
    urls = [engine_url(config, src, i) for i in range(config.replicas)]
    if config.replicas == 1:
        ready = [probe_replica(config, urls[0])]
    else:
        found = probes.run_probes(
            {str(i): (lambda url=url: probe_replica(config, url)) for i, url in enumerate(urls)},  # type: ignore[misc]
            probes.ENGINE_BUDGET_S + 0.2,
        )
        ready = [found[str(i)] for i in range(config.replicas)]
    summary, judged = read_judge(judge_path or paths.JUDGE_STATE, now)
    replicas = [judge_replica(part, judged.get(i)) for i, part in enumerate(ready)]
    listed = tuple(ReplicaStatus(replica=i, url=url, state=part.state, reason=part.reason, gpus=tuple(config.topology.replica_gpus(i)),
                                 judgement=judged_details(judged.get(i)))
                   for i, (url, part) in enumerate(zip(urls, replicas, strict=True)))
    # a replica whose probe timed out has no details: its URL stands in
    details = dataclasses.replace(replica_details(ready[0], urls[0]), replicas=listed, judge=summary)
    return _with_judge(_combined(replicas, ready, urls, details), summary)


def _combined(replicas: list[Part], ready: list[Part], urls: list[str], details: EngineDetails) -> Part:
    """The engine part from each replica's state (REPLICAS) and readiness probe (READY)."""
    not_ok = [(i, part) for i, part in enumerate(replicas) if part.state != OK]
    if len(replicas) == 1:
        return Part(replicas[0].state, replicas[0].reason, details)
    if not not_ok:
        return Part(OK, "", details)
    reason = "; ".join(f"replica {i}: {part.reason}" for i, part in not_ok)
    if all(part.state == DOWN for part in replicas):
        # refused on every port: a start in progress or a dead engine (collect's cross-check tells)
        refused = all(replica_details(part, url).refused for part, url in zip(ready, urls, strict=True))
        return Part(DOWN, reason, dataclasses.replace(details, refused=refused))
    return Part(DEGRADED, f"{len(replicas) - len(not_ok)} of {len(replicas)} replicas serve; {reason}", details)


def _with_judge(part: Part, summary: JudgeSummary) -> Part:
    """PART with what the judge's record adds: the hive ladder's verdict first; a damaged or stale
    record degrades an engine that would otherwise be ok (nobody is judging its progress)."""
    reason = part.reason
    if summary.hive:
        reason = f"{summary.hive}; {reason}" if reason else summary.hive
    state = DEGRADED if part.state == OK and (summary.hive or summary.state in ("damaged", "stale")) else part.state
    if summary.state in ("damaged", "stale"):
        reason = f"{reason}; {summary.note}" if reason else summary.note
    return Part(state, reason, part.details)


# the judge's states that take a replica out whatever its /health says
NOT_LIVE = ("stalled", "restarting", "held")
JUDGE_STALE_S = 300.0  # a record older than this is the past: the judge itself is stuck or stopped

# The reason's class, the metrics' label: a bounded set, never the free text. The first class one
# of whose words the reason contains.
REASON_WORDS = (
    ("needs_physical_action", ("physical action",)),
    ("metrics_silent", ("no answer on /metrics",)),
    ("canary_timeout", ("canary timed out", "canary timeout", "canary: no answer", "canary deadline")),
    ("canary_failed", ("canary",)),
    ("no_tokens", ("no tokens", "no progress")),
    ("engine_dead", ("enginedeaderror", "engine dead", "engine core dead", "died", "exited", "aborted")),
    ("hive_fault", ("hive", "gpu reset", "amdgpu", "ras ", "xgmi")),
    ("not_ready", ("/health", "not ready", "refused")),
    ("restart", ("restart",)),
)
REASON_CLASSES = ("none", *(name for name, _ in REASON_WORDS), "other")


def reason_class(reason: str) -> str:
    """REASON (the judge's one line) as one of REASON_CLASSES."""
    text = reason.strip().lower()
    if not text:
        return "none"
    return next((name for name, words in REASON_WORDS if any(w in text for w in words)), "other")


def judged_line(judgement: ReplicaJudgement) -> str:
    """The judge's verdict in one line, its state first: "stalled: no tokens for 95 s with 12
    requests waiting", "stalled: canary timed out after 30 s"."""
    reason = " ".join(judgement.reason.split())
    if not reason:
        return judgement.state
    return reason if reason.startswith(judgement.state) else f"{judgement.state}: {reason}"


def judge_replica(ready: Part, judgement: ReplicaJudgement | None) -> Part:
    """A replica's state: its readiness (READY), unless the judge took it out."""
    if judgement is None or judgement.state not in NOT_LIVE:
        return ready
    reason = judged_line(judgement) + ("" if ready.state == OK or not ready.reason else f"; {ready.reason}")
    return Part(DOWN, reason, ready.details)


def judged_details(judgement: ReplicaJudgement | None) -> ReplicaJudged | None:
    if judgement is None:
        return None
    return ReplicaJudged(state=judgement.state, reason=judgement.reason, reason_class=reason_class(judgement.reason),
                         since=judgement.since, last_progress_at=judgement.last_progress_at, waiting=judgement.waiting,
                         restarts=judgement.restarts)


def _age_s(when: str, now: datetime.datetime) -> float | None:
    try:
        then = datetime.datetime.fromisoformat(when)
    except ValueError:
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=datetime.UTC)
    return (now - then).total_seconds()


def read_judge(path: Path, now: datetime.datetime | None = None) -> tuple[JudgeSummary, dict[int, ReplicaJudgement]]:
    """The judge's record at PATH, leniently: its summary, and its judgement of each replica when
    the record is usable (none when it is absent, damaged or stale)."""
    now = now or datetime.datetime.now(datetime.UTC)

    def unknown(state: str, note: str) -> JudgeSummary:
        return JudgeSummary(state=state, note=note, checked_at=None, alive=None, canary_requests_last_hour=None, hive="")

    try:
        state = load_record(JudgeState, path, lenient=True)
    except UserError as e:
        return unknown("damaged", f"the judge's record is damaged: {e.message}"), {}
    if state is None:
        return unknown("not run", f"the progress judge has not run yet (no {path})"), {}
    summary = JudgeSummary(state="judging", note="", checked_at=state.checked_at, alive=state.alive,
                           canary_requests_last_hour=state.canaries_last_hour, hive=" ".join(state.hive.split()))
    age = _age_s(state.checked_at, now)
    if age is None:
        return dataclasses.replace(summary, state="damaged", note=f"the judge's record is damaged: checked_at {state.checked_at!r:.40}"), {}
    if age > JUDGE_STALE_S:
        note = f"the progress judge's last round was {age:.0f} s ago (appliance-judge.service)"
        return dataclasses.replace(summary, state="stale", note=note), {}
    return summary, {j.replica: j for j in state.replicas}


def replica_details(part: Part, url: str) -> EngineDetails:
    """What PART (one replica's probe) found; only its URL when the probe gave nothing."""
    return part.details if isinstance(part.details, EngineDetails) else EngineDetails(url=url, replicas=())


def probe_replica(config: Config, base: str) -> Part:
    """One engine on BASE: /health, then /v1/models and /metrics within the engine budget."""
    from applianctl.status import metrics

    http_timeout = probes.HTTP_TIMEOUT_S
    engine = _Engine(base, http_timeout, probes.ENGINE_BUDGET_S)
    health_path = config.engine.health.path
    details = EngineDetails(url=base, replicas=())
    try:
        try:
            engine.connect()
        except ConnectionRefusedError:
            return Part(DOWN, f"{base}{health_path}: connection refused", dataclasses.replace(details, refused=True))
        except TimeoutError:
            return Part(DOWN, f"{base}{health_path}: no connection within {http_timeout:g} s", details)
        except OSError as e:
            return Part(DOWN, f"{base}{health_path}: {e.strerror or type(e).__name__}", details)
        try:
            status, _, _ = engine.get(health_path)
        except TimeoutError:
            return Part(DOWN, f"{base}{health_path}: no answer within {http_timeout:g} s", details)
        except (OSError, http.client.HTTPException) as e:
            return Part(DOWN, f"{base}{health_path}: {type(e).__name__}", details)
        details = dataclasses.replace(details, health=status)
        if status != 200:
            return Part(DOWN, f"{health_path} answered HTTP {status}", details)

        problems: list[str] = []
        want = config.served_model
        try:
            status, _, body = engine.get("/v1/models")
            if status != 200:
                raise ValueError(f"HTTP {status}")
            models = tuple(str(m.get("id")) for m in json.loads(body).get("data", []))
            details = dataclasses.replace(details, models=models)
            if want not in models:
                problems.append(f"/v1/models does not list {want}")
        except (OSError, http.client.HTTPException, ValueError, AttributeError) as e:
            details = dataclasses.replace(details, models=None)
            said = str(e) if isinstance(e, ValueError) and str(e).startswith("HTTP ") else type(e).__name__
            problems.append(f"/v1/models: {said}")
        try:
            status, content_type, body = engine.get("/metrics")
            if status != 200:
                raise metrics.ParseError(f"HTTP {status}")
            figures = metrics.engine_summary(metrics.parse(body.decode("utf-8", "replace"), content_type))
            details = dataclasses.replace(details, metrics=EngineMetrics(**figures))
        except (OSError, http.client.HTTPException, metrics.ParseError) as e:
            details = dataclasses.replace(details, metrics=None)
            problems.append(f"/metrics: {type(e).__name__}: {e}".splitlines()[0])
        return Part(DEGRADED if problems else OK, "; ".join(problems), details)
    finally:
        engine.conn.close()


def probe_startup(config: Config, path: Path | None = None) -> Part:
    path = path or paths.STARTUP_REPORT
    try:
        report = load_record(StartupReport, path, lenient=True)
    except UserError as e:
        return Part(DEGRADED, e.message)
    if report is None:
        return Part(NOT_CONFIGURED, f"no startup report ({path})")
    state, figures, reason = report.state, report.figures, report.reason
    # the expectations the report was made against; the configured ones when it names none
    expected = report.expected if plain(report.expected) else config.expected
    details = StartupDetails(report_state=state,
                             figures={k: Figure(value=getattr(figures, k), expected=getattr(expected, k)) for k in FIGURES},
                             cuda_graphs=figures.cuda_graphs, ready=figures.ready, reached_s=dict(report.reached_s))
    if state == "ok":
        return Part(OK, "", details)
    if state == "loading":
        return Part(DEGRADED, reason or "the engine is still starting", details)
    if state == "degraded":
        return Part(DEGRADED, reason or "the start fell short of the expected figures", details)
    return Part(DEGRADED, f"unknown startup state {state!r}", details)
