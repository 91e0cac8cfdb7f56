# SPDX-License-Identifier: MIT
"""A latency-bound backend shaped like vLLM's OpenAI server, for the proxy rows of `make bench`
and the replica tests: `python -m bench.paced_engine PORT [CONCURRENCY SERVICE_S]`.

uvicorn + starlette (as vLLM serves, keep-alive 5 s). POST /v1/chat/completions: at most
CONCURRENCY requests at once (a semaphore, as an engine's batch caps them); streamed, the role
chunk and the first token after one token time, then one SSE `data:` chunk every TOKEN_S, then
the finish chunk and `data: [DONE]`; not streamed, one JSON answer after SERVICE_S. The work is
sleeping, so the host's 2 cores are left to the proxy and the clients, and both paths meet the
same fixed latencies. Every answer names the backend's port in X-Paced-Engine (which replica
answered, for the balancing tests) and the SHA-256 of the body it received in X-Paced-Body.
GET /metrics has vLLM's count of finished requests, which the balancer's check of replicas reads
(a replica is admitted once it has answered one: `start` sends that warm-up request, as the
engine's unit does, unless told not to), and vLLM's token counters and request gauges, which the
progress judge reads (prompt tokens counted as a request enters the batch, generated ones as they
are sent). POST /v1/completions answers the judge's canary the way a chat answer is made.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

MODEL = "bench/paced"
TOKEN_S = 0.02
SERVICE_S = 0.25
CONCURRENCY = 64
TOKENS = 32
PROMPT_TOKENS = 8  # each request's prompt, as counted


def chunk(head: dict[str, Any], delta: dict[str, str], finish: str | None = None) -> bytes:
    """One SSE event as vLLM writes it for a chat completion chunk."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return b"data: " + json.dumps({**head, "choices": [choice]}, separators=(",", ":")).encode() + b"\n\n"


def make_app(token_s: float = TOKEN_S, service_s: float = SERVICE_S, concurrency: int = CONCURRENCY, tokens: int = TOKENS,
             name: str = "") -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    batch = asyncio.Semaphore(concurrency)
    counter = iter(range(1 << 62))
    finished = [0]
    # vLLM's token counters and request gauges (the progress judge's signal)
    counts = {"prompt": 0, "generation": 0, "waiting": 0, "running": 0}

    @contextlib.asynccontextmanager
    async def in_batch() -> AsyncIterator[None]:
        """A request's place in the batch: waiting for it, then running (its prompt counted)."""
        counts["waiting"] += 1
        try:
            await batch.acquire()
        finally:
            counts["waiting"] -= 1
        counts["running"] += 1
        counts["prompt"] += PROMPT_TOKENS
        try:
            yield
        finally:
            counts["running"] -= 1
            batch.release()

    async def health(request: Request) -> Response:
        return Response(b"")

    async def metrics(request: Request) -> Response:
        labels = f'engine="0",model_name="{MODEL}"'
        text = ("# TYPE vllm:request_success_total counter\n"
                f'vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{MODEL}"}} {finished[0]:.1f}\n'
                "# TYPE vllm:prompt_tokens_total counter\n"
                f"vllm:prompt_tokens_total{{{labels}}} {counts['prompt']:.1f}\n"
                "# TYPE vllm:generation_tokens_total counter\n"
                f"vllm:generation_tokens_total{{{labels}}} {counts['generation']:.1f}\n"
                "# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{{{labels}}} {counts['running']:.1f}\n"
                "# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{{{labels}}} {counts['waiting']:.1f}\n")
        return Response(text.encode(), media_type="text/plain; version=0.0.4")

    async def completion(request: Request) -> Response:
        """POST /v1/completions, not streamed: the judge's canary (one token) after SERVICE_S."""
        body: dict[str, Any] = json.loads(await request.body())
        n = int(body.get("max_tokens") or tokens)
        async with in_batch():
            await asyncio.sleep(service_s)
        counts["generation"] += n
        finished[0] += 1
        return JSONResponse({"id": f"cmpl-{next(counter)}", "object": "text_completion", "created": int(time.time()),
                             "model": MODEL, "choices": [{"index": 0, "text": " tok" * n, "logprobs": None, "finish_reason": "length"}],
                             "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n}})

    async def chat(request: Request) -> Response:
        raw = await request.body()
        body: dict[str, Any] = json.loads(raw)
        # what this backend received, for the tests that check a request arrives as it was sent
        sent = {"X-Paced-Engine": name, "X-Paced-Body": hashlib.sha256(raw).hexdigest()}
        n = int(body.get("max_tokens") or tokens)
        head = {"id": f"chatcmpl-{next(counter)}", "object": "chat.completion.chunk", "created": int(time.time()), "model": MODEL}
        if not body.get("stream"):
            async with in_batch():
                await asyncio.sleep(service_s)
            counts["generation"] += n
            finished[0] += 1
            message = {"role": "assistant", "content": " tok" * n}
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n, "total_tokens": PROMPT_TOKENS + n}
            return JSONResponse({**head, "object": "chat.completion",
                                 "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
                                 "usage": usage}, headers=sent)

        async def events() -> AsyncIterator[bytes]:
            async with in_batch():
                start = time.monotonic()
                await asyncio.sleep(token_s)  # the prefill: one token time
                yield chunk(head, {"role": "assistant", "content": ""})
                for i in range(n):
                    # paced against the start, so a late wake-up does not push every later token
                    await asyncio.sleep(max(0.0, start + (i + 1) * token_s - time.monotonic()))
                    counts["generation"] += 1
                    yield chunk(head, {"content": " tok"})
                yield chunk(head, {"content": ""}, "stop")
                yield b"data: [DONE]\n\n"
                finished[0] += 1

        return StreamingResponse(events(), media_type="text/event-stream", headers=sent)

    return Starlette(routes=[Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/completions", completion, methods=["POST"])])


@contextlib.contextmanager
def running(ports: list[int], work: Path, concurrency: int = CONCURRENCY, service_s: float = SERVICE_S) -> Iterator[dict[int, Any]]:
    """A paced backend on each of PORTS until the block ends (its process by port; a test may kill
    one and start it again with `start`); ready once each port connects."""
    from testkit import caddy

    procs = {port: start(port, work, concurrency, service_s) for port in ports}
    try:
        yield procs
    finally:
        for proc in procs.values():
            caddy.stop(proc)


def warm(port: int) -> None:
    """The warm-up request: one completion straight to the backend on PORT."""
    import urllib.request

    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def start(port: int, work: Path, concurrency: int = CONCURRENCY, service_s: float = SERVICE_S, *, warmed: bool = True) -> Any:
    """One paced backend on PORT (log in WORK/engine-PORT.log), once it connects; WARMED: once it
    has answered the warm-up request too."""
    from testkit import caddy

    root = Path(__file__).resolve().parents[1]
    log = work / f"engine-{port}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "bench.paced_engine", str(port), str(concurrency), str(service_s)], cwd=root,
                                env={**os.environ, "PYTHONPATH": str(root)}, stdout=out, stderr=subprocess.STDOUT)
    caddy.wait_ready("the paced backend (needs uvicorn and starlette)", lambda: caddy.connects(port), proc, log)
    if warmed:
        warm(port)
    return proc


def main(argv: list[str]) -> None:
    import uvicorn

    # vLLM's defaults: uvicorn, keep-alive 5 s, no access log
    port = argv[0]
    concurrency, service_s = (int(argv[1]), float(argv[2])) if len(argv) > 2 else (CONCURRENCY, SERVICE_S)
    uvicorn.run(make_app(name=port, concurrency=concurrency, service_s=service_s), host="127.0.0.1", port=int(port),
                log_level="warning", access_log=False, timeout_keep_alive=5)

if __name__ == "__main__":
    main(sys.argv[1:])
