# SPDX-License-Identifier: MIT
"""Proof from afar, riding on the journey's boots: the installer made the attestation key and said
so; boot A (v1) is enrolled by `builder attest enroll` from the probe namespace and proven by
`builder attest` (a quote of the guest's swtpm over the verifier's nonce, PCR 11 against the
kernel images' signed policies of a signed channel index, PCR 7 replayed from the firmware's
event log against the demo's Secure Boot certificates); after the upgrade, the same verifier
proves v2 (conftest.journey_run1, journey_run2, attest_host.py). The file sorts after the other
journey files, so that the journey's boots come in the order they always have."""

from __future__ import annotations

import re
from typing import Any

import pytest
from attest_host import verdict_of
from journey import V1, V2, reports_of

pytestmark = pytest.mark.integration


def _guest_step(run: dict[str, Any], version: str) -> dict[str, Any]:
    steps = [s for r in reports_of(run) for s in r.get("steps", []) if s["do"] == "attest" and s["version"] == version]
    assert steps, f"no attest step of {version} in the run's reports"
    return steps[-1]


def test_the_installer_made_the_attestation_key_and_summarised_it(installed: dict[str, Any]) -> None:
    # the EK's fingerprint and the AK's name, which enrollment later proves to be in one TPM
    assert re.search(r"TPM EK\s+sha256:[0-9a-f]{64}", installed["output"]), installed["output"][-3000:]
    assert re.search(r"TPM AK\s+000b[0-9a-f]{64}", installed["output"]), installed["output"][-3000:]


def test_boot_a_is_enrolled_and_proven_to_run_v1_with_secure_boot_enforcing(journey_run1: dict[str, Any]) -> None:
    answer, verdict = verdict_of(journey_run1)
    assert answer["enroll"]["exit"] == 0, answer["enroll"]
    assert answer["check"]["exit"] == 0, answer["check"]
    assert verdict["proven"] and verdict["code"] == "ok", verdict
    assert verdict["release"] == V1 and verdict["secure_boot"] == "enforcing", verdict
    assert re.search(r'appliance_attestation_proven\{[^}]*host="' + re.escape(answer["host"]) + r'"[^}]*\} 1',
                     answer["check"]["prometheus"]), answer["check"]["prometheus"]
    guest = _guest_step(journey_run1, V1)
    assert guest["host_done_seen"] and guest["unit"] == "active", guest


def test_after_the_upgrade_the_same_enrollment_proves_v2(journey_run2: dict[str, Any]) -> None:
    answer, verdict = verdict_of(journey_run2)
    assert "enroll" not in answer  # enrolled once, at boot A: the same AK in the same TPM
    assert verdict["proven"] and verdict["release"] == V2 and verdict["secure_boot"] == "enforcing", verdict
    assert _guest_step(journey_run2, V2)["host_done_seen"]
