# SPDX-License-Identifier: MIT
"""The checks: `run(readings, expected, previous)` judges every GPU and the host, and returns a
`Report` that says per GPU ok, or failed with one-line reasons naming the GPU and the value, and
which checks could not be made and why. It only reads its arguments.

A failed GPU takes out the replicas that use it: `Report.failed_gpus`. A failed host check (driver,
kernel command line, NUMA balancing, a RAS error on a device no GPU answers to) concerns every GPU,
so every GPU is in `failed_gpus` then. Correctable ECC errors are compared with the counts an earlier
run stored (`previous`); the report carries the counts to store for the next one.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.config.model import RENDER_MINOR_BASE
from applianctl.selftest.facts import Facts, GpuFacts, read, version
from applianctl.selftest.readings import Readings

OK = "ok"
FAILED = "failed"
NOT_CHECKED = "not checked"

EXIT_OK, EXIT_FAILED, EXIT_COULD_NOT_RUN = 0, 1, 3
_MAX_RECORDED = 64  # GPUs in the correctable-ECC record


def _no_firmware() -> Mapping[str, str]:
    return types.MappingProxyType({})


@dataclass(frozen=True)
class Expectations:
    """What a healthy host looks like; the defaults are an eight-MI300X server. Until the
    configuration model carries them, they live here and nowhere else."""

    gpu_count: int = 8
    device_ids: tuple[int, ...] = (0x74A1,)  # MI300X OAM, as rocm-smi and amd-smi print it
    compute_partition: str = "SPX"
    memory_partition: str = "NPS1"
    vram_mib: float = 196592  # an MI300X's 192 GB as amd-smi reports it (its "MB" are MiB)
    correctable_rise_max: int = 0  # correctable ECC errors must not rise between runs
    # A policy figure, half the driver's own RMA threshold in AMD's amd-smi example (ROCm 7.0.2:
    # BAD_PAGE_THRESHOLD 128): a GPU whose HBM keeps losing pages leaves service before it fails requests.
    retired_pages_max: int = 64
    firmware: Mapping[str, str] = field(default_factory=_no_firmware)  # amd-smi fw_id -> version
    driver_min: str | None = None  # the oldest amdgpu the engine image's ROCm accepts
    gfx_targets: tuple[str, ...] = ("gfx942",)  # what the engine image's ROCm is built for
    pcie_width: int | None = None  # lanes; None: the GPU's own maximum
    pcie_speed_gts: float | None = None  # None: the GPU's own maximum
    # AMD's MI300X system optimization guide: `iommu=pt` on AMD hosts (`amd_iommu=on` is not a
    # value the kernel knows: admin-guide/kernel-parameters)
    kernel_cmdline: tuple[str, ...] = ("iommu=pt",)
    # With several replicas each engine is given GPU G as /dev/dri/renderD(128+G) alone
    # (Config.replica_devices): the render node of the GPU this check calls G must be that one, or
    # a replica would run on another GPU than the one checked for it.
    render_node_per_gpu: bool = False


@dataclass(frozen=True)
class Finding:
    check: str
    state: str
    reason: str = ""

    def to_json(self) -> dict[str, str]:
        return {"check": self.check, "state": self.state, "reason": self.reason}


@dataclass(frozen=True)
class GpuResult:
    index: int
    bdf: str | None
    findings: tuple[Finding, ...]

    @property
    def state(self) -> str:
        return FAILED if any(f.state == FAILED for f in self.findings) else OK

    def to_json(self) -> dict[str, Any]:
        return {"gpu": self.index, "bdf": self.bdf, "state": self.state, "findings": [f.to_json() for f in self.findings]}


@dataclass(frozen=True)
class Report:
    tool: str | None
    gpus: tuple[GpuResult, ...]
    host: tuple[Finding, ...]
    correctable_counts: Mapping[str, int]
    problems: tuple[str, ...] = ()

    @property
    def could_not_run(self) -> str:
        """Why there is no GPU list at all ("" when there is one)."""
        return "" if self.tool is not None else "; ".join(self.problems) or "neither amd-smi nor rocm-smi listed the GPUs"

    @property
    def failed_gpus(self) -> list[int]:
        host_failed = any(f.state == FAILED for f in self.host)
        return [g.index for g in self.gpus if host_failed or g.state == FAILED]

    @property
    def exit_status(self) -> int:
        if self.could_not_run:
            return EXIT_COULD_NOT_RUN
        return EXIT_FAILED if self.failed_gpus else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.exit_status == EXIT_OK,
            "tool": self.tool,
            "could_not_run": self.could_not_run,
            "failed_gpus": self.failed_gpus,
            "gpus": [g.to_json() for g in self.gpus],
            "host": [f.to_json() for f in self.host],
            "correctable_counts": dict(self.correctable_counts),
            "problems": list(self.problems),
        }


# ----------------------------------------------------------------------------------- per GPU

Check = Callable[[GpuFacts, Facts, Expectations], Finding]


def _name(g: GpuFacts) -> str:
    return f"GPU {g.index}"


def _device_id(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    if g.device_id is None:
        return Finding("device-id", NOT_CHECKED, f"{_name(g)}: no PCI device ID reported")
    wanted = ", ".join(f"0x{d:04x}" for d in e.device_ids)
    if g.device_id not in e.device_ids:
        return Finding("device-id", FAILED, f"{_name(g)}: PCI device ID 0x{g.device_id:04x}, expected {wanted}")
    return Finding("device-id", OK)


def _partition(check: str, what: str, have: str | None, want: str, g: GpuFacts) -> Finding:
    if have is None:
        return Finding(check, NOT_CHECKED, f"{_name(g)}: no {what} partition mode reported")
    if have != want.upper():
        return Finding(check, FAILED, f"{_name(g)}: {what} partition mode {have}, expected {want}")
    return Finding(check, OK)


def _compute_partition(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    return _partition("compute-partition", "compute", g.compute_partition, e.compute_partition, g)


def _memory_partition(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    return _partition("memory-partition", "memory", g.memory_partition, e.memory_partition, g)


def _vram(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    if g.vram_mib is None:
        return Finding("vram", NOT_CHECKED, f"{_name(g)}: no VRAM size reported")
    if g.vram_mib < e.vram_mib:
        return Finding("vram", FAILED, f"{_name(g)}: {g.vram_mib:.0f} MiB of VRAM, expected {e.vram_mib:.0f} MiB")
    return Finding("vram", OK)


def _ecc_uncorrectable(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    if g.ecc_uncorrectable is None and g.ecc_deferred is None:
        return Finding("ecc-uncorrectable", NOT_CHECKED, f"{_name(g)}: no uncorrectable ECC count reported")
    ue, deferred = g.ecc_uncorrectable or 0, g.ecc_deferred or 0
    if ue or deferred:  # MI300 reports uncorrectable HBM errors as deferred ones (amd64_edac)
        return Finding("ecc-uncorrectable", FAILED, f"{_name(g)}: {ue} uncorrectable and {deferred} deferred ECC errors")
    return Finding("ecc-uncorrectable", OK)


def _retired_pages(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    if g.retired_pages is None:
        return Finding("retired-pages", NOT_CHECKED, f"{_name(g)}: no retired page list reported")
    if g.retired_pages > e.retired_pages_max:
        return Finding("retired-pages", FAILED, f"{_name(g)}: {g.retired_pages} retired HBM pages, more than {e.retired_pages_max}")
    return Finding("retired-pages", OK)


def _pending_pages(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    if g.pending_pages is None and g.unreservable_pages is None:
        return Finding("pending-pages", NOT_CHECKED, f"{_name(g)}: no pending page list reported")
    pending, unreservable = g.pending_pages or 0, g.unreservable_pages or 0
    if pending or unreservable:
        return Finding("pending-pages", FAILED,
                       f"{_name(g)}: {pending} bad pages pending retirement, {unreservable} the driver could not reserve")
    return Finding("pending-pages", OK)


def _plain_version(v: str) -> str:
    """"0x0036024b" (rocm-smi) and "00.36.02.4B" (amd-smi) are one version: "0036024b"."""
    return "".join(c for c in v.lower().removeprefix("0x") if c.isalnum())


def _firmware(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    if not e.firmware:
        return Finding("firmware", NOT_CHECKED, "no firmware versions configured")
    wrong = [f"{block} {g.firmware[block]}, configured {want}" for block, want in sorted(e.firmware.items())
             if block in g.firmware and _plain_version(g.firmware[block]) != _plain_version(want)]
    if wrong:
        return Finding("firmware", FAILED, f"{_name(g)}: firmware " + "; ".join(wrong))
    missing = sorted(set(e.firmware) - set(g.firmware))
    if missing:
        return Finding("firmware", NOT_CHECKED, f"{_name(g)}: no version reported for {', '.join(missing)}")
    return Finding("firmware", OK)


def _kfd(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    if f.kfd is None:
        return Finding("kfd", NOT_CHECKED, "KFD topology not read")
    if g.bdf is None:
        return Finding("kfd", NOT_CHECKED, f"{_name(g)}: no PCI address reported to find its KFD node by")
    if g.bdf not in f.kfd:
        return Finding("kfd", FAILED, f"{_name(g)}: KFD has no node for {g.bdf}: ROCm cannot use this GPU")
    target = f.kfd[g.bdf]
    if target is None:
        return Finding("kfd", NOT_CHECKED, f"{_name(g)}: KFD node states no gfx target")
    if target not in e.gfx_targets:
        return Finding("kfd", FAILED, f"{_name(g)}: KFD reports {target}, the engine's ROCm is built for {', '.join(e.gfx_targets)}")
    return Finding("kfd", OK)


def _render_node(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    if not e.render_node_per_gpu:
        return Finding("render-node", NOT_CHECKED, "one engine is given every render node")
    if f.render_minors is None or g.bdf is None or g.bdf not in f.render_minors:
        return Finding("render-node", NOT_CHECKED, f"{_name(g)}: KFD states no render node for it")
    minor, expected = f.render_minors[g.bdf], RENDER_MINOR_BASE + g.index
    if minor != expected:
        return Finding("render-node", FAILED, f"{_name(g)}: its render node is renderD{minor}, but its replica is given "
                                              f"renderD{expected} (another GPU)")
    return Finding("render-node", OK)


def _pcie_link(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    width_floor = e.pcie_width if e.pcie_width is not None else g.pcie_max_width
    speed_floor = e.pcie_speed_gts if e.pcie_speed_gts is not None else g.pcie_max_speed_gts
    width, speed = g.pcie_width, g.pcie_speed_gts
    if (width is None or width_floor is None) and (speed is None or speed_floor is None):
        return Finding("pcie-link", NOT_CHECKED, f"{_name(g)}: no current and maximum PCIe link reported")
    slow = []
    if width is not None and width_floor is not None and width < width_floor:
        slow.append(f"x{width:g} of x{width_floor:g}")
    if speed is not None and speed_floor is not None and speed < speed_floor:
        slow.append(f"{speed:g} of {speed_floor:g} GT/s")
    if slow:
        return Finding("pcie-link", FAILED, f"{_name(g)}: PCIe link degraded: " + ", ".join(slow))
    return Finding("pcie-link", OK)


def _xgmi(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    if g.xgmi_error is None and g.xgmi_links is None:
        return Finding("xgmi", NOT_CHECKED, f"{_name(g)}: no XGMI error status or link status reported")
    if g.xgmi_error is not None and g.xgmi_error != "NO_ERRORS":
        return Finding("xgmi", FAILED, f"{_name(g)}: XGMI error status {g.xgmi_error}")
    if g.xgmi_links is not None:
        up = g.xgmi_links.count("U")
        peers = e.gpu_count - 1  # a GPU reaches each other GPU of the hive over its own link
        if up < peers:
            down = [str(i) for i, s in enumerate(g.xgmi_links) if s == "D"]
            return Finding("xgmi", FAILED, f"{_name(g)}: {up} XGMI links up, {peers} needed (down: {', '.join(down) or 'none'})")
    return Finding("xgmi", OK)


def _ras_log(g: GpuFacts, f: Facts, e: Expectations) -> Finding:
    if f.ras_errors is None:
        return Finding("ras-kernel-log", NOT_CHECKED, "kernel log not read")
    mine = [r.line for r in f.ras_errors if g.bdf is not None and r.bdf == g.bdf]
    if mine:
        more = f" (and {len(mine) - 1} more)" if len(mine) > 1 else ""
        return Finding("ras-kernel-log", FAILED, f"{_name(g)}: amdgpu RAS error this boot: {mine[0]}{more}")
    if g.bdf is None:
        return Finding("ras-kernel-log", NOT_CHECKED, f"{_name(g)}: no PCI address reported to match kernel log lines with")
    return Finding("ras-kernel-log", OK)


GPU_CHECKS: tuple[Check, ...] = (_device_id, _compute_partition, _memory_partition, _vram, _ecc_uncorrectable, _retired_pages,
                                 _pending_pages, _firmware, _kfd, _render_node, _pcie_link, _xgmi, _ras_log)


def gpu_key(g: GpuFacts) -> str:
    """Which GPU a stored count belongs to: its serial, else its PCI address, else its number."""
    return f"serial:{g.serial}" if g.serial else f"bdf:{g.bdf}" if g.bdf else f"gpu:{g.index}"


def _correctable(g: GpuFacts, previous: Mapping[str, int], e: Expectations) -> Finding:
    if g.ecc_correctable is None:
        return Finding("ecc-correctable-rising", NOT_CHECKED, f"{_name(g)}: no correctable ECC count reported")
    before = previous.get(gpu_key(g))
    if before is None:
        return Finding("ecc-correctable-rising", NOT_CHECKED, f"{_name(g)}: no earlier count to compare with")
    # a count lower than before was reset (the driver reloaded), and counts anew from here
    if g.ecc_correctable - before > e.correctable_rise_max:
        return Finding("ecc-correctable-rising", FAILED,
                       f"{_name(g)}: correctable ECC errors rose from {before} to {g.ecc_correctable} since the last run")
    return Finding("ecc-correctable-rising", OK)


# ----------------------------------------------------------------------------------- host


def _host(f: Facts, e: Expectations) -> list[Finding]:
    out = []
    have, want = version(f.driver_version), version(e.driver_min)
    if want is None:
        out.append(Finding("driver-version", NOT_CHECKED, "no minimum amdgpu version configured"))
    elif have is None:
        out.append(Finding("driver-version", NOT_CHECKED, "no amdgpu version reported"))
    elif have < want:
        out.append(Finding("driver-version", FAILED, f"amdgpu {f.driver_version}, older than the {e.driver_min} the engine's ROCm needs"))
    else:
        out.append(Finding("driver-version", OK))
    if f.cmdline is None:
        out.append(Finding("kernel-cmdline", NOT_CHECKED, "/proc/cmdline not read"))
    elif missing := [w for w in e.kernel_cmdline if w not in f.cmdline]:
        out.append(Finding("kernel-cmdline", FAILED, f"the kernel command line lacks {' '.join(missing)} (AMD's MI300X tuning guide)"))
    else:
        out.append(Finding("kernel-cmdline", OK))
    if f.numa_balancing is None:
        out.append(Finding("numa-balancing", NOT_CHECKED, "/proc/sys/kernel/numa_balancing not read"))
    elif f.numa_balancing:
        out.append(Finding("numa-balancing", FAILED,
                           f"NUMA balancing is on (kernel.numa_balancing = {f.numa_balancing}); AMD's MI300X tuning guide turns it off"))
    else:
        out.append(Finding("numa-balancing", OK))
    return out


def _stray_ras(f: Facts) -> list[Finding]:
    """RAS errors on a device that is none of the GPUs (or that the line does not name)."""
    known = {g.bdf for g in f.gpus if g.bdf}
    stray = [r for r in f.ras_errors or [] if r.bdf not in known]
    if not stray:
        return []
    where = stray[0].bdf or "a device the line does not name"
    return [Finding("ras-kernel-log", FAILED, f"amdgpu RAS error this boot on {where}, none of the listed GPUs: {stray[0].line}")]


# ----------------------------------------------------------------------------------- all


def _stored(previous: Mapping[str, Any] | None) -> dict[str, int]:
    """The earlier counts that are counts: a record someone else could have written."""
    if not isinstance(previous, Mapping):
        return {}
    items = [(k, v) for k, v in previous.items() if isinstance(k, str) and len(k) < 200]
    return {k: v for k, v in items if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63}


def run(readings: Readings, expected: Expectations | None = None, previous: Mapping[str, Any] | None = None) -> Report:
    """Judge READINGS against EXPECTED; PREVIOUS holds the correctable ECC counts of the last run."""
    e = expected or Expectations()
    f = read(readings)
    earlier = _stored(previous)
    counts = {gpu_key(g): g.ecc_correctable for g in f.gpus if g.ecc_correctable is not None}
    for key, value in earlier.items():  # a GPU not read this time keeps its count
        if len(counts) < _MAX_RECORDED:
            counts.setdefault(key, value)
    if f.tool is None:
        return Report(None, (), (), counts, tuple(f.problems))
    present = {g.index for g in f.gpus}
    results = []
    for g in f.gpus:
        findings = [check(g, f, e) for check in GPU_CHECKS] + [_correctable(g, earlier, e)]
        if g.index >= e.gpu_count:
            findings.insert(0, Finding("gpu-count", FAILED, f"{_name(g)}: not expected, the configuration has {e.gpu_count} GPUs"))
        results.append(GpuResult(g.index, g.bdf, tuple(findings)))
    for index in range(min(e.gpu_count, _MAX_RECORDED)):
        if index not in present:
            reason = f"GPU {index}: not found ({len(present)} of {e.gpu_count} GPUs present)"
            results.append(GpuResult(index, None, (Finding("gpu-count", FAILED, reason),)))
    results.sort(key=lambda r: r.index)
    return Report(f.tool, tuple(results), tuple(_host(f, e) + _stray_ras(f)), counts, tuple(f.problems))
