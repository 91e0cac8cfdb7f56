"""builder/qemu.py without QEMU: the guest's questions and the host-side probe network."""

from __future__ import annotations

import os
import subprocess

import pytest

from builder import qemu


def test_questions_are_read_in_order_and_half_written_lines_wait() -> None:
    text = (
        "noise\nAPPLIANCE-ASK netprobe {\"bridge\": \"10.88.0.2\"}\n"
        "APPLIANCE-REPORT-BEGIN\n{}\nAPPLIANCE-REPORT-END\n"
        "APPLIANCE-ASK other [1]\nAPPLIANCE-ASK late {\"x\""
    )
    questions = qemu.parse_questions(text)
    assert questions == [
        {"name": "netprobe", "payload": {"bridge": "10.88.0.2"}},
        {"name": "other", "payload": {"value": [1]}},
    ]


def test_probe_network_credential_is_static_and_never_delays_online() -> None:
    net = qemu.ProbeNet("unused", subnet="198.51.100.0/24")
    (name, body), = net.credentials().items()
    assert name == "network.network.10-appliance-probe"  # sorts before the image's 80-appliance-ethernet
    assert f"MACAddress={net.MAC}" in body and "Address=198.51.100.2/24" in body
    assert "RequiredForOnline=no" in body and "DHCP" not in body


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/net/tun"), reason="needs root and /dev/net/tun")
def test_probe_network_namespace_has_the_tap_address_and_routes_and_is_removed() -> None:
    name = f"appliance-test-{os.getpid()}"
    with qemu.ProbeNet(name, routes=("10.88.0.0/16",)) as net:
        assert net.fd is not None and f"fd={net.fd}" in " ".join(net.qemu_args())
        addresses = net.run(["ip", "-br", "addr", "show", "dev", net.tap]).stdout
        assert "198.51.100.1/24" in addresses
        assert "10.88.0.0/16 via 198.51.100.2" in net.run(["ip", "route"]).stdout
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
