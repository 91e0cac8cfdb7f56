# SPDX-License-Identifier: MIT
"""GPU metrics (applianctl/status/gpu_metrics.py) from the recorded outputs of the real tools
(tests/fixtures/gpu/), read back with prometheus_client's parser.

No full `amd-smi static|metric --json` from an MI300X is recorded (fixtures/README.md, "Not
found"), so the JSON here is derived, each test saying from what:
- from amd-smi's human-readable recordings, by undoing amd-smi's own formatter
  (ROCm/amdsmi@0ceca28 amdsmi_cli/amdsmi_logger.py `_convert_json_to_human_readable`: the JSON's
  keys upper-cased, nested by four spaces; amdsmi_helpers.py `unit_format`: `{"value": N, "unit": U}`
  printed as "N U"; temperatures are "°C" in text and "C" in JSON);
- from `amd-smi monitor -putm`, whose columns read the same gpu_metrics fields as `amd-smi metric`
  (amdsmi_commands.py `monitor`: current_socket_power, temperature_hotspot, temperature_mem,
  average_gfx_activity, average_umc_activity, current_uclk);
- from rocm-smi's recordings, with the arithmetic amd-smi applies to the same driver values
  (amdsmi_commands.py `metric_gpu`: mem_usage is bytes // 2^20 as "MB", energy is uJ / 10^6 as "J"
  rounded to 3 places);
- where nothing is recorded (PCIe link, ECC, XGMI), with the keys and shapes `metric_gpu` writes and
  values chosen here, said so where they are used.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from fakeprog import fake_program
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from repository import FIXTURES as ALL_FIXTURES

from applianctl.status import gpu_metrics, probes

FIXTURES = ALL_FIXTURES / "gpu"
STATIC_TEXT = (FIXTURES / "amd-smi-static-text-mi300x-truncated.txt").read_text()
METRIC_TEXT = (FIXTURES / "amd-smi-metric-text-mi300x-truncated.txt").read_text()
STATIC_VRAM = json.loads((FIXTURES / "amd-smi-static-json-vram-fragment-rocm6-mi300x.json").read_text())
MONITOR_TEXT = (FIXTURES / "amd-smi-monitor-putm-mi300x-x8.txt").read_text()
ROCM_SMI_VRAM = (FIXTURES / "rocm-smi-concise-and-showmeminfo-vram-mi300x-x8-spx-rocm633.txt").read_text()
ROCM_SMI_A = (FIXTURES / "rocm-smi-a-mi300x-x4-sriov.txt").read_text()

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


# ------------------------------------------------------------------------ amd-smi's JSON, derived


def _hr_value(text: str) -> Any:
    if text.startswith("[") and text.endswith("]"):
        return [_hr_value(item.strip()) for item in text[1:-1].split(",")]
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?|N/A) (\S+)", text)
    if m:
        value: Any = m.group(1) if m.group(1) == "N/A" else json.loads(m.group(1))
        return {"value": value, "unit": {"°C": "C"}.get(m.group(2), m.group(2))}
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def from_human_readable(text: str) -> list[dict[str, Any]]:
    """The `--json` document of an amd-smi text output: its formatter undone (see the module docstring)."""
    gpus: list[dict[str, Any]] = []
    stack: list[tuple[int, dict[str, Any]]] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith(("$", "[")):
            continue  # the command line, blank lines, "[output truncated]"
        indent = len(line) - len(line.lstrip(" "))
        key, _, rest = line.strip().partition(":")
        if indent == 0:
            gpus.append({key.lower(): int(rest)})
            stack = [(0, gpus[-1])]
            continue
        while stack[-1][0] >= indent:
            stack.pop()
        if rest.strip():
            stack[-1][1][key.lower()] = _hr_value(rest.strip())
        else:
            child: dict[str, Any] = {}
            stack[-1][1][key.lower()] = child
            stack.append((indent, child))
    return gpus


def from_monitor(text: str) -> list[dict[str, Any]]:
    """`amd-smi metric --json` records holding what `amd-smi monitor -putm` printed. GFX_CLOCK is left
    out: monitor reads current_gfxclk, metric the per-XCC current_gfxclks. Edge is "N/A" as on every
    MI300X (the exporter exports edge on MI2xx only; amd-smi gives N/A when the edge limit is 0)."""

    def v(n: int, unit: str) -> dict[str, Any]:
        return {"value": n, "unit": unit}

    records = []
    for row in text.splitlines()[2:]:
        gpu, rest = row.split(maxsplit=1)
        power, hotspot, mem, gfx, _gfx_clock, umc, mem_clock = (int(n) for n in re.findall(r"(\d+) (?:W|°C|%|MHz)", rest))
        records.append({
            "gpu": int(gpu),
            "power": {"socket_power": v(power, "W")},
            "temperature": {"edge": "N/A", "hotspot": v(hotspot, "C"), "mem": v(mem, "C")},
            "usage": {"gfx_activity": v(gfx, "%"), "umc_activity": v(umc, "%")},
            "clock": {"mem_0": {"clk": v(mem_clock, "MHz"), "min_clk": "N/A", "max_clk": "N/A"}},
        })
    return records


def rocm_smi_labels(text: str) -> dict[int, dict[str, str]]:
    """rocm-smi's `GPU[n] : label: value` lines, by GPU."""
    found: dict[int, dict[str, str]] = {}
    for m in re.finditer(r"^GPU\[(\d+)\]\s*:\s*([^:\n]+?)\s*:\s*(.*?)\s*$", text, re.MULTILINE):
        found.setdefault(int(m.group(1)), {})[m.group(2)] = m.group(3)
    return found


# ------------------------------------------------------------------------------------ running


def runner(static: Any, metric: Any, calls: list[tuple[tuple[str, ...], float]] | None = None) -> probes.Runner:
    """amd-smi answering with STATIC and METRIC: a document (printed as JSON), (rc, text), or an exception class."""

    def run(argv: Sequence[str], timeout: float) -> tuple[int, str]:
        if calls is not None:
            calls.append((tuple(argv), timeout))
        answer = {"static": static, "metric": metric}[argv[1]]
        if isinstance(answer, type) and issubclass(answer, BaseException):
            raise answer(argv, timeout) if answer is subprocess.TimeoutExpired else answer(argv[0])
        if isinstance(answer, tuple):
            return answer
        return 0, json.dumps(answer)

    return run


def parse(text: str) -> Series:
    """Every sample of TEXT, checked by prometheus_client's parser; no series twice, all gauges."""
    series: Series = {}
    for family in text_string_to_metric_families(text):
        assert family.type == "gauge", family.name
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in series, f"{key} twice"
            series[key] = s.value
    return series


def values(series: Series, name: str, **labels: str) -> dict[str, float]:
    """NAME's values by gpu_id, of the series that carry LABELS."""
    return {
        dict(lbl)["gpu_id"]: v for (n, lbl), v in series.items() if n == name and set(labels.items()) <= set(lbl)
    }


def names(series: Series) -> set[str]:
    return {n for n, _ in series}


# -------------------------------------------------------------------------------------- tests


def test_the_blog_mi300x_static_and_metric() -> None:
    # One MI300X (the AMD blog's system): static's text and JSON vram fragment, metric's text.
    static = from_human_readable(STATIC_TEXT)
    static[0]["vram"] = STATIC_VRAM
    assert static[0]["bus"]["max_pcie_speed"] == {"value": 32, "unit": "GT/s"}
    metric = from_human_readable(METRIC_TEXT)
    assert metric[0]["power"]["gfx_voltage"] == {"value": "N/A", "unit": "mV"}
    calls: list[tuple[tuple[str, ...], float]] = []
    series = parse(gpu_metrics.exposition(runner(static, metric, calls), 2.5))
    assert sorted(calls) == [(("amd-smi", "metric", "--json"), 2.5), (("amd-smi", "static", "--json"), 2.5)]
    assert series[("appliance_gpu_metrics_up", frozenset())] == 1
    assert series[("gpu_nodes_total", frozenset())] == 1
    labels = frozenset({"gpu_id": "0", "serial_number": "0xAF54E92B0A5D57C8", "card_model": "MI300X-O"}.items())
    assert series[("gpu_total_vram", labels)] == 196592  # MiB: rocm-smi gives the same VRAM as 206141652992 B
    assert series[("gpu_package_power", labels)] == 234
    assert series[("gpu_gfx_activity", labels)] == 100
    assert series[("gpu_umc_activity", labels)] == 0
    assert series[("pcie_max_speed", labels)] == 32
    assert series[("pcie_max_width", labels)] == 16
    clocks = {dict(lbl)["clock_index"]: v for (n, lbl), v in series.items() if n == "gpu_clock" and ("clock_type", "system") in lbl}
    assert clocks == {"0": 2102, "1": 2101, "2": 2107}
    # The recording stops in CLOCK: no temperature, PCIe link or ECC, so none of those series.
    assert not names(series) & {"gpu_junction_temperature", "pcie_speed", "gpu_ecc_correct_total", "gpu_used_vram"}


def test_eight_mi300x_from_monitor() -> None:
    static = [{"gpu": i, "vram": STATIC_VRAM} for i in range(8)]
    series = parse(gpu_metrics.exposition(runner(static, from_monitor(MONITOR_TEXT)), 1.0))
    assert series[("gpu_nodes_total", frozenset())] == 8
    ids = [str(i) for i in range(8)]
    assert values(series, "gpu_junction_temperature") == dict(zip(ids, [42, 40, 41, 40, 42, 39, 41, 40], strict=True))
    assert values(series, "gpu_memory_temperature") == dict(zip(ids, [41, 39, 40, 38, 40, 38, 41, 37], strict=True))
    assert values(series, "gpu_package_power") == dict(zip(ids, [182, 143, 117, 116, 118, 118, 116, 118], strict=True))
    assert values(series, "gpu_gfx_activity") == dict(zip(ids, [83, 13, 0, 1, 0, 0, 0, 0], strict=True))
    assert values(series, "gpu_clock", clock_type="memory") == dict(zip(ids, [1230, 1173, 900, 913, 900, 900, 900, 900], strict=True))
    assert values(series, "gpu_total_vram") == dict.fromkeys(ids, 196592)
    assert "gpu_edge_temperature" not in names(series)  # "N/A"
    assert "gpu_min_clock" not in names(series)


def test_vram_usage_as_amd_smi_derives_it_from_the_driver_bytes() -> None:
    # rocm-smi's VRAM bytes of 8x MI300X, as amd-smi metric turns them into mem_usage: bytes // 2^20, "MB".
    by_gpu = rocm_smi_labels(ROCM_SMI_VRAM)
    metric: list[dict[str, Any]] = []
    for i, labels in sorted(by_gpu.items()):
        total, used = int(labels["VRAM Total Memory (B)"]), int(labels["VRAM Total Used Memory (B)"])
        mb = {"total_vram": total // 2**20, "used_vram": used // 2**20, "free_vram": total // 2**20 - used // 2**20}
        metric.append({"gpu": i, "mem_usage": {k: {"value": v, "unit": "MB"} for k, v in mb.items()}})
    series = parse(gpu_metrics.exposition(runner([{"gpu": i} for i in range(8)], metric), 1.0))
    assert values(series, "gpu_total_vram") == dict.fromkeys(map(str, range(8)), 196592)
    assert values(series, "gpu_used_vram")["0"] == 283  # 297771008 B
    assert values(series, "gpu_used_vram")["4"] == 283  # 297775104 B
    assert values(series, "gpu_free_vram")["7"] == 196592 - 283
    # Another unit amd-smi might give is converted, not copied: 192 GB is 196608 MiB.
    metric[0]["mem_usage"]["total_vram"] = {"value": 192, "unit": "GB"}
    series = parse(gpu_metrics.exposition(runner([{"gpu": i} for i in range(8)], metric), 1.0))
    assert values(series, "gpu_total_vram")["0"] == 196608
    assert values(series, "gpu_free_vram")["0"] == 196608 - 283


def test_pcie_ecc_energy_and_xgmi_in_amd_smi_metric_shape() -> None:
    # Four MI300X of the rocm-smi -a recording: serial number, card series (as static's market_name),
    # PCIe replays, junction and memory temperature, accumulated energy (uJ; amd-smi prints J rounded
    # to 3 places). The PCIe link, ECC and XGMI values are chosen here, in the keys and shapes of
    # amdsmi_commands.py metric_gpu.
    by_gpu = rocm_smi_labels(ROCM_SMI_A)
    static, metric = [], []
    for i, labels in sorted(by_gpu.items()):
        static.append({"gpu": i, "asic": {"market_name": labels["Card series"], "asic_serial": "N/A"},
                       "board": {"product_serial": labels["Serial Number"], "product_name": "N/A"},
                       "bus": {"max_pcie_width": 16, "max_pcie_speed": {"value": 32, "unit": "GT/s"}}})
        joules = round(round(float(labels["Accumulated Energy (uJ)"]), 3) / 1_000_000, 3)
        metric.append({
            "gpu": i,
            "temperature": {"edge": "N/A",
                            "hotspot": {"value": float(labels["Temperature (Sensor junction) (C)"]), "unit": "C"},
                            "mem": {"value": float(labels["Temperature (Sensor memory) (C)"]), "unit": "C"}},
            "pcie": {"width": 16, "speed": {"value": 32, "unit": "GT/s"}, "bandwidth": {"value": 1204, "unit": "Mb/s"},
                     "replay_count": int(labels["PCIe Replay Count"]), "l0_to_recovery_count": 1, "replay_roll_over_count": 0,
                     "nak_sent_count": 0, "nak_received_count": 2, "current_bandwidth_sent": "N/A",
                     "current_bandwidth_received": "N/A", "max_packet_size": "N/A", "lc_perf_other_end_recovery": "N/A"},
            "ecc": {"total_correctable_count": i, "total_uncorrectable_count": 1 if i == 3 else 0, "total_deferred_count": 0,
                    "cache_correctable_count": 0, "cache_uncorrectable_count": 0},
            "energy": {"total_energy_consumption": {"value": joules, "unit": "J"}},
            "xgmi_err": ["AMDSMI_XGMI_STATUS_NO_ERRORS", "AMDSMI_XGMI_STATUS_ERROR", "AMDSMI_XGMI_STATUS_MULTIPLE_ERRORS", "N/A"][i],
        })
    series = parse(gpu_metrics.exposition(runner(static, metric), 1.0))
    one = frozenset({"gpu_id": "1", "serial_number": "692347005894", "card_model": "AMD Instinct MI300X OAM"}.items())
    assert values(series, "gpu_junction_temperature") == {"0": 35.0, "1": 37.0, "2": 34.0, "3": 39.0}
    assert values(series, "gpu_memory_temperature") == {"0": 33.0, "1": 34.0, "2": 32.0, "3": 36.0}
    assert series[("pcie_speed", one)] == 32 and series[("pcie_max_speed", one)] == 32
    assert series[("pcie_width", one)] == 16 and series[("pcie_max_width", one)] == 16
    assert series[("pcie_bandwidth", one)] == 1204
    assert series[("pcie_replay_count", one)] == 0
    assert series[("pcie_recovery_count", one)] == 1
    assert series[("pcie_nack_received_count", one)] == 2
    assert series[("gpu_energy_consumed", one)] == pytest.approx(78098902297000, rel=1e-12)  # uJ, as the exporter has it
    assert values(series, "gpu_ecc_correct_total") == {"0": 0, "1": 1, "2": 2, "3": 3}
    assert values(series, "gpu_ecc_uncorrect_total") == {"0": 0, "1": 0, "2": 0, "3": 1}
    assert values(series, "gpu_xgmi_error_status") == {"0": 0, "1": 1, "2": 2}  # "N/A" drops GPU 3's


def test_rocm7_gpu_data_wrapper_gives_the_same_text() -> None:
    static = from_human_readable(STATIC_TEXT)
    metric = from_monitor(MONITOR_TEXT)
    wrapped = gpu_metrics.exposition(runner({"gpu_data": static}, {"gpu_data": metric}), 1.0)
    assert wrapped == gpu_metrics.exposition(runner(static, metric), 1.0)
    assert "gpu_junction_temperature{" in wrapped


def test_help_and_type_once_per_metric_before_its_samples() -> None:
    text = gpu_metrics.exposition(runner([{"gpu": i, "vram": STATIC_VRAM} for i in range(8)], from_monitor(MONITOR_TEXT)), 1.0)
    lines = text.splitlines()
    shown = [line.split()[2] for line in lines if line.startswith("# TYPE ")]
    assert len(shown) == len(set(shown)) and len(shown) > 5
    for name in shown:
        assert sum(line.startswith(f"# HELP {name} ") for line in lines) == 1
        at = lines.index(f"# TYPE {name} gauge")
        assert lines[at - 1].startswith(f"# HELP {name} ")
        samples = [i for i, line in enumerate(lines) if re.match(rf"{name}[{{ ]", line)]
        assert samples == list(range(at + 1, at + 1 + len(samples))) and samples
    assert text.endswith("\n")


@pytest.mark.parametrize(
    "failure",
    [probes.ToolMissing, subprocess.TimeoutExpired, (1, "AMDSMI: no GPUs\n"), (0, "Traceback (most recent call last):\n"), (0, "42")],
    ids=["missing", "timeout", "exit-status", "not-json", "not-a-gpu-list"],
)
def test_no_answer_is_up_0_and_no_gpu_series(failure: Any) -> None:
    text = gpu_metrics.exposition(runner(failure, failure), 1.0)
    assert parse(text) == {("appliance_gpu_metrics_up", frozenset()): 0}
    assert "gpu_" not in text.replace("appliance_gpu_metrics_up", "")


def test_one_call_failing_is_up_0_but_keeps_what_answered() -> None:
    text = gpu_metrics.exposition(runner((2, ""), from_monitor(MONITOR_TEXT)), 1.0)
    series = parse(text)
    assert series[("appliance_gpu_metrics_up", frozenset())] == 0
    assert values(series, "gpu_package_power")["0"] == 182
    assert not any("serial_number" in dict(lbl) for _, lbl in series)  # static's labels are gone with it


def test_hanging_amd_smi_costs_one_timeout() -> None:
    release = threading.Event()

    def run(argv: Sequence[str], timeout: float) -> tuple[int, str]:
        release.wait(10)
        return 0, "[]"

    start = time.monotonic()
    text = gpu_metrics.exposition(run, 0.2)
    release.set()
    assert time.monotonic() - start < 2
    assert parse(text) == {("appliance_gpu_metrics_up", frozenset()): 0}


def test_na_wrong_units_and_odd_shapes_drop_only_their_series() -> None:
    metric = [{
        "gpu": 0,
        "usage": "N/A",  # amd-smi's whole section when the call failed
        "power": {"socket_power": {"value": "N/A", "unit": "W"}},
        "temperature": {"edge": {"value": 300, "unit": "K"}, "hotspot": {"value": 61, "unit": "C"}, "mem": 50},
        "pcie": {"width": "N/A", "speed": {"value": 16, "unit": "GT/s"}, "bandwidth": {"value": "Infinity", "unit": "Mb/s"}},
        "clock": {"gfx_0": {"clk": "N/A"}, "gfx_1": "N/A", "mem_0": {"clk": {"value": 900, "unit": "kHz"}},
                  "vclk_0": {"clk": {"value": 29, "unit": "MHz"}}, "weird_0": {"clk": {"value": 1, "unit": "MHz"}}},
        "ecc": {"total_correctable_count": "N/A", "total_uncorrectable_count": 0},
        "xgmi_err": "SOMETHING_NEW",
        "mem_usage": {"total_vram": {"value": 1e308, "unit": "GB"}, "used_vram": {"value": 5, "unit": "MB"}},  # total: inf MiB
    }]
    static = [{"gpu": 0, "asic": {"market_name": "N/A", "asic_serial": ""}, "board": "N/A", "bus": {"max_pcie_speed": "N/A"}}]
    series = parse(gpu_metrics.exposition(runner(static, metric), 1.0))
    gpu0 = frozenset({"gpu_id": "0"}.items())
    assert {n for n, lbl in series if lbl == gpu0} == {"gpu_junction_temperature", "pcie_speed", "gpu_ecc_uncorrect_total", "gpu_used_vram"}
    assert series[("gpu_junction_temperature", gpu0)] == 61
    assert [dict(lbl)["clock_type"] for n, lbl in series if n == "gpu_clock"] == ["video"]


def test_hostile_label_values_are_escaped() -> None:
    serial = 'SN"1\\2\n} evil{x="y"} 1'
    static = [{"gpu": 0, "asic": {"market_name": "MI300X\\", "asic_serial": "0x1"}, "board": {"product_serial": serial}}]
    metric = [{"gpu": 0, "power": {"socket_power": {"value": 234, "unit": "W"}}}]
    text = gpu_metrics.exposition(runner(static, metric), 1.0)
    assert 'serial_number="SN\\"1\\\\2\\n} evil{x=\\"y\\"} 1"' in text
    assert len(text.splitlines()) == 9  # up, nodes, power: HELP, TYPE and one sample each; no line smuggled in
    series = parse(text)
    labels = frozenset({"gpu_id": "0", "serial_number": serial, "card_model": "MI300X\\"}.items())
    assert series[("gpu_package_power", labels)] == 234


def test_same_gpu_twice_gives_one_series() -> None:
    metric = [{"gpu": 0, "power": {"socket_power": {"value": 100, "unit": "W"}}},
              {"gpu": 0.0, "power": {"socket_power": {"value": 200, "unit": "W"}}},
              {"gpu": "Infinity", "power": {"socket_power": {"value": 300, "unit": "W"}}}]
    series = parse(gpu_metrics.exposition(runner([], metric), 1.0))
    assert values(series, "gpu_package_power") == {"0": 200, "2": 300}  # the last record of a number wins; no number: its place


def test_real_program_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through probes.run_command: one fake amd-smi printing the derived JSON for each subcommand."""
    static = from_human_readable(STATIC_TEXT)
    (tmp_path / "static.json").write_text(json.dumps(static))
    (tmp_path / "metric.json").write_text(json.dumps(from_human_readable(METRIC_TEXT)))
    fake_program(tmp_path / "bin", "amd-smi", script_body=f'cat "{tmp_path}/$1.json"')
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    series = parse(gpu_metrics.exposition(probes.run_command, 5.0))
    assert series[("appliance_gpu_metrics_up", frozenset())] == 1
    assert values(series, "gpu_package_power", serial_number="0xAF54E92B0A5D57C8") == {"0": 234}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from(["N/A", "gpu", "value", "unit", "W", "C", "MHz", "gfx_0", "Infinity"]),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["gpu", "value", "unit", "power", "socket_power", "temperature", "hotspot", "clock",
                                       "gfx_0", "clk", "mem_usage", "total_vram", "vram", "size", "ecc", "pcie", "speed",
                                       "board", "product_serial", "gpu_data", "xgmi_err", "bus"]) | st.text(max_size=6),
                      children, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(static=json_values, metric=json_values)
def test_garbage_never_raises_and_stays_valid(static: Any, metric: Any) -> None:
    text = gpu_metrics.exposition(runner(static, metric), 1.0)
    series = parse(text)
    assert series[("appliance_gpu_metrics_up", frozenset())] in (0, 1)
