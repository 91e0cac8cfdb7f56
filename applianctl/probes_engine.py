"""Status parts `engine` (health, served models and /metrics on loopback) and `startup` (the
startup report the engine's first minutes left)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import Config
from applianctl import probes
from applianctl.probes import DEGRADED, DOWN, NOT_CONFIGURED, OK, Part, Sources

FIGURES = ("model_memory_gib", "draft_params", "kv_cache_tokens", "max_concurrency", "offload_mmap_gb")


def engine_url(config: Config, src: Sources) -> str:
    return src.engine_url or f"http://127.0.0.1:{config.engine.port}"


def probe_engine(config: Config, src: Sources) -> Part:
    import requests  # imported in the probe's thread, beside the other probes' work

    from applianctl import metrics

    base = engine_url(config, src)
    http_timeout = probes.HTTP_TIMEOUT_S
    end = time.monotonic() + probes.ENGINE_BUDGET_S
    session = requests.Session()
    session.trust_env = False  # never through a proxy from the environment

    def get(path: str) -> requests.Response:
        left = min(http_timeout, end - time.monotonic())
        if left <= 0:
            raise requests.Timeout(f"no time left for {path}")
        return session.get(base + path, timeout=(left, left))

    health_path = config.health_path
    details: dict[str, Any] = {"url": base}
    try:
        r = get(health_path)
    except requests.ConnectionError as e:
        if isinstance(e, requests.ConnectTimeout):
            return Part(DOWN, f"{base}{health_path}: no connection within {http_timeout:g} s", details)
        return Part(DOWN, f"{base}{health_path}: connection refused", {**details, "refused": True})
    except requests.Timeout:
        return Part(DOWN, f"{base}{health_path}: no answer within {http_timeout:g} s", details)
    except requests.RequestException as e:
        return Part(DOWN, f"{base}{health_path}: {type(e).__name__}", details)
    details["health"] = r.status_code
    if r.status_code != 200:
        return Part(DOWN, f"{health_path} answered HTTP {r.status_code}", details)

    problems: list[str] = []
    want = config.served_model
    try:
        r = get("/v1/models")
        r.raise_for_status()
        details["models"] = [str(m.get("id")) for m in r.json().get("data", [])]
        if want not in details["models"]:
            problems.append(f"/v1/models does not list {want}")
    except (requests.RequestException, ValueError, AttributeError) as e:
        details["models"] = None
        problems.append(f"/v1/models: {type(e).__name__}")
    try:
        r = get("/metrics")
        r.raise_for_status()
        details["metrics"] = metrics.engine_summary(metrics.parse(r.text, r.headers.get("Content-Type", "")))
    except (requests.RequestException, metrics.ParseError) as e:
        details["metrics"] = None
        problems.append(f"/metrics: {type(e).__name__}: {e}".splitlines()[0])
    return Part(DEGRADED if problems else OK, "; ".join(problems), details)


def probe_startup(config: Config, path: Path | None = None) -> Part:
    path = path or paths.STARTUP_REPORT
    try:
        report = json.loads(path.read_text())
        state = report["state"]
    except FileNotFoundError:
        return Part(NOT_CONFIGURED, f"no startup report ({path})")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Part(DEGRADED, f"{path}: unreadable ({type(e).__name__})")
    figures = report.get("figures") or {}
    configured = {k: getattr(config.expected, k) for k in FIGURES}
    expected = report.get("expected") or configured
    details: dict[str, Any] = {
        "report_state": state,
        "figures": {k: {"value": figures.get(k), "expected": expected.get(k)} for k in FIGURES},
        "cuda_graphs": figures.get("cuda_graphs"),
        "ready": figures.get("ready"),
        "reached_s": report.get("reached_s") or {},
    }
    reason = str(report.get("reason") or "")
    if state == "ok":
        return Part(OK, "", details)
    if state == "loading":
        return Part(DEGRADED, reason or "the engine is still starting", details)
    if state == "degraded":
        return Part(DEGRADED, reason or "the start fell short of the expected figures", details)
    return Part(DEGRADED, f"unknown startup state {state!r}", details)
