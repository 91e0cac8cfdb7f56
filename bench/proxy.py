# SPDX-License-Identifier: MIT
"""`make bench`, the proxy: the real Caddy on the rendered demo Caddyfile (testkit/caddy.py) against
straight to the engine, both in front of the same latency-bound backend (bench/paced_engine.py:
20 ms a token, at most 64 requests at once, 250 ms for an answer that is not streamed), so that
the 2 cores measure the proxy and not their own contention.

One client code for both paths, only the address differs: http.client keep-alive connections,
HTTPS trusting the appliance CA to Caddy, plain HTTP to the backend (what Caddy itself talks
upstream). Every round opens its connections and sends one request on each before the clock
starts (handshakes and Caddy's upstream connections are not what is measured), and rounds run in
the order direct, proxy, proxy, direct, ... so that drift on the host weighs on both. An answer
that is not whole (not 200, tokens missing, no `[DONE]`) means the figure is not measured.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import http.client
import itertools
import json
import shutil
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from appliance import config
from bench import paced_engine
from bench.common import Figure, measured, percentile
from testkit import caddy
from testkit.standin import free_port

CHAT = "/v1/chat/completions"
LATENCY_GOAL = 1.05  # proxy / direct, at most
THROUGHPUT_GOAL = 0.95  # proxy / direct, at least
STREAMS = 24  # streamed chat completions at once
STREAMS_EACH = 3  # measured per stream and round
CLIENTS = 64  # non-streamed clients at once: the backend's cap
REQUESTS_EACH = 10  # per client and round
ROUNDS = 4  # per path
T = TypeVar("T")


class IncompleteAnswer(RuntimeError):
    """An answer that is not whole: the figure it was for is not measured."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where the clients connect: the backend (no TLS) or the proxy (TLS trusting its CA)."""

    name: str
    port: int
    tls: ssl.SSLContext | None = None

    def connect(self) -> http.client.HTTPConnection:
        if self.tls is None:
            return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        return http.client.HTTPSConnection("127.0.0.1", self.port, timeout=30, context=self.tls)


def _post(conn: http.client.HTTPConnection, stream: bool) -> http.client.HTTPResponse:
    body = {"model": paced_engine.MODEL, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": paced_engine.TOKENS, "stream": stream}
    conn.request("POST", CHAT, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return conn.getresponse()


def stream_once(conn: http.client.HTTPConnection, tokens: int = paced_engine.TOKENS) -> tuple[float, list[float]]:
    """One streamed chat completion on CONN: the time to its first token and the gaps between its
    tokens, in seconds, each taken when the token's `data:` line arrives. Raises IncompleteAnswer
    unless the answer is 200 with TOKENS tokens and `data: [DONE]`."""
    started = time.perf_counter()
    resp = _post(conn, stream=True)
    if resp.status != 200:
        resp.read()
        raise IncompleteAnswer(f"streamed chat: HTTP {resp.status}")
    arrivals: list[float] = []
    done = False
    for line in iter(resp.readline, b""):
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):].strip()
        if data == b"[DONE]":
            done = True
            break
        try:
            content = json.loads(data)["choices"][0]["delta"].get("content")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise IncompleteAnswer(f"streamed chat: not a chunk: {data[:80]!r}") from None
        if content:
            arrivals.append(time.perf_counter())
    resp.read()  # the chunked body's end, so that the connection can be used again
    if not done or len(arrivals) != tokens:
        raise IncompleteAnswer(f"streamed chat: {len(arrivals)} of {tokens} tokens" + ("" if done else ", no [DONE]"))
    return arrivals[0] - started, [b - a for a, b in itertools.pairwise(arrivals)]


def answer_once(conn: http.client.HTTPConnection) -> None:
    """One chat completion, not streamed, on CONN; raises IncompleteAnswer unless it is 200 with a message."""
    resp = _post(conn, stream=False)
    payload = resp.read()
    if resp.status != 200:
        raise IncompleteAnswer(f"chat: HTTP {resp.status}")
    try:
        content = json.loads(payload)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        content = None
    if not content:
        raise IncompleteAnswer(f"chat: no message in {payload[:80]!r}")


def together(n: int, work: Callable[[int, threading.Barrier], T]) -> list[T]:
    """WORK(i, barrier) on N threads at once, each waiting at BARRIER when ready to be timed. The
    first failure is raised (not the broken barrier it leaves the others)."""
    barrier = threading.Barrier(n, timeout=120)

    def guarded(i: int) -> T:
        try:
            return work(i, barrier)
        except BaseException:
            barrier.abort()
            raise

    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(guarded, i) for i in range(n)]
        concurrent.futures.wait(futures)
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])  # type: ignore[misc]
    return [f.result() for f in futures]


def stream_round(endpoint: Endpoint, streams: int = STREAMS, each: int = STREAMS_EACH) -> tuple[list[float], list[float]]:
    """STREAMS clients at once, EACH streamed chat completions apiece: (times to first token, token
    gaps). Their starts are spread over one stream's length, as a server's clients arrive, not all
    in the same millisecond."""
    spread = paced_engine.TOKENS * paced_engine.TOKEN_S / streams

    def client(i: int, barrier: threading.Barrier) -> list[tuple[float, list[float]]]:
        conn = endpoint.connect()
        try:
            stream_once(conn)  # warm: the handshake, the proxy's upstream connection
            barrier.wait()
            time.sleep(i * spread)
            return [stream_once(conn) for _ in range(each)]
        finally:
            conn.close()

    results = [r for per_client in together(streams, client) for r in per_client]
    return [first for first, _ in results], [gap for _, gaps in results for gap in gaps]


def throughput_round(endpoint: Endpoint, clients: int = CLIENTS, each: int = REQUESTS_EACH) -> float:
    """CLIENTS keep-alive clients at once, EACH chat completions apiece, their starts spread over one
    service time (not 64 requests in the same millisecond, every 250 ms): the sum of the clients'
    answers per second, each over its own first to last answer (a fixed count, so that an added
    millisecond shows as one and not as a request cut off at a deadline)."""
    spread = paced_engine.SERVICE_S / clients

    def client(i: int, barrier: threading.Barrier) -> float:
        conn = endpoint.connect()
        try:
            answer_once(conn)
            barrier.wait()
            time.sleep(i * spread)
            started = time.perf_counter()
            for _ in range(each):
                answer_once(conn)
            return each / (time.perf_counter() - started)
        finally:
            conn.close()

    return sum(together(clients, client))


def alternating(rounds: int) -> list[str]:
    """direct, proxy, proxy, direct, ...: ROUNDS of each, so that a drift over the run weighs on both alike."""
    pair = [("direct", "proxy"), ("proxy", "direct")]
    return [name for i in range(rounds) for name in pair[i % 2]]


@contextlib.contextmanager
def paths() -> Iterator[dict[str, Endpoint]]:
    """The paced backend and Caddy in front of it; the two endpoints by name (direct, proxy)."""
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    port = free_port()
    try:
        with paced_engine.running([port], work), caddy.demo_front(port, work) as front:
            tls = ssl.create_default_context(cafile=str(front.ca))
            yield {"direct": Endpoint("direct", port), "proxy": Endpoint("proxy", front.port, tls)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stream_figures(samples: dict[str, tuple[list[float], list[float]]]) -> list[tuple[str, float, float]]:
    """(figure, proxy, direct) in milliseconds: time to first token and token gap, p50 and p99."""
    figures = []
    for kind, index in (("time to first token", 0), ("inter-token gap", 1)):
        for q in (50, 99):
            proxy, direct = (percentile(samples[name][index], q) * 1000 for name in ("proxy", "direct"))
            figures.append((f"{kind} p{q}", proxy, direct))
    return figures


def bench_proxy_stream(demo: config.Config, rounds: int = ROUNDS, streams: int = STREAMS, each: int = STREAMS_EACH) -> list[Figure]:
    samples: dict[str, tuple[list[float], list[float]]] = {"direct": ([], []), "proxy": ([], [])}
    with paths() as endpoints:
        for name in alternating(rounds):
            first, gaps = stream_round(endpoints[name], streams, each)
            samples[name][0].extend(first)
            samples[name][1].extend(gaps)
    n = len(samples["proxy"][0])
    note = f"{n} streams of {paced_engine.TOKENS} tokens each way, {streams} at once, {paced_engine.TOKEN_S * 1000:.0f} ms a token"
    return [measured(f"proxy stream, {figure} (vs direct)", proxy, direct, "ms", at_most=LATENCY_GOAL, note=note)
            for figure, proxy, direct in stream_figures(samples)]


def bench_proxy_rps(demo: config.Config, rounds: int = ROUNDS, clients: int = CLIENTS, each: int = REQUESTS_EACH) -> list[Figure]:
    rates: dict[str, list[float]] = {"direct": [], "proxy": []}
    with paths() as endpoints:
        for name in alternating(rounds):
            rates[name].append(throughput_round(endpoints[name], clients, each))
    # the mean of the rounds: each ran the same count of answers
    proxy, direct = (sum(rates[name]) / len(rates[name]) for name in ("proxy", "direct"))
    return [measured(f"proxy, answers/s from {clients} clients (vs direct)", proxy, direct, "req/s", at_least=THROUGHPUT_GOAL,
                     note=f"backend cap {paced_engine.CONCURRENCY} at once, {paced_engine.SERVICE_S * 1000:.0f} ms an answer")]
