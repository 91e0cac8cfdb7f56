# SPDX-License-Identifier: MIT
"""The judge as a service: its endpoints on real loopback sockets, its rounds and actions against a
fake systemd, and one replica that deadlocks (a tiny engine in the test, and the stand-in)."""

from __future__ import annotations

import dataclasses
import datetime
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from appliance import config
from appliance.config.model import Progress
from appliance.schema import load_record
from applianctl.judge import daemon, endpoints, hive
from applianctl.judge.daemon import Judge, UnitState
from applianctl.judge.progress import CanaryResult, Scrape
from applianctl.records import JudgeState, ReplicaJudgement

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def demo(**progress: int) -> config.Config:
    c = config.load(ROOT / "appliance.toml", "demo")
    assert c.replicas == 2
    # the production bounds (the demo profile's are shorter for QEMU), unless a test says otherwise
    return dataclasses.replace(c, engine=dataclasses.replace(c.engine, progress=Progress(**progress)))


# ------------------------------------------------------------------------------------ endpoints


def _state(*states: tuple[str, str], hive_line: str = "") -> JudgeState:
    replicas = tuple(ReplicaJudgement(replica=i, state=s, reason=r, since="2030-01-01T00:00:00+00:00")
                     for i, (s, r) in enumerate(states))
    return JudgeState(checked_at="2030-01-01T00:00:00+00:00", replicas=replicas, canaries_last_hour=0,
                      alive=sum(s == "alive" for s, _ in states), hive=hive_line)


class FixedSource:
    def __init__(self, state: JudgeState | None, at: float | None) -> None:
        self.state, self.at = state, at

    def snapshot(self) -> tuple[JudgeState | None, float | None]:
        return self.state, self.at


@pytest.fixture
def served() -> Iterator[tuple[FixedSource, str, str]]:
    source = FixedSource(None, None)
    health, agent = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    servers = endpoints.serve(source, health, agent, stale_after_s=60)
    try:
        yield source, health, agent
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def _get(address: str, path: str = "/health", method: str = "GET") -> tuple[int, str, dict[str, Any] | None]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        raw = r.read()
        return r.status, r.getheader("Content-Type") or "", json.loads(raw) if raw else None
    finally:
        conn.close()


def _agent(address: str, sent: bytes) -> str:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(sent)
        data = b""
        while chunk := s.recv(1024):
            data += chunk
    return data.decode()


def test_health_is_200_while_a_replica_is_alive(served: tuple[FixedSource, str, str]) -> None:
    source, health, _ = served
    source.state, source.at = _state(("alive", ""), ("stalled", "stalled: no tokens for 185 s with 12 requests waiting")), time.monotonic()
    assert _get(health) == (200, "application/json", {"status": "ok", "alive": 1, "replicas": 2})
    assert _get(health, method="HEAD")[0] == 200


def test_health_is_503_with_an_openai_shaped_reason_when_none_is(served: tuple[FixedSource, str, str]) -> None:
    source, health, _ = served
    assert _get(health)[0] == 503  # before the first round
    source.state, source.at = _state(("stalled", "stalled: no tokens for 185 s with 12 requests waiting"),
                                     ("starting", "its unit is starting (start)")), time.monotonic()
    status, kind, body = _get(health)
    assert (status, kind) == (503, "application/json")
    assert body == {"error": {"message": "no engine replica is alive: replica 0 stalled: no tokens for 185 s with 12 requests "
                                         "waiting; replica 1 starting (its unit is starting (start))",
                              "type": "service_unavailable_error", "param": None, "code": 503}}
    source.state = _state(("held", "needs physical action: GPU 0000:0c:00.0 faulted 3 times"), ("held", ""),
                          hive_line="needs physical action: GPU 0000:0c:00.0 faulted 3 times")
    assert _get(health)[2]["error"]["message"] == "needs physical action: GPU 0000:0c:00.0 faulted 3 times"  # type: ignore[index]
    # a judge that stopped going round is not believed
    source.state, source.at = _state(("alive", ""), ("alive", "")), time.monotonic() - 61
    status, _, body = _get(health)
    assert status == 503 and "last round is 61 s old" in body["error"]["message"]  # type: ignore[index]
    assert _get(health, "/v1/models")[0] == 404


def test_the_agent_answers_up_or_down_for_the_replica_named(served: tuple[FixedSource, str, str]) -> None:
    source, _, agent = served
    assert _agent(agent, b"replica1\n") == "down #the judge has not judged the replicas yet\n"
    source.state, source.at = _state(("alive", ""), ("stalled", "stalled: canary timed out after 30 s")), time.monotonic()
    assert _agent(agent, b"replica0\n") == "up\n"
    assert _agent(agent, b"replica1\n") == "down #stalled: canary timed out after 30 s\n"
    assert _agent(agent, b"1\n") == "down #stalled: canary timed out after 30 s\n"
    assert _agent(agent, b"replica7\n") == "down #no replica 7 on this appliance\n"
    assert _agent(agent, b"bogus\n").startswith("down #no replica named")


# ------------------------------------------------------------------------------------ rounds, with a fake systemd


class FakeUnits:
    def __init__(self, names: list[str]) -> None:
        self.unit = {n: UnitState("active", "running", "2030-01-01T00:00:00+00:00") for n in names}
        self.actions: list[tuple[str, str]] = []
        self.seen_at_restart: list[JudgeState | None] = []
        self.judge: Judge | None = None

    def states(self, names: list[str]) -> dict[str, UnitState]:
        return {n: self.unit[n] for n in names}

    def restart(self, name: str) -> None:
        self.actions.append(("restart", name))
        if self.judge is not None:
            self.seen_at_restart.append(self.judge.snapshot()[0])
        self.unit[name] = UnitState("activating", "start-pre", None)

    def stop(self, name: str) -> None:
        self.actions.append(("stop", name))
        self.unit[name] = UnitState("deactivating", "stop")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> datetime.datetime:
        return datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(seconds=self.now)


def _judge(tmp_path: Path, scrapes: dict[str, Any], **kw: Any) -> tuple[Judge, FakeUnits, Clock, list[str]]:
    c = demo()
    units = FakeUnits([f"appliance-engine@{i}.service" for i in range(c.replicas)])
    clock = Clock()
    lines: list[str] = []
    urls = ["http://r0", "http://r1"]
    j = Judge(c, urls, units=units, state_path=tmp_path / "judge.json", clock=clock, wall=clock.wall,
              scrape=lambda url: scrapes[url](), log=lines.append, **kw)
    units.judge = j
    return j, units, clock, lines


def test_a_deadlocked_replica_is_taken_out_logged_killed_and_restarted(tmp_path: Path) -> None:
    tokens = {"n": 100.0}
    scrapes = {"http://r0": lambda: Scrape(tokens["n"], 50, 2, 8), "http://r1": lambda: Scrape(7, 3, 12, 0)}
    j, units, clock, lines = _judge(tmp_path, scrapes, send_canary=lambda url, model, timeout: CanaryResult(0, 0, False))
    for _ in range(40):
        state = j.round()
        clock.now += 5
        tokens["n"] += 40
        if units.actions:
            break
    assert units.actions == [("restart", "appliance-engine@1.service")]
    assert lines == ["replica 1 stalled: no tokens for 170 s with 12 requests waiting"]
    # the agent and /health counted it out before the restart was asked for
    (before,) = units.seen_at_restart
    assert before is not None and before.replicas[1].state == "stalled" and before.alive == 1
    assert endpoints.agent_answer(before, "replica1") == "down #stalled: no tokens for 170 s with 12 requests waiting\n"
    assert [r.state for r in state.replicas] == ["alive", "restarting"]
    assert state.replicas[1].restarts == 1 and state.replicas[1].reason.startswith("restarted by the judge: no tokens")
    written = load_record(JudgeState, tmp_path / "judge.json", lenient=True)
    assert written == state
    # restarting until systemd shows a new start; then judged afresh (its counters from zero)
    units.unit["appliance-engine@1.service"] = UnitState("activating", "start")
    assert j.round().replicas[1].state == "restarting"
    units.unit["appliance-engine@1.service"] = UnitState("active", "running", "2030-01-01T01:00:00+00:00")
    scrapes["http://r1"] = lambda: Scrape(1, 30, 0, 0)
    assert [r.state for r in j.round().replicas] == ["alive", "alive"]


def test_a_replica_not_yet_ready_is_starting_never_stalled(tmp_path: Path) -> None:
    scrapes = {"http://r0": lambda: Scrape(1, 1, 5, 0), "http://r1": lambda: Scrape(1, 1, 5, 0)}
    j, units, clock, lines = _judge(tmp_path, scrapes)
    for name in units.unit:
        units.unit[name] = UnitState("activating", "start")
    for _ in range(100):
        state = j.round()
        clock.now += 5
    assert [r.state for r in state.replicas] == ["starting", "starting"] and state.alive == 0
    assert units.actions == [] and lines == []
    assert endpoints.health(state, 0, 60)[0] == 503


def test_without_acting_a_stall_is_judged_and_nothing_restarted(tmp_path: Path) -> None:
    scrapes = {"http://r0": lambda: Scrape(1, 1, 5, 0), "http://r1": lambda: Scrape(1, 1, 0, 0)}
    j, units, clock, _lines = _judge(tmp_path, scrapes, act=False, send_canary=lambda *a: CanaryResult(0, 0, True, 200))
    for _ in range(40):
        state = j.round()
        clock.now += 5
    assert units.actions == [] and state.replicas[0].state == "stalled"


def test_canaries_are_counted_for_the_last_hour(tmp_path: Path) -> None:
    scrapes = {"http://r0": lambda: Scrape(1, 1, 0, 0), "http://r1": lambda: Scrape(1, 1, 0, 0)}
    j, _, clock, _ = _judge(tmp_path, scrapes, send_canary=lambda url, model, timeout: CanaryResult(clock.now, clock.now, True, 200))
    counts = []
    for _ in range(int(2 * 3600 / 5)):
        counts.append(j.round().canaries_last_hour)
        clock.now += 5
        time.sleep(0)  # the canaries run in the judge's pool
        if j.replicas[0].canary is not None:
            j.replicas[0].canary.result(timeout=5)
        if j.replicas[1].canary is not None:
            j.replicas[1].canary.result(timeout=5)
    # idle: one a replica about every canary_after_s (60 s) and its answer's round
    assert 2 * 50 <= counts[-1] <= 2 * 60
    assert counts[-1] == counts[-100]  # steady: the window drops the old ones


def test_several_replicas_ending_together_go_to_the_hive_ladder_which_may_hold_them(tmp_path: Path) -> None:
    scrapes = {"http://r0": lambda: Scrape(1, 1, 0, 0), "http://r1": lambda: Scrape(1, 1, 0, 0)}
    reboots: list[str] = []
    c = demo()
    ladder = hive.Ladder(dataclasses.replace(c.engine.remediation, restarts=0), path=tmp_path / "remediation.json",
                         reboot=lambda: reboots.append("reboot"))
    j, units, clock, lines = _judge(tmp_path, scrapes, ladder=ladder, kernel_log=lambda since: [])
    j.round()
    for name in units.unit:  # an orderly stop of every replica (a shutdown, the operator): no fault
        units.unit[name] = UnitState("inactive", "dead")
    clock.now += 5
    j.round()
    assert reboots == [] and not (tmp_path / "remediation.json").exists()
    for name in units.unit:
        units.unit[name] = UnitState("active", "running", "2030-01-01T01:00:00+00:00")
    clock.now += 5
    j.round()
    for name in units.unit:  # a hive reset: every process holding /dev/kfd ended at once, systemd restarts them
        units.unit[name] = UnitState("activating", "auto-restart", restarts=1, result="exit-code")
    clock.now += 5
    j.round()
    assert reboots == ["reboot"] and any(line.startswith("hive: hive-wide fault 1") for line in lines)
    assert load_record(hive.RemediationState, tmp_path / "remediation.json", lenient=True).faults == 1  # type: ignore[union-attr]
    # after the reboot it happens again, past the settle time: held down, needs physical action
    for name in units.unit:
        units.unit[name] = UnitState("active", "running", "2030-01-01T02:00:00+00:00")
    clock.now += 400
    j.round()
    for name in units.unit:
        units.unit[name] = UnitState("failed", "failed", restarts=1, result="signal")
    clock.now += 5
    state = j.round()
    assert [r.state for r in state.replicas] == ["held", "held"] and state.hive.startswith("needs physical action")
    assert endpoints.health(state, 0, 60)[1]["error"]["message"].startswith("needs physical action")
    units.unit["appliance-engine@0.service"] = UnitState("activating", "start")
    j.round()
    assert ("stop", "appliance-engine@0.service") in units.actions  # held: not let back by systemd's own restart
    j.round()
    assert sum(line.startswith("hive: needs physical action") for line in lines) == 1, lines  # said once, not every round


# ------------------------------------------------------------------------------------ against a real engine on loopback


class FreezingEngine:
    """A tiny vLLM-like engine: /metrics with the token counters, /v1/completions; FROZEN: the
    counters stop and completions are never answered, while /health and /metrics still answer."""

    def __init__(self) -> None:
        self.frozen = threading.Event()
        self.release = threading.Event()
        self.tokens = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if not engine.frozen.is_set():
                    engine.tokens += 7
                text = (f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {float(engine.tokens)}\n'
                        f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} 10.0\n'
                        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {3.0 if engine.frozen.is_set() else 0.0}\n'
                        f'vllm:num_requests_running{{engine="0",model_name="m"}} 1.0\n')
                self._reply(200, text.encode() if self.path == "/metrics" else b"{}", "text/plain")

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if engine.frozen.is_set():
                    engine.release.wait(30)
                    return
                self._reply(200, b'{"choices": [{"text": "3"}]}')

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_the_judge_takes_out_a_replica_whose_engine_deadlocks(tmp_path: Path) -> None:
    engines = [FreezingEngine(), FreezingEngine()]
    c = demo()
    c = dataclasses.replace(c, engine=dataclasses.replace(c.engine, progress=dataclasses.replace(
        c.engine.progress, interval_s=1, stall_after_s=3, canary_after_s=1, canary_timeout_s=1)))  # bounds for a test
    units = FakeUnits(["appliance-engine@0.service", "appliance-engine@1.service"])
    lines: list[str] = []
    j = Judge(c, [e.url for e in engines], units=units, log=lines.append)
    health, agent = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    stop = threading.Event()
    runner = threading.Thread(target=daemon.run_forever, args=(j, health, agent, stop), daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if _get(health)[0] == 200:
                    break
            except OSError:
                pass  # not serving yet: the first round comes first
            time.sleep(0.2)
        assert _get(health) == (200, "application/json", {"status": "ok", "alive": 2, "replicas": 2})
        engines[1].frozen.set()
        frozen_at = time.monotonic()
        while not units.actions and time.monotonic() < frozen_at + 30:
            time.sleep(0.2)
        took = time.monotonic() - frozen_at
        assert units.actions == [("restart", "appliance-engine@1.service")]
        assert took < 3 + 2 * 1 + 5  # the bound, two rounds, and room for a slow machine
        assert lines and lines[0].startswith("replica 1 stalled: no tokens for ")
        assert _agent(agent, b"replica1\n").startswith("down #")
        assert _agent(agent, b"replica0\n") == "up\n"
        assert _get(health)[2] == {"status": "ok", "alive": 1, "replicas": 2}
    finally:
        stop.set()
        runner.join(10)
        for e in engines:
            e.close()


@pytest.mark.programs
def test_the_judge_takes_out_a_deadlocked_stand_in(tmp_path: Path) -> None:
    from standin import faults
    from testkit.standin import StandinProcess

    if "deadlock_after_s" not in {f.name for f in dataclasses.fields(faults.Faults)}:
        pytest.skip("the stand-in has no deadlock switch")
    c = demo()
    c = dataclasses.replace(c, engine=dataclasses.replace(c.engine, progress=dataclasses.replace(
        c.engine.progress, interval_s=1, stall_after_s=4, canary_after_s=1, canary_timeout_s=2)))
    live = StandinProcess(["--served-model-name", c.served_model])
    stuck = StandinProcess(["--served-model-name", c.served_model], env={"STANDIN_DEADLOCK_AFTER_S": "0"})
    try:
        live.wait_ready(30)
        stuck.wait_ready(30)
        units = FakeUnits(["appliance-engine@0.service", "appliance-engine@1.service"])
        lines: list[str] = []
        j = Judge(c, [live.url, stuck.url], units=units, log=lines.append)
        deadline = time.monotonic() + 40
        while not units.actions and time.monotonic() < deadline:
            state = j.round()
            time.sleep(1)
        j.close()
        assert units.actions == [("restart", "appliance-engine@1.service")], lines
        assert lines[0].startswith("replica 1 stalled: ")
        assert state.replicas[0].state == "alive"
    finally:
        live.stop()
        stuck.stop()
