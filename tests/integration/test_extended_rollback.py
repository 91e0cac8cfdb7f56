"""Extended QEMU scenarios (make test-extended): versions that fail in ways the engine-only
assessment would not see are rolled back by the appliance itself, each with one boot try.

One appliance, one QEMU run, no host intervention after power-on:

    base  1.0.0 first boot (its updater gives a new version 1 try): report; install 1.1.0
    1.1.0 the proxy never listens (its unit runs, nothing binds the port): the assessment, which
          goes through the proxy over TLS, fails; reboot; no try left
    base  report (1.1.0 rolled back); install 1.2.0
    1.2.0 a unit ordered before the assessment and boot-complete.target never finishes: the boot
          deadline (appliance-boot-deadline.timer) reboots it; no try left
    base  the final report

The bad versions are real builds of the demo with one test-only file each in an extra tree
(built in ~3 min each from mkosi's caches); their bundles are served over HTTPS as in the journey.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from journey import reports_of

from appliance import config
from builder import build, qemu, release

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.extended]

BASE, NO_PROXY, HANGS = "1.0.0", "1.1.0", "1.2.0"
# Short for the bad versions: the proxy-less one fails its assessment after it, the hanging one
# is rebooted by the boot deadline (this plus 5 minutes after the kernel starts).
BAD_DEADLINE_S = 60

# A drop-in that keeps the proxy's unit running while nothing listens on its ports.
PROXY_NEVER_LISTENS = {
    "usr/lib/systemd/system/appliance-proxy.service.d/90-test-never-listens.conf": (
        "# test-only (tests/integration/test_extended_rollback.py): the proxy never listens\n"
        "[Service]\nType=exec\nExecStart=\nExecStart=/bin/sleep infinity\nExecReload=\n"
    ),
}
# A unit that never finishes, which the assessment and boot-complete.target wait for.
HANGS_BEFORE_BOOT_COMPLETE = {
    "usr/lib/systemd/system/appliance-test-hang.service": (
        "# test-only (tests/integration/test_extended_rollback.py): boot-complete.target never comes\n"
        "[Unit]\nDescription=Test-only: never finishes\nBefore=boot-complete.target appliance-assess.service\n\n"
        "[Service]\nType=oneshot\nExecStart=/bin/sleep infinity\nTimeoutStartSec=infinity\n"
    ),
}
HANG_LINK = ("usr/lib/systemd/system/boot-complete.target.wants/appliance-test-hang.service", "../appliance-test-hang.service")


def _tree(root: Path, files: dict[str, str], link: tuple[str, str] | None = None) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if link:
        (root / link[0]).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(link[1], root / link[0])
    return root


def _variant(demo: config.Config, version: str, boot_tries: int, deadline_s: int | None = None) -> config.Config:
    cfg = config.with_version(demo, version)
    update = dataclasses.replace(cfg.update, boot_tries=boot_tries,
                                 assessment_deadline_s=deadline_s or cfg.update.assessment_deadline_s)
    return dataclasses.replace(cfg, update=update)


@pytest.fixture(scope="module")
def extended_run(demo_config: config.Config, https_root: tuple[Path, str, str],
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """The whole run: (the last report with the earlier ones, the console of every boot)."""
    root, url, ca = https_root
    # Without it nothing reboots a hung version and this run would only end at its timeout.
    assert (ROOT / "units/appliance-boot-deadline.timer.j2").is_file(), "no boot deadline unit in this tree"
    key = build.signing_key_for(demo_config, None)
    base = _variant(demo_config, BASE, boot_tries=1)
    base_out = tmp_path_factory.mktemp("extended-base") / "out"
    disk = build.build(base, output=base_out).disk_image
    bundles = {}
    for version, files, link in ((NO_PROXY, PROXY_NEVER_LISTENS, None), (HANGS, HANGS_BEFORE_BOOT_COMPLETE, HANG_LINK)):
        cfg = _variant(demo_config, version, boot_tries=1, deadline_s=BAD_DEADLINE_S)
        tree = _tree(tmp_path_factory.mktemp(f"extra-{version}"), files, link)
        out = tmp_path_factory.mktemp(f"extended-{version}") / "out"
        build.build(cfg, (f"--extra-tree={tree}",), output=out)
        release.make_bundle(cfg, out, root / f"extended-{version}", key, [cfg.engine.digest], previous_version=BASE)
        bundles[version] = f"{url}/extended-{version}/"
    plan = {BASE: [{"do": "update", "url": bundles[NO_PROXY]}, {"do": "update", "url": bundles[HANGS]}]}
    guest = qemu.Guest(disk, tmp_path_factory.mktemp("extended-guest"))
    # base first boot + update, the failed try, base + update, the hung try (deadline), base
    run = guest.boot(timeout=4800, credentials={"appliance.plan": json.dumps(plan), "appliance.update_ca": ca})
    return run, guest.console_log.read_text(errors="replace")


def _base_reports(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in reports_of(run) if r["status"].get("parts", {}).get("os", {}).get("version") == BASE]


def _slots(report: dict[str, Any]) -> dict[str, Any]:
    return dict(report["status"]["parts"]["slots"])


def _by_version(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["version"]: s for s in _slots(report)["slots"] if s["version"]}


def test_each_bad_version_was_installed_and_tried(extended_run: tuple[dict[str, Any], str]) -> None:
    run, console = extended_run
    updates = {s["url"].rstrip("/").rsplit("-", 1)[-1]: s for s in reports_of(run)[-1]["steps"] if s["do"] == "update"}
    for version in (NO_PROXY, HANGS):
        assert updates[version]["exit"] == 0, updates[version]["output"]
    assert not run["timed_out"], console[-3000:]


def test_a_version_whose_proxy_never_listens_is_rolled_back_by_itself(extended_run: tuple[dict[str, Any], str]) -> None:
    run, console = extended_run
    bases = _base_reports(run)
    assert len(bases) >= 2, f"{len(bases)} report(s) of the base version; console: {console[-3000:]}"
    after = bases[1]  # the base again, after the proxy-less version's only try
    versions, slots = _by_version(after), _slots(after)
    assert versions[BASE]["booted"] and versions[BASE]["state"] == "good", slots
    assert versions[NO_PROXY]["state"] == "bad" and versions[NO_PROXY]["tries_left"] == 0, slots
    assert slots["rolled_back"], slots
    last = slots["last_assessment"]
    assert last["version"] == NO_PROXY and not last["ok"], last  # judged by the proxy, not the engine alone
    assert after["engine_became_healthy"], after["status_text"]


def test_a_version_that_hangs_before_boot_complete_is_rolled_back_by_itself(extended_run: tuple[dict[str, Any], str]) -> None:
    run, console = extended_run
    final = reports_of(run)[-1]
    assert final["status"]["parts"]["os"]["version"] == BASE, console[-3000:]
    versions, slots = _by_version(final), _slots(final)
    assert versions[BASE]["booted"] and versions[BASE]["state"] == "good", slots
    assert versions[HANGS]["state"] == "bad" and versions[HANGS]["tries_left"] == 0, slots
    # the boot deadline rebooted it (the assessment never ran: it waits for the hung unit)
    assert "boot-complete.target not reached before the deadline" in console, console[-3000:]
    assert final["engine_became_healthy"], final["status_text"]
