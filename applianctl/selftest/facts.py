# SPDX-License-Identifier: MIT
"""The readings as facts, per GPU and for the host. Any value may be missing, "N/A", of another type
or absurd; then its fact is None and the check that needs it says "not checked".

amd-smi's keys are those amdsmi_cli/amdsmi_commands.py writes (github.com/ROCm/amdsmi), in either
document shape gpu.py reads: static's asic, bus, driver and vram; partition's compute_partition
(accelerator_partition from amd-smi 6.4); metric's pcie, ecc and xgmi_err; firmware's fw_list;
bad-pages' retired, pending and un_res ("No bad pages found." when there are none, one record, or a
list of them); xgmi --link-status's link_status, one of U (up), D (down), X (disabled) per link.
rocm-smi's are its text labels (`GPU[0] : Compute Partition: SPX`) and its concise table's rows.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from applianctl.selftest.readings import Readings
from applianctl.status import gpu

XGMI_STATUSES = ("NO_ERRORS", "ERROR", "MULTIPLE_ERRORS")  # amdsmi_xgmi_status_t, prefix taken off
_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
_PCI_ID = re.compile(r"(?:0x)?([0-9a-f]{1,4})")
_VERSION = re.compile(r"[0-9]+(?:\.[0-9]+)*")
_MAX_GPUS = 64  # more records than any host has GPUs: the rest is not read

# rocm-smi's firmware labels ("MEC firmware version") by the amd-smi fw_id of the same block
ROCM_SMI_FIRMWARE = {"MEC": "CP_MEC1", "MEC2": "CP_MEC2", "RLC": "RLC", "SDMA": "SDMA0", "SDMA2": "SDMA1",
                     "SMC": "PM", "SOS": "PSP_SOSDRV", "TA RAS": "TA_RAS", "TA XGMI": "TA_XGMI", "VCN": "VCN"}
# a concise-table row: device, [KFD node], the device ID (old layout in brackets), ..., "NPS1, SPX"
_CONCISE_ROW = re.compile(r"([0-9]{1,4})\s+(?:[0-9]+\s+)?\[?(0x[0-9a-fA-F]{4})\b.*?\b(NPS\d+|N/A),\s*([A-Z]PX|N/A)\b")
_DRIVER_LINE = re.compile(r"^Driver version:\s*(\S+)", re.M)

# amdgpu's RAS lines that mean an error the hardware did not correct (amdgpu_ras.c, amdgpu_ras_eeprom.c):
# "{3}socket: 0, die: 1, 2 new uncorrectable hardware errors detected in umc block" (older kernels
# without socket and die), the same for deferred errors and poison consumption, the fatal ATHUB
# interrupt, and a bad-page table past the driver's threshold. Correctable ones are not faults here.
_RAS_COUNTED = re.compile(r"\b([0-9]+) (?:new )?(?:uncorrectable hardware errors|deferred hardware errors|poison consumption) detected")
_RAS_FATAL = re.compile(r"uncorrectable hardware error ?\(ERREVENT_ATHUB_INTERRUPT\) detected|RAS records: ?\d+ exceed threshold", re.I)
_LOG_DEVICE = re.compile(r"amdgpu ([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]):")


@dataclass
class GpuFacts:
    index: int
    bdf: str | None = None
    serial: str | None = None
    device_id: int | None = None
    compute_partition: str | None = None
    memory_partition: str | None = None
    vram_mib: float | None = None
    ecc_correctable: int | None = None
    ecc_uncorrectable: int | None = None
    ecc_deferred: int | None = None
    retired_pages: int | None = None
    pending_pages: int | None = None
    unreservable_pages: int | None = None
    firmware: dict[str, str] = field(default_factory=dict)
    pcie_width: float | None = None
    pcie_max_width: float | None = None
    pcie_speed_gts: float | None = None
    pcie_max_speed_gts: float | None = None
    xgmi_error: str | None = None
    xgmi_links: tuple[str, ...] | None = None
    driver_version: str | None = None


@dataclass(frozen=True)
class RasError:
    bdf: str | None  # None: the line names no device
    line: str


@dataclass
class Facts:
    tool: str | None  # "amd-smi" or "rocm-smi"; None when neither listed the GPUs
    gpus: list[GpuFacts]
    driver_version: str | None = None
    cmdline: tuple[str, ...] | None = None
    numa_balancing: int | None = None
    kfd: dict[str, str | None] | None = None  # BDF -> gfx target ("gfx942"), None when it states none
    render_minors: dict[str, int] | None = None  # BDF -> its DRM render node's minor (renderD<minor>)
    ras_errors: list[RasError] | None = None
    problems: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------- values


def text(value: Any) -> str | None:
    """A string or an integer as stripped text; None for "N/A", "", and anything else."""
    if isinstance(value, bool) or not isinstance(value, str | int) or (isinstance(value, int) and abs(value) >= 10**20):
        return None
    s = str(value).strip()
    return None if s in ("", "N/A") or len(s) > 200 else s


def count(value: Any) -> int | None:
    n = gpu.number(value)
    return None if n is None or n < 0 else int(n)


def _size(n: float | None) -> float | None:
    """A size, width or speed: 0 (what a tool prints when it could not read the link) or less is none."""
    return n if n is not None and n > 0 else None


def _counted(n: int | None) -> int | None:
    return n if n is not None and n >= 0 else None


def _section(record: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = record.get(name)
    return value if isinstance(value, Mapping) else {}


def _bdf(value: Any) -> str | None:
    s = text(value)
    return s.lower() if s is not None and _BDF.fullmatch(s.lower()) else None


def _pci_id(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 <= value <= 0xFFFF else None
    s = text(value)
    m = _PCI_ID.fullmatch(s.lower()) if s is not None else None
    return int(m.group(1), 16) if m else None


def _gts(value: Any) -> float | None:
    """A PCIe speed in GT/s, plain or {"value": 32, "unit": "GT/s"}; None in any other unit."""
    if isinstance(value, Mapping) and str(value.get("unit", "GT/s")).strip().lower() != "gt/s":
        return None
    return gpu.number(value)


def _mode(value: Any) -> str | None:
    s = text(value)
    return s.upper() if s is not None else None


def version(value: str | None) -> tuple[int, ...] | None:
    """The leading dotted numbers of a version ("6.8.5", "6.12.22+deb13-amd64"), None without them."""
    m = _VERSION.match(value.strip()) if value is not None else None
    return tuple(int(part) for part in m.group(0).split(".")[:6]) if m and len(m.group(0)) < 60 else None


def _pages(value: Any) -> int | None:
    """How many pages one of bad-pages' lists holds."""
    if isinstance(value, str) and value.strip().lower().startswith("no bad pages"):
        return 0
    if isinstance(value, Mapping):
        return 1
    if isinstance(value, list):
        return sum(isinstance(entry, Mapping) for entry in value)
    return None


def _records(doc: Any) -> dict[int, Mapping[str, Any]] | None:
    """An amd-smi document's records by GPU index; None when DOC is not an amd-smi document."""
    try:
        records = gpu.gpu_list(doc)
    except ValueError:
        return None
    return {gpu.gpu_index(i, r): r for i, r in enumerate(records[:_MAX_GPUS])}


# ----------------------------------------------------------------------------------- amd-smi


def _from_amd_smi(r: Readings) -> list[GpuFacts] | None:
    static, metric = _records(r.static), _records(r.metric)
    if static is None and metric is None:
        return None
    gpus = {i: GpuFacts(i) for i in sorted(set(static or {}) | set(metric or {}))}
    for reading in gpu.from_amd_smi(r.static if static is not None else None, r.metric if metric is not None else None):
        if (g := gpus.get(reading.gpu)) is not None:
            g.vram_mib = _size(reading.vram_total_mib)
            g.ecc_correctable, g.ecc_uncorrectable = _counted(reading.ecc_correctable), _counted(reading.ecc_uncorrectable)
    for i, rec in (static or {}).items():
        g = gpus[i]
        asic, bus = _section(rec, "asic"), _section(rec, "bus")
        g.bdf = _bdf(bus.get("bdf"))
        g.serial = text(asic.get("asic_serial")) or text(_section(rec, "board").get("product_serial"))
        g.device_id = _pci_id(asic.get("device_id"))
        g.pcie_max_width, g.pcie_max_speed_gts = _size(gpu.number(bus.get("max_pcie_width"))), _size(_gts(bus.get("max_pcie_speed")))
        g.driver_version = text(_section(rec, "driver").get("version"))
    for i, rec in (metric or {}).items():
        g = gpus[i]
        pcie = _section(rec, "pcie")
        g.pcie_width, g.pcie_speed_gts = _size(gpu.number(pcie.get("width"))), _size(_gts(pcie.get("speed")))
        g.ecc_deferred = count(_section(rec, "ecc").get("total_deferred_count"))
        status = _mode(rec.get("xgmi_err"))
        status = status.removeprefix("AMDSMI_XGMI_STATUS_") if status is not None else None
        g.xgmi_error = status if status in XGMI_STATUSES else None
    for doc in (r.static, r.partition):  # the partition call's answer wins
        for i, rec in (_records(doc) or {}).items():
            part = _section(rec, "partition")
            if (g := gpus.get(i)) is not None and part:
                g.compute_partition = _mode(part.get("accelerator_partition", part.get("compute_partition")))
                g.memory_partition = _mode(part.get("memory_partition"))
    for i, rec in (_records(r.firmware) or {}).items():
        entries = rec.get("fw_list")
        if (g := gpus.get(i)) is not None and isinstance(entries, list):
            for entry in entries[:100]:
                if isinstance(entry, Mapping) and (name := text(entry.get("fw_id"))) and (value := text(entry.get("fw_version"))):
                    g.firmware[name.upper()] = value
    for i, rec in (_records(r.bad_pages) or {}).items():
        if (g := gpus.get(i)) is not None:
            g.retired_pages, g.pending_pages = _pages(rec.get("retired")), _pages(rec.get("pending"))
            g.unreservable_pages = _pages(rec.get("un_res"))
    links = r.xgmi.get("link_status") if isinstance(r.xgmi, Mapping) else None
    for position, entry in enumerate(links[:_MAX_GPUS] if isinstance(links, list) else []):
        status = entry.get("link_status") if isinstance(entry, Mapping) else None
        if isinstance(entry, Mapping) and isinstance(status, list) and (g := gpus.get(gpu.gpu_index(position, entry))) is not None:
            g.xgmi_links = tuple(s.strip().upper()[:8] for s in status[:64] if isinstance(s, str))
            g.bdf = g.bdf or _bdf(entry.get("bdf"))
    return list(gpus.values())


# ----------------------------------------------------------------------------------- rocm-smi


def _from_rocm_smi(output: str) -> list[GpuFacts] | None:
    gpus: dict[int, GpuFacts] = {}
    for i, labels in sorted(gpu.rocm_smi_labels(output).items())[:_MAX_GPUS]:
        g = gpus.setdefault(i, GpuFacts(i))
        g.device_id = _pci_id(labels.get("Device ID"))
        g.bdf = _bdf(labels.get("PCI Bus"))
        g.compute_partition, g.memory_partition = _mode(labels.get("Compute Partition")), _mode(labels.get("Memory Partition"))
        g.vram_mib = _size(gpu.mib(labels.get("VRAM Total Memory (B)"), "B"))
        for label, value in labels.items():
            block = ROCM_SMI_FIRMWARE.get(label.removesuffix(" firmware version"))
            if label.endswith(" firmware version") and block and (v := text(value)):
                g.firmware[block] = v
    for line in output.splitlines():
        m = _CONCISE_ROW.match(line.strip())
        if m and len(gpus) < _MAX_GPUS:
            g = gpus.setdefault(int(m.group(1)), GpuFacts(int(m.group(1))))
            g.device_id = g.device_id if g.device_id is not None else _pci_id(m.group(2))
            g.memory_partition = g.memory_partition or _mode(m.group(3))
            g.compute_partition = g.compute_partition or _mode(m.group(4))
    return [gpus[i] for i in sorted(gpus)] or None


# ----------------------------------------------------------------------------------- host


def _kfd(nodes: Mapping[str, str]) -> dict[str, str | None]:
    """Each GPU node's BDF and gfx target. A node's properties are "name value" lines
    (kfd_topology.c, node_show); CPU nodes have no SIMDs."""
    return {bdf: target for bdf, (target, _) in _kfd_gpus(nodes).items()}


def _render_minors(nodes: Mapping[str, str]) -> dict[str, int]:
    """Each GPU node's BDF and the minor of its render node (node_show's drm_render_minor)."""
    return {bdf: minor for bdf, (_, minor) in _kfd_gpus(nodes).items() if minor is not None}


def kfd_sees_a_gpu(nodes: Mapping[str, str] | None) -> bool:
    """Whether the KFD topology (None: unread) has a GPU node: without one there is nothing to test."""
    return bool(_kfd_gpus(nodes or {}))


def _kfd_gpus(nodes: Mapping[str, str]) -> dict[str, tuple[str | None, int | None]]:
    found: dict[str, tuple[str | None, int | None]] = {}
    for props in nodes.values():
        values = {}
        for line in props.splitlines()[:200]:
            name, _, value = line.partition(" ")
            if re.fullmatch(r"[0-9]{1,20}", value.strip()):
                values[name] = int(value.strip())
        if values.get("simd_count", 0) > 0 and "location_id" in values:
            loc, domain = values["location_id"], values.get("domain", 0)
            bdf = f"{domain:04x}:{loc >> 8 & 0xFF:02x}:{loc >> 3 & 0x1F:02x}.{loc & 7}"
            target = values.get("gfx_target_version", 0)
            minor = values.get("drm_render_minor")
            # 90402 is gfx942: major, minor and stepping, the last two printed in hex
            found[bdf] = (f"gfx{target // 10000}{target // 100 % 100:x}{target % 100:x}" if target else None,
                          minor if minor is not None and 128 <= minor < 256 else None)
    return found


def _ras_errors(log: str) -> list[RasError]:
    errors: list[RasError] = []
    for line in log.splitlines():
        if "amdgpu" not in line or len(errors) >= 1000:
            continue
        m = _RAS_COUNTED.search(line)
        if (m and m.group(1).strip("0")) or _RAS_FATAL.search(line):
            device = _LOG_DEVICE.search(line)
            errors.append(RasError(device.group(1).lower() if device else None, line.strip()[:240]))
    return errors


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def read(r: Readings) -> Facts:
    """The facts in R. A source whose reading goes wrong in a way not foreseen is not read, and
    says so in `problems`: a self-test never fails for its own fault."""
    problems = [p for p in r.problems if isinstance(p, str)]

    def safely(what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # the reading, not the host, is at fault
            problems.append(f"{what}: not read ({type(e).__name__})")
            return None

    rocm_smi, cmdline, numa = _str(r.rocm_smi), _str(r.cmdline), (_str(r.numa_balancing) or "").strip()
    tool, gpus = "amd-smi", safely("amd-smi", _from_amd_smi, r)
    if gpus is None and rocm_smi is not None:
        tool, gpus = "rocm-smi", safely("rocm-smi", _from_rocm_smi, rocm_smi)
    driver = text(r.driver_version) or next((g.driver_version for g in gpus or [] if g.driver_version), None)
    if driver is None and rocm_smi is not None and (m := _DRIVER_LINE.search(rocm_smi)):
        driver = m.group(1)[:60]
    return Facts(
        tool=tool if gpus is not None else None,
        gpus=gpus or [],
        driver_version=driver,
        cmdline=tuple(cmdline.split()) if cmdline is not None else None,
        numa_balancing=int(numa) if re.fullmatch(r"[0-9]{1,5}", numa) else None,
        kfd=safely("KFD topology", _kfd, r.kfd_nodes) if isinstance(r.kfd_nodes, Mapping) else None,
        render_minors=safely("KFD topology", _render_minors, r.kfd_nodes) if isinstance(r.kfd_nodes, Mapping) else None,
        ras_errors=safely("kernel log", _ras_errors, r.kernel_log) if isinstance(r.kernel_log, str) else None,
        problems=problems,
    )
