# SPDX-License-Identifier: MIT
"""Extended QEMU scenarios (make test-extended GROUPS=signing): what the Secure Boot key did not sign
never runs, and the appliance stays on (or comes back to) its version with nobody at the console.
One run (tests/integration/bad_versions.py), the base built with update.boot_tries=1:

    base   1.0.0 sealed (Secure Boot enforcing, the appliance's certificate in db): offered 1.5.0,
           whose bundle the release key signed but whose kernel image another Secure Boot key
           signed, the updater proves every file and refuses it in one line before anything is
           written (`update` and `--download-only` alike): the firmware would refuse to start it,
           and its boot manager would then stay in its own menu (seen in QEMU with OVMF).
           Then it installs 1.6.0, whose /usr root hash signature another key made (the root hash
           itself is right, so the updater takes it)
    1.6.0  the initrd hands the signature to dm-verity; the kernel checks it against db and
           refuses (ENOKEY): /usr is not opened; after the device timeout the emergency unit
           reboots, the only try used up
    base   boots again by itself, 1.6.0 marked bad
The same kernel image refusal rides in the journey (make test: boot B's refusals).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bad_versions import BASE, after, base_reports, each_was_installed_and_tried, run_bad_versions
from signed_images import FOREIGN_USR_SIGNATURE, foreign_signed

from appliance import config
from builder import build, release

pytestmark = [pytest.mark.integration, pytest.mark.extended]

FOREIGN_KERNEL, FOREIGN_USR = "1.5.0", "1.6.0"
BAD_VERSIONS = ((FOREIGN_USR, FOREIGN_USR_SIGNATURE),)
SAYS = "which this firmware's db does not trust; under Secure Boot it would never start"


@pytest.fixture(scope="module")
def signing_run(demo_config: config.Config, https_root: tuple[Path, str, str],
                tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    root, url, _ = https_root
    key = build.signing_key_for(demo_config, None)
    foreign = config.with_version(demo_config, FOREIGN_KERNEL)
    out = tmp_path_factory.mktemp("foreign-kernel") / "out"
    build.build(foreign, output=out)
    release.make_bundle(foreign, foreign_signed(out, tmp_path_factory), root / "signing-foreign-kernel", key,
                        [foreign.engine.digest], previous_version=BASE)
    first = ({"do": "refusals", "bundles": {"foreign-kernel": f"{url}/signing-foreign-kernel/"}},
             {"do": "download-only", "url": f"{url}/signing-foreign-kernel/"})
    return run_bad_versions(demo_config, https_root, tmp_path_factory, BAD_VERSIONS, "signing", first)


def _step(report: dict[str, Any], do: str) -> dict[str, Any]:
    steps = [s for s in report.get("steps") or [] if s.get("do") == do]
    assert steps, f"no {do} step in the report: {report.get('steps')}"
    return steps[-1]


def test_a_kernel_image_signed_by_another_key_is_refused_in_one_line_before_any_write(
        signing_run: tuple[dict[str, Any], str]) -> None:
    first = base_reports(signing_run[0])[0]
    refusals = _step(first, "refusals")
    refused = refusals["bundles"]["foreign-kernel"]
    assert refused["exit"] == 1 and any(SAYS in line for line in refused["stderr"].splitlines()), refused
    assert "hint: " in refused["stderr"] and "Traceback" not in refused["stderr"], refused["stderr"]
    assert refusals["inactive_before"] and refusals["inactive_before"] == refusals["inactive_after"]
    staged = _step(first, "download-only")
    assert staged["exit"] == 1 and SAYS in staged["output"], staged


def test_a_usr_whose_signature_the_kernel_refuses_is_not_opened_and_rolled_back_by_itself(
        signing_run: tuple[dict[str, Any], str]) -> None:
    run, console = signing_run
    each_was_installed_and_tried(run, console, BAD_VERSIONS)
    report = after(run, console, BAD_VERSIONS, FOREIGN_USR)  # the base again, 1.6.0 bad with no try left
    assert report["status"]["parts"]["sealed"].get("usr_signature") is True
    # 1.6.0's initrd found its signature and the kernel refused it: /usr never opened, the device
    # wait ended, the emergency unit rebooted
    assert "verity: Root hash verification failed" in console and "appliance: emergency mode" in console, console[-3000:]
