# SPDX-License-Identifier: MIT
"""An appliance's serving path on loopback for the host tests, no QEMU: stand-in engines as real
processes, each run by a fake systemd that kills and restarts it as the judge asks; the judge
itself (applianctl/judge/daemon.py) going round for real with both its endpoints; the real Caddy
(and with several replicas the real HAProxy) on the rendered configuration in front (testkit/caddy.py);
and a steady client load that records when each request was sent and how it ended.

The fake systemd keeps a replica's unit "activating" until its stand-in has answered a one-token
warm-up completion, as the engine quadlet's HealthStartupCmd does: a stand-in restarted into a
deadlock (its faults file still says so) never becomes active, as a real engine would not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import requests

import appliance.config
from appliance.config.model import Progress
from applianctl.judge import daemon
from applianctl.judge.daemon import Judge, UnitState
from testkit import caddy
from testkit.standin import ROOT, StandinProcess, free_port, free_spaced_ports, write_faults

CHAT = "/v1/chat/completions"
# short bounds for a test: a round a second, stalled after 8 s without a token with requests waiting
BOUNDS = Progress(interval_s=1, stall_after_s=8, canary_after_s=4, canary_timeout_s=2)
# how late the judge may see a stall: its bound, two rounds, and room for a slow, shared machine
DETECT_SLACK_S = 2 * BOUNDS.interval_s + 6
WARMUP_TIMEOUT_S = 3.0
# A restarted engine keeps its port closed while it loads, as vLLM does for minutes: a request the
# balancer retries meanwhile is refused again, never accepted by an engine that is not warmed up.
RESTART_LOAD_S = 6
_STARTS = itertools.count(1)


def layout(replicas: int, engine_port: int) -> appliance.config.Config:
    """The demo profile with REPLICAS replicas from ENGINE_PORT and the test's judge bounds (what
    testkit.caddy.demo_front renders the proxies from, with the same ports)."""
    demo = appliance.config.load(ROOT / "appliance.toml", "demo")
    return dataclasses.replace(
        demo,
        topology=dataclasses.replace(demo.topology, gpus=replicas, layout=f"{replicas}x1"),
        engine=dataclasses.replace(demo.engine, port=engine_port, progress=BOUNDS),
    )


# ------------------------------------------------------------------------------ the fake systemd


class Engines:
    """The replicas' units (judge.daemon.Units) as a fake systemd runs them: replica I a stand-in on
    PORTS[I] with the faults file FAULTS_DIR/faults-I.json; restart() SIGKILLs its process and starts
    another on the same port and faults file."""

    def __init__(self, ports: list[int], faults_dir: Path, model: str) -> None:
        self.ports, self.model = ports, model
        self.faults = [faults_dir / f"faults-{i}.json" for i in range(len(ports))]
        self.names = [f"appliance-engine@{i}.service" for i in range(len(ports))]
        self._lock = threading.Lock()
        self._procs: dict[str, StandinProcess] = {}
        self._unit: dict[str, UnitState] = {}
        self.actions: list[tuple[float, str, str]] = []
        self._closed = threading.Event()
        for path in self.faults:
            write_faults(path, {})
        for name in self.names:
            self._start(name, load_s=0)

    def proc(self, i: int) -> StandinProcess:
        with self._lock:
            return self._procs[self.names[i]]

    def _start(self, name: str, load_s: float) -> None:
        i = self.names.index(name)
        proc = StandinProcess(["--served-model-name", self.model], env={"STANDIN_LOAD_SECONDS": str(load_s)},
                              port=self.ports[i], faults_file=self.faults[i])
        with self._lock:
            self._procs[name] = proc
            self._unit[name] = UnitState("activating", "start")
        threading.Thread(target=self._warm, args=(name, proc), daemon=True).start()

    def _warm(self, name: str, proc: StandinProcess) -> None:
        """Active once PROC has answered a warm-up completion (HealthStartupCmd's), polled until then."""
        with contextlib.suppress(TimeoutError):
            proc.wait_ready(60)
        body = {"model": self.model, "prompt": "warm-up", "max_tokens": 1}
        while not self._closed.is_set() and proc.proc.poll() is None:
            try:
                r = requests.post(f"{proc.url}/v1/completions", json=body, timeout=WARMUP_TIMEOUT_S)
                if r.status_code == 200:
                    with self._lock:
                        if self._procs.get(name) is proc:
                            started = datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")
                            self._unit[name] = UnitState("active", "running", f"{started}#{next(_STARTS)}")
                    return
            except requests.RequestException:
                pass
            self._closed.wait(0.5)

    def wait_active(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(u.active == "active" for u in self._unit.values()):
                    return
            time.sleep(0.1)
        raise TimeoutError(f"the replicas did not warm up: {self._unit}")

    # judge.daemon.Units

    def states(self, names: Any) -> dict[str, UnitState]:
        with self._lock:
            return {n: self._unit.get(n, UnitState("inactive", "dead")) for n in names}

    def restart(self, name: str) -> None:
        with self._lock:
            old = self._procs[name]
            self.actions.append((time.monotonic(), "restart", name))
            self._unit[name] = UnitState("activating", "start-pre")
        old.stop(signal.SIGKILL)  # systemctl kill --signal=SIGKILL, then a restart job
        self._start(name, load_s=RESTART_LOAD_S)

    def stop(self, name: str) -> None:
        with self._lock:
            proc = self._procs[name]
            self.actions.append((time.monotonic(), "stop", name))
            self._unit[name] = UnitState("inactive", "dead")
        proc.stop()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            proc.stop(signal.SIGKILL)

    # faults

    def deadlock(self, i: int) -> float:
        """Replica I's engine core deadlocks now (standin/faults.py); when it took effect."""
        self.proc(i).switch_faults({"deadlock_after_s": 0})
        return time.monotonic()

    def recover(self, i: int) -> None:
        """Replica I's faults cleared: its process (and any it is restarted into) serves again."""
        write_faults(self.faults[i], {})


# ------------------------------------------------------------------------------ the judge


class RunningJudge:
    """daemon.run_forever on loopback ports of its own, in a thread; its journal lines with the
    moment each was written."""

    def __init__(self, config: appliance.config.Config, engines: Engines) -> None:
        self.lines: list[tuple[float, str]] = []
        self.health, self.agent = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        urls = [f"http://127.0.0.1:{p}" for p in engines.ports]
        self.judge = Judge(config, urls, units=engines, log=lambda line: self.lines.append((time.monotonic(), line)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=daemon.run_forever, args=(self.judge, self.health, self.agent, self._stop),
                                        daemon=True)
        self._thread.start()

    def stalled_at(self, replica: int) -> float | None:
        """When the judge first said REPLICA stalled."""
        return next((t for t, line in self.lines if line.startswith(f"replica {replica} stalled: ")), None)

    def wait_stalled(self, replica: int, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while (at := self.stalled_at(replica)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if at is None:
            raise AssertionError(f"the judge did not see replica {replica} stall within {timeout:.0f} s: {self.lines}")
        return at

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)


# ------------------------------------------------------------------------------ the appliance


@dataclasses.dataclass
class Appliance:
    config: appliance.config.Config
    engines: Engines
    judge: RunningJudge
    front: caddy.Front
    work: Path

    def health(self) -> tuple[int, dict[str, Any]]:
        """The proxy's own GET /health, as a client (or a router) sees it."""
        r = requests.get(f"{self.front.url}/health", verify=str(self.front.ca), timeout=10)
        try:
            body = r.json()
        except ValueError:
            body = {"not json": r.text[:200]}
        return r.status_code, body if isinstance(body, dict) else {"not an object": body}

    def wait_health(self, status: int, timeout: float) -> tuple[float, dict[str, Any]]:
        """Until the proxy's /health answers STATUS; when, and its body."""
        deadline = time.monotonic() + timeout
        seen: tuple[int, dict[str, Any]] | None = None
        while time.monotonic() < deadline:
            with contextlib.suppress(requests.RequestException, ValueError):
                seen = self.health()
                if seen[0] == status:
                    return time.monotonic(), seen[1]
            time.sleep(0.2)
        raise AssertionError(f"the proxy's /health did not turn {status} within {timeout:.0f} s: last {seen}; "
                             f"judge: {self.judge.lines}")


@contextlib.contextmanager
def running_appliance(work: Path, replicas: int) -> Iterator[Appliance]:
    """One appliance on loopback, every replica warmed up and judged alive, /health 200."""
    work.mkdir(parents=True, exist_ok=True)
    ports = free_spaced_ports(replicas + 1)[:replicas]  # and the balancer's, the port after them
    config = layout(replicas, ports[0])
    with contextlib.ExitStack() as stack:
        engines = Engines(ports, work, config.served_model)
        stack.callback(engines.close)
        engines.wait_active()
        judge = RunningJudge(config, engines)
        stack.callback(judge.close)
        front = stack.enter_context(caddy.demo_front(ports[0], work / "front", replicas=replicas,
                                                     judge_health=judge.health, judge_agent=judge.agent))
        stand = Appliance(config, engines, judge, front, work)
        stand.wait_health(200, 30)
        yield stand


# ------------------------------------------------------------------------------ the client load


@dataclasses.dataclass(frozen=True)
class Sent:
    sent: float
    ended: float
    ok: bool
    what: str  # the status, or the exception, when not ok


class Load:
    """THREADS clients, each sending one chat completion after the other to URL (through its own
    kept-alive connection), until stopped; every request recorded."""

    def __init__(self, url: str, model: str, *, verify: str | bool = True, threads: int = 8, timeout: float = 90) -> None:
        self.url, self.verify, self.timeout = url + CHAT, verify, timeout
        self.body = {"model": model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8}
        self.sent: list[Sent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def _client(self) -> None:
        session = requests.Session()
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                r = session.post(self.url, json=self.body, verify=self.verify, timeout=(5, self.timeout))
                ok = r.status_code == 200 and bool(r.json().get("choices"))
                what = "" if ok else f"HTTP {r.status_code}: {r.text[:200]}"
            except (requests.RequestException, ValueError) as e:
                ok, what = False, f"{type(e).__name__}: {e}"[:300]
            with self._lock:
                self.sent.append(Sent(sent, time.monotonic(), ok, what))
            if not ok:
                self._stop.wait(0.2)  # no storm of refusals while nothing serves
        session.close()

    def since(self, moment: float) -> list[Sent]:
        with self._lock:
            return [s for s in self.sent if s.sent >= moment]

    def answered_since(self, moment: float) -> int:
        return sum(s.ok for s in self.since(moment))

    def wait_answered(self, count: int, moment: float, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.answered_since(moment) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        with self._lock:
            last = self.sent[-10:]
        assert self.answered_since(moment) >= count, (f"{self.answered_since(moment)} of {count} answered since "
                                                      f"{moment:.1f} (now {time.monotonic():.1f}); the last: {last}")

    def stop(self) -> list[Sent]:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 10)
        with self._lock:
            return list(self.sent)


def failures(sent: list[Sent]) -> list[str]:
    return [json.dumps(dataclasses.asdict(s)) for s in sent if not s.ok]
