# SPDX-License-Identifier: MIT
"""vLLM's /metrics through prometheus_client's parsers, and the figures `applianctl status` shows.

vLLM renamed series over time (`gpu_cache_usage_perc` -> `kv_cache_usage_perc`, `gpu_prefix_cache_*`
-> `prefix_cache_*`), so each figure names the series it accepts, newest first; with data parallel
it is summed over label sets. What the engine may add later must not make a healthy engine
"degraded": exemplars are dropped, a family of an unknown type is read as untyped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

OPENMETRICS = "application/openmetrics-text"
# The types prometheus_client's text-format parser accepts; any other `# TYPE` line is dropped
# so its samples are read as untyped instead of failing the whole scrape.
_TEXT_TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}
_TYPE_LINE = re.compile(r"^#\s*TYPE\s+\S+\s+(\S+)\s*\Z")


class ParseError(ValueError):
    """A scrape that is not Prometheus text or OpenMetrics format."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def _drop_exemplar(line: str) -> str:
    """LINE without a trailing exemplar (` # {labels} value [timestamp]`), quotes respected.
    Older prometheus_client text parsers (Debian's) do not know exemplars."""
    quoted = escaped = False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = quoted
        elif ch == '"':
            quoted = not quoted
        elif ch == "#" and not quoted and i and line[i - 1] in " \t":
            return line[:i].rstrip()
    return line


def _text_format(text: str) -> str:
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            m = _TYPE_LINE.match(stripped)
            if m and m.group(1) not in _TEXT_TYPES:
                continue
            out.append(stripped)
        elif stripped:
            out.append(_drop_exemplar(stripped))
    return "\n".join(out) + "\n"


def _parsers() -> tuple[Any, Any]:
    """prometheus_client's two parser modules, without running the package's __init__: it imports
    the HTTP exposition server, about 100 ms (a third of status's budget) for code status never
    runs. When the package is not yet imported it is registered bare (its __path__ only)."""
    import importlib
    import importlib.util
    import sys

    bare = None
    if "prometheus_client" not in sys.modules:
        spec = importlib.util.find_spec("prometheus_client")
        if spec is not None and spec.submodule_search_locations is not None:
            bare = importlib.util.module_from_spec(spec)  # not executed: no __init__ side effects
            sys.modules["prometheus_client"] = bare
    try:
        return (
            importlib.import_module("prometheus_client.parser"),
            importlib.import_module("prometheus_client.openmetrics.parser"),
        )
    finally:
        # Whoever imports the package later gets the whole package (its __init__ runs then).
        if bare is not None and sys.modules.get("prometheus_client") is bare:
            del sys.modules["prometheus_client"]


def parse(text: str, content_type: str = "") -> list[Sample]:
    """Every sample in TEXT: OpenMetrics when CONTENT_TYPE says so or the text ends in `# EOF`,
    the Prometheus text format otherwise."""
    parser, openmetrics_parser = _parsers()

    try:
        if content_type.startswith(OPENMETRICS) or text.rstrip().endswith("# EOF"):
            families = list(openmetrics_parser.text_string_to_metric_families(text))
        else:
            families = list(parser.text_string_to_metric_families(_text_format(text)))
    except (ValueError, TypeError, IndexError) as e:
        raise ParseError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    return [
        Sample(s.name, tuple(sorted(s.labels.items())), float(s.value)) for family in families for s in family.samples
    ]


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
