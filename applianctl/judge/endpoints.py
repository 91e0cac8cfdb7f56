# SPDX-License-Identifier: MIT
"""The judge's two loopback endpoints, answered from its last published round.

- HTTP `GET /health` (paths.JUDGE_HEALTH; the proxy's own /health asks it): 200
  `{"status": "ok", "alive": N, "replicas": R}` while at least one replica is alive by the judge;
  503 with an OpenAI-shaped error naming why otherwise: every replica stalled, restarting or still
  starting (a first boot: a router in front must not send to an appliance that cannot answer),
  held by the hive ladder ("needs physical action: ..."), or a judge whose last round is too old
  to be the truth (its watchdog restarts it).
- HAProxy's agent-check (paths.JUDGE_AGENT): the agent-send string names a server ("replica1\\n"),
  the answer is "up\\n" when that replica is alive, "down #<why>\\n" otherwise (HAProxy's agent
  protocol: the word, then a description after '#'), then the connection closes. An agent that
  does not answer is no verdict for HAProxy (its own check still runs): a dead judge takes no
  replica out, and a stale one keeps its last answers until the watchdog restarts it.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from appliance.balancer import agent_reply
from applianctl.judge.canary import SCRAPE_TIMEOUT_S
from applianctl.judge.progress import Bounds
from applianctl.records import JudgeState

ERROR_TYPE = "service_unavailable_error"  # the same as the proxy's own 503 (appliance/caddyfile.py)
AGENT_READ_TIMEOUT_S = 2.0
MAX_NAME = 64
_NAME = re.compile(r"^(?:replica)?([0-9]{1,4})\Z")


class Source(Protocol):
    """What the endpoints read: the judge (daemon.Judge)."""

    def snapshot(self) -> tuple[JudgeState | None, float | None]: ...


def _said(state: str, reason: str) -> str:
    if not reason:
        return state
    return reason if reason.startswith(state) else f"{state} ({reason})"


def why_none_alive(state: JudgeState) -> str:
    """One line: why no replica serves."""
    if state.hive:
        return state.hive
    if not state.replicas:
        return "no engine replica is configured"
    each = "; ".join(f"replica {r.replica} {_said(r.state, r.reason)}" for r in state.replicas)
    return f"no engine replica is alive: {each}"


def health(state: JudgeState | None, age_s: float | None, stale_after_s: float) -> tuple[int, dict[str, Any]]:
    """The /health answer for STATE, published AGE_S seconds ago: (HTTP status, JSON body)."""
    if state is None or age_s is None:
        message = "the judge has not judged the replicas yet"
    elif age_s > stale_after_s:
        message = f"the judge's last round is {age_s:.0f} s old: no replica is known to be alive"
    elif state.alive > 0:
        return 200, {"status": "ok", "alive": state.alive, "replicas": len(state.replicas)}
    else:
        message = why_none_alive(state)
    return 503, {"error": {"message": message[:1000], "type": ERROR_TYPE, "param": None, "code": 503}}


def agent_answer(state: JudgeState | None, sent: str) -> str:
    """The agent's line for the server named SENT ("replica1", or "1")."""
    name = sent.strip()
    m = _NAME.match(name)
    if m is None:
        return agent_reply(False, f"no replica named {name[:MAX_NAME]!r}")
    if state is None:
        return agent_reply(False, "the judge has not judged the replicas yet")
    index = int(m.group(1))
    found = next((r for r in state.replicas if r.replica == index), None)
    if found is None:
        return agent_reply(False, f"no replica {index} on this appliance")
    if found.state == "alive":
        return agent_reply(True)
    return agent_reply(False, _said(found.state, found.reason).replace("#", " ")[:200])


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


class _HealthHandler(http.server.BaseHTTPRequestHandler):
    server_version = "appliance-judge"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    answer: Callable[[], tuple[int, dict[str, Any]]]

    def _send(self, status: int, body: dict[str, Any], head: bool = False) -> None:
        raw = (json.dumps(body) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(raw)

    def _answer(self, head: bool) -> None:
        if self.path.split("?", 1)[0] != "/health":
            self._send(404, {"error": {"message": "the judge serves GET /health only", "type": "invalid_request_error",
                                       "param": None, "code": 404}}, head)
            return
        status, body = type(self).answer()
        self._send(status, body, head)

    def do_GET(self) -> None:
        self._answer(head=False)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # every few seconds from the proxy: not for the journal


class _AgentHandler(socketserver.BaseRequestHandler):
    state: Callable[[], JudgeState | None]

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(AGENT_READ_TIMEOUT_S)
        data = b""
        try:
            while b"\n" not in data and len(data) <= MAX_NAME:
                chunk = sock.recv(MAX_NAME + 1)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        line = data.split(b"\n", 1)[0].decode("ascii", "replace")
        with contextlib.suppress(OSError):
            sock.sendall(agent_answer(type(self).state(), line).encode("ascii", "replace"))


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True


class _HttpServer(http.server.ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True


def stale_after(bounds: Bounds) -> float:
    """How old the last round may be before /health stops trusting it: three rounds and a scrape
    late, and half a minute more (the watchdog restarts a judge that stopped long before)."""
    return 3 * bounds.interval_s + SCRAPE_TIMEOUT_S + 30


def serve(source: Source, health_address: str, agent_address: str, *, stale_after_s: float,
          clock: Callable[[], float] = time.monotonic) -> list[socketserver.BaseServer]:
    """Both endpoints on their addresses (host:port; port 0 picks a free one), each in a thread of
    its own; the servers, to shut down."""
    limit = stale_after_s

    def answer() -> tuple[int, dict[str, Any]]:
        state, at = source.snapshot()
        return health(state, None if at is None else clock() - at, limit)

    health_handler = type("HealthHandler", (_HealthHandler,), {"answer": staticmethod(answer)})
    agent_handler = type("AgentHandler", (_AgentHandler,), {"state": staticmethod(lambda: source.snapshot()[0])})
    servers: list[socketserver.BaseServer] = [_HttpServer(_address(health_address), health_handler),
                                              _Server(_address(agent_address), agent_handler)]
    for server in servers:
        threading.Thread(target=server.serve_forever, name=f"judge-{type(server).__name__}", daemon=True).start()
    return servers
