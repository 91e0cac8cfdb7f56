# SPDX-License-Identifier: MIT
"""Nothing outside the signed image changes behaviour, on the journey's boots: a drop-in for the
engine placed in /etc on boot A is named by `applianctl verify` and has no effect after the
reboot (the initrd put the factory /etc of the signed /usr back); no boot of any version, after
upgrades and rollbacks, finds anything in /etc that differs from its own image's."""

from __future__ import annotations

import re
from typing import Any

import pytest
from journey import V1, reports_of

pytestmark = pytest.mark.integration

DROPIN = "/etc/systemd/system/appliance-engine@.service.d/50-not-signed.conf"


def test_a_drop_in_in_etc_is_reported_then_gone_after_a_reboot(journey_run1: dict[str, Any], journey_run2: dict[str, Any]) -> None:
    boot_a = reports_of(journey_run1)[0]
    (placed,) = [s for s in boot_a["steps"] if s["do"] == "etc-dropin" and s["version"] == V1]
    assert DROPIN in placed["drop_in_paths"], placed  # systemd took it: it would change the engine
    assert placed["verify_exit"] == 1, placed
    assert any(DROPIN in line and line.startswith("added") for line in placed["verify"]["overrides"]), placed["verify"]
    boot_c = reports_of(journey_run2)[0]
    etc = boot_c["etc"]
    assert not etc["etc_dropin_present"], etc
    assert DROPIN not in etc["engine_drop_in_paths"] and "APPLIANCE_UNSIGNED_DROPIN" not in etc["engine_environment"], etc
    # the drop-in, or the directory it made (not in the factory /etc either), deleted as a whole
    assert re.search(r"etc-reset: deleted /etc/systemd/system/appliance-engine@\.service\.d(/50-not-signed\.conf)? ",
                     etc["reset_log"]), etc["reset_log"]
    assert boot_c["engine_became_healthy"], boot_c["status_text"]


def test_no_boot_finds_anything_in_etc_that_its_image_did_not_put_there(journey_run1: dict[str, Any],
                                                                         journey_run2: dict[str, Any]) -> None:
    """Each version's /etc is its own: status is read before the boot's steps, so even boot A's
    verify saw the factory /etc; v2's and v3's boots after an upgrade, and v1's after a rollback,
    find theirs too."""
    for report in [*reports_of(journey_run1), *reports_of(journey_run2)]:
        verify = report["status"]["parts"]["verify"]
        version = report["status"]["parts"]["os"].get("version")
        assert verify["state"] == "ok" and verify.get("overrides") == [], (version, verify)
