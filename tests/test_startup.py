# SPDX-License-Identifier: MIT
"""The startup report: vLLM's real recorded logs, the runbook's lines, and the stand-in's own output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from repository import FIXTURES as ALL_FIXTURES

from applianctl.engine.startup import Report, parse
from testkit.standin import ROOT, StandinProcess

pytestmark = pytest.mark.timeout(60)

FIXTURES = ALL_FIXTURES / "vllm"
PRODUCTION = tomllib.loads((ROOT / "appliance.toml").read_text())["expected"]
E = "(EngineCore_DP0 pid=278) INFO 08-04"
RUNBOOK = [  # docs/reference-stack.md, the runbook: a healthy production start, in order
    f"{E} 10:00:00 [gpu_model_runner.py:2598] Model loading took 156.67 GiB and 240.1 seconds",
    f"{E} 10:00:05 [speculator.py:112] DSpark draft model loaded: 96 params",
    f"{E} 10:02:00 [kv_cache_utils.py:1087] GPU KV cache size: 1,927,444 tokens",
    f"{E} 10:02:00 [kv_cache_utils.py:1091] Maximum concurrency for 262,144 tokens per request: 7.35x",
    f"{E} 10:02:30 [shared_offload_region.py:68] Created mmap file /dev/shm/vllm_offload_1_dp0.mmap (103.08 GB)",
    "Capturing CUDA graphs (decode, FULL): 100%|██████████| 35/35 [00:20<00:00,  1.70it/s]",
    "(APIServer pid=8) INFO 08-04 10:03:10 [api_server.py:1895] Starting vLLM API server 0 on http://0.0.0.0:8000",
    "(APIServer pid=8) INFO:     Application startup complete.",
]


def _fixture(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


def test_v1_rocm_log_figures_and_times() -> None:
    report = parse(_fixture("startup-rocm-v1-gemma3-27b-mi300x-class.log"), {})
    assert report.figures == {"model_memory_gib": 51.7891, "kv_cache_tokens": 205696, "max_concurrency": 50.05,
                              "cuda_graphs": True, "ready": True}
    # from vLLM's own stamps: first line 13:38:11, model 13:39:07, KV 13:40:28, last stamp 13:40:51
    assert report.reached_s == {"model_memory_gib": 56.0, "kv_cache_tokens": 137.0, "max_concurrency": 137.0,
                                "cuda_graphs": 137.0, "ready": 160.0}
    assert report.state == "ok"


def test_v1_rocm_log_against_production_expectations_is_degraded() -> None:
    report = parse(_fixture("startup-rocm-v1-gemma3-27b-mi300x-class.log"), PRODUCTION)
    data = report.to_json()
    assert data["state"] == "degraded" and data["ok"] is False
    assert "GPU KV cache 205696 tokens is below the expected 1927444 tokens" in data["reason"]
    assert "no KV offload mmap line before startup completed" in data["reason"]
    assert "maximum concurrency" not in data["reason"]  # 50.05x is above 7.35x
    assert "\n" not in data["reason"]


def test_v0_log_without_commas_or_ready_line() -> None:
    # a stopped clock: the unstamped lines before the first stamp take no time (a loaded host took 17 ms)
    report = parse(_fixture("startup-rocm-v0-mi300x-llama31-8b-vllm0.9.log"), {"max_concurrency": 7.0}, clock=lambda: 0.0)
    assert report.figures == {"model_memory_gib": 15.3047, "max_concurrency": 7.69, "cuda_graphs": True}
    assert report.reached_s["model_memory_gib"] == 26.0  # 17:11:10 -> 17:11:36
    assert report.state == "loading"


def test_offload_mmap_line() -> None:
    report = parse(_fixture("kv-offload-created-mmap-logline-excerpt-vllm44888.log"), {"offload_mmap_gb": 3.0})
    assert report.figures == {"offload_mmap_gb": 3.22}
    assert report.state == "loading"


@pytest.mark.parametrize("prefix", ["", "vllm-1  | ", "Aug 04 10:00:00 dsv4-appliance appliance-engine[4242]: "])
def test_runbook_start_is_ok_with_any_prefix(prefix: str) -> None:
    report = parse([prefix + line for line in RUNBOOK], PRODUCTION)
    assert report.figures == {"model_memory_gib": 156.67, "draft_params": 96, "kv_cache_tokens": 1927444,
                              "max_concurrency": 7.35, "offload_mmap_gb": 103.08, "cuda_graphs": True, "ready": True}
    assert report.state == "ok", report.reason
    assert report.reached_s["ready"] == 190.0 and report.reached_s["cuda_graphs"] == 150.0


def test_fewer_kv_tokens_is_degraded_and_more_is_ok() -> None:
    fewer = [line.replace("1,927,444", "1,900,000") for line in RUNBOOK]
    report = parse(fewer, PRODUCTION)
    assert report.state == "degraded"
    assert report.reason == "GPU KV cache 1900000 tokens is below the expected 1927444 tokens"
    more = [line.replace("1,927,444", "2,000,000") for line in RUNBOOK]
    assert parse(more, PRODUCTION).state == "ok"
    assert parse(fewer, {**PRODUCTION, "kv_cache_tokens": None}).state == "ok"  # no expectation: not compared
    assert parse([*RUNBOOK[:3], RUNBOOK[2].replace("1,927,444", "10")], PRODUCTION).state == "degraded"


def test_a_new_start_resets_the_report() -> None:
    report = parse(RUNBOOK, PRODUCTION)
    assert report.state == "ok"
    report.feed("(EngineCore_DP0 pid=9) INFO 08-04 11:00:00 [gpu_model_runner.py:2598] Model loading took 156.67 GiB")
    assert report.state == "loading"
    assert report.figures == {"model_memory_gib": 156.67} and report.reached_s == {"model_memory_gib": 0.0}


def test_lines_without_stamps_take_the_clock() -> None:
    now = [100.0]
    report = Report(expected={}, clock=lambda: now[0])
    report.feed("Model loading took 1.5 GiB")
    now[0] = 112.5
    report.feed("Application startup complete.")
    assert report.reached_s == {"model_memory_gib": 0.0, "ready": 12.5}


def _demo_expected(appliance_json: Callable[[str], Path]) -> dict[str, object]:
    expected = json.loads(appliance_json("demo").read_text())["expected"]
    return {k: v for k, v in expected.items() if v is not None}


def test_standin_output_meets_the_demo_expectations(shm_dir: Path, appliance_json: Callable[[str], Path]) -> None:
    demo = tomllib.loads((ROOT / "appliance.toml").read_text())["profiles"]["demo"]
    proc = StandinProcess(demo["engine"]["args"], env={"STANDIN_SHM_DIR": str(shm_dir), "STANDIN_LOAD_SECONDS": "1"})
    try:
        proc.wait_ready()
    finally:
        proc.stop()
    expected = _demo_expected(appliance_json)
    report = parse(proc.lines, expected)
    assert report.state == "ok", report.reason
    for name, value in expected.items():
        assert report.figures[name] == value, name
    assert report.figures["cuda_graphs"] and report.figures["ready"]
    assert list(report.reached_s) == ["model_memory_gib", "draft_params", "kv_cache_tokens", "max_concurrency",
                                      "offload_mmap_gb", "cuda_graphs", "ready"]


def test_standin_with_a_small_kv_cache_is_degraded(shm_dir: Path, appliance_json: Callable[[str], Path]) -> None:
    demo = tomllib.loads((ROOT / "appliance.toml").read_text())["profiles"]["demo"]
    proc = StandinProcess(demo["engine"]["args"], env={"STANDIN_SHM_DIR": str(shm_dir),
                                                       "STANDIN_KV_CACHE_TOKENS": "32768"})
    try:
        proc.wait_ready()
    finally:
        proc.stop()
    report = parse(proc.lines, _demo_expected(appliance_json))
    assert report.state == "degraded"
    assert "GPU KV cache 32768 tokens is below the expected 65536 tokens" in report.reason
    assert "maximum concurrency 8.0x is below the expected 16.0x" in report.reason


# ------------------------------------------------------------------------------------------- command line


def _env(appliance_json: Callable[[str], Path], run_dir: Path, profile: str = "production") -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "APPLIANCE_CONFIG": str(appliance_json(profile)),
            "APPLIANCE_RUN_DIR": str(run_dir)}


def test_cli_from_file_and_stdin(tmp_path: Path, appliance_json: Callable[[str], Path]) -> None:
    log = tmp_path / "engine.log"
    log.write_text("\n".join("vllm-1  | " + line for line in RUNBOOK) + "\n")
    command = [sys.executable, "-m", "applianctl", "startup-report"]
    done = subprocess.run([*command, "--from", str(log)], cwd=ROOT, env=_env(appliance_json, tmp_path),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "startup-report.json").read_text())
    assert report["state"] == "ok" and report["figures"]["kv_cache_tokens"] == 1927444
    assert set(report) >= {"state", "reason", "figures", "reached_s", "expected"}
    assert report["expected"]["offload_mmap_gb"] == 103.08
    fixture = (FIXTURES / "startup-rocm-v1-gemma3-27b-mi300x-class.log").read_text()
    done = subprocess.run([*command, "--from", "-"], input=fixture, cwd=ROOT, env=_env(appliance_json, tmp_path),
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert json.loads((tmp_path / "startup-report.json").read_text())["state"] == "degraded"
    assert "below the expected 1927444" in done.stderr


def _wait_for_state(path: Path, state: str, timeout: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if path.exists():
            last = json.loads(path.read_text())
            if last["state"] == state:
                return last
        time.sleep(0.1)
    raise AssertionError(f"report never became {state}: {last}")


def test_cli_follow_rewrites_the_report_and_resets_on_restart(tmp_path: Path,
                                                               appliance_json: Callable[[str], Path]) -> None:
    log = tmp_path / "engine.log"
    log.write_text("")
    out = tmp_path / "startup-report.json"
    proc = subprocess.Popen([sys.executable, "-m", "applianctl", "startup-report", "--follow", "--from", str(log)],
                            cwd=ROOT, env=_env(appliance_json, tmp_path), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        assert _wait_for_state(out, "loading")["figures"] == {}
        with log.open("a") as f:
            f.write("\n".join(RUNBOOK[:3]) + "\n")
        _wait_for_state(out, "loading")
        deadline = time.monotonic() + 10
        while json.loads(out.read_text())["figures"].get("kv_cache_tokens") != 1927444:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with log.open("a") as f:
            f.write("\n".join(RUNBOOK[3:]) + "\n")
        assert _wait_for_state(out, "ok")["figures"]["ready"] is True
        with log.open("a") as f:  # the engine restarts, and comes up short
            f.write("\n".join(line.replace("1,927,444", "1,000") for line in RUNBOOK) + "\n")
        report = _wait_for_state(out, "degraded")
        assert report["figures"]["kv_cache_tokens"] == 1000
    finally:
        proc.terminate()
        proc.wait(10)
