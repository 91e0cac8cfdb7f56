# SPDX-License-Identifier: MIT
"""The proxy in front of several replicas: Caddy (TLS, the allowlist) sends the
engine's requests to the balancer, the real HAProxy on the rendered configuration of a layout RxTP,
which names every replica, picks the one with the fewest requests in flight, sends a request that
carries proxy.affinity_header to the replica its value hashes to, and loses no request sent after a
replica is killed (SIGKILL): only the ones in flight on it may fail, at most its concurrency; a
request that found it dead reaches another replica with its own body. The replicas are
bench/paced_engine.py (latency-bound, capped concurrency, the answering port in X-Paced-Engine, the
digest of the body received in X-Paced-Body)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from repository import FIXTURES
from test_proxy import _adapt

from appliance import balancer, config, paths
from appliance.caddyfile import render_caddyfile
from appliance.errors import ConfigError
from bench import paced_engine
from testkit import caddy
from testkit.standin import free_spaced_ports

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (os.access(caddy.CADDY, os.X_OK) and os.access(caddy.HAPROXY, os.X_OK)),
                                reason="needs Debian's caddy and haproxy (make setup)")

CAP = 4  # requests at once per replica
SERVICE_S = 0.05
CHAT = "/v1/chat/completions"
BODY = {"model": paced_engine.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _layout(replicas: int, affinity_header: str = "") -> config.Config:
    demo = config.load(ROOT / "appliance.toml", "demo")
    return dataclasses.replace(demo, topology=dataclasses.replace(demo.topology, gpus=replicas, layout=f"{replicas}x1"),
                               proxy=dataclasses.replace(demo.proxy, affinity_header=affinity_header))


def _engine_proxies(adapted: dict[str, Any]) -> list[dict[str, Any]]:
    """Every reverse_proxy handler of the clients' site that forwards to the engine (or its balancer):
    the ones that buffer request bodies (the judge's /health and the metrics site's do not), but for
    the metrics site's attestation service (paths.ATTEST), which buffers its small bodies too."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("handler") == "reverse_proxy" and node.get("buffer_requests") \
                    and [u.get("dial") for u in node.get("upstreams", [])] != [paths.ATTEST]:
                found.append(node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(adapted["apps"]["http"]["servers"])
    return found


def _servers(cfg: str, backend: str) -> list[str]:
    section = cfg.split(f"\nbackend {backend}\n", 1)[1].split("\n\n", 1)[0]
    return [line.split()[2] for line in section.splitlines() if line.strip().startswith("server ")]


def _haproxy_check(cfg: str, tmp_path: Path) -> None:
    """HAProxy's own parser accepts the rendered configuration."""
    path = tmp_path / "haproxy.cfg"
    path.write_text(cfg)
    check = subprocess.run([caddy.HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


# ------------------------------------------------------------------------------ the rendered files


@pytest.mark.programs
def test_one_engine_renders_a_single_upstream_and_no_balancer(tmp_path: Path) -> None:
    one = _layout(1)
    text = render_caddyfile(one)
    assert "reverse_proxy 127.0.0.1:8000 {" in text and "lb_policy" not in text
    # replica 0's metrics at its own path too: one scrape configuration for every layout
    assert "`^/engine/0/metrics$`" in text and "`^/engine/1/metrics$`" not in text
    (proxy,) = _engine_proxies(_adapt(text, tmp_path))
    assert [u["dial"] for u in proxy["upstreams"]] == ["127.0.0.1:8000"]
    assert proxy["health_checks"]["active"]["uri"] == one.engine.health.path
    assert not balancer.wanted(one)


@pytest.mark.programs
def test_two_replicas_go_through_the_balancer_by_requests_in_flight_and_caddy_never_retries(tmp_path: Path) -> None:
    two = _layout(2)
    (proxy,) = _engine_proxies(_adapt(render_caddyfile(two), tmp_path))
    # Caddy: one upstream, the balancer; no retry of its own (Caddy 2.6.2 resends a buffered body it
    # has handed back: appliance/balancer.py), no health checks (the balancer checks each replica)
    assert [u["dial"] for u in proxy["upstreams"]] == [f"127.0.0.1:{two.balancer_port}"] == ["127.0.0.1:8004"]
    assert "load_balancing" not in proxy and "health_checks" not in proxy
    cfg = balancer.render_balancer(two)
    _haproxy_check(cfg, tmp_path)
    assert "\tbind 127.0.0.1:8004\n" in cfg and "\tbalance leastconn\n" in cfg
    assert _servers(cfg, "replicas") == ["127.0.0.1:8000", "127.0.0.1:8002"]
    # a refused connection goes to another replica; a request that reached one is never resent
    assert "\tretry-on conn-failure\n" in cfg and "\toption redispatch 1\n" in cfg
    assert "affine" not in cfg


def test_a_replica_is_admitted_once_it_has_answered_a_request() -> None:
    """The balancer's check: vLLM's count of finished requests above zero in its /metrics."""
    cfg = balancer.render_balancer(_layout(2))
    assert "\thttp-check send meth GET uri /metrics\n" in cfg
    assert "\thttp-check expect rstring request_success_total[^\\ \\n]*\\ [1-9]\n" in cfg
    pattern = re.compile(balancer.WARMED_RE)
    recorded = (FIXTURES / "vllm" / "metrics-v1-ngc-vllm25.09-qwen3-4b.prom").read_text()
    assert pattern.search(recorded)  # a real vLLM's /metrics after 6 requests
    assert not pattern.search(re.sub(r"(request_success_total\{[^}]*\}) [0-9.e+]+", r"\1 0.0", recorded))  # and after none


@pytest.mark.programs
def test_eight_replicas_each_with_its_own_metrics_path(tmp_path: Path) -> None:
    eight = _layout(8)
    text = render_caddyfile(eight)
    (proxy,) = _engine_proxies(_adapt(text, tmp_path))
    assert [u["dial"] for u in proxy["upstreams"]] == ["127.0.0.1:8016"]
    cfg = balancer.render_balancer(eight)
    _haproxy_check(cfg, tmp_path)
    assert _servers(cfg, "replicas") == [f"127.0.0.1:{8000 + 2 * i}" for i in range(8)]
    for i in range(8):
        assert f"`^/engine/{i}/metrics$`" in text and f"reverse_proxy 127.0.0.1:{8000 + 2 * i}\n" in text


@pytest.mark.programs
def test_affinity_by_a_header_goes_first_and_the_rest_by_requests_in_flight(tmp_path: Path) -> None:
    cfg = balancer.render_balancer(_layout(2, "X-Session-Id"))
    _haproxy_check(cfg, tmp_path)
    assert "\tuse_backend affine if { req.hdr(X-Session-Id) -m found }\n\tdefault_backend replicas\n" in cfg
    assert "\tbalance hdr(X-Session-Id)\n\thash-type consistent\n" in cfg
    assert _servers(cfg, "affine") == _servers(cfg, "replicas") == ["127.0.0.1:8000", "127.0.0.1:8002"]


@pytest.mark.parametrize("hostile", ["X-Session-Id *", "X-Session-Id\n}", "{http.request.uri}", "1abc", "X" * 65])
def test_an_affinity_header_that_is_not_a_header_name_is_refused_in_one_line(tmp_path: Path, hostile: str) -> None:
    text = (ROOT / "appliance.toml").read_text()
    assert text.count('affinity_header = ""') == 1
    path = tmp_path / "appliance.toml"
    path.write_text(text.replace('affinity_header = ""', f"affinity_header = {hostile!r}".replace("'", '"').replace("\n", "\\n")))
    with pytest.raises(ConfigError) as e:
        config.load(path, "demo")
    assert "affinity_header" in e.value.message and "\n" not in e.value.message and e.value.hint


# ------------------------------------------------------------------------- the real Caddy and HAProxy


@dataclasses.dataclass
class Replicas:
    ports: list[int]
    procs: dict[int, Any]
    url: str
    ca: Path
    work: Path


@pytest.fixture
def two(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Replicas]:
    affinity = getattr(request, "param", "")
    ports = free_spaced_ports(3)[:2]  # and the balancer's, the port after them
    with paced_engine.running(ports, tmp_path, CAP, SERVICE_S) as procs, \
            caddy.demo_front(ports[0], tmp_path / "front", replicas=2, affinity_header=affinity) as front:
        yield Replicas(ports, procs, front.url, front.ca, tmp_path)


def _session(r: Replicas) -> requests.Session:
    s = requests.Session()
    s.trust_env = False  # REQUESTS_CA_BUNDLE and the like would win over verify
    s.verify = str(r.ca)
    return s


def _ask(s: requests.Session, r: Replicas, headers: dict[str, str] | None = None) -> str:
    """One chat completion through the proxy; the replica (port) that answered."""
    resp = s.post(r.url + CHAT, json=BODY, headers=headers or {}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.headers["X-Paced-Engine"]


@pytest.mark.programs
def test_requests_are_spread_over_both_replicas(two: Replicas) -> None:
    def client(_: int) -> list[str]:
        with _session(two) as s:
            return [_ask(s, two) for _ in range(6)]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answered = collections.Counter(port for ports in pool.map(client, range(8)) for port in ports)
    # 8 clients against a cap of 4 each: one replica alone would queue half of them
    assert set(answered) == {str(p) for p in two.ports} and min(answered.values()) >= 12, answered


@pytest.mark.programs
@pytest.mark.parametrize("two", ["X-Session-Id"], indirect=True)
def test_a_session_header_keeps_a_conversation_on_one_replica(two: Replicas) -> None:
    with _session(two) as s:
        by_session = {key: {_ask(s, two, {"X-Session-Id": key}) for _ in range(5)} for key in (f"conv-{i}" for i in range(8))}
        without = {_ask(s, two) for _ in range(8)}
    assert all(len(ports) == 1 for ports in by_session.values()), by_session
    # the sessions' hashes use both replicas, and requests without the header still reach both
    assert {p for ports in by_session.values() for p in ports} == {str(p) for p in two.ports}, by_session
    assert without == {str(p) for p in two.ports}


@pytest.mark.programs
def test_a_killed_replica_fails_only_its_requests_in_flight_and_none_sent_after(two: Replicas) -> None:
    """SIGKILL one replica while 6 clients send a steady stream of non-streaming requests: what was
    in flight on it may fail (at most its concurrency), nothing sent after; started again, it
    takes requests once its health check passes."""
    stop, killed_at = threading.Event(), [0.0]
    outcomes: list[tuple[float, int | str, str]] = []  # (sent at, status or error, replica)
    lock = threading.Lock()

    def client() -> None:
        with _session(two) as s:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    resp = s.post(two.url + CHAT, json=BODY, timeout=30)
                    outcome: tuple[float, int | str, str] = (sent, resp.status_code, resp.headers.get("X-Paced-Engine", ""))
                except requests.RequestException as e:
                    outcome = (sent, type(e).__name__, "")
                with lock:
                    outcomes.append(outcome)

    victim = two.ports[1]
    threads = [threading.Thread(target=client) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        two.procs[victim].send_signal(signal.SIGKILL)
        two.procs[victim].wait()
        killed_at[0] = time.monotonic()  # the loss: from here on it is gone (before, requests reached it)
        time.sleep(4)
        two.procs[victim] = paced_engine.start(victim, two.work, CAP, SERVICE_S)
        restarted_at = time.monotonic()
        # the balancer's next check (every CHECK_INTERVAL_S) finds it serving
        deadline = restarted_at + 30
        while time.monotonic() < deadline and not any(sent > restarted_at and port == str(victim) for sent, _, port in list(outcomes)):
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join()
    before = [o for o in outcomes if o[0] < killed_at[0]]
    after = [o for o in outcomes if o[0] >= killed_at[0]]
    failed_before = [o for o in before if o[1] != 200]
    failed_after = [o for o in after if o[1] != 200]
    assert any(o[2] == str(victim) for o in before), "the victim served nothing before it was killed"
    assert len(failed_before) <= CAP, failed_before
    assert failed_after == [], failed_after[:5]
    assert len(after) > 50, len(after)
    assert any(sent > restarted_at and port == str(victim) for sent, _, port in after), "the restarted replica got no request"


@pytest.mark.programs
def test_a_replica_takes_traffic_only_once_it_has_answered_its_warm_up_request(two: Replicas) -> None:
    """Restarted without its warm-up request, a replica gets nothing through the proxy once a health
    check has seen it (every CHECK_INTERVAL_S), however long it listens; warmed up, it gets requests from the
    next health check on."""
    victim = two.ports[1]
    two.procs[victim].send_signal(signal.SIGKILL)
    two.procs[victim].wait()
    two.procs[victim] = paced_engine.start(victim, two.work, CAP, SERVICE_S, warmed=False)
    with _session(two) as s:
        time.sleep(2 * balancer.CHECK_INTERVAL_S + 1)  # two checks of the listening, unwarmed replica have run
        cold = {_ask(s, two) for _ in range(40)}
        time.sleep(balancer.CHECK_INTERVAL_S + 1)  # and another
        cold |= {_ask(s, two) for _ in range(40)}
        assert cold == {str(two.ports[0])}, cold
        paced_engine.warm(victim)
        deadline = time.monotonic() + 25
        warmed: set[str] = set()
        while time.monotonic() < deadline and str(victim) not in warmed:
            warmed |= {_ask(s, two) for _ in range(8)}
            time.sleep(0.5)
    assert str(victim) in warmed, warmed


@pytest.mark.programs
def test_a_replica_that_died_idle_costs_no_request_and_each_arrives_with_its_own_body(two: Replicas) -> None:
    """Nothing in flight on it when it died, so nothing told the balancer: the requests that pick it
    find its port closed and go to the other replica, each with the body its client sent (Caddy
    2.6.2's own retry resent a pooled buffer: empty, or another request's), while 8 clients send
    requests with bodies of their own at once."""
    two.procs[two.ports[1]].send_signal(signal.SIGKILL)
    two.procs[two.ports[1]].wait()

    def client(n: int) -> list[tuple[int, str, str, str]]:
        out = []
        with _session(two) as s:
            for k in range(6):
                raw = json.dumps({**BODY, "messages": [{"role": "user", "content": f"client {n} turn {k} " + "x" * (n * 97)}]})
                r = s.post(two.url + CHAT, data=raw, headers={"Content-Type": "application/json"}, timeout=30)
                out.append((r.status_code, r.headers.get("X-Paced-Engine", ""), r.headers.get("X-Paced-Body", ""),
                            hashlib.sha256(raw.encode()).hexdigest()))
        return out

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = [a for batch in pool.map(client, range(8)) for a in batch]
    assert [a for a in answers if a[0] != 200] == []
    assert {a[1] for a in answers} == {str(two.ports[0])}
    assert [a for a in answers if a[2] != a[3]] == []  # every request arrived as its client sent it


def test_the_warm_up_request_admits_the_stand_in_engine(tmp_path: Path) -> None:
    """The demo's engine (the stand-in, speaking vLLM's API): its /metrics fails the proxy's
    admission check until the unit's warm-up body (rendered from the demo's configuration) has
    been posted to it, as the quadlet's startup check does with curl, and passes after."""
    from standin_engine import free_port, start_standin, stop

    from builder import render

    demo = config.load(ROOT / "appliance.toml", "demo")
    pattern = re.compile(balancer.WARMED_RE)
    port = free_port()
    proc = start_standin(port, name=demo.served_model)
    try:
        base = f"http://127.0.0.1:{port}"
        assert not pattern.search(requests.get(base + "/metrics", timeout=10).text)
        answer = requests.post(base + "/v1/completions", data=render.warmup_body(demo),
                               headers={"Content-Type": "application/json"}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert pattern.search(requests.get(base + "/metrics", timeout=10).text)
    finally:
        stop(proc)


def test_the_balancer_ends_a_request_whose_client_left_and_waits_no_longer_than_a_request_lasts() -> None:
    from appliance import engine_limits

    for layout in (_layout(2), config.load(ROOT / "appliance.toml", "production")):
        cfg = balancer.render_balancer(dataclasses.replace(layout, topology=dataclasses.replace(layout.topology, gpus=2, layout="2x1")))
        bound = engine_limits.request_bound_s(layout)
        assert f"\ttimeout server {bound}s\n" in cfg and f"\ttimeout client {bound}s\n" in cfg
        assert "\toption abortonclose\n" in cfg and "\toption http-no-delay\n" in cfg
    # the production engine's context (262144 tokens) at the slowest progressing rate, after its first token
    production = config.load(ROOT / "appliance.toml", "production")
    assert engine_limits.request_bound_s(production) == engine_limits.FIRST_TOKEN_S + 262144 // engine_limits.MIN_TOKENS_PER_S + 1


def test_each_replica_is_asked_of_the_judges_agent_by_name_and_a_clients_metrics_come_from_one_replica() -> None:
    from appliance import paths

    cfg = balancer.render_balancer(_layout(2, "X-Session-Id"))
    host, port = paths.JUDGE_AGENT.split(":")
    assert f"\tdefault-server agent-check agent-addr {host} agent-port {port} agent-inter {balancer.AGENT_INTERVAL_MS}ms\n" in cfg
    assert cfg.count('check agent-send "replica0\\n"') == 1 and cfg.count('check agent-send "replica1\\n"') == 1
    # the other backends follow the replicas' backend's verdict, with no checks of their own
    assert cfg.count("track replicas/replica1 no-agent-check") == 2
    assert "\tuse_backend metrics if { path /metrics }\n" in cfg and "\tbalance first\n" in cfg
    assert balancer.agent_reply(True) == "up\n"
    assert balancer.agent_reply(False, "stalled: no tokens\nfor 95 s") == "down #stalled: no tokens for 95 s\n"


@pytest.mark.programs
def test_with_no_replica_serving_the_client_gets_an_openai_shaped_error_not_haproxys_page(two: Replicas) -> None:
    """Both replicas gone: HAProxy's own 503 reaches the client through Caddy as JSON with
    error.message (an OpenAI client parses it), not HAProxy's HTML page."""
    for proc in two.procs.values():
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with _session(two) as s:
        deadline = time.monotonic() + 3 * balancer.CHECK_INTERVAL_S + 5
        resp = s.post(two.url + CHAT, json=BODY, timeout=30)
        while resp.status_code != 503 and time.monotonic() < deadline:  # until the checks marked both down
            time.sleep(0.5)
            resp = s.post(two.url + CHAT, json=BODY, timeout=30)
    assert resp.status_code in (502, 503), resp.text
    assert resp.headers["Content-Type"].startswith("application/json"), resp.text
    error = resp.json()["error"]
    assert error["code"] == resp.status_code and error["message"], error
