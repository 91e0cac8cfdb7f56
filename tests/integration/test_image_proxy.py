# SPDX-License-Identifier: MIT
"""The demo image serves through its own Caddy, with its own CA, to allowed sources only."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.integration


def test_smoke_completion_through_the_proxy(first_boot: dict[str, Any]) -> None:
    # applianctl smoke: HTTPS to the proxy, trusting only the appliance CA, SNI = the hostname.
    out = first_boot["smoke_proxy"]
    assert "answer '391'" in out and out.rstrip().splitlines()[-1].startswith("ok: "), out


def test_proxy_and_tls_healthy_in_status(first_boot: dict[str, Any]) -> None:
    parts = first_boot["status"]["parts"]
    assert parts["tls"]["state"] == "ok", parts["tls"]
    proxy = parts["units"]["units"]["appliance-proxy.service"]
    assert proxy["state"] == "ok", proxy
