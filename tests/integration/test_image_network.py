"""Only the proxy is reachable from the appliance's network (issue 12, item 5): probed in boot A
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
