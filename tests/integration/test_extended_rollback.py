"""Extended QEMU scenarios (make test-extended): versions that fail in ways the engine-only
assessment would not see are rolled back by the appliance itself, each with one boot try.

One appliance, one QEMU run, no host intervention after power-on:

    base  1.0.0 first boot (built with update.boot_tries=1: what it installs gets 1 try):
          report; install 1.1.0
    1.1.0 the proxy never starts (the engine serves on loopback): the assessment, which goes
          through the proxy over TLS, fails; reboot; no try left
    base  report (1.1.0 rolled back); install 1.2.0
    1.2.0 a unit boot-complete.target waits for never finishes: the boot deadline
          (appliance-boot-deadline.timer) reboots it; no try left
    base  report (1.2.0 rolled back); install 1.3.0
    1.3.0 the kernel panics before boot-complete.target: panic= reboots it; no try left
    base  report (1.3.0 rolled back); install 1.4.0
    1.4.0 PID 1 is frozen before boot-complete.target (held stopped by ptrace): no timer fires,
          not even the boot deadline's; the hardware watchdog (i6300esb, armed by
          systemd.watchdog_sec= on the kernel command line) resets the machine; no try left
    base  the final report

The bad versions are testkit.faults' synthetic bad versions (the demo built again under a new
version with a fault word on its kernel command line); their bundles are served over HTTPS as in
the journey.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from journey import reports_of

from appliance import config
from builder import build, qemu, release
from testkit import faults

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.extended]

BASE, NO_PROXY, HANGS, PANICS, FREEZES = "1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0"
# in the order they are installed; the base boots again after each one's only try
BAD_VERSIONS = ((NO_PROXY, "proxy-never-listens"), (HANGS, "hang-before-boot-complete"), (PANICS, "panic"),
                (FREEZES, "freeze-pid1"))
# Short for the bad versions: the proxy-less one fails its assessment after it, the hanging one
# is rebooted by the boot deadline (this plus 5 minutes after the kernel starts).
BAD_DEADLINE_S = 60


@pytest.fixture(scope="module")
def extended_run(demo_config: config.Config, https_root: tuple[Path, str, str],
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """The whole run: (the last report with the earlier ones, the console of every boot)."""
    root, url, ca = https_root
    # Without it nothing reboots a hung version and this run would only end at its timeout.
    assert (ROOT / "units/appliance-boot-deadline.timer.j2").is_file(), "no boot deadline unit in this tree"
    key = build.signing_key_for(demo_config, None)
    base = config.with_version(demo_config, BASE)
    base = dataclasses.replace(base, update=dataclasses.replace(base.update, boot_tries=1))
    disk = build.build(base, output=tmp_path_factory.mktemp("extended-base") / "out").disk_image
    bundles = {}
    for version, fault in BAD_VERSIONS:
        bad = faults.bad_version(base, version, fault, assessment_deadline_s=BAD_DEADLINE_S)
        out = tmp_path_factory.mktemp(f"extended-{version}") / "out"
        build.build(bad.config, extra_mkosi_args=bad.mkosi_args, output=out)
        release.make_bundle(bad.config, out, root / f"extended-{version}", key, [bad.config.engine.digest], previous_version=BASE)
        bundles[version] = f"{url}/extended-{version}/"
    plan = {BASE: [{"do": "update", "url": bundles[version]} for version, _ in BAD_VERSIONS]}
    guest = qemu.Guest(disk, tmp_path_factory.mktemp("extended-guest"), enroll_cert=build.secure_boot_certificate(demo_config))
    # base first boot + update, then for each bad version its try and the base again
    run = guest.boot(timeout=6000, credentials={"appliance.plan": json.dumps(plan), "appliance.update_ca": ca})
    return run, guest.console_log.read_text(errors="replace")


def _base_reports(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in reports_of(run) if r["status"].get("parts", {}).get("os", {}).get("version") == BASE]


def _slots(report: dict[str, Any]) -> dict[str, Any]:
    return dict(report["status"]["parts"]["slots"])


def _by_version(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["version"]: s for s in _slots(report)["slots"] if s["version"]}


def _after(run: dict[str, Any], console: str, version: str) -> dict[str, Any]:
    """The base version's report after VERSION's only try."""
    bases = _base_reports(run)
    index = 1 + [v for v, _ in BAD_VERSIONS].index(version)
    assert len(bases) > index, f"{len(bases)} report(s) of the base version; console: {console[-3000:]}"
    after = bases[index]
    versions, slots = _by_version(after), _slots(after)
    assert versions[BASE]["booted"] and versions[BASE]["state"] == "good", slots
    assert versions[version]["state"] == "bad" and versions[version]["tries_left"] == 0, slots
    assert after["engine_became_healthy"], after["status_text"]
    return after


def test_each_bad_version_was_installed_and_tried(extended_run: tuple[dict[str, Any], str]) -> None:
    run, console = extended_run
    updates = {s["url"].rstrip("/").rsplit("-", 1)[-1]: s for s in reports_of(run)[-1]["steps"] if s["do"] == "update"}
    for version, _ in BAD_VERSIONS:
        assert updates[version]["exit"] == 0, updates[version]["output"]
    assert not run["timed_out"], console[-3000:]
    assert reports_of(run)[-1]["status"]["parts"]["os"]["version"] == BASE, console[-3000:]


def test_a_version_whose_proxy_never_listens_is_rolled_back_by_itself(extended_run: tuple[dict[str, Any], str]) -> None:
    run, console = extended_run
    slots = _slots(_after(run, console, NO_PROXY))
    assert slots["rolled_back"], slots
    last = slots["last_assessment"]
    assert last["version"] == NO_PROXY and not last["ok"], last
    assert "through https://127.0.0.1" in last["reason"], last  # judged through the proxy, not the engine alone


def test_a_version_that_hangs_before_boot_complete_is_rolled_back_by_itself(extended_run: tuple[dict[str, Any], str]) -> None:
    run, console = extended_run
    _after(run, console, HANGS)
    # the boot deadline rebooted it: boot-complete.target waits for the hung unit, whatever the assessment said
    assert "boot-complete.target not reached before the deadline" in console, console[-3000:]


def test_a_version_that_panics_is_rolled_back_by_itself(extended_run: tuple[dict[str, Any], str]) -> None:
    run, console = extended_run
    _after(run, console, PANICS)
    assert "Kernel panic" in console, console[-3000:]


FREEZE_MARK = "appliance: synthetic fault: freezing PID 1"


def test_a_version_whose_pid1_freezes_is_reset_by_the_watchdog(extended_run: tuple[dict[str, Any], str]) -> None:
    run, console = extended_run
    _after(run, console, FREEZES)
    assert FREEZE_MARK in console, console[-3000:]
    # After the freeze nothing in the guest could reboot it in order: no shutdown, no panic, no
    # boot deadline; the next thing on the console is the firmware starting again.
    frozen = console.split(FREEZE_MARK, 1)[1]
    next_boot = frozen.find("Linux version")
    assert next_boot > 0, frozen[-3000:]
    between = frozen[:next_boot]
    for word in ("Kernel panic", "reboot: Restarting system", "boot-complete.target not reached", "Reached target reboot"):
        assert word not in between, (word, between[-3000:])
