"""`make bench`'s runner (bench/common.py run_benches): a benchmark that cannot measure its figure
fails the run and is named, and the others still run. No real benchmark runs here."""

from __future__ import annotations

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


def test_main_runs_every_benchmark_through_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import __main__ as bench_main

    ran: list[str] = []
    monkeypatch.setattr(bench_main, "BENCHES", _benches(ran))
    monkeypatch.delenv("BENCH_ONLY", raising=False)
    assert bench_main.main() == 1
    assert ran == ["bench_ok", "bench_raises", "bench_refused", "bench_last"]
