# SPDX-License-Identifier: MIT
"""builder/qemu.py without QEMU: the guest's questions and the host-side probe network."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from builder import qemu

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)


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


def test_every_boot_hands_over_the_demo_weights_mirror_unless_told_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Demo images fetch their weights at first boot from the source handed over:
    by default the build host's mirror of the demo weights, which answers while the guest runs."""
    import requests
    import urllib3

    from builder import weights_mirror

    seen: list[dict[str, str]] = []

    def fake_boot(self: qemu.Guest, creds: dict[str, str], *args: object) -> dict[str, object]:
        seen.append(dict(creds))
        if creds.get(qemu.MODEL_SOURCE, "").startswith("https://10.0.2.2:"):  # the mirror serves during the boot
            port = creds[qemu.MODEL_SOURCE].split(":")[2].strip("/")
            with pytest.warns(urllib3.exceptions.InsecureRequestWarning):
                got = requests.get(f"https://127.0.0.1:{port}/config.json", verify=False, timeout=10)
            seen[-1]["status"] = str(got.status_code)
        return {}

    monkeypatch.setattr(qemu, "OVMF_CODE", tmp_path / "code.fd")
    (tmp_path / "code.fd").write_bytes(b"")
    monkeypatch.setattr(qemu, "firmware_vars", lambda path, cert: path)
    monkeypatch.setattr(qemu.Guest, "_boot", fake_boot)
    real = weights_mirror.demo
    monkeypatch.setattr(weights_mirror, "demo", lambda: real(tmp_path / "cache"))
    disk = tmp_path / "disk.raw"
    disk.write_bytes(b"")
    guest = qemu.Guest(disk, tmp_path / "guest")
    guest.boot(10)
    guest.boot(10, credentials={qemu.MODEL_SOURCE: ""})
    guest.boot(10, credentials={qemu.MODEL_SOURCE: "https://mirror.example/w/"})
    assert seen[0][qemu.MODEL_SOURCE].startswith(f"https://{weights_mirror.GUEST_SEES_HOST}:")
    assert seen[0][qemu.MODEL_SOURCE_CA].startswith("-----BEGIN CERTIFICATE-----") and seen[0]["status"] == "200"
    assert qemu.MODEL_SOURCE not in seen[1] and qemu.MODEL_SOURCE_CA not in seen[1]
    assert seen[2][qemu.MODEL_SOURCE] == "https://mirror.example/w/" and qemu.MODEL_SOURCE_CA not in seen[2]
