# SPDX-License-Identifier: MIT
"""The journal off the box: the journey's install plan names a log collector
(a real systemd-journal-remote on the test host, conftest.log_collector) and its CA; on every boot
systemd-journal-upload sends the guest's journal there over TLS, the appliance's own client
certificate presented. Rides on boot A."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def _received(collector: dict[str, Any], *match: str) -> list[str]:
    proc = subprocess.run(["journalctl", f"--directory={collector['dir']}", "-o", "cat", "--no-pager", *match],
                          capture_output=True, text=True, timeout=120, check=False)
    return proc.stdout.splitlines()


def test_the_collector_received_the_engines_startup_lines(journey_run1: dict[str, Any], log_collector: dict[str, Any]) -> None:
    files = sorted(p.name for p in log_collector["dir"].iterdir())
    assert files, f"nothing received; journal-remote said: {log_collector['log'].read_text()[-2000:]}"
    lines = _received(log_collector)
    # the stand-in logs as vLLM does; the startup report reads the same lines on the appliance
    assert any("Model loading took" in line for line in lines), lines[-50:]
    assert any("Starting vLLM API server" in line for line in lines), lines[-50:]
    # and the appliance's own units, e.g. the proxy's start
    assert _received(log_collector, "_SYSTEMD_UNIT=appliance-proxy.service"), "no line of the proxy's unit"
