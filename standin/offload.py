"""The CPU KV offload region, a /dev/shm file made as vLLM's v1/kv_offload/cpu/shared_offload_region.py does.

O_CREAT|O_EXCL, mode 0600, ftruncated to the offload size, mapped shared. vLLM leaks it on any unclean
exit; the stand-in, too, removes it only on a clean one.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path


class OffloadRegion:
    def __init__(self, directory: Path, size_bytes: int) -> None:
        self.path = directory / f"vllm_offload_{time.time_ns()}_dp0.mmap"
        self.size_bytes = size_bytes
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(self._fd, size_bytes)
            self._map: mmap.mmap | None = mmap.mmap(self._fd, size_bytes, mmap.MAP_SHARED)
        except BaseException:
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
            raise

    @property
    def size_gb(self) -> float:
        """The size as vLLM logs it: decimal gigabytes."""
        return self.size_bytes / 1e9

    def close(self) -> None:
        """Unmap, close and remove the file (a clean exit)."""
        if self._map is not None:
            self._map.close()
            self._map = None
            os.close(self._fd)
            self.path.unlink(missing_ok=True)
