# SPDX-License-Identifier: MIT
"""The proxies in front of the engine, live: the real Caddy on the rendered Caddyfile, and with two
replicas the real HAProxy on the rendered balancer configuration, in front of a backend that
answers slowly and records when the connection of each request closes.

- A client that goes away mid-answer, streamed or not, closes the request's connection at the
  backend within seconds (vLLM aborts a request whose connection closes): no proxy keeps it open.
- A streamed answer still arrives chunk by chunk.
- The proxy's /health is the judge's verdict (a fake judge on loopback), and a 503 with an
  OpenAI-shaped reason when no judge answers, in both layouts.
- The balancer asks the judge's agent about each replica: one it says is down gets no request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import os
import select
import socket
import socketserver
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance import balancer, caddyfile
from testkit import caddy
from testkit.standin import free_spaced_ports

pytestmark = [
    pytest.mark.programs,
    pytest.mark.skipif(not (os.access(caddy.CADDY, os.X_OK) and os.access(caddy.HAPROXY, os.X_OK)),
                       reason="needs Debian's caddy and haproxy (make setup)"),
]

CHAT = "/v1/chat/completions"
CHUNK_S = 0.2  # the backend's pace: one SSE chunk every CHUNK_S
CHUNKS = 60  # a streamed answer lasts CHUNKS * CHUNK_S (12 s) unless its connection closes first
ANSWER_S = 15.0  # a non-streamed answer comes after this long, unless its connection closes first
CANCEL_BOUND_S = 3.0  # a client gone: the backend sees its request's connection closed within this


# --------------------------------------------------------------------- the slow, recording backend


@dataclasses.dataclass
class Seen:
    port: int
    stream: bool
    started: float
    closed: float | None = None  # when the backend saw the connection close before the answer ended
    finished: float | None = None  # when it sent the whole answer


class _Backend(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, seen: dict[str, Seen], lock: threading.Lock) -> None:
        self.seen, self.lock = seen, lock
        super().__init__(("127.0.0.1", port), _BackendHandler)


class _BackendHandler(socketserver.StreamRequestHandler):
    """HTTP/1.1 by hand, so that the moment the peer closes is seen: GET /metrics (warmed up, for
    the balancer's check), GET /health, POST /v1/chat/completions (X-Probe names the request)."""

    server: _Backend

    def _closed(self, wait: float) -> bool:
        """Whether the peer closed the connection (waiting up to WAIT for it)."""
        readable, _, _ = select.select([self.connection], [], [], wait)
        if not readable:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def handle(self) -> None:
        # as uvicorn (vLLM's server) and asyncio: each write goes out at once
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(OSError):  # the balancer's checks may reset their connections
            self._serve()

    def _serve(self) -> None:
        while True:
            line = self.rfile.readline(65536)
            if not line:
                return
            headers: dict[str, str] = {}
            while (header := self.rfile.readline(65536)) not in (b"\r\n", b"\n", b""):
                name, _, value = header.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = self.rfile.read(int(headers.get("content-length", "0")))
            method, target = line.split()[:2]
            if target == b"/metrics":
                text = b'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0\n'
                self._send(b"200 OK", b"text/plain; version=0.0.4", text)
            elif target == b"/health":
                self._send(b"200 OK", b"text/plain", b"")
            elif method == b"POST" and target == CHAT.encode():
                self._chat(headers.get("x-probe", ""), bool(json.loads(body or b"{}").get("stream")),
                           float(headers.get("x-answer-s", ANSWER_S)))
                return  # one request per connection: the proxies open one per request anyway
            else:
                self._send(b"404 Not Found", b"text/plain", b"")

    def _send(self, status: bytes, kind: bytes, payload: bytes) -> None:
        self.wfile.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + kind + b"\r\nContent-Length: %d\r\n\r\n" % len(payload)
                         + payload)
        self.wfile.flush()

    def _chat(self, probe: str, stream: bool, answer_s: float) -> None:
        seen = Seen(self.server.server_address[1], stream, time.monotonic())
        with self.server.lock:
            self.server.seen[probe] = seen
        try:
            if stream:
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                self.wfile.flush()
                for i in range(CHUNKS):
                    event = b'data: {"choices":[{"index":0,"delta":{"content":" t%d"}}]}\n\n' % i
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    if self._closed(CHUNK_S):
                        seen.closed = time.monotonic()
                        return
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            else:
                deadline = seen.started + answer_s
                while time.monotonic() < deadline:
                    if self._closed(0.05):
                        seen.closed = time.monotonic()
                        return
                self._send(b"200 OK", b"application/json", b'{"choices":[{"index":0,"message":{"content":"done"}}]}')
            seen.finished = time.monotonic()
        except OSError:
            seen.closed = seen.closed or time.monotonic()


@dataclasses.dataclass
class Stand:
    front: caddy.Front
    ports: list[int]
    seen: dict[str, Seen]
    lock: threading.Lock
    work: Path


@contextlib.contextmanager
def _backends(ports: list[int]) -> Iterator[tuple[dict[str, Seen], threading.Lock]]:
    seen: dict[str, Seen] = {}
    lock = threading.Lock()
    servers = [_Backend(port, seen, lock) for port in ports]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        yield seen, lock
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


@contextlib.contextmanager
def _stand(tmp_path: Path, replicas: int, **judge: str) -> Iterator[Stand]:
    ports = free_spaced_ports(replicas + 1)[:replicas]  # and the balancer's, the port after them
    with _backends(ports) as (seen, lock), caddy.demo_front(ports[0], tmp_path / "front", replicas=replicas, **judge) as front:
        stand = Stand(front, ports, seen, lock, tmp_path)
        if replicas > 1:
            _admitted(stand)
        yield stand


def _admitted(stand: Stand) -> None:
    """Once the balancer's checks have admitted every replica (each has answered a request)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        ports = {stand.seen[p].port for p in [_post(stand, stream=False, wait_s=0) for _ in range(4)] if p in stand.seen}
        if ports == set(stand.ports):
            return
        time.sleep(0.5)
    pytest.fail(f"the balancer did not admit every replica:\n{(stand.work / 'front' / 'haproxy.log').read_text()[-2000:]}")


def _tls(stand: Stand) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=str(stand.front.ca))
    raw = socket.create_connection(("127.0.0.1", stand.front.port), timeout=30)
    return ctx.wrap_socket(raw, server_hostname="127.0.0.1")


def _request(probe: str, stream: bool, answer_s: float = ANSWER_S) -> bytes:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}).encode()
    return (f"POST {CHAT} HTTP/1.1\r\nHost: appliance\r\nX-Probe: {probe}\r\nX-Answer-S: {answer_s}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _post(stand: Stand, *, stream: bool, wait_s: float) -> str:
    """Send one completion; for WAIT_S read its answer, then go away (0: an answer at once, read
    whole). Its probe."""
    probe = uuid.uuid4().hex
    with _tls(stand) as conn:
        conn.sendall(_request(probe, stream, 0 if wait_s == 0 else ANSWER_S))
        if wait_s == 0 and not stream:
            conn.settimeout(ANSWER_S + 15)
            data = b""
            while b"done" not in data and (piece := conn.recv(65536)):
                data += piece
            return probe
        deadline = time.monotonic() + wait_s
        conn.settimeout(0.2)
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.recv(65536)
    return probe


def _wait_closed(stand: Stand, probe: str, gone_at: float) -> Seen:
    deadline = gone_at + CANCEL_BOUND_S + 10  # how long to look; the bound is asserted below
    while time.monotonic() < deadline:
        with stand.lock:
            seen = stand.seen.get(probe)
        if seen is not None and (seen.closed or seen.finished):
            return seen
        time.sleep(0.05)
    with stand.lock:
        return stand.seen.get(probe) or Seen(0, False, 0.0)


# ------------------------------------------------------------------------------- a client that leaves


@pytest.mark.parametrize("replicas", [1, 2], ids=["one-engine", "two-replicas"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_client_that_goes_away_closes_its_request_at_the_engine(tmp_path: Path, replicas: int, stream: bool) -> None:
    with _stand(tmp_path, replicas) as stand:
        probes = []
        for _ in range(2 if replicas > 1 else 1):  # with two replicas, at least one on each is likely; both checked
            probe = _post(stand, stream=stream, wait_s=1.5)
            gone_at = time.monotonic()
            seen = _wait_closed(stand, probe, gone_at)
            probes.append((probe, seen, gone_at))
        for probe, seen, gone_at in probes:
            assert seen.started, f"the backend never got {probe}"
            assert seen.finished is None, "the backend answered whole: nothing told it that its client had gone"
            assert seen.closed is not None and seen.closed - gone_at < CANCEL_BOUND_S, (seen, gone_at)


@pytest.mark.parametrize("replicas", [1, 2], ids=["one-engine", "two-replicas"])
def test_a_streamed_answer_arrives_chunk_by_chunk(tmp_path: Path, replicas: int) -> None:
    with _stand(tmp_path, replicas) as stand, _tls(stand) as conn:
        conn.sendall(_request(uuid.uuid4().hex, True))
        conn.settimeout(CHUNKS * CHUNK_S + 20)
        arrivals: list[float] = []
        data = b""
        while not data.endswith(b"0\r\n\r\n") and (piece := conn.recv(65536)):
            data += piece
            arrivals += [time.monotonic()] * piece.count(b"data: ")
        sent = time.monotonic()
    assert len(arrivals) == CHUNKS, data[-300:]
    # the first chunk came long before the last: nothing held the answer back to send it whole
    assert arrivals[-1] - arrivals[0] > CHUNKS * CHUNK_S / 2, (arrivals[0], arrivals[-1])
    assert len(set(arrivals)) > CHUNKS / 2  # in many reads, not a few large ones
    assert sent - arrivals[-1] < 5


# ----------------------------------------------------------------------------------- the judge's /health


class _Judge(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        self.alive = 1
        super().__init__(("127.0.0.1", 0), _JudgeHandler)


class _JudgeHandler(http.server.BaseHTTPRequestHandler):
    server: _Judge

    def do_GET(self) -> None:
        if self.server.alive:
            status, body = 200, {"status": "ok", "alive": self.server.alive}
        else:
            status, body = 503, {"error": {"message": "no replica is serving: replica 0 stalled", "type": "service_unavailable_error",
                                           "param": None, "code": 503}}
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _health(stand: Stand) -> tuple[int, dict[str, object]]:
    with _tls(stand) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: appliance\r\nConnection: close\r\n\r\n")
        data = b""
        while piece := conn.recv(65536):
            data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("replicas", [1, 2], ids=["one-engine", "two-replicas"])
def test_the_proxys_health_is_the_judges_verdict_and_503_without_a_judge(tmp_path: Path, replicas: int) -> None:
    judge = _Judge()
    threading.Thread(target=judge.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{judge.server_address[1]}"
        with _stand(tmp_path, replicas, judge_health=address) as stand:
            assert _health(stand) == (200, {"status": "ok", "alive": 1})
            judge.alive = 0  # every replica stalled: the engine's own /health would still say 200
            status, body = _health(stand)
            assert status == 503 and "replica 0 stalled" in json.dumps(body), body
            judge.alive = 1
            assert _health(stand)[0] == 200
            judge.shutdown()
            judge.server_close()  # the judge gone: no answer is no 200
            status, body = _health(stand)
            assert (status, body) == (503, json.loads(caddyfile.REFUSALS["judge_down"])), body
    finally:
        judge.server_close()


def test_without_a_judge_address_of_its_own_the_proxy_asks_the_devices() -> None:
    from appliance import paths
    from appliance.config import load

    config = load(Path(__file__).resolve().parents[1] / "appliance.toml", "demo")
    assert f"reverse_proxy {paths.JUDGE_HEALTH} {{" in caddyfile.render_caddyfile(config)
    host, port = paths.JUDGE_AGENT.split(":")
    assert f"agent-addr {host} agent-port {port} " in balancer.render_balancer(config)


# ------------------------------------------------------------------------------ the judge's agent


class _Agent(socketserver.ThreadingTCPServer):
    """HAProxy's agent protocol: a line naming the replica in, "up" or "down #reason" out."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.asked: list[str] = []
        super().__init__(("127.0.0.1", 0), _AgentHandler)


class _AgentHandler(socketserver.StreamRequestHandler):
    server: _Agent

    def handle(self) -> None:
        name = self.rfile.readline(256).decode().strip()
        self.server.asked.append(name)
        # HAProxy 2.6 reads the reason after a '#' only as a word of its own: "down#reason" is no
        # "down" at all (the server stays up), hence balancer.AGENT_DOWN's space
        self.wfile.write(balancer.agent_reply(False, "stalled: no tokens for 95 s").encode() if name in self.server.down
                         else balancer.agent_reply(True).encode())


def test_a_replica_the_judges_agent_says_is_down_gets_no_request(tmp_path: Path) -> None:
    agent = _Agent()
    threading.Thread(target=agent.serve_forever, daemon=True).start()
    try:
        with _stand(tmp_path, 2, judge_agent=f"127.0.0.1:{agent.server_address[1]}") as stand:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not {"replica0", "replica1"} <= set(agent.asked):
                time.sleep(0.1)
            assert {"replica0", "replica1"} <= set(agent.asked), agent.asked  # each asked by its name
            agent.down.add("replica1")
            marked = time.monotonic()
            time.sleep(2 * balancer.AGENT_INTERVAL_MS / 1000 + 0.5)  # two agent rounds
            probes = [_post(stand, stream=False, wait_s=0) for _ in range(12)]
            with stand.lock:
                ports = [stand.seen[p].port for p in probes]
            assert ports == [stand.ports[0]] * len(probes), ports
            assert time.monotonic() - marked < 60
            log = (stand.work / "front" / "haproxy.log").read_text()
            assert "replica1 is DOWN" in log and "stalled: no tokens for 95 s" in log, log[-2000:]
            agent.down.clear()  # serving again: back in the rotation
            deadline = time.monotonic() + 20
            back = False
            while time.monotonic() < deadline and not back:
                probe = _post(stand, stream=False, wait_s=0)
                back = stand.seen[probe].port == stand.ports[1]
            assert back, "replica1 did not come back once the agent said up"
    finally:
        agent.shutdown()
        agent.server_close()
