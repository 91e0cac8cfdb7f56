# SPDX-License-Identifier: MIT
"""The extended bad-version runs (test_extended_rollback.py, test_extended_watchdog.py): one
appliance, one QEMU run, no host intervention after power-on. The base 1.0.0 (built with
update.boot_tries=1: what it installs gets one try) installs each bad version in turn; each bad
version uses up its only try in its own way, and the base boots again and reports.

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
from signed_images import FOREIGN_USR_SIGNATURE, foreign_usr_signature

from appliance import config
from builder import build, qemu, release
from testkit import faults

ROOT = Path(__file__).resolve().parents[2]
BASE = "1.0.0"
# Short for the bad versions: the proxy-less one fails its assessment after it, the hanging one
# is rebooted by the boot deadline (this plus 5 minutes after the kernel starts).
BAD_DEADLINE_S = 60


def run_bad_versions(demo_config: config.Config, https_root: tuple[Path, str, str], tmp_path_factory: pytest.TempPathFactory,
                     bad_versions: tuple[tuple[str, str], ...], name: str,
                     first_steps: tuple[dict[str, Any], ...] = ()) -> tuple[dict[str, Any], str]:
    """The whole run: (the last report with the earlier ones, the console of every boot). A fault
    FOREIGN_USR_SIGNATURE is no fault word: the version is built as it is, then its /usr root hash
    signature is made again with a key no firmware's db holds. FIRST_STEPS run on the base's first
    boot, before the updates."""
    root, url, ca = https_root
    # Without it nothing reboots a hung version and this run would only end at its timeout.
    assert (ROOT / "units/appliance-boot-deadline.timer.j2").is_file(), "no boot deadline unit in this tree"
    key = build.signing_key_for(demo_config, None)
    base = config.with_version(demo_config, BASE)
    base = dataclasses.replace(base, update=dataclasses.replace(base.update, boot_tries=1))
    disk = build.build(base, output=tmp_path_factory.mktemp(f"{name}-base") / "out").disk_image
    bundles = {}
    for version, fault in bad_versions:
        out = tmp_path_factory.mktemp(f"{name}-{version}") / "out"
        if fault == FOREIGN_USR_SIGNATURE:
            bad_config = config.with_version(base, version)
            build.build(bad_config, output=out)
            foreign_usr_signature(out, tmp_path_factory)
        else:
            bad = faults.bad_version(base, version, fault, assessment_deadline_s=BAD_DEADLINE_S)
            bad_config = bad.config
            build.build(bad.config, extra_mkosi_args=bad.mkosi_args, output=out)
        release.make_bundle(bad_config, out, root / f"{name}-{version}", key, [bad_config.engine.digest], previous_version=BASE)
        bundles[version] = f"{url}/{name}-{version}/"
    plan = {BASE: [*first_steps, *({"do": "update", "url": bundles[version]} for version, _ in bad_versions)]}
    guest = qemu.Guest(disk, tmp_path_factory.mktemp(f"{name}-guest"), enroll_cert=build.secure_boot_certificate(demo_config))
    # base first boot + update, then for each bad version its try and the base again
    run = guest.boot(timeout=6000, credentials={"appliance.plan": json.dumps(plan), "appliance.update_ca": ca})
    return run, guest.console_log.read_text(errors="replace")


def base_reports(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in reports_of(run) if r["status"].get("parts", {}).get("os", {}).get("version") == BASE]


def slots_of(report: dict[str, Any]) -> dict[str, Any]:
    return dict(report["status"]["parts"]["slots"])


def after(run: dict[str, Any], console: str, bad_versions: tuple[tuple[str, str], ...], version: str) -> dict[str, Any]:
    """The base version's report after VERSION's only try."""
    bases = base_reports(run)
    index = 1 + [v for v, _ in bad_versions].index(version)
    assert len(bases) > index, f"{len(bases)} report(s) of the base version; console: {console[-3000:]}"
    report = bases[index]
    versions = {s["version"]: s for s in slots_of(report)["slots"] if s["version"]}
    assert versions[BASE]["booted"] and versions[BASE]["state"] == "good", slots_of(report)
    assert versions[version]["state"] == "bad" and versions[version]["tries_left"] == 0, slots_of(report)
    assert report["engine_became_healthy"], report["status_text"]
    return report


def each_was_installed_and_tried(run: dict[str, Any], console: str, bad_versions: tuple[tuple[str, str], ...]) -> None:
    updates = {s["url"].rstrip("/").rsplit("-", 1)[-1]: s for s in reports_of(run)[-1]["steps"] if s["do"] == "update"}
    for version, _ in bad_versions:
        assert updates[version]["exit"] == 0, updates[version]["output"]
    assert not run["timed_out"], console[-3000:]
    assert reports_of(run)[-1]["status"]["parts"]["os"]["version"] == BASE, console[-3000:]
