# SPDX-License-Identifier: MIT
"""The versions of the upgrade journey (conftest.py) and how to read its runs."""

from __future__ import annotations

import re
from typing import Any

from testkit.boot_report import BootReport, is_boot_report, load_report

V1, V2, V3 = "1.0.0", "1.0.1", "1.0.2"
# What builder/qemu.py's Guest.boot adds to a run's last report: the host's, not the guest's
RUN_KEYS = ("boot_seconds", "earlier_boots", "power_cut", "timed_out", "asked")


def reports_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Every report of a QEMU run (the guest reboots within one), oldest first."""
    return [*run["earlier_boots"], run]


def boot_reports(run: dict[str, Any]) -> list[BootReport]:
    """The boot check's reports of a QEMU run, oldest first, loaded through their schema
    (testkit/boot_report.py): typed attributes, and a report the guest wrote otherwise refused."""
    return [load_report({k: v for k, v in r.items() if k not in RUN_KEYS}, f"boot {i}'s report")
            for i, r in enumerate(reports_of(run)) if is_boot_report(r)]


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
