# SPDX-License-Identifier: MIT
"""A minimal server shaped like vLLM's (uvicorn + starlette, uvicorn's defaults: timeout_keep_alive 5 s,
h11, TCP_NODELAY) with the stand-in's answers, for the proxy soak: `python3 uvicorn_engine.py PORT`.

Only what the soak drives: GET /health and /v1/models, POST /v1/completions and /v1/chat/completions
(plain JSON, or server-sent events with "stream": true and stream_options.include_usage).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from standin import answers
from standin.server import tokens

MODEL = "standin/tiny-demo"


async def health(request: Request) -> Response:
    return Response(b"", media_type="application/json")


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm"}]})


def _usage(prompt: str, pieces: list[str]) -> dict[str, int]:
    n = max(1, len(tokens(prompt)))
    return {"prompt_tokens": n, "completion_tokens": len(pieces), "total_tokens": n + len(pieces)}


async def _generate(request: Request, chat: bool) -> Response:
    body: dict[str, Any] = await request.json()
    users = [m.get("content", "") for m in body.get("messages", []) if m.get("role") == "user"]
    prompt = (users[-1] if users else "") if chat else body["prompt"]
    pieces = tokens(answers.answer(prompt))
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": MODEL,
            "object": "chat.completion.chunk" if chat else "text_completion"}

    def choice(piece: str, finish: str | None = None) -> dict[str, Any]:
        if chat:
            return {"index": 0, "delta": {"content": piece}, "finish_reason": finish}
        return {"index": 0, "text": piece, "finish_reason": finish}

    if not body.get("stream"):
        text = "".join(pieces)
        c = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"} if chat
             else {"index": 0, "text": text, "finish_reason": "stop"})
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({**head, "object": obj, "choices": [c], "usage": _usage(prompt, pieces)})

    async def events() -> AsyncIterator[str]:
        if chat:
            yield "data: " + json.dumps({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                              "finish_reason": None}]}) + "\n\n"
        for piece in pieces:
            yield "data: " + json.dumps({**head, "choices": [choice(piece)]}) + "\n\n"
        yield "data: " + json.dumps({**head, "choices": [choice("", "stop")]}) + "\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            yield "data: " + json.dumps({**head, "choices": [], "usage": _usage(prompt, pieces)}) + "\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat(request: Request) -> Response:
    return await _generate(request, chat=True)


app = Starlette(routes=[
    Route("/health", health, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat, methods=["POST"]),
])

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_keep_alive=5)
