"""The journey's appliance was flashed by the installer onto a blank disk (conftest.installed), and
its per-host settings, from the signed install plan, survive the journey's upgrade and rollback."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import JOURNEY_HOSTNAME
from journey import V1, V2, reports_of

pytestmark = pytest.mark.integration


def test_the_installer_wrote_the_blank_disk_and_summarised(installed: dict[str, Any]) -> None:
    names = [p.get("name") for p in installed["table"]["partitiontable"]["partitions"]]
    # the release's partitions, slot B made empty and /var, as a first boot would
    assert "appliance-var" in names and f"appliance_{V1}" in names and "_empty" in names, names
    output = installed["output"]
    assert f"Appliance {V1} installed" in output, (output or installed["console"])[-3000:]
    assert "/usr " in output and "verified" in output  # the written /usr checked against the signed root hash


def test_the_installer_enrolled_the_keys_and_every_later_boot_is_sealed(
    installed: dict[str, Any], journey_run1: dict[str, Any], journey_run2: dict[str, Any]
) -> None:
    """The journey's firmware starts in setup mode (no keys): the installer enrolls the appliance's
    keys, so the installed disk's first boot and every one after it enforce Secure Boot, with a TPM
    and the kernel image's signed PCR policy."""
    output = installed["output"]
    assert "secure boot keys enrolled" in output, (output or installed["console"])[-3000:]
    boots = [*reports_of(journey_run1), *reports_of(journey_run2)]
    assert {V1, V2} <= {r["status"]["parts"]["os"].get("version") for r in boots}
    for report in boots:
        version = report["status"]["parts"]["os"].get("version")
        assert report["sealed"] == {"secure_boot": True, "setup_mode": False, "tpm": True, "pcr_signature": True}, (
            version, report["sealed"])


def _host(report: dict[str, Any]) -> dict[str, Any]:
    return dict(report["status"]["parts"]["host"])


def test_the_plans_settings_hold_on_every_version_of_the_journey(
    installed: dict[str, Any], journey_run1: dict[str, Any], journey_run2: dict[str, Any]
) -> None:
    boots = [*reports_of(journey_run1), *reports_of(journey_run2)]
    versions = {r["status"]["parts"]["os"].get("version") for r in boots}
    assert {V1, V2} <= versions  # v1 as installed, v2 after the upgrade and after v3's rollback
    for report in boots:
        host = _host(report)
        assert host["source"] == "plan", host
        assert host["settings"]["hostname"] == JOURNEY_HOSTNAME, host
        assert host["settings"]["ssh_authorized_keys"] == [installed["ssh_line"]], host
