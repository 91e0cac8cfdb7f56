# SPDX-License-Identifier: MIT
"""The GPU self-test (applianctl/selftest/) on recorded tool output.

The healthy readings are the real recordings in fixtures/gpu/ (rocm-smi)
and the eight-MI300X amd-smi documents derived from real fragments in fixtures/gpu-faults/ (its
README says where each value and key comes from): none gives a false alarm. Each fault class is then
shown by changing one healthy reading, and only the GPU changed fails. A hostile reading never
raises; collecting runs only read-only commands, under one deadline.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repository import FIXTURES

import applianctl.__main__
from applianctl.selftest import command, readings
from applianctl.selftest.checks import FAILED, NOT_CHECKED, OK, Expectations, Report, gpu_key, run
from applianctl.selftest.facts import read
from applianctl.selftest.readings import Readings, collect
from applianctl.status.probes import ToolMissing

RECORDED = FIXTURES / "gpu"
FAULTS = FIXTURES / "gpu-faults"
ROCM_SMI_A = (RECORDED / "rocm-smi-a-mi300x-x4-sriov.txt").read_text()
ROCM_SMI_X8_VRAM = (RECORDED / "rocm-smi-concise-and-showmeminfo-vram-mi300x-x8-spx-rocm633.txt").read_text()
RECORDINGS = [  # (rocm-smi recording, GPUs in it)
    ("rocm-smi-a-mi300x-x4-sriov.txt", 4),
    ("rocm-smi-concise-mi300x-x4-sriov.txt", 4),
    ("rocm-smi-concise-mi300x-x8.txt", 8),
    ("rocm-smi-concise-and-showmeminfo-vram-mi300x-x8-spx-rocm633.txt", 8),
    ("rocm-smi-session-mi300x-x1-spx-rocm633.txt", 1),
]
# the BDFs of the derived amd-smi documents (AMD's `amd-smi xgmi` example, amdsmi CHANGELOG for ROCm 6.4.0)
BDFS = ["0000:05:00.0", "0000:26:00.0", "0000:46:00.0", "0000:65:00.0", "0000:85:00.0", "0000:a6:00.0", "0000:c6:00.0", "0000:e5:00.0"]
CMDLINE = "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro quiet iommu=pt"


def load(name: str) -> Any:
    return json.loads((FAULTS / name).read_text())


def kfd_nodes(bdfs: Sequence[str]) -> dict[str, str]:
    """A KFD topology: the CPU node, then the recorded GPU node's properties once per BDF, each with
    its own location_id and render node (renderD128 onwards, in probe order)."""
    gpu_props = (FAULTS / "kfd-node-properties-mi300x.txt").read_text()
    nodes = {"0": (FAULTS / "kfd-node-properties-cpu.txt").read_text()}
    for n, bdf in enumerate(bdfs, start=1):
        bus, dev, fn = int(bdf[5:7], 16), int(bdf[8:10], 16), int(bdf[11])
        props = re.sub(r"(?m)^location_id \d+$", f"location_id {bus << 8 | dev << 3 | fn}", gpu_props)
        nodes[str(n)] = re.sub(r"(?m)^drm_render_minor \d+$", f"drm_render_minor {127 + n}", props)
    return nodes


def healthy(**changes: Any) -> Readings:
    """The eight healthy MI300X of the derived amd-smi documents on a host tuned as AMD's guide says."""
    fields: dict[str, Any] = {
        "static": load("amd-smi-static-json-mi300x-x8.json"),
        "metric": load("amd-smi-metric-json-mi300x-x8.json"),
        "partition": load("amd-smi-static-partition-json-mi300x-x8.json"),
        "firmware": load("amd-smi-firmware-json-mi300x-x8.json"),
        "bad_pages": load("amd-smi-bad-pages-json-mi300x-x8.json"),
        "xgmi": load("amd-smi-xgmi-link-status-json-mi300x-x8.json"),
        "cmdline": CMDLINE + "\n",
        "numa_balancing": "0\n",
        "kfd_nodes": kfd_nodes(BDFS),
        "kernel_log": "",
    }
    fields.update(changes)
    return Readings(**fields)


def edited(field: str, edit: Any) -> Readings:
    """The healthy readings with EDIT(document) applied to a copy of FIELD's document."""
    doc = copy.deepcopy(getattr(healthy(), field))
    edit(doc)
    return healthy(**{field: doc})


def findings(report: Report, check: str) -> dict[int, tuple[str, str]]:
    """(state, reason) of CHECK by GPU."""
    return {g.index: (f.state, f.reason) for g in report.gpus for f in g.findings if f.check == check}


def failures(report: Report, check: str) -> dict[int, str]:
    return {i: reason for i, (state, reason) in findings(report, check).items() if state == FAILED}


def host(report: Report, check: str) -> tuple[str, str]:
    (found,) = [(f.state, f.reason) for f in report.host if f.check == check]
    return found


# ----------------------------------------------------------------------------------- no false alarm


@pytest.mark.parametrize(("name", "gpus"), RECORDINGS)
def test_rocm_smi_recordings_raise_no_alarm(name: str, gpus: int) -> None:
    report = run(Readings(rocm_smi=(RECORDED / name).read_text()), Expectations(gpu_count=gpus))
    assert (report.tool, report.failed_gpus, report.exit_status) == ("rocm-smi", [], 0)
    assert [g.index for g in report.gpus] == list(range(gpus))
    for check in ("device-id", "compute-partition", "memory-partition"):
        assert {state for state, _ in findings(report, check).values()} == {OK}, check


def test_rocm_smi_vram_and_firmware_are_read_from_the_recordings() -> None:
    report = run(Readings(rocm_smi=ROCM_SMI_X8_VRAM))
    assert {state for state, _ in findings(report, "vram").values()} == {OK}
    # the recorded firmware, configured in amd-smi's spelling (fw_id; SOS as amd-smi prints it)
    firmware = {"CP_MEC1": "138", "RLC": "63", "PM": "00.85.91.00", "PSP_SOSDRV": "00.36.02.4B", "VCN": "06.11.30.0C"}
    report = run(Readings(rocm_smi=ROCM_SMI_A), Expectations(gpu_count=4, firmware=firmware, driver_min="6.7"))
    assert {state for state, _ in findings(report, "firmware").values()} == {OK}
    assert host(report, "driver-version") == (OK, "")
    assert report.failed_gpus == []


def test_derived_amd_smi_readings_raise_no_alarm_and_every_check_ran() -> None:
    report = run(healthy(), Expectations(render_node_per_gpu=True))
    assert (report.tool, report.failed_gpus, report.exit_status) == ("amd-smi", [], 0)
    assert [(g.index, g.bdf) for g in report.gpus] == list(enumerate(BDFS))
    for g in report.gpus:
        states = {f.check: f.state for f in g.findings}
        not_checked = {check for check, state in states.items() if state == NOT_CHECKED}
        # nothing configured for firmware, no earlier ECC record: everything else was judged
        assert not_checked == {"firmware", "ecc-correctable-rising"}, g.index
        assert set(states.values()) == {OK, NOT_CHECKED}
    assert {f.check: f.state for f in report.host} == {"driver-version": NOT_CHECKED, "kernel-cmdline": OK, "numa-balancing": OK}


def test_correctable_and_aca_lines_of_a_real_mi300x_log_are_no_fault() -> None:
    # ROCm/ROCm#4021: eight MI300X whose MODE1 reset lines name these BDFs; 0000:dd:00.0 raised the
    # fatal ATHUB interrupt, 0000:9d:00.0 logged 1533 correctable XGMI errors, 0000:1b:00.0 ACA entries
    real = ["0000:1b:00.0", "0000:3d:00.0", "0000:4e:00.0", "0000:5f:00.0", "0000:9d:00.0", "0000:bd:00.0", "0000:cd:00.0", "0000:dd:00.0"]

    def at_real_bdfs(doc: Any) -> None:
        for record, bdf in zip(doc, real, strict=True):
            record["bus"]["bdf"] = bdf

    log = (FAULTS / "dmesg-ras-mi300x-rocm-issue-4021.txt").read_text()
    static = edited("static", at_real_bdfs).static
    report = run(healthy(static=static, kernel_log=log, kfd_nodes=kfd_nodes(real), xgmi=None))
    assert list(failures(report, "ras-kernel-log")) == [7]
    assert "ERREVENT_ATHUB_INTERRUPT" in failures(report, "ras-kernel-log")[7]
    assert report.failed_gpus == [7]


# ----------------------------------------------------------------------------------- each fault class


def test_gpu_count_a_missing_gpu_fails_alone() -> None:
    drop_last = {"static": healthy().static[:7], "metric": healthy().metric[:7]}
    report = run(healthy(**drop_last))
    assert report.failed_gpus == [7]
    assert failures(report, "gpu-count") == {7: "GPU 7: not found (7 of 8 GPUs present)"}
    extra = run(healthy(), Expectations(gpu_count=6))
    assert extra.failed_gpus == [6, 7]
    assert "not expected" in failures(extra, "gpu-count")[6]


def test_device_id_another_pci_id() -> None:
    report = run(edited("static", lambda doc: doc[2]["asic"].update(device_id="0x74a5")))
    assert failures(report, "device-id") == {2: "GPU 2: PCI device ID 0x74a5, expected 0x74a1"}
    assert report.failed_gpus == [2]


def test_compute_partition_not_spx() -> None:
    report = run(edited("partition", lambda doc: doc["gpu_data"][3]["partition"].update(accelerator_partition="CPX")))
    assert failures(report, "compute-partition") == {3: "GPU 3: compute partition mode CPX, expected SPX"}
    # amd-smi before 6.4: `compute_partition`, inside static's own answer
    old = edited("static", lambda doc: doc[1].update(partition={"compute_partition": "DPX", "memory_partition": "NPS1"}))
    assert list(failures(run(Readings(**{**vars(old), "partition": None})), "compute-partition")) == [1]
    # rocm-smi -a's label
    text = ROCM_SMI_A.replace("GPU[1]\t\t: Compute Partition: SPX", "GPU[1]\t\t: Compute Partition: CPX")
    assert text != ROCM_SMI_A
    assert list(failures(run(Readings(rocm_smi=text), Expectations(gpu_count=4)), "compute-partition")) == [1]


def test_memory_partition_not_nps1() -> None:
    report = run(edited("partition", lambda doc: doc["gpu_data"][4]["partition"].update(memory_partition="NPS4")))
    assert failures(report, "memory-partition") == {4: "GPU 4: memory partition mode NPS4, expected NPS1"}
    # the concise table's "Partitions (Mem, Compute, ID)" column
    row = "5       7     0x74a1,   2251   41.0°C      133.0W    NPS1, SPX, 0"
    text = ROCM_SMI_X8_VRAM.replace(row, row.replace("NPS1", "NPS4"))
    assert text != ROCM_SMI_X8_VRAM
    assert list(failures(run(Readings(rocm_smi=text)), "memory-partition")) == [5]


def test_vram_below_expected() -> None:
    line = "GPU[6]      : VRAM Total Memory (B): 206141652992"
    text = ROCM_SMI_X8_VRAM.replace(line, line.replace("206141652992", "103070826496"))
    assert text != ROCM_SMI_X8_VRAM
    report = run(Readings(rocm_smi=text))
    assert failures(report, "vram") == {6: "GPU 6: 98296 MiB of VRAM, expected 196592 MiB"}
    # what the driver reports in use (metric) counts before the board's size (static)
    report = run(edited("metric", lambda doc: doc[0]["mem_usage"].update(total_vram={"value": 98304, "unit": "MB"})))
    assert list(failures(report, "vram")) == [0]
    without_usage = edited("metric", lambda doc: doc[1].pop("mem_usage"))
    report = run(healthy(metric=without_usage.metric, static=edited("static", lambda doc: doc[1]["vram"].update(size="N/A")).static))
    assert findings(report, "vram")[1][0] == NOT_CHECKED


def test_ecc_uncorrectable_above_zero() -> None:
    report = run(edited("metric", lambda doc: doc[4]["ecc"].update(total_uncorrectable_count=2)))
    assert failures(report, "ecc-uncorrectable") == {4: "GPU 4: 2 uncorrectable and 0 deferred ECC errors"}
    report = run(edited("metric", lambda doc: doc[5]["ecc"].update(total_deferred_count=1)))
    assert list(failures(report, "ecc-uncorrectable")) == [5]


def test_ecc_correctable_rising_since_the_last_run() -> None:
    rising = edited("metric", lambda doc: doc[1]["ecc"].update(total_correctable_count=19))
    first = run(rising)
    assert findings(first, "ecc-correctable-rising")[1][0] == NOT_CHECKED  # nothing to compare with yet
    key = "bdf:0000:26:00.0"  # GPU 1 has no serial in the record; GPU 0's is its ASIC serial
    assert first.correctable_counts[key] == 19
    assert first.correctable_counts["serial:0xAF54E92B0A5D57C8"] == 0
    report = run(rising, previous={**first.correctable_counts, key: 4})
    assert failures(report, "ecc-correctable-rising") == {1: "GPU 1: correctable ECC errors rose from 4 to 19 since the last run"}
    assert report.failed_gpus == [1]
    assert run(rising, previous=first.correctable_counts).failed_gpus == []  # the same count: not rising
    assert run(rising, previous={key: 40}).failed_gpus == []  # lower: the counter was reset
    tolerant = run(rising, Expectations(correctable_rise_max=20), previous={key: 4})
    assert tolerant.failed_gpus == []


def test_retired_pages_over_the_threshold() -> None:
    page = {"page_address": 16777216, "page_size": 4096, "status": "RESERVED"}  # amdsmi_commands.py bad_pages
    report = run(edited("bad_pages", lambda doc: doc[2].update(retired=[page] * 65)))
    assert failures(report, "retired-pages") == {2: "GPU 2: 65 retired HBM pages, more than 64"}
    one = run(edited("bad_pages", lambda doc: doc[2].update(retired=page)))  # one record: amd-smi drops the list
    assert one.failed_gpus == []


def test_pending_or_unreservable_bad_pages() -> None:
    page = {"page_address": 16777216, "page_size": 4096, "status": "PENDING"}
    report = run(edited("bad_pages", lambda doc: doc[3].update(pending=page)))
    assert failures(report, "pending-pages") == {3: "GPU 3: 1 bad pages pending retirement, 0 the driver could not reserve"}
    report = run(edited("bad_pages", lambda doc: doc[6].update(un_res=[{**page, "status": "UNRESERVABLE"}] * 2)))
    assert list(failures(report, "pending-pages")) == [6]


def test_firmware_other_than_configured() -> None:
    def older_pm(doc: Any) -> None:
        doc["gpu_data"][6]["fw_list"][5] = {"fw_id": "PM", "fw_version": "00.85.90.00"}

    report = run(edited("firmware", older_pm), Expectations(firmware={"PM": "00.85.91.00"}))
    assert failures(report, "firmware") == {6: "GPU 6: firmware PM 00.85.90.00, configured 00.85.91.00"}
    text = ROCM_SMI_A.replace("GPU[2]\t\t: SOS firmware version: \t0x0036024b", "GPU[2]\t\t: SOS firmware version: \t0x0036024c")
    assert text != ROCM_SMI_A
    report = run(Readings(rocm_smi=text), Expectations(gpu_count=4, firmware={"PSP_SOSDRV": "00.36.02.4B"}))
    assert list(failures(report, "firmware")) == [2]


def test_driver_older_than_the_engine_needs_fails_every_gpu() -> None:
    report = run(Readings(rocm_smi=ROCM_SMI_A), Expectations(gpu_count=4, driver_min="6.8"))
    assert host(report, "driver-version") == (FAILED, "amdgpu 6.7.0, older than the 6.8 the engine's ROCm needs")
    assert report.failed_gpus == [0, 1, 2, 3]
    # amdgpu-dkms's module version ("ROCk module version 6.8.5", ROCm/ROCm#4021) wins over the tool's
    assert run(Readings(rocm_smi=ROCM_SMI_A, driver_version="6.8.5\n"), Expectations(gpu_count=4, driver_min="6.8")).failed_gpus == []
    # amd-smi static's driver block (AMD's CLI guide shows the inbox driver as the kernel's version)
    inbox = edited("static", lambda doc: [record.update(driver={"name": "amdgpu", "version": "6.14.4"}) for record in doc])
    assert run(inbox, Expectations(driver_min="6.12")).failed_gpus == []
    assert host(run(inbox, Expectations(driver_min="6.15")), "driver-version")[0] == FAILED


def test_render_nodes_in_another_order_than_the_gpus_fail_only_with_several_replicas() -> None:
    """Each replica is given renderD(128+G) for GPU G; a host whose render nodes are numbered in
    another order would give a replica another GPU than the one checked for it."""
    nodes = kfd_nodes(BDFS)
    assert "drm_render_minor 129\n" in nodes["2"]
    per_gpu = Expectations(render_node_per_gpu=True)
    assert run(healthy(), per_gpu).failed_gpus == []
    assert set(findings(run(healthy(), per_gpu), "render-node").values()) == {(OK, "")}
    nodes["2"], nodes["3"] = (nodes["2"].replace("drm_render_minor 129", "drm_render_minor 130"),
                              nodes["3"].replace("drm_render_minor 130", "drm_render_minor 129"))
    assert failures(run(healthy(kfd_nodes=nodes), per_gpu), "render-node") == {
        1: "GPU 1: its render node is renderD130, but its replica is given renderD129 (another GPU)",
        2: "GPU 2: its render node is renderD129, but its replica is given renderD130 (another GPU)",
    }
    # one engine is given every render node: the order does not matter
    assert failures(run(healthy(kfd_nodes=nodes)), "render-node") == {}
    # a KFD that states none (older kernels): not checked, not failed
    bare = {k: re.sub(r"(?m)^drm_render_minor \d+\n", "", v) for k, v in kfd_nodes(BDFS).items()}
    assert {state for state, _ in findings(run(healthy(kfd_nodes=bare), per_gpu), "render-node").values()} == {NOT_CHECKED}


def test_kfd_without_the_gpu_or_for_another_target() -> None:
    nodes = kfd_nodes(BDFS)
    del nodes["4"]  # GPU 3's node
    report = run(healthy(kfd_nodes=nodes))
    assert failures(report, "kfd") == {3: "GPU 3: KFD has no node for 0000:65:00.0: ROCm cannot use this GPU"}
    nodes = kfd_nodes(BDFS)
    nodes["2"] = nodes["2"].replace("gfx_target_version 90402", "gfx_target_version 90010")
    assert failures(run(healthy(kfd_nodes=nodes)), "kfd") == {1: "GPU 1: KFD reports gfx90a, the engine's ROCm is built for gfx942"}
    assert run(healthy(kfd_nodes={})).failed_gpus == list(range(8))  # no topology: ROCm sees no GPU


def test_pcie_link_narrower_or_slower_than_its_maximum() -> None:
    report = run(edited("metric", lambda doc: doc[5]["pcie"].update(width=8)))
    assert failures(report, "pcie-link") == {5: "GPU 5: PCIe link degraded: x8 of x16"}
    report = run(edited("metric", lambda doc: doc[0]["pcie"].update(speed={"value": 16, "unit": "GT/s"})))
    assert failures(report, "pcie-link") == {0: "GPU 0: PCIe link degraded: 16 of 32 GT/s"}


def test_xgmi_error_status_or_links_down() -> None:
    report = run(edited("metric", lambda doc: doc[2].update(xgmi_err="AMDSMI_XGMI_STATUS_ERROR")))
    assert failures(report, "xgmi") == {2: "GPU 2: XGMI error status ERROR"}
    # the link states of AMD's `amd-smi xgmi --link-status` example (amdsmi CHANGELOG, ROCm 6.4.0)
    example = ["U", "U", "U", "U", "D", "U", "D", "X"]
    report = run(edited("xgmi", lambda doc: doc["link_status"][6].update(link_status=example)))
    assert failures(report, "xgmi") == {6: "GPU 6: 5 XGMI links up, 7 needed (down: 4, 6)"}


def test_numa_balancing_on_fails_every_gpu() -> None:
    report = run(healthy(numa_balancing="1\n"))
    assert host(report, "numa-balancing")[0] == FAILED
    assert "kernel.numa_balancing = 1" in host(report, "numa-balancing")[1]
    assert report.failed_gpus == list(range(8))


def test_kernel_command_line_without_the_required_words() -> None:
    report = run(healthy(cmdline=CMDLINE.replace(" iommu=pt", "")))
    assert host(report, "kernel-cmdline") == (FAILED, "the kernel command line lacks iommu=pt (AMD's MI300X tuning guide)")
    assert report.exit_status == 1
    assert run(healthy(cmdline=CMDLINE), Expectations(kernel_cmdline=("iommu=pt", "pci=realloc=off"))).exit_status == 1


def test_ras_errors_in_the_kernel_log() -> None:
    report = run(healthy(kernel_log=(FAULTS / "kernel-log-ras-derived.txt").read_text()))
    failed = failures(report, "ras-kernel-log")
    assert sorted(failed) == [2, 3, 4]  # uncorrectable, deferred, past the bad-page threshold; 5's are correctable
    assert failed[2].startswith("GPU 2: amdgpu RAS error this boot: amdgpu 0000:46:00.0: {2}socket: 0, die: 0, 1 new uncorrectable")
    assert failed[2].endswith("(and 1 more)")
    stray = run(healthy(kernel_log="amdgpu 0000:ff:00.0: amdgpu: RAS records:130 exceed threshold:128\n"))
    assert host(stray, "ras-kernel-log")[0] == FAILED
    assert stray.failed_gpus == list(range(8))


# ----------------------------------------------------------------------------------- hostile readings

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    | st.sampled_from(["N/A", "0x74a1", "SPX", "No bad pages found.", "U", "D", "AMDSMI_XGMI_STATUS_ERROR", "0000:05:00.0"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["gpu", "gpu_data", "asic", "bus", "bdf", "device_id", "partition", "accelerator_partition",
                         "memory_partition", "vram", "size", "value", "unit", "pcie", "width", "speed", "max_pcie_width",
                         "max_pcie_speed", "ecc", "total_correctable_count", "total_uncorrectable_count", "xgmi_err",
                         "fw_list", "fw_id", "fw_version", "retired", "pending", "un_res", "link_status", "mem_usage",
                         "driver", "version", "asic_serial"]) | st.text(max_size=6),
        inner, max_size=5),
    max_leaves=25,
)
TEXT = st.text(max_size=300) | st.sampled_from([ROCM_SMI_A[:2000], "amdgpu 0000:05:00.0: 99 new uncorrectable hardware errors detected"])


@settings(max_examples=150, deadline=None)
@given(docs=st.lists(JSON, min_size=6, max_size=6), texts=st.lists(TEXT | st.none(), min_size=5, max_size=5),
       nodes=st.none() | st.dictionaries(st.text(max_size=3), TEXT, max_size=3), previous=JSON)
def test_a_hostile_reading_never_raises(docs: list[Any], texts: list[str | None], nodes: dict[str, str] | None, previous: Any) -> None:
    r = Readings(*docs, rocm_smi=texts[0], cmdline=texts[1], numa_balancing=texts[2], driver_version=texts[3],
                 kfd_nodes=nodes, kernel_log=texts[4])
    report = run(r, previous=previous)
    json.dumps(report.to_json())
    command.render(report)


def test_huge_numbers_and_wrong_types_are_not_checked_not_raised() -> None:
    hostile = healthy(
        static=[{"gpu": 1e308, "asic": {"device_id": 10**30}, "bus": {"bdf": ["x"], "max_pcie_width": float("inf")}, "vram": "big"}],
        metric={"gpu_data": [{"gpu": -1, "ecc": {"total_uncorrectable_count": "2"}, "pcie": {"width": 10**400}}]},
        partition={"gpu_data": "nope"},
        firmware=[{"gpu": 0, "fw_list": [1, {"fw_id": ["PM"]}, {"fw_id": "PM", "fw_version": 10**50}]}],
        bad_pages=[{"gpu": 0, "retired": 7, "pending": None}],
        xgmi={"link_status": [1, "a", {"gpu": "x", "link_status": [None, 5, "U"]}]},
        kfd_nodes={"1": "simd_count " + "9" * 40 + "\nlocation_id -5\n", "2": "simd_count 1\nlocation_id 99999999999\n"},
        kernel_log="amdgpu 0000:05:00.0: " + "9" * 5000 + " new uncorrectable hardware errors detected in umc block\n",
        numa_balancing="²", cmdline=5, driver_version=b"6.8",
    )
    report = run(hostile, previous={"gpu:0": 10**40, "x": "y", "serial:a": True})
    json.dumps(report.to_json())
    assert report.correctable_counts == {}
    assert host(report, "numa-balancing")[0] == NOT_CHECKED
    assert host(report, "kernel-cmdline")[0] == NOT_CHECKED


def test_absurd_values_are_not_checked_rather_than_failed() -> None:
    def absurd(doc: Any) -> None:
        doc[0]["ecc"].update(total_uncorrectable_count=-1, total_deferred_count="lots")
        doc[0]["pcie"].update(width=0, speed={"value": 32, "unit": "MHz"})
        doc[0]["mem_usage"]["total_vram"] = {"value": -5, "unit": "MB"}
        doc[0]["xgmi_err"] = "SOMETHING_NEW"

    report = run(edited("metric", absurd))
    assert report.failed_gpus == []
    for check in ("ecc-uncorrectable", "pcie-link", "vram"):
        assert findings(report, check)[0][0] == NOT_CHECKED, check
    assert findings(report, "xgmi")[0][0] == OK  # the link list still says all links are up


def test_no_gpu_list_means_could_not_run() -> None:
    report = run(Readings(problems=("amd-smi static: amd-smi is not installed", "rocm-smi -a: rocm-smi is not installed")))
    assert report.exit_status == 3
    assert "amd-smi is not installed" in report.could_not_run
    assert run(Readings(static="garbage", rocm_smi="no gpu here\n")).exit_status == 3
    assert run(Readings(static=[])).failed_gpus == list(range(8))  # amd-smi answered: it lists none


# ----------------------------------------------------------------------------------- collecting

READ_ONLY = {readings.AMD_SMI_PARTITION, readings.AMD_SMI_FIRMWARE, readings.AMD_SMI_BAD_PAGES, readings.AMD_SMI_XGMI,
             readings.ROCM_SMI_ALL, readings.ROCM_SMI_VRAM, readings.KERNEL_LOG,
             ("amd-smi", "static", "--json"), ("amd-smi", "metric", "--json")}


class FakeTools:
    """Answers each command from a table; records every command line it was asked to run."""

    def __init__(self, answers: dict[tuple[str, ...], tuple[int, str]], missing: Sequence[str] = (), hang: Sequence[str] = ()) -> None:
        self.answers, self.missing, self.hang = answers, set(missing), set(hang)
        self.asked: list[tuple[str, ...]] = []
        self.release = threading.Event()

    def __call__(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
        self.asked.append(tuple(argv))
        if argv[0] in self.missing:
            raise ToolMissing(argv[0])
        if argv[0] in self.hang:
            self.release.wait(10)
        return self.answers.get(tuple(argv), (2, ""))


def host_root(tmp_path: Path) -> Path:
    files = {"proc/cmdline": CMDLINE + "\n", "proc/sys/kernel/numa_balancing": "0\n", "sys/module/amdgpu/version": "6.8.5\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for name, props in kfd_nodes(BDFS).items():
        node = tmp_path / "sys/class/kfd/kfd/topology/nodes" / name
        node.mkdir(parents=True)
        (node / "properties").write_text(props)
    return tmp_path


def amd_smi_answers() -> dict[tuple[str, ...], tuple[int, str]]:
    h = healthy()
    return {("amd-smi", "static", "--json"): (0, json.dumps(h.static)), ("amd-smi", "metric", "--json"): (0, json.dumps(h.metric)),
            readings.AMD_SMI_PARTITION: (0, json.dumps(h.partition)), readings.AMD_SMI_FIRMWARE: (0, json.dumps(h.firmware)),
            readings.AMD_SMI_BAD_PAGES: (0, json.dumps(h.bad_pages)), readings.KERNEL_LOG: (0, "amdgpu: loaded\n")}


def test_collect_reads_every_source_with_read_only_commands(tmp_path: Path) -> None:
    tools = FakeTools(amd_smi_answers())  # `xgmi --link-status` is unknown to this amd-smi: status 2
    got = collect(tools, 5.0, host_root(tmp_path))
    assert set(tools.asked) <= READ_ONLY
    assert got.rocm_smi is None and ("rocm-smi", "-a") not in tools.asked  # amd-smi answered
    assert (got.cmdline, got.numa_balancing, got.driver_version) == (CMDLINE + "\n", "0\n", "6.8.5\n")
    assert got.xgmi is None and any(p.startswith("amd-smi xgmi --link-status:") for p in got.problems)
    report = run(got, Expectations(driver_min="6.8"))
    assert report.failed_gpus == []
    assert findings(report, "xgmi")[0][0] == NOT_CHECKED  # metric's xgmi_err is N/A and there is no link list
    assert findings(report, "kfd")[0][0] == OK


def test_collect_falls_back_to_rocm_smi(tmp_path: Path) -> None:
    vram = ROCM_SMI_X8_VRAM.split("rocm-smi --showmeminfo vram", 1)[1]
    tools = FakeTools({readings.ROCM_SMI_ALL: (0, ROCM_SMI_X8_VRAM), readings.ROCM_SMI_VRAM: (0, vram)}, missing=["amd-smi"])
    got = collect(tools, 5.0, host_root(tmp_path))
    assert set(tools.asked) <= READ_ONLY
    assert "amd-smi static: amd-smi is not installed" in got.problems
    report = run(got)
    assert report.tool == "rocm-smi"
    assert {state for state, _ in findings(report, "vram").values()} == {OK}


def test_collect_keeps_its_deadline_when_a_tool_hangs(tmp_path: Path) -> None:
    tools = FakeTools(amd_smi_answers(), hang=["journalctl"])
    start = time.monotonic()
    try:
        got = collect(tools, 0.5, host_root(tmp_path))
    finally:
        tools.release.set()
    assert time.monotonic() - start < 3
    assert got.kernel_log is None and any(p.startswith("journalctl -k:") for p in got.problems)
    assert got.static is not None


# ----------------------------------------------------------------------------------- the command


def test_command_exit_statuses(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setattr(command, "collect", lambda run, timeout: healthy())
    assert applianctl.__main__.main(["selftest", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["ok"], out["failed_gpus"], out["gpus"][0]["bdf"]) == (True, [], "0000:05:00.0")
    stored = tmp_path / "selftest.json"
    stored.write_text(json.dumps({**out, "correctable_counts": {"bdf:0000:26:00.0": 0}}))

    rising = edited("metric", lambda doc: doc[1]["ecc"].update(total_correctable_count=3))
    monkeypatch.setattr(command, "collect", lambda run, timeout: rising)
    assert applianctl.__main__.main(["selftest", "--previous", str(stored)]) == 1
    text = capsys.readouterr().out
    assert "GPU 1 (0000:26:00.0): failed\n  ecc-correctable-rising: GPU 1: correctable ECC errors rose from 0 to 3" in text
    assert text.rstrip().endswith("failed GPUs: 1")

    monkeypatch.setattr(command, "collect", lambda run, timeout: Readings(problems=("amd-smi static: amd-smi is not installed",)))
    assert applianctl.__main__.main(["selftest"]) == 3
    assert "could not run: amd-smi static: amd-smi is not installed" in capsys.readouterr().out


@pytest.mark.parametrize("json_out", [False, True])
def test_command_without_a_gpu_is_exit_3_with_a_hint(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                     json_out: bool) -> None:
    # a machine with no AMD GPU (a QEMU guest): no KFD topology, no tool lists a GPU
    nothing = Readings(problems=("amd-smi static: amd-smi is not installed",), kfd_nodes={})
    monkeypatch.setattr(command, "collect", lambda run, timeout: nothing)
    assert applianctl.__main__.main(["selftest", *(["--json"] if json_out else [])]) == 3
    out, err = capsys.readouterr()
    assert ("could not run: amd-smi static" in out) if not json_out else json.loads(out)["could_not_run"]
    assert err.startswith("hint: no amdgpu/KFD device: on a machine without an AMD GPU the self-test cannot run (in QEMU that is expected)")
    assert len(err.splitlines()) == 1
    # the KFD sees GPUs but the tools list none: the hint is the tools, not the hardware
    tools_missing = healthy(static=None, metric=None, problems=("amd-smi static: amd-smi is not installed",))
    monkeypatch.setattr(command, "collect", lambda run, timeout: tools_missing)
    assert applianctl.__main__.main(["selftest"]) == 3
    assert capsys.readouterr().err.startswith("hint: the KFD sees a GPU but neither amd-smi nor rocm-smi listed it")


def test_command_bad_previous_report_is_exit_2_with_a_hint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "selftest.json"
    bad.write_text("{not json")
    assert applianctl.__main__.main(["selftest", "--previous", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"applianctl: {bad}: not JSON")
    assert "hint: pass a report `applianctl selftest --json` printed" in err
    bad.write_text("[]")
    assert applianctl.__main__.main(["selftest", "--previous", str(bad)]) == 2


def test_command_that_breaks_could_not_run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken(run: Any, timeout: float) -> Readings:
        raise RuntimeError("boom")

    monkeypatch.setattr(command, "collect", broken)
    assert applianctl.__main__.main(["selftest"]) == 3
    err = capsys.readouterr().err.splitlines()
    assert err == ["applianctl selftest: could not run: RuntimeError: boom",
                   "hint: the self-test broke: run `applianctl --debug selftest` for the traceback"]


def test_facts_name_each_gpu_by_its_key() -> None:
    gpus = read(healthy()).gpus
    assert [gpu_key(g) for g in gpus[:2]] == ["serial:0xAF54E92B0A5D57C8", "bdf:0000:26:00.0"]


# ----------------------------------------------------------------------------------- at boot


@pytest.fixture
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A device whose topology uses GPUs 0 and 1 (2x1) of the eight the readings show; a function
    that sets gpu.required."""
    import dataclasses

    from appliance import config, paths

    def set_required(required: bool) -> None:
        c = config.load(Path(__file__).resolve().parents[1] / "appliance.toml", "production")
        c = dataclasses.replace(c, topology=dataclasses.replace(c.topology, gpus=2, layout="2x1"),
                                gpu=dataclasses.replace(c.gpu, required=required))
        (tmp_path / "lib/appliance.json").write_text(json.dumps(c.to_json()))

    for d in ("lib", "run", "state"):
        (tmp_path / d).mkdir()
    set_required(True)
    monkeypatch.setenv("APPLIANCE_CONFIG", str(tmp_path / "lib/appliance.json"))
    for name, value in {"LIB_DIR": tmp_path / "lib", "RUN_DIR": tmp_path / "run", "STATE_DIR": tmp_path / "state",
                        "GPU_SELFTEST": tmp_path / "run/gpu-selftest.json"}.items():
        monkeypatch.setattr(paths, name, value)
    return set_required


def _boot(monkeypatch: pytest.MonkeyPatch, found: Readings) -> int:
    monkeypatch.setattr(command, "collect", lambda run, timeout: found)
    return applianctl.__main__.main(["selftest", "--at-boot"])


def _gpu_part() -> Any:
    from appliance import paths
    from appliance.host_settings import load_device
    from applianctl.status import gpu

    answers = {"static": json.dumps(healthy().static), "metric": json.dumps(healthy().metric)}
    return gpu.probe(load_device(), lambda argv, timeout: (0, answers[argv[1]]), paths.GPU_SELFTEST)


def test_at_boot_a_failed_gpu_the_engines_use_keeps_them_stopped_and_status_names_it(
        device: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from appliance import paths

    assert _boot(monkeypatch, healthy()) == 0  # eight healthy GPUs; the counts kept as the baseline
    assert json.loads(paths.GPU_SELFTEST.read_text())["used_gpus"] == [0, 1]
    baseline = paths.gpu_selftest_baseline_path().read_text()
    capsys.readouterr()
    # GPU 1's correctable ECC errors rose since the last passing run: it is used by replica 1, which
    # stays stopped (its unit's gate fails); replica 0 on GPU 0 still starts, so the unit passes
    assert _boot(monkeypatch, edited("metric", lambda doc: doc[1]["ecc"].update(total_correctable_count=3))) == 0
    assert "GPU(s) 1 failed: replica(s) 1 stay stopped" in capsys.readouterr().err
    assert applianctl.__main__.main(["selftest", "--replica", "1"]) == 1
    assert "replica 1 runs on GPU(s) 1, which failed" in capsys.readouterr().err
    assert applianctl.__main__.main(["selftest", "--replica", "0"]) == 0
    assert paths.gpu_selftest_baseline_path().read_text() == baseline  # a rise stays a rise until someone looks
    report = json.loads(paths.GPU_SELFTEST.read_text())
    assert report["failed_used_gpus"] == [1]
    part = _gpu_part()
    assert part.state == "down" and "GPU 1 failed its self-test: GPU 1: correctable ECC errors rose from 0 to 3" in part.reason, part


def test_at_boot_failed_gpus_under_every_replica_keep_the_unit_failed(device: Any, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from appliance import paths

    assert _boot(monkeypatch, edited("metric", lambda doc: [doc[g]["ecc"].update(total_uncorrectable_count=1) for g in (0, 1)])) == 1
    assert "replica(s) 0, 1 stay stopped" in capsys.readouterr().err
    assert [applianctl.__main__.main(["selftest", "--replica", str(i)]) for i in (0, 1)] == [1, 1]
    # a damaged report keeps the replica out; no report (no self-test this boot) is no verdict
    paths.GPU_SELFTEST.write_text("{not json")
    assert applianctl.__main__.main(["selftest", "--replica", "0"]) == 1
    paths.GPU_SELFTEST.unlink()
    assert applianctl.__main__.main(["selftest", "--replica", "0"]) == 0
    assert applianctl.__main__.main(["selftest", "--replica", "2"]) == 2  # the topology has two


def test_at_boot_a_failed_gpu_no_engine_uses_is_reported_not_fatal(device: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance import paths

    assert _boot(monkeypatch, edited("metric", lambda doc: doc[5]["ecc"].update(total_uncorrectable_count=2))) == 0
    report = json.loads(paths.GPU_SELFTEST.read_text())
    # GPUs 2-7 are beyond the topology's two ("not expected"), GPU 5 also has uncorrectable errors: idle, not fatal
    assert report["failed_gpus"] == [2, 3, 4, 5, 6, 7] and report["failed_used_gpus"] == []
    (gpu5,) = [g for g in report["gpus"] if g["gpu"] == 5]
    assert any(f["check"] == "ecc-uncorrectable" and f["state"] == "failed" for f in gpu5["findings"]), gpu5
    part = _gpu_part()
    assert part.state == "ok" and part.to_json()["selftest"]["failed_used_gpus"] == [], part


def test_at_boot_could_not_run_blocks_only_where_a_gpu_is_required(
    device: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from appliance import paths

    nothing = Readings(problems=("amd-smi static: amd-smi is not installed",))
    assert _boot(monkeypatch, nothing) == 3
    assert "hint: no amdgpu/KFD device: " in capsys.readouterr().err
    assert json.loads(paths.GPU_SELFTEST.read_text())["could_not_run"]
    assert not paths.gpu_selftest_baseline_path().exists()
    device(False)
    assert _boot(monkeypatch, nothing) == 0


def test_a_previous_report_with_counts_that_are_not_counts_is_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A negative count would make every later count a rise; a string one is no count."""
    bad = tmp_path / "selftest.json"
    for counts, shown in (({"gpu:0": -5}, "-5"), ({"gpu:0": "3"}, "'3'"), ([1], r"\[...\]")):
        bad.write_text(json.dumps({"ok": True, "correctable_counts": counts}))
        assert applianctl.__main__.main(["selftest", "--previous", str(bad)]) == 2
        err = capsys.readouterr().err
        assert re.match(rf"applianctl: {re.escape(str(bad))}: correctable_counts(\.gpu:0)? = {shown}: invalid\n", err), err
        assert "hint: pass a report `applianctl selftest --json` printed" in err


@pytest.mark.parametrize("damage", ["a negative count", "a directory", "a link"])
def test_at_boot_a_damaged_baseline_is_one_line_and_kept_anew(device: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                              damage: str, capsys: pytest.CaptureFixture[str]) -> None:
    from appliance import paths

    baseline = paths.gpu_selftest_baseline_path()
    baseline.parent.mkdir(parents=True, exist_ok=True)
    if damage == "a negative count":
        baseline.write_text(json.dumps({"correctable_counts": {"bdf:0000:26:00.0": -1000}}))
    elif damage == "a directory":
        baseline.mkdir()
    else:
        (tmp_path / "elsewhere.json").write_text(json.dumps({"correctable_counts": {}}))
        baseline.symlink_to(tmp_path / "elsewhere.json")
    assert _boot(monkeypatch, healthy()) == 0
    err = capsys.readouterr().err
    assert "starting from this run's counts" in err, err
    kept = json.loads(baseline.read_text())["correctable_counts"]
    assert kept and all(type(v) is int and v >= 0 for v in kept.values()) and not baseline.is_symlink()
    if damage == "a link":
        assert json.loads((tmp_path / "elsewhere.json").read_text()) == {"correctable_counts": {}}  # never written through
