"""Extended QEMU scenario (make test-extended GROUPS=signing): a kernel image signed by another key.

    base    1.0.0 (built with update.boot_tries=1) installs 1.5.0, whose bundle is signed by the
            release key (the updater takes it) but whose kernel image is signed by another Secure
            Boot key, then reboots into it
    1.5.0   the firmware refuses the kernel image: no kernel of it ever starts; systemd-boot 257
            hands the failure back to the firmware's boot manager, which moves on to its next
            boot option and, with none that boots, stays there: nothing resets the machine
    power   the operator (or the BMC) power-cycles it: systemd-boot skips 1.5.0, out of tries,
            and boots 1.0.0, which reports
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from appliance import config
from builder import build, keys, qemu, release

pytestmark = [pytest.mark.integration, pytest.mark.extended]

FOREIGN = "1.5.0"
RESTART = "reboot: Restarting system"
WAIT_AFTER_RESTART_S = 420  # a kernel the firmware accepted would print "Linux version" within seconds


@pytest.fixture(scope="module")
def foreign_runs(demo_config: config.Config, https_root: tuple[Path, str, str],
                 tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root, url, ca = https_root
    key = build.signing_key_for(demo_config, None)
    base = config.with_version(demo_config, "1.0.0")
    base = dataclasses.replace(base, update=dataclasses.replace(base.update, boot_tries=1))
    disk = build.build(base, output=tmp_path_factory.mktemp("foreign-base") / "out").disk_image
    foreign = config.with_version(base, FOREIGN)
    out = tmp_path_factory.mktemp("foreign") / "out"
    build.build(foreign, output=out)
    (sb_key, sb_cert), _ = keys.boot_keys(tmp_path_factory.mktemp("foreign-keys"), make=True)
    (uki,) = [p for p in out.glob("*.efi")]
    subprocess.run(["sbattach", "--remove", str(uki)], check=True, capture_output=True)
    subprocess.run(["sbsign", "--key", str(sb_key), "--cert", str(sb_cert), "--output", str(uki), str(uki)], check=True,
                   capture_output=True)
    release.make_bundle(foreign, out, root / "sealed-foreign", key, [foreign.engine.digest], previous_version="1.0.0")
    guest = qemu.Guest(disk, tmp_path_factory.mktemp("foreign-guest"), enroll_cert=build.secure_boot_certificate(demo_config))
    plan = {"1.0.0": [{"do": "update", "url": f"{url}/sealed-foreign/"}]}
    creds = {"appliance.plan": json.dumps(plan), "appliance.update_ca": ca}
    runs: dict[str, Any] = {"tried": guest.boot(timeout=3000, credentials=creds, cut_power=(RESTART, WAIT_AFTER_RESTART_S))}
    runs["tried_console"] = guest.console_log.read_text(errors="replace")
    runs["after"] = guest.boot(timeout=2400)  # the power cycle (no plan: nothing installed again)
    return runs


def test_a_kernel_image_signed_by_another_key_never_starts(foreign_runs: dict[str, Any]) -> None:
    console = foreign_runs["tried_console"]
    assert foreign_runs["tried"]["power_cut"], "the base never rebooted into the update"
    assert RESTART in console, console[-3000:]
    after_restart = console.rsplit(RESTART, 1)[1]
    assert "Linux version" not in after_restart, after_restart[-3000:]  # the firmware refused it


def test_after_a_power_cycle_the_previous_version_boots_and_the_foreign_one_has_no_tries(foreign_runs: dict[str, Any]) -> None:
    report = foreign_runs["after"]
    os_part = report["status"]["parts"]["os"]
    assert os_part.get("version") == "1.0.0", os_part
    entries = [e for e in report["status"]["parts"]["slots"].get("entries") or [] if e.get("version") == FOREIGN]
    assert entries and all(e.get("tries_left") == 0 for e in entries), report["status"]["parts"]["slots"]
