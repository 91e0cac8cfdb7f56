# SPDX-License-Identifier: MIT
"""Status part `disk`: free space on /var (state, journal) and in the model cache."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import Config
from applianctl.status.document import DiskDetails, FsUsage
from applianctl.status.probes import DEGRADED, DOWN, OK, Part

GIB = 1024**3
DISK_MIN_FREE_FRACTION = 0.05
DISK_MIN_FREE_BYTES = 1 * GIB


def fs_usage(path: Path, **more: Any) -> FsUsage:
    """PATH's file system: its size, what is used and what is free to an unprivileged writer."""
    st = os.statvfs(path)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return FsUsage(path=str(path), total_bytes=total, used_bytes=total - st.f_bfree * st.f_frsize, free_bytes=free, **more)


def tree_bytes(root: Path, budget_s: float = 0.3) -> tuple[int, bool]:
    """Bytes allocated under ROOT without following links; False when the walk ran out of time."""
    end = time.monotonic() + budget_s
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
        if time.monotonic() > end:
            return total, False
    return total, True


def probe_disk(config: Config, state_dir: Path | None = None) -> Part:
    state_dir = state_dir or paths.STATE_DIR
    cache = Path(config.model.cache_dir)
    problems: list[str] = []
    try:
        var = fs_usage(state_dir)
    except OSError as e:
        return Part(DOWN, f"{state_dir}: {e.strerror}", DiskDetails())
    if cache.is_dir():
        used, complete = tree_bytes(cache)
        model_cache = fs_usage(cache, cache_bytes=used, cache_bytes_complete=complete)
    else:
        model_cache = FsUsage(path=str(cache), present=False)
    for fs in (var, model_cache):
        if fs.total_bytes is None or fs.free_bytes is None:
            continue
        if fs.free_bytes < max(DISK_MIN_FREE_BYTES, fs.total_bytes * DISK_MIN_FREE_FRACTION):
            problems.append(f"{fs.path}: only {fs.free_bytes / GIB:.1f} GiB free")
    return Part(DEGRADED if problems else OK, "; ".join(problems), DiskDetails(var=var, model_cache=model_cache))
