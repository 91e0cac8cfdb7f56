# SPDX-License-Identifier: MIT
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


# A second address of the host's namespace, outside the plan's metrics allowlist (conftest's
# INSTALL_PLAN admits the namespace's first address only): a machine that is not a scraper.
NOT_A_SCRAPER = "198.51.100.3"


def scrape(net: qemu.ProbeNet, url: str, source: str | None = None) -> dict[str, Any]:
    """One scrape as Prometheus makes it (GET, TLS; the appliance CA is not the host's): the HTTP
    status and the body."""
    cmd = ["curl", "-sk", "-w", "\n%{http_code}", "--max-time", str(PROXY_TIMEOUT_S), *(["--interface", source] if source else []), url]
    proc = net.run(cmd, timeout=PROXY_TIMEOUT_S + 30)
    body, _, code = proc.stdout.rpartition("\n")
    return {"url": url, "source": source or net.host_address, "exit": proc.returncode, "http_code": code, "body": body,
            "stderr": proc.stderr.strip()[-300:]}


def answerer(net: qemu.ProbeNet) -> qemu.Answerer:
    def probe(question: dict[str, Any]) -> dict[str, Any]:
        guest, port = net.guest_address, int(question["engine_port"])
        answer = {
            "guest": guest,
            "routes": net.run(["ip", "route"]).stdout,
            "engine_on_guest": curl(net, f"http://{guest}:{port}/health", NEGATIVE_TIMEOUT_S),
        }
        if question.get("metrics_port"):
            metrics = f"https://{guest}:{int(question['metrics_port'])}"
            answer["metrics"] = scrape(net, f"{metrics}/metrics")
            answer["engine_metrics"] = scrape(net, f"{metrics}/engine/metrics")
            net.run(["ip", "addr", "add", f"{NOT_A_SCRAPER}/{net.prefix}", "dev", net.tap])
            answer["metrics_not_a_scraper"] = scrape(net, f"{metrics}/metrics", source=NOT_A_SCRAPER)
        if question.get("bridge"):
            answer["engine_on_bridge"] = curl(net, f"http://{question['bridge']}:{port}/health", NEGATIVE_TIMEOUT_S)
        # last: the positive control, which is also the guest's signal that the host is done
        answer["proxy"] = curl(net, f"https://{guest}:{question['https_port']}{question['done_path']}", PROXY_TIMEOUT_S)
        return answer

    return probe
