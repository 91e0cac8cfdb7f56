# SPDX-License-Identifier: MIT
"""`make bench`'s runner (bench/common.py measure): a benchmark that cannot measure its figure fails
the run and is named, and the others still run; every run is recorded (bench/report.py). No real
benchmark runs here (tests/test_bench_setup.py runs each one small)."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance.errors import UserError
from bench.common import run_benches

CONFIG = object()


def _benches(ran: list[str]) -> list[Any]:
    def bench_ok(config: Any) -> None:
        ran.append("bench_ok" if config is CONFIG or config.profile == "demo" else "bench_ok with another config")
        print("bench_ok figure")

    def bench_raises(config: Any) -> None:
        ran.append("bench_raises")
        raise RuntimeError("no loop device\nsecond line")

    def bench_refused(config: Any) -> None:
        ran.append("bench_refused")
        raise UserError("no image at out/demo", hint="build it first")

    def bench_last(config: Any) -> None:
        ran.append("bench_last")

    return [bench_ok, bench_raises, bench_refused, bench_last]


def test_a_benchmark_that_raises_fails_the_run_and_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []
    assert run_benches(_benches(ran), CONFIG) == 1
    assert ran == ["bench_ok", "bench_raises", "bench_refused", "bench_last"]  # the others still ran
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "bench_ok figure",
        "bench_raises: not measured: RuntimeError: no loop device",
        "bench_refused: not measured: no image at out/demo",
    ]
    assert err == "bench: 2 figure(s) not measured: bench_raises, bench_refused\n"


def test_every_figure_measured_passes(capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []
    benches = _benches(ran)
    assert run_benches([benches[0], benches[3]], CONFIG) == 0
    assert ran == ["bench_ok", "bench_last"] and capsys.readouterr().err == ""


def test_bench_only_runs_those_and_a_failure_among_them_still_fails(capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []
    assert run_benches(_benches(ran), CONFIG, "bench_last") == 0
    assert ran == ["bench_last"]
    assert run_benches(_benches(ran), CONFIG, "bench_last,bench_raises") == 1
    assert ran == ["bench_last", "bench_raises", "bench_last"]


def test_bench_only_naming_no_benchmark_is_a_usage_fault(capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []
    assert run_benches(_benches(ran), CONFIG, "bench_typo") == 2
    assert ran == []
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "BENCH_ONLY: no benchmark bench_typo" and err[1].startswith("hint: one of: bench_ok, ")


def test_main_runs_every_benchmark_through_the_runner_and_records_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import bench.__main__
    from bench import report

    ran: list[str] = []
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\n{report.START}\nold\n{report.END}\n")
    monkeypatch.setattr(bench.__main__, "BENCHES", _benches(ran))
    monkeypatch.setattr(report, "commit", lambda: "unknown")  # git is a program: tests/test_bench_report.py runs it
    monkeypatch.delenv("BENCH_ONLY", raising=False)
    assert bench.__main__.main(tmp_path / "out", docs) == 1
    assert ran == ["bench_ok", "bench_raises", "bench_refused", "bench_last"]
    recorded = json.loads((tmp_path / "out/bench.json").read_text())
    assert recorded["ran"] == ran and set(recorded["not_measured"]) == {"bench_raises", "bench_refused"}
    assert "old" not in docs.read_text() and "| no image at out/demo | `bench_refused` |" in docs.read_text()


def test_a_run_of_some_benchmarks_leaves_the_docs_as_they_are(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import bench.__main__
    from bench import report

    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"{report.START}\nold\n{report.END}\n")
    monkeypatch.setattr(bench.__main__, "BENCHES", _benches([]))
    monkeypatch.setattr(report, "commit", lambda: "unknown")
    monkeypatch.setenv("BENCH_ONLY", "bench_last")
    assert bench.__main__.main(tmp_path / "out", docs) == 0
    assert "old" in docs.read_text() and json.loads((tmp_path / "out/bench.json").read_text())["ran"] == ["bench_last"]
    monkeypatch.setenv("BENCH_ONLY", "bench_typo")
    assert bench.__main__.main(tmp_path / "again", docs) == 2 and not (tmp_path / "again").exists()


# ------------------------------------------------------------------ ratios, percentiles, goals


def test_percentile_is_the_nearest_rank() -> None:
    from bench.common import percentile

    values = [float(v) for v in range(100, 0, -1)]  # unsorted on purpose
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([3.0, 1.0], 50) == 1.0 and percentile([3.0, 1.0], 51) == 3.0
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("values, q", [([], 50), ([1.0], 0), ([1.0], 101)])
def test_percentile_of_nothing_or_out_of_range_is_refused(values: list[float], q: float) -> None:
    from bench.common import percentile

    with pytest.raises(ValueError):
        percentile(values, q)


def test_a_baseline_of_zero_has_no_ratio() -> None:
    from bench.common import measured, ratio

    assert ratio(3.0, 2.0) == 1.5
    for base in (0.0, -1.0):
        with pytest.raises(ValueError, match="nothing measured"):
            ratio(1.0, base)
    with pytest.raises(ValueError):
        measured("a figure", 1.0, 0.0, "ms")


def test_a_figure_names_its_goal_and_whether_it_is_met(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.common import measured

    assert (measured("a", 1.05, 1.0, "s", at_most=1.05).goal, measured("a", 1.05, 1.0, "s", at_most=1.05).verdict) == ("<= 1.05x", "met")
    assert measured("a", 1.06, 1.0, "s", at_most=1.05).verdict == "NOT met"
    assert measured("a", 0.95, 1.0, "s", at_least=0.95).verdict == "met"
    assert measured("a", 0.94, 1.0, "s", at_least=0.95).verdict == "NOT met"
    both = measured("scrape", 300.0, 250.0, "ms", at_most=1.5, under=250)
    assert (both.goal, both.verdict) == ("<= 1.50x and under 250 ms", "NOT met")  # the ratio is met, the bound is not
    plain = measured("size", 2.0, 4.0, "MB", note="smaller is better")
    assert (plain.goal, plain.verdict, plain.ratio) == ("", "", 0.5)
    capsys.readouterr()
    line = measured("proxy stream, time to first token p50", 21.0, 20.0, "ms", at_most=1.05).line()
    assert line.split()[-6:] == ["ratio", "1.05x", "(goal", "<=", "1.05x:", "met)"] and "21.00 ms" in line
    assert capsys.readouterr().out == line + "\n"  # printed as it is measured


# ------------------------------------------------------------------ the proxy rows' client


class _Backend(http.server.ThreadingHTTPServer):
    """A chat endpoint that answers whole, or the ways a proxy can fail a client (MODE)."""

    daemon_threads = True
    mode = "whole"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        from bench import paced_engine

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = self.server.mode  # type: ignore[attr-defined]
        head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": paced_engine.MODEL}
        if mode == "502":
            payload, status = b'{"error": {"message": "bad gateway"}}', 502
        elif not body["stream"]:
            message = {"role": "assistant", "content": "" if mode == "empty" else " tok"}
            payload, status = json.dumps({**head, "choices": [{"index": 0, "message": message}]}).encode(), 200
        else:
            status = 200
            events = [paced_engine.chunk(head, {"role": "assistant", "content": ""})]
            tokens = {"whole": paced_engine.TOKENS, "cut": 3, "empty": 0, "no-done": paced_engine.TOKENS}[mode]
            events += [paced_engine.chunk(head, {"content": " tok"}) for _ in range(tokens)]
            if mode != "no-done":
                events += [paced_engine.chunk(head, {"content": ""}, "stop"), b"data: [DONE]\n\n"]
            payload = b"".join(events) if mode != "empty" else b""
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream" if body.get("stream") else "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if mode == "whole" and body["stream"]:
            for event in events:  # paced, so that each gap is a gap
                self.wfile.write(event)
                self.wfile.flush()
                time.sleep(0.001)
        else:
            self.wfile.write(payload)


@pytest.fixture
def backend() -> Iterator[_Backend]:
    server = _Backend(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _endpoint(server: _Backend) -> Any:
    from bench.proxy import Endpoint

    return Endpoint("direct", server.server_address[1])


def test_a_whole_stream_gives_its_first_token_time_and_every_gap(backend: _Backend) -> None:
    from bench import paced_engine
    from bench.proxy import answer_once, stream_once

    conn = _endpoint(backend).connect()
    first, gaps = stream_once(conn)
    again, _ = stream_once(conn)  # the same keep-alive connection, used again
    answer_once(conn)
    conn.close()
    assert first > 0 and again > 0 and len(gaps) == paced_engine.TOKENS - 1 and all(g >= 0 for g in gaps)


@pytest.mark.parametrize("mode, said", [
    ("empty", "0 of 32 tokens, no [DONE]"),  # the empty 200 through Caddy
    ("cut", "3 of 32 tokens"),
    ("no-done", "32 of 32 tokens, no [DONE]"),
    ("502", "HTTP 502"),
])
def test_an_answer_that_is_not_whole_is_no_figure(backend: _Backend, mode: str, said: str) -> None:
    from bench.proxy import IncompleteAnswer, answer_once, stream_once

    backend.mode = mode
    conn = _endpoint(backend).connect()
    with pytest.raises(IncompleteAnswer) as e:
        stream_once(conn)
    assert str(e.value).endswith(said)
    if mode in ("empty", "502"):
        with pytest.raises(IncompleteAnswer, match=r"no message|HTTP 502"):
            answer_once(_endpoint(backend).connect())


def test_rounds_alternate_so_that_drift_weighs_on_both_paths() -> None:
    from bench.proxy import alternating

    order = alternating(4)
    assert order == ["direct", "proxy", "proxy", "direct", "direct", "proxy", "proxy", "direct"]


def test_together_raises_the_first_real_failure_not_the_broken_barrier() -> None:
    from bench.proxy import IncompleteAnswer, together

    def work(i: int, barrier: threading.Barrier) -> int:
        if i == 3:
            raise IncompleteAnswer("client 3 got an empty answer")
        barrier.wait()
        return i

    with pytest.raises(IncompleteAnswer, match="client 3"):
        together(5, work)
    assert together(3, lambda i, barrier: (barrier.wait(), i)[1]) == [0, 1, 2]


def test_stream_figures_are_proxy_over_direct_per_percentile() -> None:
    from bench.proxy import stream_figures

    direct = ([0.020] * 99 + [0.040], [0.020] * 100)
    proxy = ([0.021] * 99 + [0.050], [0.020] * 99 + [0.030])
    figures = {name: (p, d) for name, p, d in stream_figures({"direct": direct, "proxy": proxy})}
    assert figures == {"time to first token p50": pytest.approx((21.0, 20.0)), "time to first token p99": pytest.approx((21.0, 20.0)),
                       "inter-token gap p50": pytest.approx((20.0, 20.0)), "inter-token gap p99": pytest.approx((20.0, 20.0))}
    with pytest.raises(ValueError, match="no samples"):
        stream_figures({"direct": direct, "proxy": ([], [])})


@contextlib.contextmanager
def _both_to(server: _Backend) -> Iterator[dict[str, Any]]:
    yield {"direct": _endpoint(server), "proxy": _endpoint(server)}


@pytest.mark.parametrize("bench_name, mode, said", [
    ("bench_proxy_stream", "empty", "IncompleteAnswer: streamed chat: 0 of 32 tokens, no [DONE]"),
    ("bench_proxy_rps", "502", "IncompleteAnswer: chat: HTTP 502"),
])
def test_a_proxy_row_that_gets_no_whole_answer_fails_the_run(backend: _Backend, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str], bench_name: str, mode: str,
                                                              said: str) -> None:
    from bench import proxy

    backend.mode = mode
    monkeypatch.setattr(proxy, "paths", lambda: _both_to(backend))
    assert run_benches([getattr(proxy, bench_name)], CONFIG) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"{bench_name}: not measured: {said}"]
    assert err == f"bench: 1 figure(s) not measured: {bench_name}\n"


def test_the_proxy_stream_row_prints_each_figure_with_its_goal(backend: _Backend, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from bench import proxy

    monkeypatch.setattr(proxy, "paths", lambda: _both_to(backend))
    original = proxy.stream_round
    monkeypatch.setattr(proxy, "stream_round", lambda endpoint, *size: original(endpoint, 2, 1))  # 2 streams, 1 each
    assert run_benches([proxy.bench_proxy_stream], CONFIG) == 0
    lines = capsys.readouterr().out.splitlines()
    figures = [line for line in lines if line.startswith("proxy stream, ")]
    assert [f.split(",")[1].split("(")[0].strip() for f in figures] == [
        "time to first token p50", "time to first token p99", "inter-token gap p50", "inter-token gap p99"]
    assert all("(goal <= 1.05x: " in f for f in figures)


@pytest.mark.programs
def test_the_proxy_rows_fail_the_run_without_caddy(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("uvicorn")
    from bench import proxy
    from testkit import caddy

    monkeypatch.setattr(caddy, "CADDY", "/nonexistent/caddy")
    assert run_benches([proxy.bench_proxy_stream], CONFIG) == 1
    assert capsys.readouterr().out.splitlines() == [
        "bench_proxy_stream: not measured: NotReady: /nonexistent/caddy: no caddy (apt install caddy)"]


# ------------------------------------------------------------------ bundle bytes: two real releases


def test_two_releases_sharing_an_engine_ship_it_once_by_the_release_codes_own_decision(tmp_path: Path) -> None:
    from fake_release import demo_config, fake_build, make_signing

    from appliance.signed import release_manifest
    from bench.upgrade import as_built, bundle_figures, engine_bytes_of, next_version, two_releases

    key, _ = make_signing(tmp_path)
    built = fake_build(tmp_path / "out", demo_config("1.0.0"), key)
    # the build's pin, not appliance.toml's (which may have moved on since the last build)
    demo = dataclasses.replace(demo_config("1.0.0"), engine=dataclasses.replace(demo_config("1.0.0").engine, digest="sha256:" + "0" * 64))
    config = as_built(demo, built)
    full, upgrade = two_releases(config, built, tmp_path / "work", key)
    assert (full.version, upgrade.version, next_version("1.9.9")) == ("1.0.0", "1.0.1", "1.9.10")
    assert full.engine_digest == upgrade.engine_digest == demo_config("1.0.0").engine.digest
    assert engine_bytes_of(full) > 0 and engine_bytes_of(upgrade) == 0  # release.py read 1.0.0's index and left it out
    signed = release_manifest.load(release_manifest.parse_canonical((tmp_path / "work/bundle-1.0.1/manifest.json").read_bytes()))
    assert signed.version == "1.0.1"
    upgrade_bytes, full_bytes, shipped = bundle_figures(full, upgrade)
    assert upgrade_bytes < full_bytes and shipped == 0
    # a "full" bundle without an engine would make the comparison true by construction
    with pytest.raises(RuntimeError, match="ships no engine image"):
        bundle_figures(upgrade, upgrade)
