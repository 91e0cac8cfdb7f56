# SPDX-License-Identifier: MIT
"""The canary: a one-token completion of the runbook's smoke prompt sent to one replica on loopback,
with a deadline, and the /metrics read of each round. The standard library's http.client (the
judge runs every few seconds for as long as the appliance does: no session state, nothing pooled).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Callable

from appliance.config.model import SMOKE_PROMPT
from applianctl.judge.progress import CanaryResult, Scrape, read_scrape

MAX_BODY = 8 * 1024 * 1024  # /metrics of a large engine is a few hundred KiB; a completion of one token far less
SCRAPE_TIMEOUT_S = 5.0  # a busy engine's /metrics (the API server answers it, not the engine core)


def body(model: str) -> bytes:
    """The canary's request: the engine's warm-up request (builder/render.py), one token."""
    return json.dumps({"model": model, "prompt": SMOKE_PROMPT, "max_tokens": 1, "temperature": 0}).encode()


def _connection(base: str, timeout: float) -> http.client.HTTPConnection:
    url = urllib.parse.urlsplit(base)
    return http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=timeout)


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:200]


def send(base: str, model: str, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> CanaryResult:
    """POST the canary to BASE's /v1/completions; its answer within TIMEOUT_S (each socket step
    bounded by what is left) or none."""
    sent = clock()
    deadline = sent + timeout_s
    conn = _connection(base, timeout_s)

    def left() -> float:
        remaining = deadline - clock()
        if remaining <= 0:
            raise TimeoutError
        return remaining

    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(left())
        conn.request("POST", "/v1/completions", body(model), {"Content-Type": "application/json"})
        conn.sock.settimeout(left())
        response = conn.getresponse()
        conn.sock.settimeout(left())
        raw = response.read(MAX_BODY)
        if response.status != 200:
            detail = _error_message(raw)
            return CanaryResult(sent, clock(), False, response.status, f"HTTP {response.status}" + (f" {detail}" if detail else ""))
        try:
            choices = json.loads(raw).get("choices")
        except (ValueError, AttributeError):
            choices = None
        if not choices:
            return CanaryResult(sent, clock(), False, response.status, "an answer without a completion")
        return CanaryResult(sent, clock(), True, response.status)
    except TimeoutError:
        return CanaryResult(sent, clock(), False, None, "")
    except ConnectionRefusedError:
        return CanaryResult(sent, clock(), False, None, "connection refused")
    except (OSError, http.client.HTTPException) as e:
        return CanaryResult(sent, clock(), False, None, type(e).__name__)
    finally:
        conn.close()


def _error_message(raw: bytes) -> str:
    """The error's type or message from an OpenAI-shaped (or vLLM's) error body, else ""."""
    try:
        data = json.loads(raw)
    except ValueError:
        return _first_line(raw[:200].decode("utf-8", "replace"))
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return _first_line(str(error.get("type") or error.get("message") or ""))
    if isinstance(data, dict):
        return _first_line(str(data.get("message") or data.get("detail") or ""))
    return ""


class ScrapeFailed(Exception):
    """/metrics did not answer, or not with vLLM's counters."""


def scrape(base: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> Scrape:
    """BASE's /metrics as the judge reads it; ScrapeFailed saying why."""
    from applianctl.status import metrics

    conn = _connection(base, timeout_s)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        raw = response.read(MAX_BODY)
        if response.status != 200:
            raise ScrapeFailed(f"/metrics answered HTTP {response.status}")
        samples = metrics.parse(raw.decode("utf-8", "replace"), response.getheader("Content-Type") or "")
        return read_scrape(samples)
    except TimeoutError:
        raise ScrapeFailed(f"/metrics: no answer within {timeout_s:g} s") from None
    except ConnectionRefusedError:
        raise ScrapeFailed("/metrics: connection refused") from None
    except (OSError, http.client.HTTPException) as e:
        raise ScrapeFailed(f"/metrics: {type(e).__name__}") from None
    except ValueError as e:  # metrics.ParseError, progress.NoCounters
        raise ScrapeFailed(f"/metrics: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    finally:
        conn.close()
