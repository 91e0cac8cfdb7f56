# SPDX-License-Identifier: MIT
"""The GPUs as Prometheus metrics (text exposition format), read from `amd-smi static --json` and
`amd-smi metric --json` through gpu.py's reader, so the status probe and these series agree.

Names, units and labels are AMD's device-metrics-exporter's (github.com/ROCm/device-metrics-exporter:
the GPUMetricField names of pkg/exporter/proto/exporterconfig.proto in lower case, as
pkg/amdgpu/gpuagent/gpuagent_gpu_metrics.go registers them; units from its
docs/configuration/metricslist.md), so dashboards and alerts written for the exporter read these:
every series is a gauge, labelled gpu_id and, where amd-smi static gives them, serial_number (the
board's product serial, else the ASIC serial) and card_model (the ASIC's market name). Units: VRAM
in MiB (amd-smi's and the exporter's "MB" are 2^20 bytes), power in W, temperatures in degrees C,
activity in %, clocks in MHz, PCIe speed in GT/s and bandwidth in Mb/s, energy in µJ (amd-smi gives
J). gpu_clock carries clock_type (the exporter's: system, memory, video, data, fabric, soc) and
clock_index (amd-smi's number within that type; the exporter numbers all clocks in one list).

Not the exporter's, which has no such field: pcie_width and pcie_max_width (lanes; named like its
pcie_speed and pcie_max_speed), gpu_xgmi_error_status (amd-smi's xgmi_err: 0 no error, 1 one, 2
several) and appliance_gpu_metrics_up (1 when both amd-smi calls answered with JSON, else 0: the
tool is missing, failed, timed out or printed something else; whatever did answer is still shown).

The amd-smi keys are those amdsmi_cli/amdsmi_commands.py (github.com/ROCm/amdsmi) writes, each
value `{"value": N, "unit": U}` or plain. A value that is missing, "N/A", not finite, or in another
unit than expected (or in none, as before ROCm 6.1) drops its series; nothing here raises on what
amd-smi prints.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from applianctl.status import gpu
from applianctl.status.exposition import escape
from applianctl.status.probes import Runner

UP = "appliance_gpu_metrics_up"

# Every metric in the order shown, with its HELP text.
HELP = {
    UP: "1 when amd-smi static and metric both answered with JSON; 0 when amd-smi is missing, failed, timed out or printed no JSON",
    "gpu_nodes_total": "Number of GPUs amd-smi lists",
    "gpu_package_power": "Current socket power in Watts",
    "gpu_edge_temperature": "Edge temperature in Celsius",
    "gpu_junction_temperature": "Hotspot (aka junction) temperature in Celsius",
    "gpu_memory_temperature": "Memory temperature in Celsius",
    "gpu_gfx_activity": "Graphics engine usage in Percentage (0-100)",
    "gpu_umc_activity": "Memory engine usage in Percentage (0-100)",
    "gpu_total_vram": "Total VRAM memory of the GPU (in MB, 2^20 bytes)",
    "gpu_used_vram": "Used VRAM memory of the GPU (in MB, 2^20 bytes)",
    "gpu_free_vram": "Free VRAM memory of the GPU (in MB, 2^20 bytes)",
    "gpu_ecc_correct_total": "Total correctable ECC error count",
    "gpu_ecc_uncorrect_total": "Total uncorrectable ECC error count",
    "gpu_energy_consumed": "Accumulated energy consumed by the GPU in uJ",
    "gpu_clock": "Current GPU clock frequencies in MHz",
    "gpu_xgmi_error_status": "XGMI error status: 0 no error, 1 one error, 2 multiple errors",
    "pcie_speed": "Current PCIe speed in GT/s",
    "pcie_max_speed": "Maximum PCIe speed in GT/s",
    "pcie_width": "Current PCIe link width in lanes",
    "pcie_max_width": "Maximum PCIe link width in lanes",
    "pcie_bandwidth": "Current PCIe bandwidth in Mb/s",
    "pcie_replay_count": "Total number of PCIe replays",
    "pcie_recovery_count": "Total number of PCIe recoveries",
    "pcie_replay_rollover_count": "PCIe replay accumulated count",
    "pcie_nack_sent_count": "PCIe NAK sent accumulated count",
    "pcie_nack_received_count": "PCIe NAK received accumulated count",
}

# (metric, section, keys tried in turn, unit amd-smi gives (None: a plain number), factor to our unit)
METRIC_FIELDS: tuple[tuple[str, str, tuple[str, ...], str | None, float], ...] = (
    ("gpu_package_power", "power", ("socket_power",), "W", 1.0),
    ("gpu_edge_temperature", "temperature", ("edge",), "C", 1.0),
    ("gpu_junction_temperature", "temperature", ("hotspot", "junction"), "C", 1.0),
    ("gpu_memory_temperature", "temperature", ("mem",), "C", 1.0),
    ("gpu_gfx_activity", "usage", ("gfx_activity",), "%", 1.0),
    ("gpu_umc_activity", "usage", ("umc_activity",), "%", 1.0),
    ("gpu_energy_consumed", "energy", ("total_energy_consumption",), "J", 1e6),
    ("pcie_speed", "pcie", ("speed",), "GT/s", 1.0),
    ("pcie_width", "pcie", ("width",), None, 1.0),
    ("pcie_bandwidth", "pcie", ("bandwidth",), "Mb/s", 1.0),
    ("pcie_replay_count", "pcie", ("replay_count",), None, 1.0),
    ("pcie_recovery_count", "pcie", ("l0_to_recovery_count",), None, 1.0),
    ("pcie_replay_rollover_count", "pcie", ("replay_roll_over_count",), None, 1.0),
    ("pcie_nack_sent_count", "pcie", ("nak_sent_count",), None, 1.0),
    ("pcie_nack_received_count", "pcie", ("nak_received_count",), None, 1.0),
)
STATIC_FIELDS: tuple[tuple[str, str, tuple[str, ...], str | None, float], ...] = (
    ("pcie_max_speed", "bus", ("max_pcie_speed",), "GT/s", 1.0),
    ("pcie_max_width", "bus", ("max_pcie_width",), None, 1.0),
)
# amd-smi's clock names (gfx_0, mem_0, vclk_0, ...) -> the exporter's clock_type
CLOCK_TYPES = {"gfx": "system", "mem": "memory", "vclk": "video", "dclk": "data", "fclk": "fabric", "socclk": "soc"}
_CLOCK = re.compile(r"([a-z]+)_(\d+)")
# amd-smi's amdsmi_xgmi_status_t names, AMDSMI_XGMI_STATUS_ taken off
XGMI_STATUS = {"NO_ERRORS": 0, "ERROR": 1, "MULTIPLE_ERRORS": 2}

Sample = tuple[str, dict[str, str], float]


def _value(raw: Any, unit: str | None, factor: float = 1.0) -> float | None:
    """RAW as a finite number in our unit; None when absent, "N/A" or in another unit than UNIT."""
    given = raw.get("unit") if isinstance(raw, Mapping) else None
    if (given is None) != (unit is None) or (unit is not None and str(given).strip().lower() != unit.lower()):
        return None
    n = gpu.number(raw)
    if n is None or not math.isfinite(n * factor):
        return None
    return n * factor


def _section(record: Mapping[str, Any] | None, name: str) -> Mapping[str, Any]:
    section = record.get(name) if record is not None else None
    return section if isinstance(section, Mapping) else {}


def _text(record: Mapping[str, Any] | None, *paths: tuple[str, str]) -> str | None:
    for section, key in paths:
        value = _section(record, section).get(key)
        if isinstance(value, str | int) and not isinstance(value, bool) and str(value).strip() not in ("", "N/A"):
            return str(value).strip()
    return None


def _by_gpu(doc: Any) -> dict[int, Mapping[str, Any]]:
    return {gpu.gpu_index(i, record): record for i, record in enumerate(gpu.gpu_list(doc))} if doc is not None else {}


def samples(static: Any, metric: Any) -> Iterator[Sample]:
    """The GPU series of the two amd-smi documents (either None when its call failed)."""
    statics, metrics = _by_gpu(static), _by_gpu(metric)
    indices = sorted(set(statics) | set(metrics))
    yield "gpu_nodes_total", {}, len(indices)
    readings = {r.gpu: r for r in gpu.from_amd_smi(static, metric)}
    for index in indices:
        st, me = statics.get(index), metrics.get(index)
        labels = {"gpu_id": str(index)}
        if (serial := _text(st, ("board", "product_serial"), ("asic", "asic_serial"))) is not None:
            labels["serial_number"] = serial
        if (model := _text(st, ("asic", "market_name"), ("board", "product_name"))) is not None:
            labels["card_model"] = model
        found: list[tuple[str, float | None]] = []
        for fields, record in ((METRIC_FIELDS, me), (STATIC_FIELDS, st)):
            for name, section, keys, unit, factor in fields:
                values = (_value(_section(record, section).get(key), unit, factor) for key in keys)
                found.append((name, next((v for v in values if v is not None), None)))
        r = readings.get(index)
        if r is not None:
            found += [("gpu_total_vram", r.vram_total_mib), ("gpu_used_vram", r.vram_used_mib), ("gpu_free_vram", r.vram_free_mib),
                      ("gpu_ecc_correct_total", r.ecc_correctable), ("gpu_ecc_uncorrect_total", r.ecc_uncorrectable)]
        xgmi = me.get("xgmi_err") if me is not None else None
        if isinstance(xgmi, str):
            found.append(("gpu_xgmi_error_status", XGMI_STATUS.get(xgmi.strip().upper().removeprefix("AMDSMI_XGMI_STATUS_"))))
        for name, value in found:
            if value is not None and math.isfinite(value):
                yield name, labels, value
        for clock, entry in sorted(_section(me, "clock").items(), key=lambda item: str(item[0])):
            m = _CLOCK.fullmatch(str(clock))
            mhz = _value(entry.get("clk"), "MHz") if isinstance(entry, Mapping) else None
            if m and m.group(1) in CLOCK_TYPES and mhz is not None:
                yield "gpu_clock", {**labels, "clock_index": m.group(2), "clock_type": CLOCK_TYPES[m.group(1)]}, mhz


def _line(name: str, labels: Mapping[str, str], value: float) -> str:
    inner = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
    number = str(int(value)) if float(value).is_integer() and abs(value) < 2**53 else repr(float(value))
    return f"{name}{{{inner}}} {number}" if inner else f"{name} {number}"


def render(series: Iterable[Sample]) -> str:
    """The exposition text of SERIES: HELP and TYPE once per metric, then its samples."""
    by_name: dict[str, list[str]] = {}
    for name, labels, value in series:
        by_name.setdefault(name, []).append(_line(name, labels, value))
    lines = []
    for name, help_text in HELP.items():
        if name in by_name:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *by_name[name]]
    return "\n".join(lines) + "\n"


def _answered(doc: Any) -> Any:
    """DOC when it is amd-smi JSON in either shape; None for an exception or anything else."""
    if isinstance(doc, BaseException):
        return None
    try:
        gpu.gpu_list(doc)
    except ValueError:
        return None
    return doc


def exposition(runner: Runner, timeout_s: float) -> str:
    """The GPU metrics, amd-smi's two calls run side by side through RUNNER within TIMEOUT_S."""
    static, metric = (_answered(doc) for doc in gpu.amd_smi_json(runner, timeout_s))
    series: list[Sample] = [(UP, {}, int(static is not None and metric is not None))]
    if static is not None or metric is not None:
        series += samples(static, metric)
    return render(series)
