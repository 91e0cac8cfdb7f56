# SPDX-License-Identifier: MIT
"""The first console's text: name, addresses, CA fingerprint and the status, escaped for agetty."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import appliance.config
from applianctl import console
from applianctl.records import EffectiveSettings
from applianctl.status import collect, document, probes

REPO = Path(__file__).resolve().parents[1]


def typed(doc: dict[str, Any]) -> document.StatusDocument:
    """DOC with its parts' details left out but the host's addresses (all the console reads of it)."""
    parts = {name: probes.Part(part["state"], part["reason"]) for name, part in doc["parts"].items()}
    host = doc["parts"]["host"]
    settings = EffectiveSettings(hostname="h", network="", ssh_authorized_keys=(), proxy_hostname="h", proxy_allowed_cidrs=(),
                                 proxy_acme_email="", update_url="", weights_source="")
    parts["host"] = probes.Part(host["state"], host["reason"], document.HostDetails(
        source=None, hostname="h", addresses=tuple(host["addresses"]), network_files=(), settings=settings,
        factory_reset=document.FactoryResetStatus(pending=None, last=None)))
    return document.StatusDocument(**{**doc, "parts": parts})


def test_console_text(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = appliance.config.load(REPO / "appliance.toml", "demo")
    doc: dict[str, Any] = {"schema": 1, "state": "degraded", "reason": "engine: a\\b", "appliance": config.appliance.name,
                           "version": config.appliance.version, "profile": "demo", "generated_at": "2026-11-30T14:00:00Z",
                           "elapsed_s": 0.1, "parts": {
                               "engine": {"state": "degraded", "reason": "a\\b"},
                               "host": {"state": "ok", "reason": "", "addresses": ["192.0.2.10/24"]},
                               "tls": {"state": "down", "reason": "no CA yet"}}}
    monkeypatch.setattr(collect, "collect", lambda config, src: typed(doc))
    monkeypatch.setenv("APPLIANCE_STATE_DIR", str(tmp_path))

    text = console.text(config, probes.Sources())
    assert f"{config.appliance.name} {config.appliance.version}" in text
    assert "addresses:  192.0.2.10/24" in text
    assert "CA SHA-256: (no CA yet)" in text  # no CA yet: the reason is shown instead
    assert "a\\\\b" in text and "a\\b " not in text.replace("a\\\\b", "")  # agetty escapes doubled
    assert "engine" in text
