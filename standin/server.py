"""The stand-in's OpenAI-compatible HTTP API on http.server, with vLLM's routes.

GET /health, /ping, /version, /v1/models, /metrics; POST /v1/completions and /v1/chat/completions
(streamed as server-sent events with "stream": true). Every response carries X-Standin-Answers.

The fault in effect (standin/faults.py) shapes each answer as vLLM's would be shaped. A client that
goes away mid-answer is noticed between tokens (its connection polled, as uvicorn's disconnect
event reaches vLLM): the request is aborted, logged ("Aborted request(s) ID.", as vLLM's AsyncLLM
logs it) and counted as vllm:request_success_total{finished_reason="abort"}.
"""

from __future__ import annotations

import http
import json
import re
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

from standin import __version__, answers, vlog
from standin.faults import Armed, Faults
from standin.metrics import Stats

_TOKEN = re.compile(r"\s*\S+")
# As vLLM's uvicorn: an idle keep-alive connection is closed after this long (timeout_keep_alive).
KEEP_ALIVE_S = 5.0
# The largest request body read (vLLM sets none; this only bounds the stand-in's memory).
MAX_BODY = 64 << 20
# How often a held request looks at its fault and its client again.
HOLD_POLL_S = 0.05
# EngineDeadError's message (vllm/v1/engine/exceptions.py), as a client gets it in a 500's body
# (vllm-project/vllm#24495) and the API server logs it (vllm-project/vllm#42362).
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
_POLL_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


def tokens(text: str) -> list[str]:
    """The 'tokenizer': words with their leading white space; joined, they give TEXT back."""
    return _TOKEN.findall(text)


class ClientGone(Exception):
    """The client closed its connection before its answer was complete."""

    def __init__(self, logged: bool = False) -> None:
        super().__init__()
        self.logged = logged


class EngineDead(Exception):
    """The engine core died while the request was in it."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param


@dataclass
class Engine:
    """What the request handlers share."""

    served_names: list[str]
    root: str
    max_model_len: int
    stats: Stats
    armed: Armed = field(default_factory=lambda: Armed(Faults()))
    # What a fault that ends the process does (crash, gpu_fault): set by __main__; in-process tests
    # record it instead.
    on_process_fault: Callable[[str], None] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _seen_mode: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def mode(self) -> str | None:
        """The fault in effect now; its start is logged once, as vLLM logs it (a deadlock, never)."""
        mode = self.armed.mode()
        with self._lock:
            changed, self._seen_mode = mode != self._seen_mode, mode
        if changed and mode == "engine_dead":
            vlog.log("v1/engine/core.py:710", "EngineCore encountered a fatal error.", level="ERROR")
            vlog.log("v1/engine/async_llm.py:480", "AsyncLLM output_handler failed.", level="ERROR", proc=vlog.API)
        if mode in ("crash", "gpu_fault") and self.on_process_fault is not None:
            self.on_process_fault(mode)
        return mode

    def hung(self) -> bool:
        return self.mode() == "hang"


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, host: str, port: int, engine: Engine) -> None:
        self.engine = engine
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), Handler)


@dataclass
class Generation:
    prompt: str
    prompt_tokens: int
    pieces: list[str]
    finish_reason: str

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def usage(self) -> dict[str, Any]:
        completion = len(self.pieces)
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + completion,
                "completion_tokens": completion, "prompt_tokens_details": None}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # uvicorn's sockets have TCP_NODELAY: without it, headers and body written apart wait for the
    # peer's delayed ACK (~40 ms) on a kept-alive connection.
    disable_nagle_algorithm = True
    keep_alive_s = KEEP_ALIVE_S

    def version_string(self) -> str:
        return "uvicorn"

    @property
    def engine(self) -> Engine:
        return cast(Server, self.server).engine

    # ----------------------------------------------------------------------------- plumbing

    def handle_one_request(self) -> None:
        # Waiting for the next request on a kept-alive connection: closed after keep_alive_s idle.
        self.connection.settimeout(self.keep_alive_s)
        try:
            waiting = cast(Any, self.rfile).peek(1)
        except OSError:  # TimeoutError included
            waiting = b""
        finally:
            self.connection.settimeout(None)
        if not waiting:
            self.close_connection = True
            return
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        while ok and self.engine.hung():
            # The hang fault: request read, no answer while it lasts.
            time.sleep(HOLD_POLL_S)
        return ok

    def _client_gone(self) -> bool:
        """Whether the client closed its connection (or reset it): polled, never blocking. A
        pipelined next request is data, not a close."""
        try:
            poller = select.poll()
            poller.register(self.connection, select.POLLIN | _POLL_GONE)
            events = poller.poll(0)
            if not events:
                return False
            if events[0][1] & _POLL_GONE:
                return True
            return bool(self.connection.recv(1, socket.MSG_PEEK) == b"")
        except (OSError, ValueError):
            return True

    def _aborted(self, request_id: str, gone: ClientGone | None = None) -> None:
        self.close_connection = True
        if gone is None or not gone.logged:
            vlog.log("v1/engine/async_llm.py:553", f"Aborted request(s) {request_id}.", proc=vlog.API)

    def end_headers(self) -> None:
        self.send_header("X-Standin-Answers", answers.VARIANT)
        super().end_headers()

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        try:
            phrase = http.HTTPStatus(int(code)).phrase
        except ValueError:
            phrase = ""
        host, port = self.client_address[:2]
        vlog.uvicorn(f'{host}:{port} - "{self.requestline}" {code} {phrase}')

    def log_message(self, format: str, *args: Any) -> None:
        vlog.log("launcher.py:99", format % args, level="WARNING", proc=vlog.API)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, data: Any) -> None:
        self._send(status, json.dumps(data).encode(), "application/json")

    def _error(self, e: ApiError) -> None:
        self._json(e.status, {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}})

    def _read_chunked(self) -> bytes:
        """A Transfer-Encoding: chunked request body (what h11 reads for uvicorn)."""
        parts: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                self.close_connection = True
                raise ApiError(400, "malformed chunked request body") from None
            if size == 0:
                break
            total += size
            if total > MAX_BODY:
                self.close_connection = True
                raise ApiError(413, "request body too large")
            data = self.rfile.read(size)
            if len(data) != size or self.rfile.read(2) != b"\r\n":
                self.close_connection = True
                raise ApiError(400, "malformed chunked request body")
            parts.append(data)
        while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
            pass  # trailers
        return b"".join(parts)

    def _body(self) -> dict[str, Any]:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raw = self._read_chunked()
        else:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                self.close_connection = True
                raise ApiError(400, "invalid Content-Length") from None
            if length > MAX_BODY:
                self.close_connection = True
                raise ApiError(413, "request body too large")
            raw = self.rfile.read(length) if length > 0 else b""
        try:
            data = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object")
        return data

    # ----------------------------------------------------------------------------- routes

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/ping"):
            # EngineDeadError: 503 (vllm-project/vllm#24897); a deadlocked engine core: still 200
            dead = self.engine.mode() == "engine_dead"
            self._send(503 if dead else 200, b"", "application/json")
        elif path == "/version":
            self._json(200, {"version": f"{__version__}+standin"})
        elif path == "/v1/models":
            self._json(200, self._models())
        elif path == "/metrics":
            self._send(200, self.engine.stats.render().encode(), "text/plain; version=0.0.4; charset=utf-8")
        elif path in ("/v1/completions", "/v1/chat/completions"):
            self._json(405, {"detail": "Method Not Allowed"})
        else:
            self._json(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/completions", "/v1/chat/completions"):
            self.close_connection = True  # the body was not read
            if path in ("/health", "/ping", "/version", "/v1/models", "/metrics"):
                self._json(405, {"detail": "Method Not Allowed"})
            else:
                self._json(404, {"detail": "Not Found"})
            return
        self.engine.mode()  # a fault that ends the process does so before this request
        try:
            body = self._body()
            model = self._model(body)
            if path == "/v1/completions":
                self._completions(body, model)
            else:
                self._chat(body, model)
        except ApiError as e:
            self._error(e)

    def _models(self) -> dict[str, Any]:
        data: list[dict[str, Any]] = [
            {"id": name, "object": "model", "created": self.engine.created, "owned_by": "vllm",
             "root": self.engine.root, "parent": None, "max_model_len": self.engine.max_model_len,
             "permission": [], "standin_answers": answers.VARIANT}
            for name in self.engine.served_names
        ]
        return {"object": "list", "data": data}

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return self.engine.served_names[0]
        if model not in self.engine.served_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return str(model)

    # ----------------------------------------------------------------------------- generation

    def _generate(self, prompt: str, prompt_tokens: int, body: dict[str, Any]) -> Generation:
        limit = self.engine.max_model_len
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = max(1, limit - prompt_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens!r}.", param="max_tokens")
        if prompt_tokens + max_tokens > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} "
                                "in the completion). Please reduce the length of the messages or completion.")
        pieces = tokens(answers.answer(prompt))
        finish = "stop"
        if len(pieces) > max_tokens:
            pieces, finish = pieces[:max_tokens], "length"
        return Generation(prompt, prompt_tokens, pieces, finish)

    def _refuse_if_dead(self) -> None:
        """vLLM raises the engine's dead error before it answers, streamed or not (a 500)."""
        if self.engine.mode() == "engine_dead":
            self._log_dead()
            raise ApiError(500, ENGINE_DEAD_MESSAGE, "Internal Server Error")

    def _log_dead(self) -> None:
        vlog.log("entrypoints/openai/api_server.py:72", f"vllm.v1.engine.exceptions.EngineDeadError: {ENGINE_DEAD_MESSAGE}",
                 level="ERROR", proc=vlog.API)

    def _hold(self, request_id: str) -> bool:
        """Held while the engine core is deadlocked. A client that leaves meanwhile is logged as
        aborted at once (the API server lives); True when it left."""
        gone = False
        while self.engine.mode() == "deadlock":
            if not gone and self._client_gone():
                gone = True
                self._aborted(request_id)
            time.sleep(HOLD_POLL_S)
        return gone

    def _admit(self, request_id: str) -> None:
        """The request reaches the engine core: queued as waiting while it is deadlocked (the token
        counters frozen, vllm:num_requests_waiting one higher), refused when it is dead."""
        stats = self.engine.stats
        if self.engine.mode() == "deadlock":
            stats.wait(1)
            try:
                gone = self._hold(request_id)
            finally:
                stats.wait(-1)
            if gone:
                stats.abort_waiting()
                raise ClientGone(logged=True)
        if self.engine.mode() == "engine_dead":
            raise EngineDead()

    def _step(self, request_id: str) -> None:
        """Before each token: its delay (collapsed or not), a deadlock held, a dead engine or a client
        that left raised."""
        delay = self.engine.armed.token_seconds()
        end = time.monotonic() + delay
        while (left := end - time.monotonic()) > 0:
            if self._client_gone():
                raise ClientGone()
            time.sleep(min(left, HOLD_POLL_S))
        if self.engine.mode() == "deadlock" and self._hold(request_id):
            raise ClientGone(logged=True)
        if self.engine.mode() == "engine_dead":
            raise EngineDead()
        if self._client_gone():
            raise ClientGone()

    def _run(self, gen: Generation, emit: Any, request_id: str) -> None:
        """Emit GEN's pieces through EMIT while the metrics count the request in the batch."""
        stats = self.engine.stats
        started = time.monotonic()
        stats.start(gen.prompt, gen.prompt_tokens)
        reason = "abort"
        emitted = 0
        try:
            for i, piece in enumerate(gen.pieces):
                self._step(request_id)
                if i == 0:
                    stats.first_token(time.monotonic() - started)
                stats.token()
                emitted += 1
                emit(piece)
            if not gen.pieces:
                stats.first_token(time.monotonic() - started)
            reason = gen.finish_reason
        finally:
            stats.finish(gen.prompt_tokens, emitted, reason)

    def _stream_error(self, message: str) -> None:
        """An error inside a stream already answered 200, as vLLM's stream generators send it."""
        self._event({"error": {"message": message, "type": "Internal Server Error", "param": None, "code": 500}})
        self._end_stream()

    def _answer(self, stream: bool, request_id: str, produce: Callable[[], None]) -> None:
        """Run PRODUCE (admission, tokens, the last events or the JSON answer) with the faults' and
        the client's endings: an abort, a dead engine."""
        try:
            try:
                produce()
            finally:
                # counted once it has ended: a fault "after N requests" meets the ones after the Nth
                self.engine.armed.count_request()
        except ClientGone as e:
            self._aborted(request_id, e)
        except (BrokenPipeError, ConnectionResetError):
            self._aborted(request_id)
        except EngineDead:
            self._log_dead()
            if not stream:
                self._error(ApiError(500, ENGINE_DEAD_MESSAGE, "Internal Server Error"))
                return
            try:
                self._stream_error(ENGINE_DEAD_MESSAGE)
            except OSError:
                self.close_connection = True

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _event(self, data: Any) -> None:
        payload = b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        self.wfile.flush()

    def _end_stream(self) -> None:
        self._event(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _completions(self, body: dict[str, Any], model: str) -> None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt = " ".join(str(t) for t in prompt)
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
        gen = self._generate(prompt, max(1, len(tokens(prompt))), body)
        self._refuse_if_dead()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
        if body.get("stream"):
            self._start_stream()

            def emit(piece: str) -> None:
                choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": None, "stop_reason": None}
                self._event({**head, "choices": [choice]})

            def stream() -> None:
                self._admit(request_id)
                self._run(gen, emit, request_id)
                last = {"index": 0, "text": "", "logprobs": None, "finish_reason": gen.finish_reason,
                        "stop_reason": None}
                self._event({**head, "choices": [last]})
                if (body.get("stream_options") or {}).get("include_usage"):
                    self._event({**head, "choices": [], "usage": gen.usage()})
                self._end_stream()

            self._answer(True, request_id, stream)
            return

        def whole() -> None:
            self._admit(request_id)
            self._run(gen, lambda piece: None, request_id)
            choice = {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
            self._json(200, {**head, "choices": [choice], "usage": gen.usage()})

        self._answer(False, request_id, whole)

    def _chat(self, body: dict[str, Any], model: str) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list", param="messages")
        texts: list[str] = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            texts.append(content if isinstance(content, str) else "")
        users = [t for m, t in zip(messages, texts, strict=True) if isinstance(m, dict) and m.get("role") == "user"]
        prompt = users[-1] if users else ""
        # Every message adds a few template tokens, as a chat template would.
        prompt_tokens = sum(len(tokens(t)) + 4 for t in texts) + 1
        gen = self._generate(prompt, prompt_tokens, body)
        self._refuse_if_dead()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        if body.get("stream"):
            self._start_stream()

            def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
                return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                             **({"stop_reason": None} if finish else {})}]}

            def stream() -> None:
                # the role chunk comes with the engine's first output: none while it is deadlocked
                self._admit(request_id)
                self._event(chunk({"role": "assistant", "content": ""}))
                self._run(gen, lambda piece: self._event(chunk({"content": piece})), request_id)
                self._event(chunk({"content": ""}, gen.finish_reason))
                if (body.get("stream_options") or {}).get("include_usage"):
                    self._event({**head, "choices": [], "usage": gen.usage()})
                self._end_stream()

            self._answer(True, request_id, stream)
            return

        def whole() -> None:
            self._admit(request_id)
            self._run(gen, lambda piece: None, request_id)
            said: dict[str, Any] = {"role": "assistant", "content": gen.text, "reasoning_content": None,
                                    "tool_calls": []}
            choice = {"index": 0, "message": said, "logprobs": None, "finish_reason": gen.finish_reason,
                      "stop_reason": None}
            self._json(200, {**head, "object": "chat.completion", "choices": [choice], "usage": gen.usage()})

        self._answer(False, request_id, whole)
