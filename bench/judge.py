# SPDX-License-Identifier: MIT
"""`make bench`, the progress judge (applianctl/judge/): how soon a deadlocked replica is taken out,
what the judge costs the proxy, and how many canaries it sends.

The judge runs as a process of its own, as appliance-judge.service runs it on the device
(`python -m bench.judge`, `main` below): the daemon's own rounds and endpoints (daemon.Judge,
daemon.run_forever) with a fake systemd in place of the bus (`FakeSystemd`, as
tests/test_judge_service.py fakes it): every replica's unit is active, and a restart clears that
replica's faults (its stand-in's faults file) and reports a new start at once, as a replica
restarted healthy would. The bench's bounds are short (`BOUNDS`: a round every second, stalled
after 10 s without a token), the production defaults being minutes.

- `bench_judge_removal`: two stand-ins (standin/, real processes) under a steady load of
  non-streamed chat completions; replica 1's engine core deadlocked at run time (its faults file:
  /health, /metrics 200, completions held, the token counters frozen); the time from the switch to
  the judge's agent answering "down" for it (what takes it out of HAProxy), against the configured
  bound stall_after_s. Several trials, the deadlock at a different phase of the judge's rounds each
  time; the worst one is the figure. A trial in which the judge takes out the live replica is no
  figure.
- `bench_judge_rps`: answers per second through the real Caddy on the rendered Caddyfile, in front
  of the paced backend (bench/paced_engine.py) alone (bench/proxy.py's set-up) and through the real
  HAProxy across two paced replicas (bench/replicas.py's), with the judge running (its /health
  behind Caddy's, its agent asked by HAProxy every 500 ms, each replica's /metrics read every round)
  against the same proxies with no judge (its ports closed: no opinion for HAProxy). Rounds
  alternate without, with, with, without, ...; the judge is started for each round with it and
  must judge every replica alive at its end.
- `bench_judge_canaries`: the canaries the judge sent (JudgeState.canaries_last_hour, from its
  state file, at the start and end of a window) to two idle stand-ins, then to the same under a
  steady load, extrapolated to an hour. No goal: an idle appliance gets about 3600 /
  canary_after_s an hour per replica (the idle figure's baseline), a busy one none (the busy
  figure's baseline is the idle rate).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from appliance import config, paths
from appliance.config.model import Progress
from appliance.schema import load_record
from applianctl.judge.daemon import UnitState
from applianctl.records import JudgeState
from bench import paced_engine, proxy, replicas
from bench.common import ROOT, Figure, measured
from testkit import caddy
from testkit.standin import FAULTS_NOW, StandinProcess, free_port, free_spaced_ports, write_faults

BOUNDS = Progress(interval_s=1, stall_after_s=10, canary_after_s=5, canary_timeout_s=2)
REMOVAL_GOAL = 1.0  # deadlock to removal / stall_after_s, at most
RPS_GOAL = 0.98  # with the judge / without, at least
TRIALS = 3  # deadlocks, each at another phase of the judge's rounds
LOAD_CLIENTS = 4  # keep-alive clients a stand-in, one request at a time each
LOAD_TOKENS = 16  # tokens an answer
TOKEN_S = "0.02"  # the stand-ins' delay between tokens (STANDIN_TOKEN_SECONDS): sleeping, not the cores
WARM_S = 2.0  # tokens flowing on both replicas before a deadlock
WINDOW_S = 60.0  # each canary window
ROUNDS = 4  # per side, with the judge and without
POLL_S = 0.1  # how often the agent is asked during a trial: the figure's resolution
STARTED = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)


# ---------------------------------------------------------------------------------- the judge's process


class FakeSystemd:
    """The judge's Units (daemon.Units) without systemd: every unit active; a restart of replica I's
    unit clears FAULTS[I] (a stand-in's faults file: `{}`) and is a new start at once."""

    def __init__(self, names: Sequence[str], faults: dict[int, Path], log: Callable[[str], None]) -> None:
        self.names = list(names)
        self.faults = faults
        self.log = log
        self.starts = dict.fromkeys(self.names, 0)

    def states(self, names: Sequence[str]) -> dict[str, UnitState]:
        return {n: UnitState("active", "running", (STARTED + datetime.timedelta(seconds=self.starts[n])).isoformat())
                for n in names}

    def restart(self, name: str) -> None:
        index = self.names.index(name)
        if index in self.faults:
            write_faults(self.faults[index], {})
        self.starts[name] += 1
        self.log(f"fake systemd: restarted {name}")

    def stop(self, name: str) -> None:
        self.log(f"fake systemd: stopped {name} (not done)")


def judge_config(urls: Sequence[str], bounds: Progress) -> config.Config:
    """The demo profile with one replica per URL and BOUNDS as engine.progress."""
    demo = config.load(ROOT / "appliance.toml", "demo")
    return dataclasses.replace(
        demo, topology=dataclasses.replace(demo.topology, gpus=len(urls), layout=f"{len(urls)}x1"),
        engine=dataclasses.replace(demo.engine, progress=bounds))


def main(argv: Sequence[str]) -> int:
    """`python -m bench.judge`: the judge's rounds and endpoints with a fake systemd, until SIGTERM."""
    from applianctl.judge import daemon

    p = argparse.ArgumentParser(prog="python -m bench.judge")
    p.add_argument("urls", nargs="+", help="each replica's base URL, in order")
    p.add_argument("--health", required=True, metavar="HOST:PORT")
    p.add_argument("--agent", required=True, metavar="HOST:PORT")
    p.add_argument("--state", required=True, type=Path, help="where each round's JudgeState is written")
    p.add_argument("--bounds", required=True, help="interval_s,stall_after_s,canary_after_s,canary_timeout_s")
    p.add_argument("--faults", action="append", default=[], metavar="I=PATH", help="replica I's faults file, cleared at its restart")
    args = p.parse_args(argv)
    bounds = Progress(*(int(v) for v in args.bounds.split(",")))
    faults = {int(i): Path(path) for i, _, path in (f.partition("=") for f in args.faults)}

    def log(line: str) -> None:
        print(line, flush=True)

    c = judge_config(args.urls, bounds)
    units = FakeSystemd([paths.engine_unit(i) for i in range(len(args.urls))], faults, log)
    judge = daemon.Judge(c, args.urls, units=units, state_path=args.state, log=log)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    daemon.run_forever(judge, args.health, args.agent, stop)
    return 0


@dataclasses.dataclass(frozen=True)
class JudgeProcess:
    proc: subprocess.Popen[bytes]
    health: int
    agent: int
    state: Path
    log: Path

    def said(self, text: str) -> bool:
        return text in self.log.read_text(errors="replace")


@contextlib.contextmanager
def judge_running(urls: Sequence[str], work: Path, bounds: Progress = BOUNDS, *, faults: dict[int, Path] | None = None,
                  health: int = 0, agent: int = 0) -> Iterator[JudgeProcess]:
    """The judge of the replicas at URLS as its own process until the block ends; ready once it has
    judged every replica alive (its agent answers "up" for each)."""
    health, agent = health or free_port(), agent or free_port()
    work.mkdir(parents=True, exist_ok=True)
    state, log = work / "judge.json", work / "judge.log"
    values = ",".join(str(getattr(bounds, f.name)) for f in dataclasses.fields(Progress))
    argv = [sys.executable, "-m", "bench.judge", *urls, "--health", f"127.0.0.1:{health}", "--agent", f"127.0.0.1:{agent}",
            "--state", str(state), "--bounds", values, *(f"--faults={i}={p}" for i, p in (faults or {}).items())]
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=out, stderr=subprocess.STDOUT)
    try:
        caddy.wait_ready("the judge", lambda: all(agent_says(agent, i) == "up" for i in range(len(urls))), proc, log, timeout=30)
        yield JudgeProcess(proc, health, agent, state, log)
    finally:
        caddy.stop(proc)


def agent_says(port: int, replica: int) -> str:
    """The judge's agent's answer for REPLICA, as HAProxy asks it ("up", "down #why")."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(f"replica{replica}\n".encode())
        data = b""
        while chunk := s.recv(1024):
            data += chunk
    return data.decode(errors="replace").strip()


def wait_until(what: str, holds: Callable[[], bool], timeout: float) -> float:
    """The moment (time.monotonic) HOLDS first held, asked every POLL_S; TimeoutError after TIMEOUT."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            if holds():
                return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(POLL_S)


def canaries(state: Path) -> int:
    """The canaries the judge sent in the last hour, from its last round's record."""
    record = load_record(JudgeState, state, lenient=True)
    if record is None:
        raise RuntimeError(f"{state}: no record of the judge's rounds")
    return record.canaries_last_hour


# ---------------------------------------------------------------------------------- stand-ins and their load


@contextlib.contextmanager
def stand_ins(count: int, work: Path) -> Iterator[list[StandinProcess]]:
    """COUNT stand-ins serving the demo's model, each with a faults file of its own, ready."""
    model = config.load(ROOT / "appliance.toml", "demo").served_model
    engines: list[StandinProcess] = []
    try:
        for i in range(count):
            engines.append(StandinProcess(["--served-model-name", model], env={"STANDIN_TOKEN_SECONDS": TOKEN_S},
                                          faults_file=work / f"faults-{i}.json"))
        for engine in engines:
            engine.wait_ready(60)
        yield engines
    finally:
        for engine in engines:
            engine.stop()


@dataclasses.dataclass
class Load:
    answered: int = 0
    failed: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def steady_load(urls: Sequence[str], clients: int) -> Iterator[dict[str, Load]]:
    """CLIENTS keep-alive clients a URL, each sending non-streamed chat completions one after
    another until the block ends; what each URL's clients got."""
    model = config.load(ROOT / "appliance.toml", "demo").served_model
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Count to ten."}],
                       "max_tokens": LOAD_TOKENS}).encode()
    stop = threading.Event()
    loads = {url: Load() for url in urls}
    lock = threading.Lock()

    def client(url: str) -> None:
        port = int(url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        while not stop.is_set():
            try:
                conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                ok, why = response.status == 200, f"HTTP {response.status}"
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                ok, why = False, type(e).__name__
            with lock:
                if ok:
                    loads[url].answered += 1
                else:
                    loads[url].failed += 1
                    loads[url].errors.append(why)
            if not ok:
                time.sleep(0.2)
        conn.close()

    threads = [threading.Thread(target=client, args=(url,), daemon=True) for url in urls for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        yield loads
    finally:
        stop.set()
        for t in threads:
            t.join(30)


def _work(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


# ---------------------------------------------------------------------------------- the figures


def bench_judge_removal(demo: config.Config, trials: int = TRIALS, clients: int = LOAD_CLIENTS,
                        bounds: Progress = BOUNDS) -> list[Figure]:
    work = _work("bench-judge-removal-")
    took: list[float] = []
    try:
        with stand_ins(2, work) as (live, stuck):
            urls = [live.url, stuck.url]
            assert stuck.faults_file is not None
            with judge_running(urls, work / "judge", bounds, faults={1: stuck.faults_file}) as judge, \
                    steady_load(urls, clients) as loads:
                for trial in range(trials):
                    wait_until("replica 1 alive by the judge", lambda: agent_says(judge.agent, 1) == "up", 60)
                    # the deadlock at another phase of the judge's rounds each trial
                    time.sleep(WARM_S + trial * bounds.interval_s / trials)
                    cleared = stuck.count_lines(FAULTS_NOW) + 2  # the deadlock's line, then the restart's
                    started = time.monotonic()
                    stuck.switch_faults({"deadlock_after_s": 0})
                    removed = wait_until("the deadlocked replica taken out", lambda: agent_says(judge.agent, 1).startswith("down"),
                                         3 * bounds.stall_after_s + 30)
                    took.append(removed - started)
                    stuck.wait_for_count(FAULTS_NOW, cleared, 60)  # the fake restart cleared it
                if agent_says(judge.agent, 0) != "up" or judge.said("replica 0 stalled"):
                    raise RuntimeError(f"the judge took out the live replica: {judge.log.read_text(errors='replace')[-500:]}")
                if judge.log.read_text(errors="replace").count("replica 1 stalled: ") != trials:
                    raise RuntimeError(f"replica 1 not judged stalled once a trial: {judge.log.read_text(errors='replace')[-500:]}")
        live_load = loads[live.url]
        if live_load.answered == 0 or live_load.failed:
            raise RuntimeError(f"the live replica's load: {live_load.answered} answered, {live_load.failed} failed "
                               f"({', '.join(sorted(set(live_load.errors)))})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    note = (f"round every {bounds.interval_s} s; {clients} clients a replica; each trial "
            + ", ".join(f"{t:.1f}" for t in took) + " s")
    return [measured(f"judge, deadlock to removal, worst of {trials} (vs stall_after_s)", max(took), bounds.stall_after_s, "s",
                     at_most=REMOVAL_GOAL, note=note)]


@contextlib.contextmanager
def _front(replica_count: int, work: Path, health: int, agent: int) -> Iterator[tuple[list[int], proxy.Endpoint]]:
    """Caddy alone in front of one paced backend (bench/proxy.py's), or Caddy and HAProxy in front
    of two capped ones (bench/replicas.py's); the judge's ports HEALTH and AGENT."""
    if replica_count == 1:
        ports, cap, service = [free_port()], paced_engine.CONCURRENCY, paced_engine.SERVICE_S
    else:
        ports, cap, service = free_spaced_ports(replica_count + 1)[:replica_count], replicas.CAP, replicas.SERVICE_S
    with paced_engine.running(ports, work, cap, service), \
            caddy.demo_front(ports[0], work / "front", replicas=replica_count, judge_health=f"127.0.0.1:{health}",
                             judge_agent=f"127.0.0.1:{agent}") as front:
        yield ports, proxy.Endpoint("proxy", front.port, ssl.create_default_context(cafile=str(front.ca)))


def judged_rates(replica_count: int, work: Path, rounds: int, clients: int, each: int, bounds: Progress) -> dict[str, list[float]]:
    """Answers per second through the proxy of REPLICA_COUNT replicas, each round without the judge
    or with it (alternated): the rates by side ("without", "with")."""
    from applianctl.judge import canary

    health, agent = free_port(), free_port()
    rates: dict[str, list[float]] = {"without": [], "with": []}
    work.mkdir(parents=True, exist_ok=True)
    with _front(replica_count, work, health, agent) as (ports, endpoint):
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls:
            canary.scrape(url)  # the judge can read the backend's counters (ScrapeFailed: no figure)
        for i in range(rounds):
            for side in (("without", "with"), ("with", "without"))[i % 2]:
                if side == "without":
                    rates[side].append(proxy.throughput_round(endpoint, clients, each))
                    continue
                with judge_running(urls, work / f"judge-{replica_count}", bounds, health=health, agent=agent) as judge:
                    rates[side].append(proxy.throughput_round(endpoint, clients, each))
                    if any(agent_says(agent, r) != "up" for r in range(replica_count)) or judge.said("stalled"):
                        raise RuntimeError(f"the judge took out a replica: {judge.log.read_text(errors='replace')[-500:]}")
    return rates


def bench_judge_rps(demo: config.Config, rounds: int = ROUNDS, clients: tuple[int, int] = (proxy.CLIENTS, replicas.CLIENTS),
                    each: tuple[int, int] = (proxy.REQUESTS_EACH, replicas.REQUESTS_EACH), bounds: Progress = BOUNDS) -> list[Figure]:
    figures = []
    work = _work("bench-judge-rps-")
    try:
        for replica_count, n, per in ((1, clients[0], each[0]), (2, clients[1], each[1])):
            rates = judged_rates(replica_count, work / f"{replica_count}", rounds, n, per, bounds)
            with_judge, without = (sum(rates[side]) / len(rates[side]) for side in ("with", "without"))
            layout = "Caddy" if replica_count == 1 else "Caddy and HAProxy, 2 replicas"
            figures.append(measured(f"proxy with the judge, answers/s, {layout} (vs without)", with_judge, without, "req/s",
                                    at_least=RPS_GOAL,
                                    note=f"{n} clients; the judge's round every {bounds.interval_s} s"
                                         + ("; HAProxy asks its agent every 500 ms a replica" if replica_count > 1 else "")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return figures


def bench_judge_canaries(demo: config.Config, window_s: float = WINDOW_S, clients: int = LOAD_CLIENTS,
                         bounds: Progress = BOUNDS) -> list[Figure]:
    work = _work("bench-judge-canaries-")
    try:
        with stand_ins(2, work) as engines:
            urls = [e.url for e in engines]
            with judge_running(urls, work / "judge", bounds) as judge:
                time.sleep(bounds.canary_after_s + 2 * bounds.interval_s)  # past the first canaries' wait
                before = canaries(judge.state)
                time.sleep(window_s)
                idle = canaries(judge.state) - before
                with steady_load(urls, clients) as loads:
                    time.sleep(2 * bounds.interval_s)  # the counters moving in the judge's eyes
                    before = canaries(judge.state)
                    time.sleep(window_s)
                    busy = canaries(judge.state) - before
                if judge.said("stalled"):
                    raise RuntimeError(f"the judge took out a replica: {judge.log.read_text(errors='replace')[-500:]}")
        if any(load.answered == 0 or load.failed for load in loads.values()):
            raise RuntimeError("the load: " + "; ".join(f"{load.answered} answered, {load.failed} failed" for load in loads.values()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    hour = 3600 / window_s
    idle_h, busy_h = idle * hour, busy * hour
    expected = len(urls) * 3600 / bounds.canary_after_s
    note = f"{len(urls)} replicas, canary_after_s {bounds.canary_after_s}, a {window_s:g} s window"
    return [measured("judge canaries an hour, idle (vs 3600 / canary_after_s a replica)", idle_h, expected, "req/h",
                     note=f"{note}: {idle} canaries"),
            measured("judge canaries an hour, busy (vs idle)", busy_h, idle_h, "req/h",
                     note=f"{note}: {busy} canaries; {clients} clients a replica")]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
