# SPDX-License-Identifier: MIT
"""`applianctl preflight`: what the engine needs from the host, checked before every start.

The model weights must be on /var; the host must have the memory the topology's replicas need
(their CPU KV offload files in /dev/shm and topology.memory_reserve_gib to spare); in a profile
that needs a GPU, /dev/kfd must exist, the amdgpu driver must be loaded, the GPU must report its
VRAM and the KFD must list the topology's GPUs. A failure is one line naming what is missing, in
the journal and in /run/appliance/preflight.json; the engine stays stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from appliance import cli_help, paths
from appliance.atomic import write_record
from appliance.config import Config
from appliance.config.model import check_host
from appliance.host_settings import load_device
from appliance.schema import dump_record
from applianctl.records import PreflightResult

SYS = Path(os.environ.get("APPLIANCE_SYSFS", "/sys"))
DEV = Path(os.environ.get("APPLIANCE_DEVFS", "/dev"))
PROC = Path(os.environ.get("APPLIANCE_PROCFS", "/proc"))


def weights_dir(config: Config) -> Path:
    """The snapshot directory on /var that the engine's first argument names inside the container."""
    return Path(config.model.weights_dir)


def vram_total_bytes() -> int | None:
    """VRAM as the amdgpu driver reports it (sysfs), summed over GPUs."""
    total = 0
    for path in sorted(SYS.glob("class/drm/card*/device/mem_info_vram_total")):
        try:
            total += int(path.read_text().strip())
        except (OSError, ValueError):
            continue
    return total or None


def kfd_gpu_count() -> int:
    """GPUs the KFD lists (topology nodes with a GPU id; CPU nodes have 0), as ROCm numbers them."""
    count = 0
    for path in SYS.glob("class/kfd/kfd/topology/nodes/*/gpu_id"):
        try:
            count += int(path.read_text().strip() or 0) != 0
        except (OSError, ValueError):
            continue
    return count


def mem_total_bytes() -> int:
    for line in (PROC / "meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no MemTotal in /proc/meminfo")


def check(config: Config) -> PreflightResult:
    weights = weights_dir(config)
    if not weights.is_dir() or not any(weights.iterdir()):
        return PreflightResult(False, f"model weights not present at {weights} (fetch {config.model.id} "
                               f"revision {config.model.revision} into {config.model.cache_dir})")
    # The topology against this host (validated at build against topology.memory_gib, when given).
    # /dev/shm is mounted at the size the replicas need by appliance-shm-clean before every start,
    # which checks it then; what must fit here is memory, and the GPUs.
    problems = check_host(config, kfd_gpu_count(), mem_total_bytes(), config.shm_size_mib << 20)
    memory = [p for p in problems if "GPU(s) seen" not in p]
    if memory:
        return PreflightResult(False, "; ".join(memory))
    if not config.gpu.required:
        return PreflightResult(True, "", gpu="not required")
    if not (DEV / "kfd").exists():
        return PreflightResult(False, "/dev/kfd is missing: no AMD GPU compute device")
    if not (SYS / "module/amdgpu").exists():
        return PreflightResult(False, "the amdgpu kernel module is not loaded")
    vram = vram_total_bytes()
    if vram is None:
        return PreflightResult(False, "the GPU reports no VRAM (mem_info_vram_total missing)")
    if problems:
        return PreflightResult(False, "; ".join(problems))
    return PreflightResult(True, "", vram_total_bytes=vram)



def main(args: argparse.Namespace) -> int:
    result = check(load_device())
    write_record(paths.PREFLIGHT_RESULT, result)
    if getattr(args, "json", False):
        print(json.dumps(dump_record(result), indent=2))
        return 0 if result.ok else 1
    if not result.ok:
        print(f"preflight failed: {result.reason}", file=sys.stderr)
        return 1
    print("preflight ok")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = cli_help.verb_parser(
        sub, "preflight", "check the GPU and the model weights before the engine starts",
        examples=["applianctl preflight", "applianctl preflight --json"],
        exit_codes=[(0, "the engine can start"), (1, "it cannot: the weights, memory or a GPU are missing (one line on stderr)"),
                    cli_help.BAD_INPUT],
        details=f"Writes {paths.PREFLIGHT_RESULT}, which status reads.",
    )
    p.add_argument("--json", action="store_true", help="print the result (the record status reads) as JSON")
    p.set_defaults(func=main)
