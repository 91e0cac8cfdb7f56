"""Read vLLM's /metrics: a parser for the Prometheus text exposition format and the figures
`applianctl status` shows from it.

Counters are exposed with a `_total` suffix and each has a `_created` gauge beside it; vLLM
renamed some series over time (`gpu_cache_usage_perc` -> `kv_cache_usage_perc`,
`gpu_prefix_cache_*` -> `prefix_cache_*`), so every figure names the series it accepts, newest
first. With several engines (data parallel) a figure is summed over their label sets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class ParseError(ValueError):
    """A line that is not Prometheus text format."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LINE = re.compile(rf"^({_NAME})(?:\{{(.*)\}})?\s+(\S+)(?:\s+-?\d+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r"\\[\\\"n]", lambda m: _ESCAPES[m.group(0)], value)


def _labels(text: str, lineno: int) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            raise ParseError(f"line {lineno}: bad label set {{{text}}}")
        out.append((m.group(1), _unescape(m.group(2))))
        pos = m.end()
    return tuple(out)


def _value(text: str, lineno: int) -> float:
    special = {"+Inf": math.inf, "-Inf": -math.inf, "Inf": math.inf, "NaN": math.nan}
    if text in special:
        return special[text]
    try:
        return float(text)
    except ValueError:
        raise ParseError(f"line {lineno}: bad value {text!r}") from None


def parse(text: str) -> list[Sample]:
    """Every sample in TEXT; comments (# HELP, # TYPE) and blank lines are skipped."""
    samples = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ParseError(f"line {lineno}: not a sample: {line[:80]!r}")
        name, labels, value = m.groups()
        samples.append(Sample(name, _labels(labels or "", lineno), _value(value, lineno)))
    return samples


def total(samples: Iterable[Sample], *names: str) -> float | None:
    """The sum over label sets of the first of NAMES that is present (each tried as given and
    with `_total`), or None when none is."""
    samples = list(samples)
    for name in names:
        for candidate in (name, name + "_total"):
            values = [s.value for s in samples if s.name == candidate]
            if values:
                return sum(values)
    return None


def highest(samples: Iterable[Sample], *names: str) -> float | None:
    """The highest value over label sets of the first of NAMES that is present."""
    samples = list(samples)
    for name in names:
        values = [s.value for s in samples if s.name == name]
        if values:
            return max(values)
    return None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _first_pair(samples: Sequence[Sample], pairs: Sequence[tuple[str, str]]) -> tuple[float | None, float | None]:
    for num, den in pairs:
        n, d = total(samples, num), total(samples, den)
        if n is not None and d is not None:
            return n, d
    return None, None


def engine_summary(samples: Sequence[Sample]) -> dict[str, Any]:
    """The figures status shows for the engine; None where the engine does not expose them."""
    hits, queries = _first_pair(
        samples,
        [
            ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
            ("vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"),
        ],
    )
    accepted = total(samples, "vllm:spec_decode_num_accepted_tokens")
    drafted = total(samples, "vllm:spec_decode_num_draft_tokens")
    ttft_sum = total(samples, "vllm:time_to_first_token_seconds_sum")
    ttft_count = total(samples, "vllm:time_to_first_token_seconds_count")
    running = total(samples, "vllm:num_requests_running")
    waiting = total(samples, "vllm:num_requests_waiting")
    return {
        "requests_running": None if running is None else int(running),
        "requests_waiting": None if waiting is None else int(waiting),
        "kv_cache_usage": highest(samples, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "prefix_cache_hit_rate": ratio(hits, queries),
        "spec_decode_acceptance_rate": ratio(accepted, drafted),
        "mean_ttft_s": ratio(ttft_sum, ttft_count),
    }
