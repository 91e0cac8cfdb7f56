# SPDX-License-Identifier: MIT
"""The stand-in engine, run as a real process on a loopback port and driven over HTTP."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import openai
import pytest
import requests

from standin import faults
from testkit.standin import ROOT, StandinProcess, port_open

pytestmark = pytest.mark.timeout(60)

SMOKE = "Calculate 17 * 23. Answer with the number only."
DEMO_ARGS = ["--served-model-name", "standin/tiny-demo", "--kv-offloading-size", "0.0625", "--max-model-len", "4096"]
OFFLOAD_BYTES = int(0.0625 * 2**30)


@pytest.fixture
def engine(shm_dir: Path) -> Iterator[StandinProcess]:
    proc = StandinProcess(DEMO_ARGS, env={"STANDIN_SHM_DIR": str(shm_dir)})
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _mmaps(directory: Path) -> list[Path]:
    return sorted(directory.glob("vllm_offload_*.mmap"))


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in requests.get(url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------- CLI


def test_help() -> None:
    top = subprocess.run([sys.executable, "-m", "standin", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert top.returncode == 0 and "serve" in top.stdout
    serve = subprocess.run([sys.executable, "-m", "standin", "serve", "--help"], capture_output=True, text=True,
                           cwd=ROOT)
    assert serve.returncode == 0
    for name in ("--kv-offloading-size", "STANDIN_CRASH_AFTER_S", "STANDIN_HANG_AFTER_S", "STANDIN_FAULTS_FILE"):
        assert name in serve.stdout


def test_production_arguments_are_accepted(shm_dir: Path) -> None:
    """The whole production argument list (unknown vLLM options included) after the model path."""
    raw = tomllib.loads((ROOT / "appliance.toml").read_text())
    args = list(raw["engine"]["args"])
    args[args.index("--kv-offloading-size") + 1] = "0.0625"  # not 96 GiB here
    proc = StandinProcess(["/root/.cache/huggingface/hub/models--x/snapshots/abc", *args],
                          env={"STANDIN_SHM_DIR": str(shm_dir)})
    try:
        proc.wait_ready()
        model = requests.get(proc.url + "/v1/models", timeout=5).json()["data"][0]
        assert model["id"] == "deepseek-ai/DeepSeek-V4-Flash-0731"
        assert model["max_model_len"] == 262144
        assert model["root"] == "/root/.cache/huggingface/hub/models--x/snapshots/abc"
        assert any("Maximum concurrency for 262,144 tokens per request: 0.25x" in line for line in proc.lines)
    finally:
        assert proc.stop() == 0


# ------------------------------------------------------------------------------------------- API


@pytest.mark.programs
def test_openai_smoke_completion_and_models(engine: StandinProcess) -> None:
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["standin/tiny-demo"]
    raw = requests.get(engine.url + "/v1/models", timeout=5)
    assert raw.headers["X-Standin-Answers"] == "upstream"
    assert raw.json()["data"][0]["standin_answers"] == "upstream"
    assert raw.json()["data"][0]["max_model_len"] == 4096
    done = client.completions.create(model="standin/tiny-demo", prompt=SMOKE, temperature=0, max_tokens=32)
    assert done.choices[0].text == "391"
    assert done.choices[0].finish_reason == "stop"
    assert done.usage is not None and done.usage.completion_tokens == 1 and done.usage.prompt_tokens > 0
    echo = client.completions.create(model="standin/tiny-demo", prompt="tell  me\nsomething", max_tokens=32)
    again = client.completions.create(model="standin/tiny-demo", prompt="tell me something", max_tokens=32)
    assert echo.choices[0].text == again.choices[0].text == "echo: tell me something"
    short = client.completions.create(model="standin/tiny-demo", prompt="one two three four", max_tokens=2)
    assert short.choices[0].text == "echo: one" and short.choices[0].finish_reason == "length"
    assert requests.get(engine.url + "/health", timeout=5).status_code == 200


def test_openai_streamed_chat(engine: StandinProcess) -> None:
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(
        model="standin/tiny-demo", messages=[{"role": "user", "content": "Say hello."}], stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello! I am the stand-in engine."
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # one chunk per token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    whole = client.chat.completions.create(model="standin/tiny-demo", messages=[{"role": "user", "content": SMOKE}])
    assert whole.choices[0].message.content == "391"


def test_stream_is_flushed_per_chunk(shm_dir: Path) -> None:
    proc = StandinProcess(DEMO_ARGS, env={"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_TOKEN_SECONDS": "0.3"})
    try:
        proc.wait_ready()
        started = time.monotonic()
        body = {"messages": [{"role": "user", "content": "Say hello."}], "stream": True}
        with requests.post(proc.url + "/v1/chat/completions", json=body, stream=True, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            times = [(time.monotonic() - started, line) for line in r.iter_lines() if line]
        assert times[-1][1] == b"data: [DONE]"
        first_content = next(t for t, line in times if b'"content": "Hello!"' in line)
        assert first_content < times[-1][0] - 1.0  # the first token came long before the end
    finally:
        proc.stop()


def test_errors_look_like_vllm(engine: StandinProcess) -> None:
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no/such-model", prompt="x", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 4096"):
        client.completions.create(model="standin/tiny-demo", prompt="x", max_tokens=5000)
    assert requests.get(engine.url + "/nope", timeout=5).status_code == 404


def test_metrics_change_as_requests_are_served(engine: StandinProcess) -> None:
    before = _metrics(engine.url)
    labels = '{engine="0",model_name="standin/tiny-demo"}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"):
        assert before[name + labels] == 0.0, name
    assert before['vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="standin/tiny-demo"}'] == 0
    for _ in range(2):
        requests.post(engine.url + "/v1/completions", json={"prompt": "Say hello.", "max_tokens": 16}, timeout=5)
    after = _metrics(engine.url)
    assert after["vllm:prefix_cache_queries_total" + labels] > 0
    assert after["vllm:prefix_cache_hits_total" + labels] > 0  # the second request repeated the prompt
    assert after["vllm:time_to_first_token_seconds_count" + labels] == 2
    assert after['vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="standin/tiny-demo"}'] == 2
    assert after["vllm:spec_decode_num_drafts_total" + labels] > 0
    assert after["vllm:spec_decode_num_draft_tokens_total" + labels] == 7 * after[
        "vllm:spec_decode_num_drafts_total" + labels]
    assert 0 < after["vllm:spec_decode_num_accepted_tokens_total" + labels] < after[
        "vllm:spec_decode_num_draft_tokens_total" + labels]
    assert after["vllm:num_requests_running" + labels] == 0


# ------------------------------------------------------------------------------------------- answers


def test_overlay_is_a_full_copy_with_one_more_answer() -> None:
    upstream = _load_module(ROOT / "standin" / "answers.py", "answers_upstream")
    overlay = _load_module(ROOT / "overlays" / "demo" / "standin_answers.py", "answers_overlay")
    assert upstream.VARIANT == "upstream" and overlay.VARIANT == "overlay-demo"
    assert upstream.ANSWERS.items() <= overlay.ANSWERS.items()
    assert len(overlay.ANSWERS) == len(upstream.ANSWERS) + 1
    for prompt in [*upstream.ANSWERS, "anything else"]:
        assert overlay.answer(prompt) == upstream.answer(prompt)


def test_overlay_mounted_over_answers_is_in_effect(tmp_path: Path, shm_dir: Path) -> None:
    """Like the container: the overlay file replaces standin/answers.py of an installed copy."""
    shutil.copytree(ROOT / "standin", tmp_path / "standin", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "overlays" / "demo" / "standin_answers.py", tmp_path / "standin" / "answers.py")
    overlay = _load_module(tmp_path / "standin" / "answers.py", "answers_mounted")
    extra = next(p for p in overlay.ANSWERS if p not in _load_module(ROOT / "standin" / "answers.py", "u").ANSWERS)
    proc = StandinProcess(DEMO_ARGS, env={"STANDIN_SHM_DIR": str(shm_dir)}, pythonpath=tmp_path)
    try:
        proc.wait_ready()
        models = requests.get(proc.url + "/v1/models", timeout=5)
        assert models.headers["X-Standin-Answers"] == "overlay-demo"
        assert models.json()["data"][0]["standin_answers"] == "overlay-demo"
        got = requests.post(proc.url + "/v1/completions", json={"prompt": extra, "max_tokens": 64}, timeout=5).json()
        assert got["choices"][0]["text"] == overlay.ANSWERS[extra]
        smoke = requests.post(proc.url + "/v1/completions", json={"prompt": SMOKE, "max_tokens": 32}, timeout=5)
        assert smoke.json()["choices"][0]["text"] == "391"
    finally:
        proc.stop()


# ------------------------------------------------------------------------------------------- loading and mmap


def test_loading_refuses_connections_then_serves(shm_dir: Path) -> None:
    proc = StandinProcess(DEMO_ARGS, env={"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_LOAD_SECONDS": "2"})
    try:
        proc.wait_for_line("Starting to load model")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proc.port), timeout=1).close()
        proc.wait_for_line("Created mmap file")
        assert not port_open(proc.port)
        proc.wait_ready()
        assert requests.get(proc.url + "/health", timeout=5).status_code == 200
    finally:
        proc.stop()


def test_startup_lines_in_order_with_vllm_prefix(engine: StandinProcess) -> None:
    wanted = ["Model loading took 0.5000 GiB", "DSpark draft model loaded: 96 params",
              "GPU KV cache size: 65,536 tokens", "Maximum concurrency for 4,096 tokens per request: 16.00x",
              "Created mmap file ", "Capturing CUDA graphs (decode, FULL)", "Application startup complete."]
    positions = [next(i for i, line in enumerate(engine.lines) if w in line) for w in wanted]
    assert positions == sorted(positions)
    model_line = engine.lines[positions[0]]
    assert re.match(r"\(EngineCore_DP0 pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[\S+\.py:\d+\] ", model_line)


def test_mmap_file_created_and_removed_on_sigterm(shm_dir: Path) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        proc = StandinProcess(DEMO_ARGS, env={"STANDIN_SHM_DIR": str(shm_dir)})
        proc.wait_ready()
        (path,) = _mmaps(shm_dir)
        st = path.stat()
        assert st.st_size == OFFLOAD_BYTES and st.st_mode & 0o777 == 0o600
        assert f"Created mmap file {path} (0.07 GB)" in proc.wait_for_line("Created mmap file")
        assert proc.stop(sig) == 0
        assert _mmaps(shm_dir) == []


def test_mmap_removed_when_stopped_while_loading(shm_dir: Path) -> None:
    proc = StandinProcess(DEMO_ARGS, env={"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_NEVER_READY": "1"})
    proc.wait_for_line("Created mmap file")
    time.sleep(0.5)
    assert not port_open(proc.port)
    assert not any("Application startup complete" in line for line in proc.lines)
    assert len(_mmaps(shm_dir)) == 1
    assert proc.stop() == 0
    assert _mmaps(shm_dir) == []


# ------------------------------------------------------------------------------------------- faults


def test_crash_after_exits_1_and_removes_mmap(shm_dir: Path) -> None:
    proc = StandinProcess(DEMO_ARGS, env={"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_CRASH_AFTER_S": "1"})
    proc.wait_ready()
    assert requests.get(proc.url + "/health", timeout=5).status_code == 200
    assert proc.proc.wait(10) == 1
    assert _mmaps(shm_dir) == []
    assert not port_open(proc.port)
    proc.stop()


def test_crash_leave_mmap_leaves_the_file(shm_dir: Path) -> None:
    env = {"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_CRASH_AFTER_S": "0.5", "STANDIN_CRASH_LEAVE_MMAP": "1"}
    proc = StandinProcess(DEMO_ARGS, env=env)
    proc.wait_ready()
    assert proc.proc.wait(10) == 1
    (left,) = _mmaps(shm_dir)
    assert left.stat().st_size == OFFLOAD_BYTES
    proc.stop()


def test_hang_after_accepts_but_never_answers(shm_dir: Path) -> None:
    proc = StandinProcess(DEMO_ARGS, env={"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_HANG_AFTER_S": "1"})
    try:
        proc.wait_ready()
        assert requests.get(proc.url + "/health", timeout=5).status_code == 200
        time.sleep(1.2)
        assert port_open(proc.port)  # the socket still accepts
        with pytest.raises(requests.ReadTimeout):
            requests.get(proc.url + "/health", timeout=1)
        with pytest.raises(requests.ReadTimeout):
            requests.post(proc.url + "/v1/completions", json={"prompt": SMOKE}, timeout=1)
        assert proc.proc.poll() is None
    finally:
        assert proc.stop() == 0
    assert _mmaps(shm_dir) == []


def test_slow_start_from_faults_file(tmp_path: Path, shm_dir: Path) -> None:
    """The faults file wins over the environment; its load_seconds keeps the port closed."""
    faults_file = tmp_path / "faults.json"
    faults_file.write_text(json.dumps({"load_seconds": 3, "crash_after_s": 0.5}))
    env = {"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_FAULTS_FILE": str(faults_file), "STANDIN_LOAD_SECONDS": "0"}
    proc = StandinProcess(DEMO_ARGS, env=env)
    started = time.monotonic()
    proc.wait_ready()
    assert time.monotonic() - started >= 2.5
    assert proc.proc.wait(10) == 1
    proc.stop()


def test_missing_faults_file_is_fine_and_bad_one_is_refused(tmp_path: Path, shm_dir: Path) -> None:
    env = {"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_FAULTS_FILE": str(tmp_path / "absent.json")}
    proc = StandinProcess(DEMO_ARGS, env=env)
    proc.wait_ready()
    assert proc.stop() == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"crash_after": 1}))
    proc = StandinProcess(DEMO_ARGS, env={**env, "STANDIN_FAULTS_FILE": str(bad)})
    assert proc.proc.wait(10) == 2
    proc.stop()
    assert any("unknown key(s) crash_after" in line for line in proc.lines)


def test_faults_parsing() -> None:
    assert faults.load({}) == faults.Faults()
    got = faults.load({"STANDIN_LOAD_SECONDS": "5", "STANDIN_NEVER_READY": "1", "STANDIN_CRASH_LEAVE_MMAP": "0",
                       "STANDIN_HANG_AFTER_S": "2.5", "STANDIN_KV_CACHE_TOKENS": "1000"})
    assert got == faults.Faults(load_seconds=5.0, never_ready=True, hang_after_s=2.5, kv_cache_tokens=1000)
    for bad in ({"STANDIN_LOAD_SECONDS": "soon"}, {"STANDIN_CRASH_AFTER_S": "-1"}, {"STANDIN_NEVER_READY": "maybe"}):
        with pytest.raises(faults.FaultsError):
            faults.load(bad)


def _raw_exchange(port: int, request: bytes, timeout: float = 10) -> tuple[socket.socket, bytes]:
    conn = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    conn.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    return conn, data


def test_chunked_request_body_is_read_and_the_connection_kept(engine: StandinProcess) -> None:
    """vLLM (h11) reads a Transfer-Encoding: chunked body; so does the stand-in, and keeps the
    connection for the next request."""
    body = json.dumps({"model": "standin/tiny-demo", "prompt": SMOKE, "max_tokens": 32}).encode()
    half = len(body) // 2
    chunked = b"%x;ext=1\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (half, body[:half], len(body) - half, body[half:])
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    conn, data = _raw_exchange(engine.port, head + chunked)
    with conn:
        assert data.startswith(b"HTTP/1.1 200 "), data[:200]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"] == "391"
        # The same connection answers the next request: the body was consumed exactly.
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert conn.recv(65536).startswith(b"HTTP/1.1 200 ")
    malformed = head + b"zz\r\nxx\r\n0\r\n\r\n"
    conn, data = _raw_exchange(engine.port, malformed)
    with conn:
        assert data.startswith(b"HTTP/1.1 400 ") and b"chunked" in data


def test_idle_keep_alive_connection_is_closed_after_five_seconds(engine: StandinProcess) -> None:
    """Like vLLM's uvicorn (timeout_keep_alive 5 s): a kept-alive connection idle that long is closed,
    one that goes on within it is kept."""
    with socket.create_connection(("127.0.0.1", engine.port), timeout=10) as conn:
        for _ in range(2):
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert conn.recv(65536).startswith(b"HTTP/1.1 200 ")
            answered = time.monotonic()
            time.sleep(2)
        assert conn.recv(65536) == b""  # closed by the stand-in
        assert 4 < time.monotonic() - answered < 7


def test_kept_alive_answers_do_not_wait_for_delayed_acks(engine: StandinProcess) -> None:
    """Headers and body go out in separate writes: without TCP_NODELAY (uvicorn sets it) each answer
    on a kept-alive connection waits ~40 ms for the client's delayed ACK."""
    with requests.Session() as session:
        session.get(engine.url + "/v1/models", timeout=5)
        started = time.monotonic()
        for _ in range(20):
            assert session.get(engine.url + "/v1/models", timeout=5).status_code == 200
        assert time.monotonic() - started < 0.5


def test_a_faults_file_for_one_replica_is_ignored_by_the_others(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps({"replica": 1, "never_ready": True}))
    env = {"STANDIN_FAULTS_FILE": str(path)}
    assert faults.load({**env, "APPLIANCE_REPLICA": "1"}).never_ready is True
    assert faults.load({**env, "APPLIANCE_REPLICA": "0"}).never_ready is False
    assert faults.load(env).never_ready is False  # no replica number: replica 0
    path.write_text(json.dumps({"never_ready": True}))  # no "replica": replica 0's
    assert faults.load(env).never_ready is True and faults.load({**env, "APPLIANCE_REPLICA": "1"}).never_ready is False
