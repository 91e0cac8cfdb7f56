# SPDX-License-Identifier: MIT
"""The GPU as `amd-smi` (or, failing that, `rocm-smi`) reports it: VRAM, temperature, power, ECC.

The tools' output changed shape between ROCm releases and this reads all of them:
- `amd-smi static|metric --json` is a bare JSON list of GPUs on ROCm 6 and `{"gpu_data": [...]}`
  on ROCm 7; values are `{"value": N, "unit": "MB"}` or plain (`"N/A"` when unsupported).
  amd-smi's "MB" are MiB: an MI300X reports `vram.size` 196592 MB, which rocm-smi gives as
  206141652992 B = 196592 x 2^20.
- `rocm-smi --showmeminfo vram --showtemp --showpower --json` is `{"card0": {label: value}}`;
  without JSON support the same labels come as text lines `GPU[0]  : label: value`.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from appliance.config import Config
from appliance.errors import UserError
from appliance.run import TimeoutExpired
from appliance.safe_read import MAX_RECORD_BYTES, loads_bounded, read_capped
from applianctl.status.document import GpuDetails, GpuReading
from applianctl.status.probes import COMMAND_TIMEOUT_S, DEGRADED, DOWN, NOT_CONFIGURED, OK, Part, Runner, ToolMissing

AMD_SMI_STATIC = ("amd-smi", "static", "--json")
AMD_SMI_METRIC = ("amd-smi", "metric", "--json")
ROCM_SMI = ("rocm-smi", "--showmeminfo", "vram", "--showtemp", "--showpower", "--json")

_UNIT_MIB = {"B": 1 / 2**20, "KB": 1 / 1024, "KIB": 1 / 1024, "MB": 1.0, "MIB": 1.0, "GB": 1024.0, "GIB": 1024.0}


@dataclass
class Reading:
    gpu: int
    vram_total_mib: float | None = None
    vram_used_mib: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_correctable: int | None = None
    ecc_uncorrectable: int | None = None

    @property
    def vram_free_mib(self) -> float | None:
        if self.vram_total_mib is None or self.vram_used_mib is None:
            return None
        return self.vram_total_mib - self.vram_used_mib


class NoGpu(Exception):
    """No tool, or the tool found no GPU."""


def number(value: Any) -> float | None:
    """A plain number, a numeric string, or {"value": N, ...}; None for "N/A", infinities and the like."""
    if isinstance(value, Mapping):
        value = value.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        n = float(value)
    except (ValueError, OverflowError):
        return None
    return n if math.isfinite(n) else None


def mib(value: Any, default_unit: str = "MB") -> float | None:
    n = number(value)
    if n is None:
        return None
    unit = value.get("unit", default_unit) if isinstance(value, Mapping) else default_unit
    factor = _UNIT_MIB.get(str(unit).upper())
    return None if factor is None else n * factor


def gpu_list(doc: Any) -> list[Mapping[str, Any]]:
    """The per-GPU records of an amd-smi JSON document in either shape."""
    if isinstance(doc, Mapping) and "gpu_data" in doc:
        doc = doc["gpu_data"]
    if isinstance(doc, Mapping):
        doc = [doc]
    if not isinstance(doc, list):
        raise ValueError("amd-smi JSON is neither a list nor {'gpu_data': [...]}")
    return [g for g in doc if isinstance(g, Mapping)]


def _first(record: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in record and number(record[key]) is not None:
            return record[key]
    return None


def gpu_index(position: int, record: Mapping[str, Any]) -> int:
    """The GPU's number in an amd-smi record: its "gpu", else its place in the list."""
    n = number(record.get("gpu"))
    return position if n is None else int(n)


def from_amd_smi(static: Any, metric: Any) -> list[Reading]:
    """Readings from `amd-smi static --json` and `amd-smi metric --json` (either may be None)."""
    readings: dict[int, Reading] = {}

    def reading(i: int, record: Mapping[str, Any]) -> Reading:
        index = gpu_index(i, record)
        return readings.setdefault(index, Reading(gpu=index))

    for i, rec in enumerate(gpu_list(static) if static is not None else []):
        r = reading(i, rec)
        vram = rec.get("vram") or {}
        r.vram_total_mib = mib(vram.get("size")) if isinstance(vram, Mapping) else None
    for i, rec in enumerate(gpu_list(metric) if metric is not None else []):
        r = reading(i, rec)
        mem = rec.get("mem_usage") or rec.get("fb_usage") or {}
        if isinstance(mem, Mapping):
            total = mib(_first(mem, "total_vram", "total"))
            used = mib(_first(mem, "used_vram", "used"))
            free = mib(_first(mem, "free_vram", "free"))
            r.vram_total_mib = total if total is not None else r.vram_total_mib
            if used is None and free is not None and r.vram_total_mib is not None:
                used = r.vram_total_mib - free
            r.vram_used_mib = used
        temp = rec.get("temperature") or {}
        if isinstance(temp, Mapping):
            r.temperature_c = number(_first(temp, "hotspot", "junction", "edge"))
        power = rec.get("power") or {}
        if isinstance(power, Mapping):
            r.power_w = number(_first(power, "socket_power", "average_socket_power", "current_socket_power"))
        ecc = rec.get("ecc") or {}
        if isinstance(ecc, Mapping):
            ce = number(_first(ecc, "total_correctable_count", "total_correctable"))
            ue = number(_first(ecc, "total_uncorrectable_count", "total_uncorrectable"))
            r.ecc_correctable = None if ce is None else int(ce)
            r.ecc_uncorrectable = None if ue is None else int(ue)
    return [readings[k] for k in sorted(readings)]


def _from_labels(index: int, labels: Mapping[str, Any]) -> Reading:
    r = Reading(gpu=index)
    r.vram_total_mib = mib(labels.get("VRAM Total Memory (B)"), "B")
    r.vram_used_mib = mib(labels.get("VRAM Total Used Memory (B)"), "B")
    for key in ("Temperature (Sensor junction) (C)", "Temperature (Sensor edge) (C)"):
        if number(labels.get(key)) is not None:
            r.temperature_c = number(labels[key])
            break
    for key in ("Current Socket Graphics Package Power (W)", "Average Graphics Package Power (W)"):
        if number(labels.get(key)) is not None:
            r.power_w = number(labels[key])
            break
    return r


def from_rocm_smi_json(doc: Any) -> list[Reading]:
    if not isinstance(doc, Mapping):
        raise ValueError("rocm-smi JSON is not an object")
    out = []
    for card, labels in doc.items():
        m = re.fullmatch(r"card(\d+)", str(card))
        if m and isinstance(labels, Mapping):
            out.append(_from_labels(int(m.group(1)), labels))
    return sorted(out, key=lambda r: r.gpu)


_TEXT_LINE = re.compile(r"^GPU\[(\d+)\]\s*:\s*([^:]+?)\s*:\s*(.*?)\s*\Z")


def rocm_smi_labels(text: str) -> dict[int, dict[str, str]]:
    """rocm-smi's text lines `GPU[0]  : label: value`, by GPU and label."""
    per_gpu: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        m = _TEXT_LINE.match(line)
        if m:
            per_gpu.setdefault(int(m.group(1)), {})[m.group(2)] = m.group(3)
    return per_gpu


def from_rocm_smi_text(text: str) -> list[Reading]:
    return [_from_labels(i, labels) for i, labels in sorted(rocm_smi_labels(text).items())]


# ----------------------------------------------------------------------------------- reading


def _run_json(run: Runner, argv: Sequence[str], timeout_s: float) -> Any:
    rc, out = run(argv, timeout_s)
    if rc != 0:
        raise NoGpu(f"{' '.join(argv[:2])} exited with status {rc}")
    return json.loads(out)


def amd_smi_json(run: Runner, timeout_s: float = COMMAND_TIMEOUT_S) -> tuple[Any, Any]:
    """(static, metric): both amd-smi calls side by side, so together they take one timeout; each
    the parsed JSON, or the exception its call ended with."""
    results: dict[str, Any] = {}

    def call(key: str, argv: Sequence[str]) -> None:
        try:
            results[key] = _run_json(run, argv, timeout_s)
        except Exception as e:
            results[key] = e

    threads = [
        threading.Thread(target=call, args=("static", AMD_SMI_STATIC), daemon=True),
        threading.Thread(target=call, args=("metric", AMD_SMI_METRIC), daemon=True),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 0.2)
    static = results.get("static", NoGpu("amd-smi static did not answer"))
    return static, results.get("metric", NoGpu("amd-smi metric did not answer"))


def read_amd_smi(run: Runner) -> list[Reading]:
    """Readings from amd-smi: its metric call must answer, its static call may fail."""
    static, metric = amd_smi_json(run)
    if isinstance(metric, BaseException) or metric is None:
        raise metric if isinstance(metric, BaseException) else NoGpu("amd-smi metric did not answer")
    readings = from_amd_smi(None if isinstance(static, BaseException) else static, metric)
    if not readings:
        raise NoGpu("amd-smi lists no GPU")
    return readings


def read_rocm_smi(run: Runner) -> list[Reading]:
    rc, out = run(ROCM_SMI, COMMAND_TIMEOUT_S)
    if rc != 0:
        raise NoGpu(f"rocm-smi exited with status {rc}")
    try:
        readings = from_rocm_smi_json(json.loads(out))
    except ValueError:
        readings = from_rocm_smi_text(out)
    if not readings:
        raise NoGpu("rocm-smi lists no GPU")
    return readings


def read(run: Runner) -> tuple[str, list[Reading]]:
    """(tool, readings) from amd-smi, else rocm-smi. Raise NoGpu when neither gives a GPU."""
    problems = []
    for tool, reader in (("amd-smi", read_amd_smi), ("rocm-smi", read_rocm_smi)):
        try:
            return tool, reader(run)
        except ToolMissing:
            problems.append(f"{tool} not installed")
        except TimeoutExpired:
            problems.append(f"{tool} gave no answer within {COMMAND_TIMEOUT_S:g} s")
        except (NoGpu, ValueError, TypeError, AttributeError) as e:
            problems.append(f"{tool}: {e}".splitlines()[0])
    raise NoGpu("; ".join(problems))


def selftest_verdict(path: Path) -> tuple[dict[str, Any] | None, str]:
    """This boot's self-test report (appliance-gpu-selftest.service) and what it means for the
    engines in one line ("" when they may run on every GPU they use); (None, "") without one."""
    try:
        doc = loads_bounded(read_capped(path, MAX_RECORD_BYTES, what="the GPU self-test report") or b"null")
    except (UserError, ValueError):
        return None, f"{path}: unreadable"
    if not isinstance(doc, dict):
        return None, ""
    if doc.get("could_not_run"):
        return doc, f"the self-test could not run: {doc['could_not_run']}"
    failed = [g for g in doc.get("gpus", []) if isinstance(g, dict) and g.get("gpu") in (doc.get("failed_used_gpus") or [])]
    reasons = [f"GPU {g['gpu']} failed its self-test: " + next((f.get("reason", "") for f in g.get("findings", [])
                                                                 if isinstance(f, dict) and f.get("state") == "failed"), "")
               for g in failed]
    return doc, "; ".join(reasons)


def probe(config: Config, run: Runner, selftest: Path | None = None) -> Part:
    required = config.gpu.required
    min_headroom = float(config.gpu.min_vram_headroom_mib)
    report, verdict = selftest_verdict(selftest) if selftest is not None else (None, "")
    try:
        tool, readings = read(run)
    except NoGpu as e:
        reason = f"not present ({e})"
        return Part(DOWN if required else NOT_CONFIGURED, reason, GpuDetails(present=False, required=required, selftest=report))
    details = GpuDetails(present=True, required=required, tool=tool, min_vram_headroom_mib=min_headroom,
                         gpus=tuple(GpuReading(**asdict(r), vram_free_mib=r.vram_free_mib) for r in readings), selftest=report)
    if report is not None and report.get("failed_used_gpus"):
        return Part(DOWN, verdict + ": no engine starts", details)
    problems = [verdict] if verdict else []
    for r in readings:
        free = r.vram_free_mib
        if free is not None and free < min_headroom:
            problems.append(
                f"GPU {r.gpu}: only {free:.0f} MiB VRAM free (< {min_headroom:.0f} MiB): "
                "the server may start but fail on the first request"
            )
        if r.ecc_uncorrectable:
            problems.append(f"GPU {r.gpu}: {r.ecc_uncorrectable} uncorrectable ECC error(s)")
    return Part(DEGRADED if problems else OK, "; ".join(problems), details)
