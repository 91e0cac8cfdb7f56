# SPDX-License-Identifier: MIT
"""The Prometheus parser, against a real vLLM /metrics scrape (tests/fixtures/vllm/)."""

from __future__ import annotations

import math

import pytest
from repository import FIXTURES

from applianctl.status import metrics

PROM = FIXTURES / "vllm" / "metrics-v1-ngc-vllm25.09-qwen3-4b.prom"


@pytest.fixture(scope="module")
def samples() -> list[metrics.Sample]:
    return metrics.parse(PROM.read_text())


def test_parses_every_sample_line_of_the_real_scrape(samples: list[metrics.Sample]) -> None:
    lines = [line for line in PROM.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert len(samples) == len(lines)
    info = [s for s in samples if s.name == "vllm:cache_config_info"]
    assert info[0].label("num_gpu_blocks") == "850"
    assert info[0].value == 1.0


def test_summary_of_the_real_scrape(samples: list[metrics.Sample]) -> None:
    s = metrics.engine_summary(samples)
    assert s["requests_running"] == 0
    assert s["requests_waiting"] == 0
    assert s["kv_cache_usage"] == pytest.approx(0.0011764705882353343)
    assert s["prefix_cache_hit_rate"] == pytest.approx(80 / 246)
    assert s["mean_ttft_s"] == pytest.approx(0.24629998207092285 / 6)
    # The scrape was taken with speculative decoding off: no spec_decode series at all.
    assert s["spec_decode_acceptance_rate"] is None


def test_created_series_are_not_taken_for_counters(samples: list[metrics.Sample]) -> None:
    # prefix_cache_hits_created is a timestamp (1.77e9); the counter is prefix_cache_hits_total (80).
    assert metrics.total(samples, "vllm:prefix_cache_hits") == 80.0


def test_deprecated_prefix_cache_series_are_used_when_the_new_ones_are_absent(samples: list[metrics.Sample]) -> None:
    old_only = [s for s in samples if not s.name.startswith("vllm:prefix_cache_")]
    assert any(s.name == "vllm:gpu_prefix_cache_hits_total" for s in old_only)
    assert metrics.engine_summary(old_only)["prefix_cache_hit_rate"] == pytest.approx(80 / 246)
    no_kv = [s for s in old_only if s.name != "vllm:kv_cache_usage_perc"]
    assert metrics.engine_summary(no_kv)["kv_cache_usage"] == pytest.approx(0.0011764705882353343)


def test_spec_decode_acceptance_and_multiple_engines() -> None:
    # No recorded scrape has spec_decode series (fixtures/README.md, "Not found"); these lines
    # follow the stand-in's and vLLM's naming, two data-parallel engines summed.
    text = "\n".join(
        [
            "# TYPE vllm:spec_decode_num_draft_tokens counter",
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 700.0',
            'vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 300.0',
            'vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="m"} 1.7e+09',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 420.0',
            'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 180.0',
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
        ]
    )
    s = metrics.engine_summary(metrics.parse(text))
    assert s["spec_decode_acceptance_rate"] == pytest.approx(0.6)
    assert s["requests_running"] == 5


def test_escaped_labels_special_values_and_timestamps() -> None:
    text = 'a{path="C:\\\\x",q="say \\"hi\\"",n="l1\\nl2"} +Inf 1700000000000\nb NaN\nc{} -1.5e3\n'
    a, b, c = metrics.parse(text)
    assert dict(a.labels) == {"path": "C:\\x", "q": 'say "hi"', "n": "l1\nl2"}
    assert a.value == math.inf
    assert math.isnan(b.value)
    assert c.value == -1500.0


@pytest.mark.parametrize("line", ["vllm:x{a=1} 2", "vllm:x", "1abc 2", 'vllm:x{a="b"} two'])
def test_bad_lines_are_refused(line: str) -> None:
    with pytest.raises(metrics.ParseError):
        metrics.parse(line)


def test_ratio_without_traffic_is_none() -> None:
    assert metrics.ratio(0.0, 0.0) is None
    assert metrics.ratio(None, 3.0) is None


def _with_exemplars(text: str) -> str:
    """The real scrape with an exemplar on every histogram bucket, as vLLM would print them with
    tracing on (the text format's optional ` # {labels} value timestamp` suffix)."""
    out = []
    for line in text.splitlines():
        if "_bucket{" in line and not line.startswith("#"):
            line += ' # {trace_id="4bf92f3577b34da6a3ce929d0e0e4736",span="a # b"} 0.042 1771042382.5'
        out.append(line)
    return "\n".join(out) + "\n"


def test_exemplars_change_nothing(samples: list[metrics.Sample]) -> None:
    text = _with_exemplars(PROM.read_text())
    assert text.count("trace_id") > 10
    with_ex = metrics.parse(text)
    assert with_ex == samples
    assert metrics.engine_summary(with_ex) == metrics.engine_summary(samples)


@pytest.mark.parametrize("kind", ["gaugehistogram", "nativehistogram"])
def test_an_unknown_metric_family_is_read_not_refused(samples: list[metrics.Sample], kind: str) -> None:
    extra = (
        f"# HELP vllm:future_thing A family from a newer vLLM\n# TYPE vllm:future_thing {kind}\n"
        'vllm:future_thing_gcount{engine="0"} 4.0\n'
    )
    got = metrics.parse(PROM.read_text().rstrip("\n") + "\n" + extra)
    assert [s.value for s in got if s.name == "vllm:future_thing_gcount"] == [4.0]
    assert metrics.engine_summary(got) == metrics.engine_summary(samples)


def test_openmetrics_with_exemplars_and_unknown_families() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:prefix_cache_hits counter",
            'vllm:prefix_cache_hits_total{engine="0"} 30.0 # {trace_id="abc"} 1.0 1700000000.0',
            'vllm:prefix_cache_hits_created{engine="0"} 1.7e+09',
            "# TYPE vllm:prefix_cache_queries counter",
            'vllm:prefix_cache_queries_total{engine="0"} 120.0',
            "# TYPE vllm:new_family unknown",
            "vllm:new_family 7",
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0"} 2',
            "# EOF",
        ]
    )
    s = metrics.engine_summary(metrics.parse(text, "application/openmetrics-text; version=1.0.0"))
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert s["requests_running"] == 2


def test_a_truncated_openmetrics_scrape_is_refused() -> None:
    with pytest.raises(metrics.ParseError):
        metrics.parse("# TYPE a counter\na_total 1\n", "application/openmetrics-text")


def test_the_parsers_load_without_the_package_server_and_the_package_stays_whole() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from applianctl.status import metrics; metrics.parse('a 1\\n');"
        "assert 'http.server' not in sys.modules, 'exposition imported';"
        "import prometheus_client; from prometheus_client import parser;"
        "assert prometheus_client.Counter and parser.text_string_to_metric_families"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
