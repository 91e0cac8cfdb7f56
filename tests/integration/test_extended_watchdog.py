# SPDX-License-Identifier: MIT
"""Extended QEMU scenarios (make test-extended GROUPS=watchdog): versions that stop the machine
so hard that nothing in userspace can reboot it in order, so the machine resets itself (the
kernel's panic=, the hardware watchdog); boot counting then judges each version (one try,
tests/integration/bad_versions.py runs them):

    base  1.0.0 first boot (built with update.boot_tries=1): report; install 1.3.0
    1.3.0 the kernel panics before boot-complete.target: panic= reboots it; no try left
    base  report (1.3.0 rolled back); install 1.4.0
    1.4.0 PID 1 is frozen before boot-complete.target (held stopped by ptrace): no timer fires,
          not even the boot deadline's; the hardware watchdog (i6300esb, armed by
          systemd.watchdog_sec= on the kernel command line) resets the machine; no try left
    base  the final report (1.4.0 rolled back)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bad_versions import after, each_was_installed_and_tried, run_bad_versions

from appliance import config

pytestmark = [pytest.mark.integration, pytest.mark.extended]

PANICS, FREEZES = "1.3.0", "1.4.0"
# in the order they are installed; the base boots again after each one's only try
BAD_VERSIONS = ((PANICS, "panic"), (FREEZES, "freeze-pid1"))
FREEZE_MARK = "appliance: synthetic fault: freezing PID 1"


@pytest.fixture(scope="module")
def watchdog_run(demo_config: config.Config, https_root: tuple[Path, str, str],
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    return run_bad_versions(demo_config, https_root, tmp_path_factory, BAD_VERSIONS, "watchdog")


def test_each_version_was_installed_and_tried(watchdog_run: tuple[dict[str, Any], str]) -> None:
    each_was_installed_and_tried(*watchdog_run, BAD_VERSIONS)


def test_a_version_whose_pid1_freezes_is_reset_by_the_watchdog(watchdog_run: tuple[dict[str, Any], str]) -> None:
    run, console = watchdog_run
    after(run, console, BAD_VERSIONS, FREEZES)
    assert FREEZE_MARK in console, console[-3000:]
    # After the freeze nothing in the guest could reboot it in order: no shutdown, no panic, no
    # boot deadline; the next thing on the console is the firmware starting again.
    frozen = console.split(FREEZE_MARK, 1)[1]
    next_boot = frozen.find("Linux version")
    assert next_boot > 0, frozen[-3000:]
    between = frozen[:next_boot]
    for word in ("Kernel panic", "reboot: Restarting system", "boot-complete.target not reached", "Reached target reboot"):
        assert word not in between, (word, between[-3000:])


def test_a_version_that_panics_is_rolled_back_by_itself(watchdog_run: tuple[dict[str, Any], str]) -> None:
    run, console = watchdog_run
    after(run, console, BAD_VERSIONS, PANICS)
    assert "Kernel panic" in console, console[-3000:]
