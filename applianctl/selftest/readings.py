# SPDX-License-Identifier: MIT
"""What the self-test reads, and `collect`, which reads it under one deadline.

Every source only reads: amd-smi's static, metric, firmware, bad-pages and xgmi subcommands (side by
side, each given what is left of the deadline), rocm-smi only when amd-smi gives no GPU list, the
kernel's command line, NUMA balancing switch, amdgpu module version and KFD topology, and this
boot's kernel log. Partitions are a call of their own because amd-smi 6.4 took them out of
`static`'s default output (reading them wakes the GPU: amdsmi_cli/amdsmi_commands.py, static_gpu).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import UserError
from appliance.run import TimeoutExpired
from appliance.safe_read import loads_bounded, read_capped
from applianctl.status import gpu
from applianctl.status.probes import Runner, ToolMissing

DEADLINE_S = 20.0
AMD_SMI_PARTITION = ("amd-smi", "static", "--partition", "--json")
AMD_SMI_FIRMWARE = ("amd-smi", "firmware", "--json")
AMD_SMI_BAD_PAGES = ("amd-smi", "bad-pages", "--json")
AMD_SMI_XGMI = ("amd-smi", "xgmi", "--link-status", "--json")  # amd-smi 6.4 and later
ROCM_SMI_ALL = ("rocm-smi", "-a")
ROCM_SMI_VRAM = ("rocm-smi", "--showmeminfo", "vram")
KERNEL_LOG = ("journalctl", "-k", "-b", "0", "-o", "cat", "--no-pager", "-q")

MAX_FILE_BYTES = 1 << 16
MAX_LOG_CHARS = 32 << 20  # a chatty boot's kernel log: the newest part is kept


@dataclass(frozen=True)
class Readings:
    """The sources' raw answers: amd-smi's documents parsed, the rest as text (KFD node properties
    by node name). None: the source gave nothing, and `problems` says why."""

    static: Any = None
    metric: Any = None
    partition: Any = None
    firmware: Any = None
    bad_pages: Any = None
    xgmi: Any = None
    rocm_smi: str | None = None
    cmdline: str | None = None
    numa_balancing: str | None = None
    driver_version: str | None = None
    kfd_nodes: Mapping[str, str] | None = None
    kernel_log: str | None = None
    problems: tuple[str, ...] = ()


def _why(what: str, error: BaseException) -> str:
    if isinstance(error, ToolMissing):
        return f"{what}: {error} is not installed"
    if isinstance(error, TimeoutExpired):
        return f"{what}: no answer in time"
    return f"{what}: {type(error).__name__}: {error}".splitlines()[0][:200]


def _output(run: Runner, argv: Sequence[str], timeout_s: float) -> str:
    rc, out = run(argv, timeout_s)
    if rc != 0:
        raise RuntimeError(f"exited with status {rc}")
    return out


def _side_by_side(calls: Mapping[str, Callable[[float], Any]], deadline: float) -> dict[str, Any]:
    """Each call in a daemon thread, given the seconds left; its result, or the exception it ended
    with, or TimeoutError when it had not answered by the deadline."""
    results: dict[str, Any] = {}
    lock = threading.Lock()

    def call(name: str, fn: Callable[[float], Any]) -> None:
        try:
            value: Any = fn(max(0.1, deadline - time.monotonic()))
        except Exception as e:
            value = e
        with lock:
            results[name] = value

    threads = [threading.Thread(target=call, args=item, daemon=True) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        return {name: results.get(name, TimeoutError("no answer by the deadline")) for name in calls}


def _file(path: Path, problems: list[str]) -> str | None:
    try:
        data = read_capped(path, MAX_FILE_BYTES, what="a kernel file")
    except UserError as e:
        problems.append(e.message)
        return None
    return None if data is None else data.decode("utf-8", "replace")


def _kfd_nodes(root: Path, problems: list[str]) -> dict[str, str] | None:
    """Each KFD topology node's properties; {} when there is no topology (KFD sees no GPU)."""
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    try:
        names = sorted(p.name for p in nodes.iterdir()) if nodes.is_dir() else []
    except OSError as e:
        problems.append(f"{nodes}: {e.strerror}")
        return None
    found = {}
    for name in names[:256]:
        text = _file(nodes / name / "properties", problems)
        if text is not None:
            found[name] = text
    return found


def collect(run: Runner, timeout_s: float = DEADLINE_S, root: Path = Path("/")) -> Readings:
    """Everything the self-test reads, within TIMEOUT_S; ROOT is where /proc and /sys are."""
    deadline = time.monotonic() + timeout_s
    problems: list[str] = []
    answers = _side_by_side({
        "amd-smi static/metric": lambda t: gpu.amd_smi_json(run, t),
        "amd-smi static --partition": lambda t: loads_bounded(_output(run, AMD_SMI_PARTITION, t)),
        "amd-smi firmware": lambda t: loads_bounded(_output(run, AMD_SMI_FIRMWARE, t)),
        "amd-smi bad-pages": lambda t: loads_bounded(_output(run, AMD_SMI_BAD_PAGES, t)),
        "amd-smi xgmi --link-status": lambda t: loads_bounded(_output(run, AMD_SMI_XGMI, t)),
        "journalctl -k": lambda t: _output(run, KERNEL_LOG, t)[-MAX_LOG_CHARS:],
    }, deadline)

    def answer(name: str, value: Any) -> Any:
        if isinstance(value, BaseException):
            problems.append(_why(name, value))
            return None
        return value

    both = answers.pop("amd-smi static/metric")
    static, metric = both if isinstance(both, tuple) else (both, both)
    docs = {"amd-smi static": static, "amd-smi metric": metric, **answers}
    docs = {name: answer(name, value) for name, value in docs.items()}

    rocm_smi = None
    if not any(_lists_gpus(docs[name]) for name in ("amd-smi static", "amd-smi metric")):
        texts = _side_by_side({"rocm-smi -a": lambda t: _output(run, ROCM_SMI_ALL, t),
                               "rocm-smi --showmeminfo vram": lambda t: _output(run, ROCM_SMI_VRAM, t)}, deadline)
        found = [text for name, text in texts.items() if answer(name, text) is not None]
        rocm_smi = "\n".join(found) if found else None

    return Readings(
        static=docs["amd-smi static"],
        metric=docs["amd-smi metric"],
        partition=docs["amd-smi static --partition"],
        firmware=docs["amd-smi firmware"],
        bad_pages=docs["amd-smi bad-pages"],
        xgmi=docs["amd-smi xgmi --link-status"],
        rocm_smi=rocm_smi,
        cmdline=_file(root / "proc/cmdline", problems),
        numa_balancing=_file(root / "proc/sys/kernel/numa_balancing", problems),
        driver_version=_file(root / "sys/module/amdgpu/version", problems),
        kfd_nodes=_kfd_nodes(root, problems),
        kernel_log=docs["journalctl -k"],
        problems=tuple(problems),
    )


def _lists_gpus(doc: Any) -> bool:
    try:
        gpu.gpu_list(doc)
    except ValueError:
        return False
    return True
