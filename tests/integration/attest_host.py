# SPDX-License-Identifier: MIT
"""The host's side of the boot check's attest step: from the probe namespace (the scraper the
journey's plan allows on the metrics site), `builder attest enroll` the first time, then
`builder attest` against a signed channel index of the journey's releases, as a fleet's verifier
would; then the request to the proxy that tells the waiting guest the host is done."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import netprobe
from journey import V1, V2, V3

from builder import qemu, sign_channel

RELEASES = (("v1", V1), ("v2", V2), ("v3", V3))


def attest_channel(root: Path, key: Path, work: Path) -> Path:
    """A channel index of the journey's three releases, beside hard links of their bundles: the
    releases a verifier accepts (their kernel images' signed PCR 11 policies)."""
    out = root / "attest-channel"
    for name, _ in RELEASES:
        shutil.copytree(root / name, out / name, copy_function=os.link)
    source = work / "attest-channel.toml"
    source.write_text('channel = "journey"\n' + "".join(f'[[releases]]\nversion = "{v}"\npath = "{n}/"\n' for n, v in RELEASES))
    sign_channel.make(source, out, key, now=time.time())
    return out


def _builder(net: qemu.ProbeNet, args: list[str], timeout: float = 600) -> dict[str, Any]:
    proc = net.run([sys.executable, "-m", "builder", "--profile", "demo", *args], timeout=timeout)
    return {"exit": proc.returncode, "stdout": proc.stdout[-6000:], "stderr": proc.stderr[-3000:]}


def answerer(net: qemu.ProbeNet, store: Path, channel: Path, work: Path) -> qemu.Answerer:
    def attest(question: dict[str, Any]) -> dict[str, Any]:
        port = int(question["metrics_port"])
        hostname = str(question["hostname"])  # the proxy's name, which its certificate gives
        ca = work / "appliance-ca.pem"
        ca.write_text(str(question.get("ca", "")))
        # that name for the guest's address inside the namespace (ip netns exec binds
        # /etc/netns/NAME/hosts over /etc/hosts): the site's certificate names the hostname
        hosts = Path("/etc/netns") / net.name
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts").write_text(f"127.0.0.1 localhost\n{net.guest_address} {hostname}\n")
        try:
            tls = ["--store", str(store), "--ca", str(ca)]
            answer: dict[str, Any] = {"host": hostname}
            if not (store / "hosts" / f"{hostname}.json").exists():
                answer["enroll"] = _builder(net, ["attest", "enroll", hostname, "--url", f"https://{hostname}:{port}/",
                                                  "--accept-software-tpm", *tls])
            prometheus = work / f"attest-{time.monotonic_ns()}.prom"
            check = _builder(net, ["attest", hostname, "--channel", str(channel), "--url-template",
                                   f"https://{{host}}:{port}/", "--json", "--prometheus", str(prometheus), *tls])
            try:
                check["verdicts"] = json.loads(check["stdout"])
            except ValueError:
                check["verdicts"] = None
            check["prometheus"] = prometheus.read_text() if prometheus.exists() else ""
            answer["check"] = check
        finally:
            shutil.rmtree(hosts, ignore_errors=True)
        # last: the guest's signal that the host is done
        answer["done"] = netprobe.curl(net, f"https://{net.guest_address}:{question['https_port']}{question['done_path']}",
                                       netprobe.PROXY_TIMEOUT_S)
        return answer

    return attest


def verdict_of(run: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The attest question's answer in a QEMU run (builder.qemu's "asked"), and its one verdict."""
    answers = [q["answer"] for q in run.get("asked", []) if q["name"] == "attest"]
    assert answers, f"the guest asked no attest question: {[q['name'] for q in run.get('asked', [])]}"
    answer = answers[-1]
    verdicts = answer["check"]["verdicts"]
    assert isinstance(verdicts, list) and len(verdicts) == 1, answer["check"]
    return answer, verdicts[0]

