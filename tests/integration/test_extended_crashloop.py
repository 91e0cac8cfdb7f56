# SPDX-License-Identifier: MIT
"""Extended QEMU scenario (make test-extended GROUPS=crashloop): a version that passes its
assessment, is blessed, and then crashes the kernel on every boot goes back to the previous
version by itself, through the crash-loop guard (applianctl/slots/crashloop.py), with nobody at
the console.

    base  1.0.0 first boot: report; install 1.5.0
    1.5.0 on trial: serves, judged good, blessed; 20 s later the kernel crashes (panic= reboots)
    1.5.0 judged good; the guard counts 1 unclean boot before this one; crash
    1.5.0 2; crash
    1.5.0 3: the guard marks 1.5.0 out of tries, records why and reboots
    base  the final report: 1.5.0 bad, rolled back by the appliance, the reason the guard's

Boot counting alone would boot 1.5.0 forever: systemd-bless-boot removed its counter on the
first boot. The bad version is testkit.faults' `crash-after-blessing`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from journey import reports_of

from appliance import config
from applianctl.slots import crashloop
from builder import build, qemu, release
from testkit import faults

pytestmark = [pytest.mark.integration, pytest.mark.extended]

BASE, CRASHES = "1.0.0", "1.5.0"


@pytest.fixture(scope="module")
def crash_run(demo_config: config.Config, https_root: tuple[Path, str, str],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    root, url, ca = https_root
    key = build.signing_key_for(demo_config, None)
    base = config.with_version(demo_config, BASE)
    disk = build.build(base, output=tmp_path_factory.mktemp("crashloop-base") / "out").disk_image
    bad = faults.bad_version(base, CRASHES, "crash-after-blessing")
    out = tmp_path_factory.mktemp(f"crashloop-{CRASHES}") / "out"
    build.build(bad.config, extra_mkosi_args=bad.mkosi_args, output=out)
    release.make_bundle(bad.config, out, root / f"crashloop-{CRASHES}", key, [bad.config.engine.digest], previous_version=BASE)
    plan = {BASE: [{"do": "update", "url": f"{url}/crashloop-{CRASHES}/"}]}
    guest = qemu.Guest(disk, tmp_path_factory.mktemp("crashloop-guest"), enroll_cert=build.secure_boot_certificate(demo_config))
    run = guest.boot(timeout=3000, credentials={"appliance.plan": json.dumps(plan), "appliance.update_ca": ca})
    return run, guest.console_log.read_text(errors="replace")


def _slots(report: dict[str, Any]) -> dict[str, Any]:
    return dict(report["status"]["parts"]["slots"])


def test_a_version_blessed_then_crashing_every_boot_is_rolled_back_by_itself(crash_run: tuple[dict[str, Any], str]) -> None:
    run, console = crash_run
    final = run
    assert final["status"]["parts"]["os"]["version"] == BASE, console[-3000:]
    versions = {s["version"]: s for s in _slots(final)["slots"] if s["version"]}
    assert versions[CRASHES]["state"] == "bad" and versions[CRASHES]["tries_left"] == 0, _slots(final)
    assert versions[BASE]["booted"] and final["engine_became_healthy"], final["status_text"]
    slots = _slots(final)
    assert slots["rolled_back"] is True and slots["rolled_back_by"] == "appliance", slots
    assert f"{CRASHES} ended {crashloop.CRASH_LOOP_BOOTS} boots in a row uncleanly" in slots["rollback_reason"], slots
    assert final["status"]["parts"]["slots"]["state"] == "degraded", final["status"]["parts"]["slots"]


def test_it_crashed_after_its_blessing_and_the_guard_counted_each_boot(crash_run: tuple[dict[str, Any], str]) -> None:
    run, console = crash_run
    # one crash per boot of 1.5.0 but the last, whose guard rebooted before the crash came; the
    # kernel's own line (the fault unit's echo goes through journald and is lost in the panic)
    crashes = console.count("Kernel panic - not syncing: sysrq triggered crash")
    assert crashes == crashloop.CRASH_LOOP_BOOTS, (crashes, console[-3000:])
    counted = [int(n) for n in re.findall(rf"{re.escape(CRASHES)}: (\d) unclean boot\(s\) in a row before this one", console)]
    assert counted == list(range(1, crashloop.CRASH_LOOP_BOOTS)), counted
    assert re.search(rf"crashloop: {re.escape(CRASHES)} ended {crashloop.CRASH_LOOP_BOOTS} boots in a row uncleanly.*rebooting", console)
    # the trial boot judged it good first: boot counting had nothing left to count
    assert "serves its clients: judged good" in console
    bases = [r for r in reports_of(run) if r["status"].get("parts", {}).get("os", {}).get("version") == BASE]
    assert len(bases) == 2, [r["status"]["parts"]["os"]["version"] for r in reports_of(run)]
