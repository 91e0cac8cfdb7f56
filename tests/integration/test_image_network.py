# SPDX-License-Identifier: MIT
"""Only the proxy is reachable from the appliance's network: probed in boot A
from a network namespace on the host joined to the guest's second NIC by a tap device, with a
route to the container bridge via the guest (conftest.journey_run1, netprobe.py)."""

from __future__ import annotations

from typing import Any

import pytest
from journey import V1, reports_of

pytestmark = pytest.mark.integration

REFUSED, TIMED_OUT = 7, 28  # curl's exit statuses


@pytest.fixture(scope="module")
def probe(journey_run1: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the host's answer, the guest's record) of boot A's netprobe step."""
    asked = [a for a in journey_run1["asked"] if a["name"] == "netprobe"]
    assert len(asked) == 1, f"the guest asked {len(asked)} times for the network probe: {journey_run1['asked']}"
    guest = [s for s in reports_of(journey_run1)[0]["steps"] if s["do"] == "netprobe" and s["version"] == V1]
    assert guest, "boot A ran no netprobe step"
    return asked[0]["answer"], guest[0]


def test_the_proxy_answers_from_the_network(probe: tuple[dict[str, Any], dict[str, Any]]) -> None:
    # the positive control: the link, the guest's address and the proxy's port work from outside
    host, _ = probe
    proxy = host["proxy"]
    assert proxy["exit"] == 0 and proxy["http_code"].isdigit() and 100 <= int(proxy["http_code"]) < 600, host


def test_the_engine_port_is_not_reachable_from_the_network(probe: tuple[dict[str, Any], dict[str, Any]]) -> None:
    host, guest = probe
    assert host["engine_on_guest"]["exit"] in (REFUSED, TIMED_OUT), host
    # meanwhile the engine served (seen from inside the guest): the negative is not for want of it
    assert guest["inside_before"] == 200 and guest["inside_after"] == 200, guest


def test_the_container_bridge_is_not_reachable_through_the_appliance(probe: tuple[dict[str, Any], dict[str, Any]]) -> None:
    host, guest = probe
    assert guest["bridge"].startswith("10.88."), guest
    assert "10.88.0.0/16 via " + host["guest"] in host["routes"], host["routes"]
    # podman turns forwarding on; without a firewall this route reaches the engine directly
    assert guest["ip_forward"] == "1", guest
    assert "engine_on_bridge" in host, host
    assert host["engine_on_bridge"]["exit"] in (REFUSED, TIMED_OUT), (host, guest.get("nft_tables"))
    assert guest["inside_before"] == 200 and guest["inside_after"] == 200, guest


# ------------------------------------------------------------------ the appliance's metrics

def _families(text: str) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def test_a_scraper_gets_the_appliances_metrics_through_the_proxy_and_they_agree_with_status(
        probe: tuple[dict[str, Any], dict[str, Any]]) -> None:
    host, guest = probe
    assert guest["metrics_unit"]["exit"] == 0, guest["metrics_unit"]
    scraped = host["metrics"]
    assert scraped["exit"] == 0 and scraped["http_code"] == "200", {k: v for k, v in scraped.items() if k != "body"}
    families = _families(scraped["body"])
    # node_exporter's own collectors, its systemd collector, and the status textfile
    assert {"node_memory_MemAvailable_bytes", "node_filesystem_avail_bytes", "node_systemd_unit_state",
            "appliance_part_state", "appliance_info", "appliance_gpu_metrics_up"} <= set(families), \
        [line for line in scraped["body"].splitlines() if line.startswith("node_scrape_collector_success")]
    states = {s.labels["part"]: s.labels["state"] for s in families["appliance_part_state"].samples if s.value == 1}
    # the part gauges say what `applianctl status --json` said at the same moment
    assert states == guest["part_states"], (states, guest["part_states"])
    info = families["appliance_info"].samples[0].labels
    assert info["version"] == V1 and info["profile"] == "demo"
    # no GPU in the demo: the GPU series say why they are absent
    assert [s.value for s in families["appliance_gpu_metrics_up"].samples] == [0]
    # the systemd collector sees the appliance's units
    engine = [s for s in families["node_systemd_unit_state"].samples
              if s.labels["name"] == "appliance-engine@0.service" and s.labels["state"] == "active"]
    assert engine and engine[0].value == 1


def test_the_engines_metrics_through_the_metrics_site(probe: tuple[dict[str, Any], dict[str, Any]]) -> None:
    host, _ = probe
    scraped = host["engine_metrics"]
    assert scraped["http_code"] == "200", {k: v for k, v in scraped.items() if k != "body"}
    assert any(name.startswith("vllm:") for name in _families(scraped["body"])), scraped["body"][:500]


def test_a_source_outside_the_metrics_allowlist_gets_403(probe: tuple[dict[str, Any], dict[str, Any]]) -> None:
    host, _ = probe
    refused = host["metrics_not_a_scraper"]
    assert refused["source"] != host["metrics"]["source"]
    assert refused["http_code"] == "403" and "permission_error" in refused["body"], refused


def test_node_exporter_and_the_journal_upload_run_as_units_status_counts(probe: tuple[dict[str, Any], dict[str, Any]]) -> None:
    _, guest = probe
    units = guest["units"]
    assert units["appliance-node-exporter.service"]["state"] == "ok", units
    assert units["appliance-journal-upload.service"]["active_state"] == "active", units
