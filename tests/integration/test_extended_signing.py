"""Extended QEMU scenario (make test-extended GROUPS=signing): a kernel image signed by another key.

    1.0.0   sealed (Secure Boot enforcing, the appliance's certificate in db): it is offered 1.5.0,
            whose bundle is signed by the release key (the updater trusts it) but whose kernel image
            is signed by another Secure Boot key. The updater downloads and proves every file, then
            refuses the kernel image in one line, before anything is written: the firmware would
            refuse to start it, and its boot manager would then stay in its own menu (seen here
            before the check existed). 1.0.0 keeps serving, its other slot untouched, nobody at
            the console. The same refusal rides in the journey (make test: boot B's refusals); this
            group adds the staged path (--download-only then --apply), where the check runs again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from signed_images import foreign_signed

from appliance import config
from builder import build, qemu, release

pytestmark = [pytest.mark.integration, pytest.mark.extended]

FOREIGN = "1.5.0"
SAYS = "which this firmware's db does not trust; under Secure Boot it would never start"


@pytest.fixture(scope="module")
def foreign_report(demo_config: config.Config, demo_image: Path, https_root: tuple[Path, str, str],
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root, url, ca = https_root
    key = build.signing_key_for(demo_config, None)
    foreign = config.with_version(demo_config, FOREIGN)
    out = tmp_path_factory.mktemp("foreign") / "out"
    build.build(foreign, output=out)
    release.make_bundle(foreign, foreign_signed(out, tmp_path_factory), root / "sealed-foreign", key,
                        [foreign.engine.digest], previous_version=demo_config.appliance.version)
    guest = qemu.Guest(demo_image, tmp_path_factory.mktemp("foreign-guest"),
                       enroll_cert=build.secure_boot_certificate(demo_config))
    version = demo_config.appliance.version
    plan = {version: [{"do": "refusals", "bundles": {"foreign-signed": f"{url}/sealed-foreign/"}},
                      {"do": "download-only", "url": f"{url}/sealed-foreign/"}]}
    creds = {"appliance.plan": json.dumps(plan), "appliance.update_ca": ca, "appliance.bootcheck": "poweroff"}
    return guest.boot(timeout=3000, credentials=creds)


def _step(report: dict[str, Any], do: str) -> dict[str, Any]:
    steps = [s for s in report.get("steps") or [] if s.get("do") == do]
    assert steps, f"no {do} step in the report: {report.get('steps')}"
    return steps[-1]


def test_the_update_is_refused_in_one_line_and_nothing_is_written(foreign_report: dict[str, Any]) -> None:
    refused = _step(foreign_report, "refusals")["bundles"]["foreign-signed"]
    assert refused["exit"] == 1, refused
    assert any(SAYS in line for line in refused["stderr"].splitlines()), refused["stderr"]
    assert "hint: " in refused["stderr"] and "Traceback" not in refused["stderr"], refused["stderr"]
    refusals = _step(foreign_report, "refusals")
    assert refusals["inactive_before"] and refusals["inactive_before"] == refusals["inactive_after"]


def test_staging_it_is_refused_too_and_the_appliance_keeps_serving_its_version(foreign_report: dict[str, Any]) -> None:
    staged = _step(foreign_report, "download-only")
    assert staged["exit"] == 1 and SAYS in staged["output"], staged
    status = foreign_report["status"]["parts"]
    assert status["os"].get("version") != FOREIGN
    assert not [e for e in status["slots"].get("entries") or [] if e.get("version") == FOREIGN], status["slots"]
    assert foreign_report["engine_became_healthy"] and foreign_report["failed_units"] == [], foreign_report["journal"]
