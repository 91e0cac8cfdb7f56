# SPDX-License-Identifier: MIT
"""`make bench`, replicas: answers per second through the real Caddy on the rendered
Caddyfile with two replicas (layout 2x1: least outstanding requests across both) against the same
proxy with one. Each replica is the latency-bound paced backend (bench/paced_engine.py) with its
concurrency capped at CAP and SERVICE_S an answer, so one replica serves at most CAP / SERVICE_S
answers a second whatever the host's 2 cores do, and CLIENTS keep the replicas' caps full. The
same clients, the same proxy configuration but for the upstreams; rounds alternate one, two, two,
one, ... so that drift weighs on both.
"""

from __future__ import annotations

import contextlib
import shutil
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

from appliance import config
from bench import paced_engine
from bench.common import Figure, measured
from bench.proxy import Endpoint, throughput_round
from testkit import caddy
from testkit.standin import free_spaced_ports

GOAL = 1.8  # two replicas / one, at least
CAP = 8  # requests at once per replica (an engine's batch)
SERVICE_S = 0.1  # one answer
CLIENTS = 32  # keep-alive clients: twice two replicas' caps
REQUESTS_EACH = 8  # per client and round
ROUNDS = 3  # per layout


@contextlib.contextmanager
def fronts() -> Iterator[dict[str, Endpoint]]:
    """Two paced replicas; Caddy with layout 1x1 (the first only) and Caddy with layout 2x1 (both,
    through the balancer at the port after them)."""
    work = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    ports = free_spaced_ports(3)[:2]
    try:
        with paced_engine.running(ports, work, CAP, SERVICE_S), \
                caddy.demo_front(ports[0], work / "one", replicas=1) as one, \
                caddy.demo_front(ports[0], work / "two", replicas=2) as two:
            yield {"one": Endpoint("one", one.port, ssl.create_default_context(cafile=str(one.ca))),
                   "two": Endpoint("two", two.port, ssl.create_default_context(cafile=str(two.ca)))}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_replicas_rps(demo: config.Config, rounds: int = ROUNDS, clients: int = CLIENTS, each: int = REQUESTS_EACH) -> list[Figure]:
    rates: dict[str, list[float]] = {"one": [], "two": []}
    with fronts() as endpoints:
        for i in range(rounds):
            for name in (("one", "two"), ("two", "one"))[i % 2]:
                rates[name].append(throughput_round(endpoints[name], clients, each))
    two, one = (sum(rates[name]) / len(rates[name]) for name in ("two", "one"))
    return [measured(f"proxy, 2 replicas vs 1, answers/s ({clients} clients)", two, one, "req/s", at_least=GOAL,
                     note=f"each replica at most {CAP} at once, {SERVICE_S * 1000:.0f} ms an answer: "
                          f"at most {CAP / SERVICE_S:.0f} req/s each")]
