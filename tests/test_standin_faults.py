# SPDX-License-Identifier: MIT
"""The stand-in's fault switches, each failing as vLLM fails (standin/faults.py's SOURCES): in process
where the HTTP server alone shows it, as a process where the process itself must end."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import pytest
import requests

from standin import faults
from standin.__main__ import gpu_fault_line
from standin.faults import Armed, Faults
from standin.metrics import Stats
from standin.server import ENGINE_DEAD_MESSAGE, Engine, Server
from testkit.hive import kill_at_once
from testkit.standin import StandinProcess, hive_reset, write_faults

pytestmark = pytest.mark.timeout(60)

MODEL = "standin/tiny-demo"
SMOKE = "Calculate 17 * 23. Answer with the number only."
HELLO = "Say hello."  # six tokens
LABELS = f'{{engine="0",model_name="{MODEL}"}}'
ABORTED = f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}}'
ROCM_FAULT = re.compile(r"Memory access fault by GPU node-\d+ \(Agent handle: 0x[0-9a-f]+\) on address 0x[0-9a-f]+\. "
                        r"Reason: Page not present or supervisor privilege\.")


class Served:
    def __init__(self, engine: Engine, port: int) -> None:
        self.engine = engine
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.process_faults: list[str] = []

    def switch(self, **switches: float) -> None:
        """As a change of the faults file does: in effect from now."""
        self.engine.armed.replace(Faults(**switches))  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def complete(self, prompt: str = SMOKE, timeout: float = 30, **body: object) -> requests.Response:
        return requests.post(self.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 32, **body},
                             timeout=timeout)


@contextmanager
def serving(cfg: Faults | None = None) -> Iterator[Served]:
    """The stand-in's HTTP server in this process, on a free loopback port."""
    engine = Engine(served_names=[MODEL], root=MODEL, max_model_len=4096,
                    stats=Stats(model_name=MODEL, kv_cache_tokens=65536), armed=Armed(cfg or Faults()))
    server = Server("127.0.0.1", 0, engine)
    served = Served(engine, int(server.server_address[1]))
    engine.on_process_fault = served.process_faults.append
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        engine.armed.replace(Faults())  # held requests go on and end
        server.shutdown()
        server.server_close()


def _wait_for(predicate: object, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def _raw_post(port: int, body: dict[str, object]) -> socket.socket:
    data = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return conn


def _received_within(conn: socket.socket, seconds: float) -> bytes:
    conn.settimeout(seconds)
    try:
        return conn.recv(65536)
    except TimeoutError:
        return b""


def _read_until(conn: socket.socket, marker: bytes, timeout: float = 5) -> bytes:
    end = time.monotonic() + timeout
    got = b""
    while marker not in got and (left := end - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        got += chunk
    return got


# ------------------------------------------------------------------------------------------- switches


def test_every_kind_has_both_triggers_and_a_public_source() -> None:
    names = {f.name for f in fields(Faults)}
    for kind in faults.KINDS:
        assert {f"{kind}_after_s", f"{kind}_after_requests"} <= names, kind
        what, source = faults.SOURCES[kind]
        assert what, kind
        if kind != "hang":  # the stand-in's own, kept: the one failure already caught
            assert re.search(r"[\w-]+/[\w.-]+#\d+", source), kind
    assert set(faults.SOURCES) == set(faults.KINDS)


def test_new_switches_parse_and_refuse_bad_values(tmp_path: Path) -> None:
    got = faults.load({"STANDIN_DEADLOCK_AFTER_S": "3", "STANDIN_ENGINE_DEAD_AFTER_REQUESTS": "2",
                       "STANDIN_COLLAPSE_AFTER_S": "0", "STANDIN_COLLAPSE_FACTOR": "0.05",
                       "STANDIN_GPU_FAULT_AFTER_REQUESTS": "0", "STANDIN_HANG_AFTER_REQUESTS": "7"})
    assert got == Faults(deadlock_after_s=3.0, engine_dead_after_requests=2, collapse_after_s=0.0,
                         collapse_factor=0.05, gpu_fault_after_requests=0, hang_after_requests=7)
    for bad in ({"STANDIN_COLLAPSE_FACTOR": "0"}, {"STANDIN_COLLAPSE_FACTOR": "2"},
                {"STANDIN_DEADLOCK_AFTER_REQUESTS": "1.5"}, {"STANDIN_DEADLOCK_AFTER_REQUESTS": "-1"},
                {"STANDIN_GPU_FAULT_AFTER_S": "inf"}, {"STANDIN_ENGINE_DEAD_AFTER_S": "soon"}):
        with pytest.raises(faults.FaultsError):
            faults.load(bad)
    path = tmp_path / "faults.json"
    path.write_text(json.dumps({"deadlock_after_requests": True}))
    with pytest.raises(faults.FaultsError, match="deadlock_after_requests"):
        faults.load({"STANDIN_FAULTS_FILE": str(path)})


def test_triggers_count_seconds_and_requests_from_when_the_faults_took_effect() -> None:
    now = [100.0]
    armed = Armed(Faults(deadlock_after_s=5, engine_dead_after_requests=2), clock=lambda: now[0])
    assert armed.mode() is None
    now[0] += 5
    assert armed.mode() == "deadlock"
    armed.count_request()
    armed.count_request()
    assert armed.mode() == "engine_dead"  # the engine's death wins over its deadlock
    # a change counts from its own moment, the start-only keys kept
    assert armed.replace(Faults(collapse_after_requests=1, kv_cache_tokens=5, token_seconds=0.5)) is True
    assert armed.faults.kv_cache_tokens == 65536
    assert armed.mode() is None and armed.token_seconds() == 0.5
    armed.count_request()
    assert armed.mode() == "collapse" and armed.token_seconds() == pytest.approx(50.0)
    assert armed.replace(Faults(collapse_after_requests=1, token_seconds=0.5)) is False  # no change, no reset
    assert armed.mode() == "collapse"
    armed.replace(Faults(collapse_after_s=0))
    assert armed.token_seconds() == pytest.approx(faults.NOMINAL_TOKEN_SECONDS / 0.01)


def test_the_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    env = {"STANDIN_FAULTS_FILE": str(path), "APPLIANCE_REPLICA": "1"}
    armed = Armed(faults.load(env))
    changes: list[Faults] = []
    errors: list[str] = []
    watcher = faults.Watcher(armed, env, changes.append, errors.append)
    watcher.poll()
    assert changes == [] and errors == []
    write_faults(path, {"deadlock_after_s": 0}, replica=1)
    watcher.poll()
    assert armed.mode() == "deadlock" and len(changes) == 1
    path.unlink()  # removed while serving: nothing changes
    watcher.poll()
    assert armed.mode() == "deadlock" and len(changes) == 1
    write_faults(path, {"deadlock_after_s": 0}, replica=0)  # another replica's: this one is clear
    watcher.poll()
    assert armed.mode() is None
    path.write_text("{not json")
    watcher.poll()
    assert armed.mode() is None and len(errors) == 1 and "cannot read" in errors[0]
    write_faults(path, {"deadlock_after_s": 0})  # no "replica": replica 0's, not this one's
    watcher.poll()
    assert armed.mode() is None


# ------------------------------------------------------------------------------------------- deadlock


def test_deadlock_keeps_the_server_green_and_holds_every_request() -> None:
    """vllm-project/vllm#39863, vllm-project/vllm#36451, vllm-project/vllm#17972, azrtydxb/Fastllm-proxy#19."""
    with serving() as s:
        assert s.complete().json()["choices"][0]["text"] == "391"
        before = s.metrics()
        s.switch(deadlock_after_s=0)
        for path in ("/health", "/ping", "/version", "/v1/models", "/metrics"):
            assert requests.get(s.url + path, timeout=5).status_code == 200, path
        pool = ThreadPoolExecutor(4)
        held = [pool.submit(s.complete) for _ in range(3)]
        assert _wait_for(lambda: s.metrics()["vllm:num_requests_waiting" + LABELS] == 3)
        stream = _raw_post(s.port, {"prompt": HELLO, "stream": True})
        assert _wait_for(lambda: s.metrics()["vllm:num_requests_waiting" + LABELS] == 4)
        head = _received_within(stream, 0.5)
        # streamed: 200 and its headers (vLLM's access log says 200 OK), then not one byte of the body
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n") and b"data:" not in head
        assert _received_within(stream, 0.3) == b""
        time.sleep(0.3)
        frozen = s.metrics()
        assert not any(f.done() for f in held)
        for name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total",
                     "vllm:time_to_first_token_seconds_count", "vllm:spec_decode_num_drafts_total"):
            assert frozen[name + LABELS] == before[name + LABELS], name
        assert frozen["vllm:num_requests_running" + LABELS] == 0
        # the engine core comes back (a test's switch; vLLM's never does): every held request is answered
        s.switch()
        assert [f.result(timeout=10).status_code for f in held] == [200, 200, 200]
        assert b"data: [DONE]" in _read_until(stream, b"[DONE]", 10)
        stream.close()
        after = s.metrics()
        assert after["vllm:num_requests_waiting" + LABELS] == 0
        assert after["vllm:generation_tokens_total" + LABELS] > before["vllm:generation_tokens_total" + LABELS]
        pool.shutdown()


def test_deadlock_in_the_middle_of_an_answer_freezes_it() -> None:
    with serving(Faults(token_seconds=0.1)) as s:
        conn = _raw_post(s.port, {"prompt": HELLO, "stream": True})
        assert b"data:" in _read_until(conn, b"data:")
        s.switch(token_seconds=0.1, deadlock_after_s=0)
        time.sleep(0.3)  # a token possibly on its way
        frozen = s.metrics()["vllm:generation_tokens_total" + LABELS]
        assert _received_within(conn, 0.5) == b""
        assert s.metrics()["vllm:generation_tokens_total" + LABELS] == frozen < 6
        assert s.metrics()["vllm:num_requests_running" + LABELS] == 1
        conn.close()


def test_a_client_leaving_a_deadlocked_engine_is_logged_then_counted_when_it_returns(
        capfd: pytest.CaptureFixture[str]) -> None:
    with serving(Faults(deadlock_after_s=0)) as s:
        conn = _raw_post(s.port, {"prompt": SMOKE})
        assert _wait_for(lambda: s.metrics()["vllm:num_requests_waiting" + LABELS] == 1)
        conn.close()
        assert _wait_for(lambda: "Aborted request(s) cmpl-" in capfd.readouterr().err, 5)
        assert s.metrics()[ABORTED] == 0  # the frozen engine core never processed the abort
        s.switch()
        assert _wait_for(lambda: s.metrics()[ABORTED] == 1)
        assert s.metrics()["vllm:num_requests_waiting" + LABELS] == 0


# ------------------------------------------------------------------------------------------- engine dead


def test_engine_dead_answers_503_health_and_500_engine_dead_error(capfd: pytest.CaptureFixture[str]) -> None:
    """vllm-project/vllm#24897 (/health 503), vllm-project/vllm#24495 (the body), vllm-project/vllm#42362 (the log line)."""
    with serving(Faults(engine_dead_after_requests=1)) as s:
        assert requests.get(s.url + "/health", timeout=5).status_code == 200
        assert s.complete().status_code == 200
        wanted = {"error": {"message": ENGINE_DEAD_MESSAGE, "type": "Internal Server Error", "param": None,
                            "code": 500}}
        for body in ({}, {"stream": True}):
            answer = s.complete(**body)
            assert answer.status_code == 500 and answer.json() == wanted, body
        chat = requests.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": SMOKE}]},
                             timeout=5)
        assert chat.status_code == 500 and chat.json() == wanted
        health = requests.get(s.url + "/health", timeout=5)
        assert health.status_code == 503 and health.content == b""
        assert requests.get(s.url + "/v1/models", timeout=5).status_code == 200
        assert requests.get(s.url + "/metrics", timeout=5).status_code == 200
        # a request vLLM refuses before the engine still gets its own answer
        assert s.complete(model="no/such-model").status_code == 404
        err = capfd.readouterr().err
        assert "EngineCore encountered a fatal error." in err
        assert f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}" in err


def test_engine_dying_mid_stream_ends_the_stream_with_an_error() -> None:
    with serving(Faults(token_seconds=0.1)) as s:
        conn = _raw_post(s.port, {"prompt": HELLO, "stream": True})
        assert b"data:" in _read_until(conn, b"data:")
        s.switch(token_seconds=0.1, engine_dead_after_s=0)
        rest = _read_until(conn, b"[DONE]")
        conn.close()
        assert ENGINE_DEAD_MESSAGE.encode() in rest and b"data: [DONE]" in rest


# ------------------------------------------------------------------------------------------- collapse


def test_throughput_collapse_keeps_tokens_coming_slowly() -> None:
    with serving(Faults(collapse_after_s=0, collapse_factor=0.05)) as s:  # 0.2 s a token
        started = time.monotonic()
        body = {"prompt": HELLO, "max_tokens": 16, "stream": True}
        seen = []
        with requests.post(s.url + "/v1/completions", json=body, stream=True, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    seen.append(time.monotonic() - started)
                    if len(seen) == 3:
                        # the counters move while the answer is still coming
                        assert s.metrics()["vllm:generation_tokens_total" + LABELS] >= 3
        assert len(seen) == 7  # six tokens and the last event
        assert seen[-1] >= 6 * 0.2 * 0.9
    with serving() as s:
        started = time.monotonic()
        assert s.complete(HELLO).status_code == 200
        assert time.monotonic() - started < 1.0


# ------------------------------------------------------------------------------------------- hang, process faults


def test_hang_after_requests_stops_every_answer() -> None:
    with serving(Faults(hang_after_requests=1)) as s:
        assert s.complete().status_code == 200
        with pytest.raises(requests.ReadTimeout):
            requests.get(s.url + "/health", timeout=0.5)
        with pytest.raises(requests.ReadTimeout):
            s.complete(timeout=0.5)
        s.switch()
        assert requests.get(s.url + "/health", timeout=5).status_code == 200


def test_process_faults_end_the_process_on_the_request_after_n() -> None:
    for kind in ("crash", "gpu_fault"):
        with serving(Faults(**{f"{kind}_after_requests": 2})) as s:  # type: ignore[arg-type]
            assert s.complete().status_code == 200 and s.complete().status_code == 200
            assert s.process_faults == []
            s.complete(timeout=2)
            assert s.process_faults and set(s.process_faults) == {kind}


def test_gpu_fault_line_is_rocms() -> None:
    for replica in (0, 7):
        line = gpu_fault_line(replica)
        assert ROCM_FAULT.fullmatch(line), line
        assert f"GPU node-{2 + replica} " in line


# ------------------------------------------------------------------------------------------- a client that leaves


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_mid_answer_aborts_its_request(stream: bool, capfd: pytest.CaptureFixture[str]) -> None:
    with serving(Faults(token_seconds=0.2)) as s:
        conn = _raw_post(s.port, {"prompt": HELLO, "stream": stream, "max_tokens": 16})
        assert _wait_for(lambda: s.metrics()["vllm:num_requests_running" + LABELS] == 1)
        time.sleep(0.3)
        conn.close()
        left = time.monotonic()
        assert _wait_for(lambda: s.metrics()[ABORTED] == 1, 5)
        assert time.monotonic() - left < 2.0  # noticed within a token or two, not at the answer's end
        m = s.metrics()
        assert m["vllm:num_requests_running" + LABELS] == 0
        assert m["vllm:generation_tokens_total" + LABELS] < 6  # the rest never generated
        assert re.search(r"\(APIServer pid=\d+\) INFO .* Aborted request\(s\) cmpl-[0-9a-f]+\.", capfd.readouterr().err)
        # a client that stays is not aborted
        assert s.complete(HELLO).status_code == 200
        assert s.metrics()[ABORTED] == 1


# ------------------------------------------------------------------------------------------- as processes


@pytest.mark.programs
def test_gpu_fault_prints_rocms_line_and_aborts(shm_dir: Path) -> None:
    env = {"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_GPU_FAULT_AFTER_REQUESTS": "1", "APPLIANCE_REPLICA": "1"}
    proc = StandinProcess(["--kv-offloading-size", "0.0625"], env=env)
    try:
        proc.wait_ready()
        assert requests.post(proc.url + "/v1/completions", json={"prompt": SMOKE}, timeout=5).status_code == 200
        with pytest.raises(requests.ConnectionError):
            requests.post(proc.url + "/v1/completions", json={"prompt": SMOKE}, timeout=10)
        assert proc.proc.wait(10) == -signal.SIGABRT
        line = proc.wait_for_line("Memory access fault by GPU")
        assert ROCM_FAULT.fullmatch(line) and "GPU node-3 " in line
        assert len(list(shm_dir.glob("vllm_offload_*.mmap"))) == 1  # nothing cleaned up
    finally:
        proc.stop()


@pytest.mark.programs
def test_faults_switched_at_runtime_through_the_file(tmp_path: Path, shm_dir: Path) -> None:
    proc = StandinProcess(env={"STANDIN_SHM_DIR": str(shm_dir)}, faults_file=tmp_path / "faults.json")
    try:
        proc.wait_ready()
        proc.switch_faults({"deadlock_after_s": 0})
        assert requests.get(proc.url + "/health", timeout=5).status_code == 200
        with pytest.raises(requests.ReadTimeout):
            requests.post(proc.url + "/v1/completions", json={"prompt": SMOKE}, timeout=1)
        proc.wait_for_line("Aborted request(s) cmpl-")  # the client above gave up
        proc.switch_faults({"engine_dead_after_s": 0})
        assert requests.get(proc.url + "/health", timeout=5).status_code == 503
        proc.switch_faults({})
        got = requests.post(proc.url + "/v1/completions", json={"prompt": SMOKE}, timeout=5)
        assert got.json()["choices"][0]["text"] == "391"
        proc.switch_faults({"crash_after_requests": 0})
        with pytest.raises(requests.ConnectionError):
            requests.post(proc.url + "/v1/completions", json={"prompt": SMOKE}, timeout=10)
        assert proc.proc.wait(10) == 1
    finally:
        proc.stop()


@pytest.mark.programs
def test_hive_reset_kills_every_replica_at_once(shm_dir: Path) -> None:
    replicas = [StandinProcess(env={"STANDIN_SHM_DIR": str(shm_dir), "APPLIANCE_REPLICA": str(i)}) for i in range(3)]
    try:
        for proc in replicas:
            proc.wait_ready()
        killed = hive_reset(replicas)
        assert sorted(killed) == sorted(p.proc.pid for p in replicas)
        assert [p.proc.wait(10) for p in replicas] == [-signal.SIGKILL] * 3
        assert kill_at_once(killed) == []  # gone: nothing left to kill, no error
    finally:
        for proc in replicas:
            proc.stop()
