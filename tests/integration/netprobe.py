"""The host's side of the boot check's netprobe step: from a network namespace on the guest's
second NIC (builder.qemu.ProbeNet), as a machine on the appliance's network would, try the
engine's port on the guest's address and on the container's bridge address (routed via the
guest), then the proxy's public port, whose request tells the waiting guest that the host is done."""

from __future__ import annotations

from typing import Any

from builder import qemu

# Dropped packets time out; a short limit keeps the boot short. The proxy's TLS handshake under
# emulation takes seconds: its limit is longer.
NEGATIVE_TIMEOUT_S = 5
PROXY_TIMEOUT_S = 30


def curl(net: qemu.ProbeNet, url: str, timeout: float) -> dict[str, Any]:
    """curl's exit status (0: an HTTP answer; 7: refused or unreachable; 28: timed out) and the
    HTTP status it got."""
    cmd = ["curl", "-sk", "-o", "/dev/null", "-w", "%{http_code}", "--connect-timeout", str(timeout),
           "--max-time", str(timeout), url]
    proc = net.run(cmd, timeout=timeout + 30)
    return {"url": url, "exit": proc.returncode, "http_code": proc.stdout.strip(), "stderr": proc.stderr.strip()[-300:]}


def answerer(net: qemu.ProbeNet) -> qemu.Answerer:
    def probe(question: dict[str, Any]) -> dict[str, Any]:
        guest, port = net.guest_address, int(question["engine_port"])
        answer = {
            "guest": guest,
            "routes": net.run(["ip", "route"]).stdout,
            "engine_on_guest": curl(net, f"http://{guest}:{port}/health", NEGATIVE_TIMEOUT_S),
        }
        if question.get("bridge"):
            answer["engine_on_bridge"] = curl(net, f"http://{question['bridge']}:{port}/health", NEGATIVE_TIMEOUT_S)
        # last: the positive control, which is also the guest's signal that the host is done
        answer["proxy"] = curl(net, f"https://{guest}:{question['https_port']}{question['done_path']}", PROXY_TIMEOUT_S)
        return answer

    return probe
