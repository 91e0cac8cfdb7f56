# SPDX-License-Identifier: MIT
"""Status part `shm`: /dev/shm's size against the CPU KV offload, and offload files nobody holds.

Holders are found by applianctl.engine.shm's scanner, the one the cleaner trusts before it removes a
file; status only reports.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import Config
from applianctl.status.probes import DEGRADED, DOWN, NOT_CONFIGURED, OK, Part, Sources

GIB = 1024**3


def probe_shm(config: Config, src: Sources, shm_dir: Path | None = None) -> Part:
    from applianctl.engine import shm

    shm_dir = shm_dir or paths.SHM_DIR
    offload_gib = config.engine.offload_gib
    if not shm_dir.is_dir():
        if offload_gib == 0:
            return Part(NOT_CONFIGURED, f"{shm_dir} absent and no CPU KV offload configured")
        return Part(DOWN, f"{shm_dir} is absent; the engine needs {offload_gib:g} GiB there")
    usage = shm.statvfs_usage(shm_dir)
    details: dict[str, Any] = {
        "path": str(shm_dir),
        "total_bytes": usage.size_bytes,
        "used_bytes": usage.used_bytes,
        "free_bytes": usage.free_bytes,
    }
    problems: list[str] = []
    files = sorted(shm_dir.glob(shm.PATTERN))
    listed: list[dict[str, Any]] = []
    stale: list[str] = []
    if files:
        holders = shm.scan_holders(src.proc)
        for f in files:
            try:
                st = os.stat(f, follow_symlinks=False)
            except FileNotFoundError:
                continue
            # Stale: held by no process whose /proc entries could be read (root reads all of
            # them on the appliance; the count of unreadable ones is kept in the details).
            in_use = bool(holders.pids(f, st))
            listed.append({"name": f.name, "bytes": st.st_size, "in_use": in_use})
            if not in_use:
                stale.append(f.name)
        details["unreadable_maps"] = len(holders.unreadable)
    details["offload_files"] = listed
    details["stale_offload_files"] = stale
    if stale:
        problems.append(
            f"{len(stale)} stale offload file(s) in {shm_dir} ({stale[0]}...): the next engine start may "
            "fail with 'Bad address'; restart the engine to clean them"
        )
    need = config.shm_required_bytes if offload_gib else 0
    details["needed_bytes"] = need
    if need and details["total_bytes"] < need:
        problems.append(
            f"{shm_dir} holds {details['total_bytes'] / GIB:.1f} GiB; the CPU KV offload needs "
            f"{config.shm_need}"
        )
    return Part(DEGRADED if problems else OK, "; ".join(problems), details)
