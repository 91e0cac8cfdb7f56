# SPDX-License-Identifier: MIT
"""Status parts `engine` (health, served models and /metrics on loopback) and `startup` (the
startup report the engine's first minutes left)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
import urllib.parse
from pathlib import Path

from appliance import paths
from appliance.config import Config
from appliance.errors import UserError
from appliance.schema import load_record, plain
from applianctl.records import StartupReport
from applianctl.status import probes
from applianctl.status.document import EngineDetails, EngineMetrics, Figure, ReplicaStatus, StartupDetails
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


def probe_engine(config: Config, src: Sources) -> Part:
    """Every replica, at once: the first one's details (health, models, metrics), and with several
    replicas each one's state in `replicas`. Down when none serves, degraded while some do not."""
    urls = [engine_url(config, src, i) for i in range(config.replicas)]
    if config.replicas == 1:
        replicas = [probe_replica(config, urls[0])]
    else:
        found = probes.run_probes(
            {str(i): (lambda url=url: probe_replica(config, url)) for i, url in enumerate(urls)},  # type: ignore[misc]
            probes.ENGINE_BUDGET_S + 0.2,
        )
        replicas = [found[str(i)] for i in range(config.replicas)]
    first = replicas[0]
    listed = tuple(ReplicaStatus(replica=i, url=url, state=part.state, reason=part.reason, gpus=tuple(config.topology.replica_gpus(i)))
                   for i, (url, part) in enumerate(zip(urls, replicas, strict=True)))
    # a replica whose probe timed out has no details: its URL stands in
    details = dataclasses.replace(replica_details(first, urls[0]), replicas=listed)
    not_ok = [(i, part) for i, part in enumerate(replicas) if part.state != OK]
    if len(replicas) == 1:
        return Part(first.state, first.reason, details)
    if not not_ok:
        return Part(OK, "", details)
    reason = "; ".join(f"replica {i}: {part.reason}" for i, part in not_ok)
    if all(part.state == DOWN for part in replicas):
        # refused on every port: a start in progress or a dead engine (collect's cross-check tells)
        refused = all(replica_details(part, url).refused for part, url in zip(replicas, urls, strict=True))
        return Part(DOWN, reason, dataclasses.replace(details, refused=refused))
    return Part(DEGRADED, f"{len(replicas) - len(not_ok)} of {len(replicas)} replicas serve; {reason}", details)


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
