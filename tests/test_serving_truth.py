# SPDX-License-Identifier: MIT
"""Serving truth, live on loopback (no QEMU): stand-in engines whose core deadlocks at run time as
vLLM's does (/health and /metrics still 200, completions never answered: standin/faults.py), the
judge going round for real with its /health and HAProxy agent, acting on a fake systemd that kills
and restarts the stand-in process, the real Caddy and HAProxy on the rendered configuration in
front, and a steady client load (tests/serving_stand.py).

- Two replicas, one deadlocked: the judge sees it within its bound, and no request sent after that
  fails (those in flight on it may); the proxy's /health turns 503, with an OpenAI-shaped reason,
  once every replica is deadlocked, and 200 again once one recovers.
- One replica: the proxy's /health is 503 while its only replica is deadlocked, though the engine's
  own /health says 200.
- vLLM's own router (vllm-router) in front of two such appliances, each worker the appliance's
  proxy over HTTPS: once one appliance's engines all deadlock, every request sent after the bound
  succeeds through the router, which reads the truth from the appliance's /health.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from serving_stand import BOUNDS, DETECT_SLACK_S, Appliance, Load, failures, running_appliance

from testkit import caddy
from testkit.standin import free_port

pytestmark = [
    pytest.mark.programs,
    pytest.mark.skipif(not (os.access(caddy.CADDY, os.X_OK) and os.access(caddy.HAPROXY, os.X_OK)),
                       reason="needs Debian's caddy and haproxy (make setup)"),
]

DETECT_BOUND_S = BOUNDS.stall_after_s + DETECT_SLACK_S


def _openai_503(body: dict[str, object]) -> str:
    """The message of an OpenAI-shaped 503 body (asserting its shape)."""
    error = body.get("error")
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, body
    assert error["type"] == "service_unavailable_error" and error["code"] == 503 and error["param"] is None, body
    message = error["message"]
    assert isinstance(message, str) and message, body
    return message


# ------------------------------------------------------------------------------ one appliance


def test_a_deadlocked_replica_is_taken_out_and_the_proxys_health_follows_every_replica(tmp_path: Path) -> None:
    with running_appliance(tmp_path / "appliance", replicas=2) as app:
        load = Load(app.front.url, app.config.served_model, verify=str(app.front.ca))
        try:
            start = time.monotonic()
            load.wait_answered(40, start)
            # replica 1's engine core deadlocks: its /health still answers 200
            deadlocked_at = app.engines.deadlock(1)
            assert requests.get(f"{app.engines.proc(1).url}/health", timeout=10).status_code == 200
            detected_at = app.judge.wait_stalled(1, DETECT_BOUND_S + 10)
            assert detected_at - deadlocked_at <= DETECT_BOUND_S, (detected_at - deadlocked_at, app.judge.lines)
            assert any(name == "appliance-engine@1.service" for _, action, name in app.engines.actions if action == "restart")
            # the stand-in restarted into the same deadlock never warms up: replica 0 serves alone
            load.wait_answered(80, detected_at + 1)
            status, body = app.health()
            assert (status, body) == (200, {"status": "ok", "alive": 1, "replicas": 2}), body
            after = load.since(detected_at)
            assert not failures(after), failures(after)[:5]

            # now replica 0 too: no replica serves, and the proxy's /health says so, and why
            app.engines.deadlock(0)
            # the engine's own /health: still 200 (a deadlocked core, a live HTTP server)
            assert requests.get(f"{app.engines.proc(0).url}/health", timeout=10).status_code == 200
            app.judge.wait_stalled(0, DETECT_BOUND_S + 10)
            _, body = app.wait_health(503, 10)
            message = _openai_503(body)
            assert message.startswith("no engine replica is alive: replica 0 "), message
            assert "no tokens for" in message, message

            # replica 1 recovers (its restarted engine warms up): /health 200 again, and it serves
            recovered = time.monotonic()
            app.engines.recover(1)
            _, body = app.wait_health(200, 30)
            assert body == {"status": "ok", "alive": 1, "replicas": 2}, body
            load.wait_answered(20, time.monotonic())
            assert app.judge.stalled_at(1) == detected_at  # seen once: no restart of a replica that serves
            assert time.monotonic() - recovered < 60
        finally:
            sent = load.stop()
    # every request that failed was sent before replica 1 was detected (in flight on it), or while
    # no replica was alive
    both_down = app.judge.stalled_at(0)
    assert both_down is not None
    bad = [s for s in sent if not s.ok and s.sent >= detected_at and s.ended < both_down]
    assert not bad, bad[:5]


def test_one_replica_the_proxys_health_is_503_while_it_is_deadlocked(tmp_path: Path) -> None:
    with running_appliance(tmp_path / "appliance", replicas=1) as app:
        load = Load(app.front.url, app.config.served_model, verify=str(app.front.ca), threads=4)
        try:
            load.wait_answered(20, time.monotonic())
            deadlocked_at = app.engines.deadlock(0)
            detected_at = app.judge.wait_stalled(0, DETECT_BOUND_S + 10)
            assert detected_at - deadlocked_at <= DETECT_BOUND_S, (detected_at - deadlocked_at, app.judge.lines)
            turned_at, body = app.wait_health(503, 10)
            assert "no tokens for" in _openai_503(body)
            # it stays 503 while the replica is deadlocked (restarted into the same deadlock), while
            # the engine's own /health answers 200
            for _ in range(5):
                time.sleep(1)
                status, body = app.health()
                assert status == 503, body
                with contextlib.suppress(requests.ConnectionError):  # between its kill and its restart
                    assert requests.get(f"{app.engines.proc(0).url}/health", timeout=10).status_code == 200
            assert turned_at - deadlocked_at <= DETECT_BOUND_S + 5
            app.engines.recover(0)
            _, body = app.wait_health(200, 30)
            assert body == {"status": "ok", "alive": 1, "replicas": 1}
            load.wait_answered(10, time.monotonic())
        finally:
            load.stop()


# ------------------------------------------------------------------------------ vLLM's router in front of a fleet


def _router_program() -> str | None:
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.is_file() else shutil.which("vllm-router")


# How the router is told to watch its workers: every second, a worker out after two failed checks
# of its /health, back after one that passes (its defaults: 60 s, 3 and 2).
ROUTER_CHECK_S, ROUTER_FAILURES, ROUTER_CHECK_TIMEOUT_S = 1, 2, 3
# How long after an appliance's /health turned 503 the router may still send to it.
ROUTER_SEES_S = (ROUTER_FAILURES + 1) * ROUTER_CHECK_S + ROUTER_CHECK_TIMEOUT_S + 3


@contextlib.contextmanager
def _router(workers: list[str], ca_bundle: Path, work: Path) -> Iterator[str]:
    """vllm-router on loopback in front of WORKERS (the appliances' proxies over HTTPS, trusted
    through SSL_CERT_FILE: the router has no option for a CA of its own); its URL."""
    program = _router_program()
    assert program is not None
    port = free_port()
    log = work / "router.log"
    command = [program, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
               "--policy", "round_robin", "--health-check-endpoint", "/health",
               "--health-check-interval-secs", str(ROUTER_CHECK_S), "--health-failure-threshold", str(ROUTER_FAILURES),
               "--health-success-threshold", "1", "--health-check-timeout-secs", str(ROUTER_CHECK_TIMEOUT_S),
               "--worker-startup-timeout-secs", "60", "--worker-startup-check-interval", "1",
               "--prometheus-port", str(free_port()),
               # neither retries nor the circuit breaker: a request the router still sent to the
               # stalled appliance fails and is seen, so that only its /health can keep traffic away
               "--disable-retries", "--disable-circuit-breaker"]
    env = {**os.environ, "SSL_CERT_FILE": str(ca_bundle), "NO_COLOR": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        caddy.wait_ready("vllm-router", lambda: caddy.connects(port), proc, log, timeout=90)
        yield f"http://127.0.0.1:{port}"
    finally:
        caddy.stop(proc)


@pytest.mark.skipif(_router_program() is None, reason="needs vllm-router (pip: the dev extra, make setup-dev)")
def test_vllm_router_stops_sending_to_an_appliance_whose_engines_stalled(tmp_path: Path) -> None:
    with running_appliance(tmp_path / "a", replicas=2) as a, running_appliance(tmp_path / "b", replicas=2) as b:
        bundle = tmp_path / "appliance-cas.pem"
        bundle.write_text(a.front.ca.read_text() + b.front.ca.read_text())
        with _router([a.front.url, b.front.url], bundle, tmp_path) as router:
            load = Load(router, a.config.served_model)
            try:
                load.wait_answered(40, time.monotonic())
                served = {app.front.url: _answered_by(app) for app in (a, b)}
                assert all(served.values()), served  # both appliances take the router's requests
                # every engine of appliance a deadlocks at once
                deadlocked_at = min(a.engines.deadlock(0), a.engines.deadlock(1))
                detected = max(a.judge.wait_stalled(i, DETECT_BOUND_S + 10) for i in (0, 1))
                assert detected - deadlocked_at <= DETECT_BOUND_S + BOUNDS.interval_s, a.judge.lines
                seen_503, body = a.wait_health(503, 10)
                _openai_503(body)
                bound = seen_503 + ROUTER_SEES_S
                time.sleep(max(0.0, bound - time.monotonic()))
                before = _answered_by(b)
                load.wait_answered(100, bound)
                after = load.since(bound)
                assert not failures(after), failures(after)[:5]
                # they were b's: a's engines serve nothing (restarted into the same deadlock)
                assert _answered_by(b) - before >= 100
                # one of a's engines serves again: its /health 200, and the router sends to it again
                a.engines.recover(0)
                a.wait_health(200, 30)
                deadline = time.monotonic() + 30
                while _answered_by(a) < 5 and time.monotonic() < deadline:
                    time.sleep(0.2)
                assert _answered_by(a) >= 5, "the router did not send to the appliance once it served again"
            finally:
                load.stop()


def _answered_by(app: Appliance) -> int:
    """How many completions the appliance's engines have answered (their stand-ins' logs)."""
    engines = app.engines
    return sum(engines.proc(i).count_lines("POST /v1/chat/completions HTTP/1.1\" 200") for i in range(len(engines.ports)))


@pytest.mark.skipif(_router_program() is None, reason="needs vllm-router (pip: the dev extra, make setup-dev)")
def test_the_router_command_line_in_the_fleet_guide_parses() -> None:
    from vllm_router.launch_router import parse_router_args

    text = (Path(__file__).resolve().parents[1] / "docs" / "fleet.md").read_text()
    block = text.split("```sh\nSSL_CERT_FILE=", 1)[1].split("```", 1)[0]
    words = shlex.split(block.replace("\\\n", " "))
    assert words[1] == "vllm-router", words
    args = parse_router_args(words[2:])
    assert args.health_check_endpoint == "/health" and len(args.worker_urls) == 3
    assert all(url.startswith("https://") for url in args.worker_urls)
