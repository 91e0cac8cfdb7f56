# SPDX-License-Identifier: MIT
"""What the engine's own arguments bound for the proxies in front of it: the context length
(`--max-model-len`), and from it how long one request can last, which the proxy (Caddy) and the
balancer (HAProxy) take as the longest they keep an upstream connection waiting.

Both proxies cancel a request at the engine as soon as its client goes away (vLLM aborts a request
whose connection closes); this bound is the backstop for a client that stays and an engine that
never answers (the progress judge restarts a stalled replica well before it).
"""

from __future__ import annotations

import math
import re

from appliance.config.model import Config

# Without --max-model-len (the model's own context applies), this many tokens are assumed.
FALLBACK_CONTEXT = 131072
# The slowest one request's tokens come on a busy engine that still makes progress (per request,
# tokens per second): a full batch of a large model decodes tens of tokens per second per request;
# a throughput collapse below this is the progress judge's to see, not the proxies'.
MIN_TOKENS_PER_S = 10
# Before the first token: the wait in the engine's queue and the prefill of a context-long prompt.
FIRST_TOKEN_S = 600


def max_model_len(args: tuple[str, ...] | list[str]) -> int | None:
    """--max-model-len from the engine's arguments (N, 'Nk' as vLLM takes it), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == "--max-model-len" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--max-model-len="):
            value = arg.split("=", 1)[1]
    if value is None:
        return None
    m = re.fullmatch(r"([0-9]+)([kKmM]?)", value.strip())
    if not m:
        return None
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}[m.group(2)]
    return int(m.group(1)) * scale


def context_tokens(config: Config) -> int:
    """The most tokens (prompt and answer together) one request can hold."""
    return max_model_len(config.engine.args) or FALLBACK_CONTEXT


def request_bound_s(config: Config) -> int:
    """The longest one request can last: its first token, then a whole context of tokens at the
    slowest rate that still counts as progress. A non-streamed answer sends nothing before its
    end, so the proxies wait this long for it; a streamed one resets their wait at each chunk."""
    return FIRST_TOKEN_S + math.ceil(context_tokens(config) / MIN_TOKENS_PER_S)
