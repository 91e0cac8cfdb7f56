# SPDX-License-Identifier: MIT
"""GPU readings from the recorded outputs of the real tools (tests/fixtures/gpu/).

No full `amd-smi metric --json` from an MI300X exists (fixtures/README.md, "Not found"), so the
amd-smi inputs here are the real fragments, put into the document shape the tools produce; each
test says what it derived and from which file.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest
from fakeprog import calls, fake_program
from repository import FIXTURES as ALL_FIXTURES

import appliance.config
from appliance.config import Config
from appliance.config.model import Gpu
from applianctl.status import gpu, probes

FIXTURES = ALL_FIXTURES / "gpu"
STATIC_VRAM = json.loads((FIXTURES / "amd-smi-static-json-vram-fragment-rocm6-mi300x.json").read_text())
METRIC_P = json.loads((FIXTURES / "amd-smi-metric-p-json-rocm61-changelog-example.json").read_text())
ROCM_SMI_FILE = FIXTURES / "rocm-smi-concise-and-showmeminfo-vram-mi300x-x8-spx-rocm633.txt"
ROCM_SMI_TEXT = ROCM_SMI_FILE.read_text()

# `amd-smi static --json | jq '.[0]["vram"]'`: the blog's fragment is element 0's "vram" of a bare list.
STATIC_ROCM6 = [{"gpu": 0, "vram": STATIC_VRAM}]
def gpu_config(required: bool = True, min_vram_headroom_mib: int = 1024) -> Config:
    """The demo profile's real configuration with the given [gpu] settings."""
    loaded = appliance.config.load(Path(__file__).parents[1] / "appliance.toml", "demo")
    return dataclasses.replace(loaded, gpu=Gpu(required=required, min_vram_headroom_mib=min_vram_headroom_mib))


CONFIG = gpu_config()


def fake_runner(outputs: dict[str, tuple[int, str] | type[BaseException]]) -> probes.Runner:
    """A runner answering by the command line's first two words; absent programs are missing."""

    def run(argv: Sequence[str], timeout: float) -> tuple[int, str]:
        key = " ".join(argv[:2])
        if argv[0] not in {k.split()[0] for k in outputs}:
            raise probes.ToolMissing(argv[0])
        out = outputs[key]
        if isinstance(out, type):
            raise out(argv, timeout) if out is subprocess.TimeoutExpired else out()
        return out

    return run


def test_rocm6_list_shape_with_value_unit_pairs() -> None:
    (r,) = gpu.from_amd_smi(STATIC_ROCM6, METRIC_P)
    assert r.gpu == 0
    assert r.vram_total_mib == 196592  # "MB" as amd-smi means it: MiB
    assert r.power_w == 10
    assert r.vram_used_mib is None and r.vram_free_mib is None


def test_rocm7_gpu_data_wrapper_gives_the_same_readings() -> None:
    # The ROCm 7.0.2 dump (a pdb session, cut short) shows the wrapper and gpu index 0 ...
    dump = (FIXTURES / "amd-smi-metric-rocm702-mi300x-dpx-pdb-dump-TRUNCATED.txt").read_text().splitlines()
    assert dump[0] == "(Pdb) rocm_metrics['gpu_data'][0]['gpu']"
    assert ast.literal_eval(dump[1]) == 0
    # ... so the list-shaped real records are wrapped the same way.
    wrapped = gpu.from_amd_smi({"gpu_data": STATIC_ROCM6}, {"gpu_data": METRIC_P})
    assert wrapped == gpu.from_amd_smi(STATIC_ROCM6, METRIC_P)


def test_rocm7_usage_values_from_the_dump_are_value_unit_pairs() -> None:
    dump = (FIXTURES / "amd-smi-metric-rocm702-mi300x-dpx-pdb-dump-TRUNCATED.txt").read_text().splitlines()
    # The "usage" line is cut mid-structure; its first entry is complete.
    usage_line = dump[3]
    first = usage_line[usage_line.index("{'value'") : usage_line.index("}") + 1]
    assert gpu.number(ast.literal_eval(first)) == 0.0
    assert gpu.number("N/A") is None


def test_amd_smi_memory_temperature_and_ecc() -> None:
    # amd-smi metric's mem_usage/temperature/ecc blocks (keys as amd-smi 6.1+ prints them) added
    # to the real changelog record; the values are an MI300X after warm-up per the runbook.
    record = dict(METRIC_P[0])
    record["mem_usage"] = {
        "total_vram": {"value": 196592, "unit": "MB"},
        "used_vram": {"value": 195000, "unit": "MB"},
        "free_vram": {"value": 1592, "unit": "MB"},
    }
    record["temperature"] = {"edge": "N/A", "hotspot": {"value": 61, "unit": "C"}, "mem": {"value": 50, "unit": "C"}}
    record["ecc"] = {"total_correctable_count": 4, "total_uncorrectable_count": 0}
    (r,) = gpu.from_amd_smi(STATIC_ROCM6, [record])
    assert (r.vram_used_mib, r.vram_free_mib, r.temperature_c) == (195000, 1592, 61)
    assert (r.ecc_correctable, r.ecc_uncorrectable) == (4, 0)
    run = fake_runner({"amd-smi static": (0, json.dumps(STATIC_ROCM6)), "amd-smi metric": (0, json.dumps([record]))})
    assert gpu.probe(CONFIG, run).state == probes.OK
    record["ecc"] = {"total_correctable_count": 4, "total_uncorrectable_count": 2}
    run = fake_runner({"amd-smi static": (0, json.dumps(STATIC_ROCM6)), "amd-smi metric": (0, json.dumps([record]))})
    part = gpu.probe(CONFIG, run)
    assert part.state == probes.DEGRADED
    assert "2 uncorrectable ECC" in part.reason


def test_rocm_smi_showmeminfo_vram_text() -> None:
    readings = gpu.from_rocm_smi_text(ROCM_SMI_TEXT)
    assert [r.gpu for r in readings] == list(range(8))
    assert readings[0].vram_total_mib == 206141652992 / 2**20 == 196592
    assert readings[0].vram_used_mib == pytest.approx(297771008 / 2**20)
    assert readings[4].vram_used_mib == pytest.approx(297775104 / 2**20)


def test_rocm_smi_text_with_tabs_and_json_labels() -> None:
    text = (FIXTURES / "rocm-smi-a-mi300x-x4-sriov.txt").read_text()
    readings = gpu.from_rocm_smi_text(text)
    assert len(readings) == 4
    assert readings[0].temperature_c == 35.0
    assert readings[0].power_w == 133.0
    # rocm-smi --json uses the same labels under "cardN".
    labels = {"VRAM Total Memory (B)": "206141652992", "VRAM Total Used Memory (B)": "297771008"}
    (r,) = gpu.from_rocm_smi_json({"card0": labels, "system": {}})
    assert r.vram_total_mib == 196592


def test_probe_falls_back_to_rocm_smi_text_when_amd_smi_is_missing() -> None:
    part = gpu.probe(CONFIG, fake_runner({"rocm-smi --showmeminfo": (0, ROCM_SMI_TEXT)}))
    assert part.state == probes.OK, part.reason
    assert part.to_json()["tool"] == "rocm-smi"
    assert len(part.to_json()["gpus"]) == 8


def test_low_vram_headroom_is_degraded() -> None:
    config = gpu_config(min_vram_headroom_mib=196400)
    part = gpu.probe(config, fake_runner({"rocm-smi --showmeminfo": (0, ROCM_SMI_TEXT)}))
    assert part.state == probes.DEGRADED
    assert "MiB VRAM free" in part.reason and "first request" in part.reason


@pytest.mark.parametrize(("required", "state"), [(True, probes.DOWN), (False, probes.NOT_CONFIGURED)])
def test_no_tool_is_not_present(required: bool, state: str) -> None:
    part = gpu.probe(gpu_config(required=required), fake_runner({}))
    assert part.state == state
    assert part.reason.startswith("not present")
    assert part.to_json()["present"] is False


def test_tool_without_gpu_or_hanging_is_not_present() -> None:
    run = fake_runner(
        {
            "amd-smi static": subprocess.TimeoutExpired,
            "amd-smi metric": subprocess.TimeoutExpired,
            "rocm-smi --showmeminfo": (2, "ERROR: No AMD GPUs specified\n"),
        }
    )
    part = gpu.probe(CONFIG, run)
    assert part.state == probes.DOWN
    assert "amd-smi" in part.reason and "rocm-smi exited with status 2" in part.reason


def test_real_programs_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real subprocess path: amd-smi fails as it does without a GPU, rocm-smi prints the recording."""
    fake_program(tmp_path, "amd-smi", script_body="echo 'AMDSMI: no GPUs' >&2", exit=1)
    fake_program(tmp_path, "rocm-smi", script_body=f"cat '{ROCM_SMI_FILE}'")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    part = gpu.probe(CONFIG, probes.run_command)
    assert part.state == probes.OK, part.reason
    assert sorted(calls(tmp_path / "calls.log")) == [  # both amd-smi calls run side by side: in either order
        ["amd-smi", "metric", "--json"],
        ["amd-smi", "static", "--json"],
        ["rocm-smi", "--showmeminfo", "vram", "--showtemp", "--showpower", "--json"],
    ]
    assert part.to_json()["gpus"][0]["vram_total_mib"] == 196592
