# SPDX-License-Identifier: MIT
"""Extended QEMU scenarios (make test-extended GROUPS=rollback): versions that fail in ways the
engine-only assessment would not see are rolled back by the appliance itself, each with one boot
try (tests/integration/bad_versions.py runs them):

    base  1.0.0 first boot (built with update.boot_tries=1: what it installs gets 1 try):
          report; install 1.1.0
    1.1.0 the proxy never starts (the engine serves on loopback): the assessment, which goes
          through the proxy over TLS, fails; reboot; no try left
    base  report (1.1.0 rolled back); install 1.2.0
    1.2.0 a unit boot-complete.target waits for never finishes: the boot deadline
          (appliance-boot-deadline.timer) reboots it; no try left
    base  the final report (1.2.0 rolled back)

A version whose kernel panics or whose PID 1 freezes (the machine resets itself, by panic= or by
the hardware watchdog) is the group `watchdog`: split off so that each group stays under 40 minutes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bad_versions import after, each_was_installed_and_tried, run_bad_versions, slots_of
from journey import reports_of

from appliance import config

pytestmark = [pytest.mark.integration, pytest.mark.extended]

NO_PROXY, HANGS = "1.1.0", "1.2.0"
# in the order they are installed; the base boots again after each one's only try
BAD_VERSIONS = ((NO_PROXY, "proxy-never-listens"), (HANGS, "hang-before-boot-complete"))


@pytest.fixture(scope="module")
def extended_run(demo_config: config.Config, https_root: tuple[Path, str, str],
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    return run_bad_versions(demo_config, https_root, tmp_path_factory, BAD_VERSIONS, "extended")


def test_each_bad_version_was_installed_and_tried(extended_run: tuple[dict[str, Any], str]) -> None:
    each_was_installed_and_tried(*extended_run, BAD_VERSIONS)


def test_a_version_whose_proxy_never_listens_is_rolled_back_by_itself(extended_run: tuple[dict[str, Any], str]) -> None:
    run, console = extended_run
    slots = slots_of(after(run, console, BAD_VERSIONS, NO_PROXY))
    assert slots["rolled_back"], slots
    last = slots["last_assessment"]
    assert last["version"] == NO_PROXY and not last["ok"], last
    assert "through https://127.0.0.1" in last["reason"], last  # judged through the proxy, not the engine alone


def test_a_version_that_hangs_before_boot_complete_is_rolled_back_by_itself(extended_run: tuple[dict[str, Any], str]) -> None:
    run, console = extended_run
    after(run, console, BAD_VERSIONS, HANGS)
    # the boot deadline rebooted it: boot-complete.target waits for the hung unit, whatever the assessment said
    assert "boot-complete.target not reached before the deadline" in console, console[-3000:]




def test_no_trial_boot_wiped_var(extended_run: tuple[dict[str, Any], str]) -> None:
    """Each kernel image carries the factory reset entries (UKI profiles); systemd-boot 257 may boot
    a reset profile's command line for a version on trial (its entries' ids collide once counted).
    The reset then refuses (applianctl/factory_reset.py menu_refusal): no report, of any boot,
    records a factory reset, and what the loader booted is shown for whoever reads a failure
    (the refusal itself goes to the console: "... not a factory reset entry: nothing deleted")."""
    run, console = extended_run
    reports = reports_of(run)
    assert reports, console[-3000:]
    loaders = [(r["status"]["parts"]["os"].get("version"), r.get("loader"), r.get("cmdline", "")[-120:]) for r in reports]
    for report in reports:
        reset = report["status"]["parts"]["host"]["factory_reset"]
        assert reset["last"] is None and reset["pending"] is None, (reset, loaders)
