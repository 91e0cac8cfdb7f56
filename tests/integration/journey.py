# SPDX-License-Identifier: MIT
"""The versions of the upgrade journey (conftest.py) and how to read its runs."""

from __future__ import annotations

import re
from typing import Any

V1, V2, V3 = "1.0.0", "1.0.1", "1.0.2"


def reports_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every report of a QEMU run (the guest reboots within one), oldest first."""
    return [*run["earlier_boots"], run]


# Each boot's console starts with the stub's line; a kernel oops before systemd's first line is
# the emulator's fault under TCG on a loaded host: the int3 the kernel plants while it patches its
# own code (text poking) traps in sched_clock_cpu. Intermittent, not reproducible on demand.
BOOT_START = "EFI stub: UEFI Secure Boot is enabled."
EARLY_OOPS = re.compile(r"Oops: |Kernel panic - not syncing")


def oopsed_before_userspace(console: str) -> bool:
    """Whether a boot in CONSOLE (one or more boots) had its kernel oops before systemd started."""
    for boot in console.split(BOOT_START):
        oops = EARLY_OOPS.search(boot)
        if oops is not None and "systemd[1]" not in boot[: oops.start()]:
            return True
    return False
