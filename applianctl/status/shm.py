# SPDX-License-Identifier: MIT
"""Status part `shm`: /dev/shm's size against the CPU KV offload, and offload files nobody holds.

Holders are found by applianctl.engine.shm's scanner, the one the cleaner trusts before it removes a
file; status only reports.
"""

from __future__ import annotations

import os
from pathlib import Path

from appliance import paths
from appliance.config import Config
from applianctl.status.document import OffloadFile, ShmDetails
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
    problems: list[str] = []
    files = sorted(shm_dir.glob(shm.PATTERN))
    listed: list[OffloadFile] = []
    stale: list[str] = []
    unreadable = None
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
            listed.append(OffloadFile(name=f.name, bytes=st.st_size, in_use=in_use))
            if not in_use:
                stale.append(f.name)
        unreadable = len(holders.unreadable)
    if stale:
        problems.append(
            f"{len(stale)} stale offload file(s) in {shm_dir} ({stale[0]}...): the next engine start may "
            "fail with 'Bad address'; restart the engine to clean them"
        )
    need = config.shm_required_bytes if offload_gib else 0
    if need and usage.size_bytes < need:
        problems.append(
            f"{shm_dir} holds {usage.size_bytes / GIB:.1f} GiB; the CPU KV offload needs "
            f"{config.shm_need}"
        )
    details = ShmDetails(path=str(shm_dir), total_bytes=usage.size_bytes, used_bytes=usage.used_bytes, free_bytes=usage.free_bytes,
                         unreadable_maps=unreadable, offload_files=tuple(listed), stale_offload_files=tuple(stale), needed_bytes=need)
    return Part(DEGRADED if problems else OK, "; ".join(problems), details)
