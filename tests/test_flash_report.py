# SPDX-License-Identifier: MIT
"""The installer's report and the collector of `builder flash --bmc`: installer/report.py's send()
against builder/flash_report.py's Collector, both for real over TLS in this process (a test CA, a
collector certificate for 127.0.0.1): sent only to a server the plan's CA vouches for, taken only for
a host of the fleet with its plan's host name, the first kept, every other request refused with its
status before its body is read where the status says so."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import plan_values
import pytest

from appliance import recovery_seal
from appliance.errors import UserError
from appliance.signed import install_plan
from builder import flash_bmc, flash_report
from installer import report
from testkit.bmc_rig import make_ca

PLAN = b'{"hostname":"gpu-07"}'
SHA = hashlib.sha256(PLAN).hexdigest()
HOST = "gpu-07.example.net"


def report_doc(**change: Any) -> dict[str, Any]:
    """An installer's report as installer/report.py's document() makes it."""
    doc: dict[str, Any] = {
        "format": 1, "host": HOST, "plan_sha256": SHA, "version": "1.4.0", "reinstalled": False,
        "disk": {"path": "/dev/nvme1n1", "model": "SAMSUNG MZQL23T8HCLS", "serial": "S64ANS0T512345", "size_bytes": 3840755982336},
        "usr_hash": "a" * 64, "secure_boot": "secure boot keys enrolled (PK, KEK, db): the next boot enforces",
        "attestation": ["TPM EK      sha256:" + "e" * 64 + " (no EK certificate in the TPM)", "TPM AK      000b" + "ab" * 32],
        "steps": ["/usr /dev/nvme1n1p2 verified"], "seconds": 312, "summary": "=====\n Appliance 1.4.0 installed\n=====",
    }
    doc.update(change)
    return doc


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ca = make_ca(tmp, "report-ca")
        self.cert, self.key = self.ca.server(tmp, "collector", ips=("127.0.0.1",))
        self.key.chmod(0o600)
        self.lines: list[str] = []
        self.output = tmp / "out"

    def collector(self, **kw: Any) -> flash_report.Collector:
        return flash_report.Collector(("127.0.0.1", 0), self.cert, self.key, {SHA: "gpu-07"}, self.output, self.lines.append,
                                      hosts={"gpu-07": HOST}, **kw)

    def settings(self, port: int, ca: Path | None = None) -> install_plan.Report:
        return install_plan.Report(url=f"https://127.0.0.1:{port}/", ca=(ca or self.ca.pem).read_text())


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


@pytest.fixture
def running(rig: Rig) -> Iterator[tuple[Rig, flash_report.Collector]]:
    with rig.collector() as c:
        yield rig, c


def _send(settings: install_plan.Report, doc: dict[str, Any], **kw: Any) -> str:
    pauses: list[float] = []
    kw.setdefault("tries", 2)
    line = report.send(settings, doc, sleep=pauses.append, wait_online=lambda s: None, timeout=5, **kw)
    assert "\n" not in line
    return line


def test_a_report_reaches_the_collector_and_the_first_one_is_kept(running: tuple[Rig, flash_report.Collector]) -> None:
    rig, collector = running
    settings = rig.settings(collector.port)
    assert _send(settings, report_doc()) == f"report sent to {settings.url} (HTTP 204)"
    stored = flash_report.report_path(rig.output, "gpu-07")
    assert stored.stat().st_mode & 0o777 == 0o600
    assert json.loads(stored.read_text()) == report_doc() == collector.report_for("gpu-07")
    assert collector.reports() == {"gpu-07": report_doc()}
    assert rig.lines == ["gpu-07: the installer reported: appliance 1.4.0 on /dev/nvme1n1 (serial S64ANS0T512345)"]
    # the same again (an installer that retried after a lost answer): as the first
    assert _send(settings, report_doc()) == f"report sent to {settings.url} (HTTP 204)"
    # another one: refused, the first kept, one line
    line = _send(settings, report_doc(disk={**report_doc()["disk"], "serial": "OTHER"}))
    assert line == f"report NOT sent to {settings.url}: the collector answered HTTP 409; the summary above is the only copy"
    assert json.loads(stored.read_text()) == report_doc()
    assert rig.lines[-1].startswith("gpu-07: a different report from 127.0.0.1 refused: the first one is kept")


SEALED = recovery_seal.seal(plan_values.RECIPIENT_PEM, b"recovery key", recovery_seal.report_context(HOST, SHA))


def test_a_report_with_its_sealed_recovery_key_is_kept_with_it(running: tuple[Rig, flash_report.Collector]) -> None:
    rig, collector = running
    doc = report_doc(recovery_key_sealed=SEALED)
    assert flash_report.problem(doc) == ""
    assert _send(rig.settings(collector.port), doc).startswith("report sent")
    stored = flash_report.report_path(rig.output, "gpu-07")
    assert json.loads(stored.read_text()) == doc and stored.stat().st_mode & 0o777 == 0o600
    kept = flash_report.read_report(rig.output, "gpu-07")
    assert kept is not None
    context = recovery_seal.report_context(kept["host"], kept["plan_sha256"])
    assert recovery_seal.open_sealed(plan_values.RECIPIENT_KEY, kept["recovery_key_sealed"], context) == b"recovery key"


def test_a_collector_on_an_ipv6_address_takes_the_report(rig: Rig) -> None:
    """--report-listen [2001:db8::5]:8443, as a rack on IPv6 names it in the plans' report.url."""
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    cert, key = rig.ca.server(rig.tmp, "collector6", ips=("::1",))
    key.chmod(0o600)
    with flash_report.Collector(("::1", 0), cert, key, {SHA: "gpu-07"}, rig.output, rig.lines.append,
                                hosts={"gpu-07": HOST}) as c:
        settings = install_plan.Report(url=f"https://[::1]:{c.port}/", ca=rig.ca.pem.read_text())
        assert _send(settings, report_doc()) == f"report sent to {settings.url} (HTTP 204)"
        assert c.report_for("gpu-07") == report_doc()


def test_a_stopped_runs_report_is_still_the_first(rig: Rig) -> None:
    with rig.collector() as c:
        assert _send(rig.settings(c.port), report_doc()).startswith("report sent")
    with rig.collector() as c:
        assert c.report_for("gpu-07") == report_doc()
        assert "HTTP 409" in _send(rig.settings(c.port), report_doc(seconds=1))


def test_the_installer_sends_only_to_the_server_its_plan_names(running: tuple[Rig, flash_report.Collector], tmp_path: Path) -> None:
    """The plan's CA is the only trust: another CA (or the system's) gets nothing, nor a server
    whose certificate does not name the URL's host."""
    rig, collector = running
    other = make_ca(tmp_path, "another-ca")
    line = _send(rig.settings(collector.port, other.pem), report_doc())
    assert line.startswith(f"report NOT sent to https://127.0.0.1:{collector.port}/: its certificate is not the plan's report.ca's")
    assert line.endswith("; the summary above is the only copy")
    named = install_plan.Report(url=f"https://localhost:{collector.port}/", ca=rig.ca.pem.read_text())  # the cert names 127.0.0.1
    assert "not the plan's report.ca's" in _send(named, report_doc())
    assert collector.reports() == {} and not flash_report.report_path(rig.output, "gpu-07").exists()


def test_send_never_raises_and_tries_again(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    pauses: list[float] = []
    waited: list[int] = []
    rig = Rig(tmp_path)
    line = report.send(rig.settings(port), report_doc(), sleep=pauses.append, wait_online=waited.append, tries=3, timeout=2)
    assert line.startswith(f"report NOT sent to https://127.0.0.1:{port}/: ") and "Connection refused" in line
    assert pauses == [report.PAUSE_S] * 2 and waited == [report.WAIT_ONLINE_S]

    def offline(timeout: int) -> None:
        raise UserError("no network", hint="")
    bad_ca = install_plan.Report(url=f"https://127.0.0.1:{port}/", ca="-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    assert report.send(bad_ca, report_doc(), wait_online=offline).startswith("report NOT sent")
    assert "more than the collector reads" in report.send(rig.settings(port), report_doc(summary="x" * report.MAX_REPORT_BYTES))


def _request(port: int, ca: Path, method: str, path: str = "/", body: bytes | None = None,
             headers: dict[str, str] | None = None) -> int:
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ssl.create_default_context(cafile=str(ca)), timeout=5)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for k, v in (headers or {}).items():
            conn.putheader(k, v)
        conn.endheaders(body)
        return conn.getresponse().status
    finally:
        conn.close()


def _post(port: int, ca: Path, doc: Any) -> int:
    body = json.dumps(doc).encode()
    return _request(port, ca, "POST", body=body, headers={"Content-Length": str(len(body)), "Content-Type": "application/json"})


def test_the_collector_refuses_every_other_request(running: tuple[Rig, flash_report.Collector]) -> None:
    rig, collector = running
    port, ca = collector.port, rig.ca.pem
    assert _request(port, ca, "GET") == 405
    assert _request(port, ca, "PUT", headers={"Content-Length": "0"}) == 405
    assert _request(port, ca, "POST", "/reports", body=b"{}", headers={"Content-Length": "2"}) == 404
    assert _request(port, ca, "POST") == 411
    # answered from the header alone: the body is never sent, nor read
    assert _request(port, ca, "POST", headers={"Content-Length": str(flash_report.MAX_REPORT_BYTES + 1)}) == 413
    assert _request(port, ca, "POST", body=b"[1", headers={"Content-Length": "2"}) == 400
    assert _post(port, ca, [report_doc()]) == 400
    for bad in (report_doc(format=2), report_doc(format=True), report_doc(plan_sha256="A" * 64), report_doc(extra=1),
                report_doc(disk={"path": "/dev/sda"}), report_doc(seconds=-1), report_doc(version="1.4.0\x1b[2J"),
                report_doc(steps=["ok", "\x85"]), report_doc(summary="ok\nthen\x07"), report_doc(attestation="TPM"),
                report_doc(secure_boot="x" * (flash_report.MAX_TEXT + 1)), report_doc(reinstalled="no"),
                *(report_doc(recovery_key_sealed=sealed) for sealed in (
                    "sealed", {**SEALED, "nonce": "!"}, {**SEALED, "ciphertext": "A" * 2000}, {**SEALED, "scheme": "rsa"},
                    {**SEALED, "extra": ""}, {k: v for k, v in SEALED.items() if k != "ephemeral"}))):
        assert flash_report.problem(bad), bad
        assert _post(port, ca, bad) == 400
    assert collector.reports() == {} and rig.lines == []
    # a plan of no host of the fleet, or not its plan's host name: refused, with a line
    assert _post(port, ca, report_doc(plan_sha256="0" * 64)) == 404
    assert rig.lines == ["report from 127.0.0.1 for no host of this fleet"]
    assert _post(port, ca, report_doc(host="gpu-08.example.net")) == 400
    assert rig.lines[-1] == ("gpu-07: a report from 127.0.0.1 for its plan names host 'gpu-08.example.net', "
                             "not 'gpu-07.example.net': refused")
    assert collector.reports() == {} and not (rig.output / "reports").exists()
    assert _post(port, ca, report_doc()) == 204


def test_the_collectors_key_is_a_secret_of_ours(rig: Rig) -> None:
    rig.key.chmod(0o644)
    with pytest.raises(UserError, match="can be read by others"), rig.collector():
        pass
    rig.key.chmod(0o600)
    link = rig.tmp / "key-link"
    link.symlink_to(rig.key)
    with pytest.raises(UserError, match="--report-key"), \
            flash_report.Collector(("127.0.0.1", 0), rig.cert, link, {}, rig.output, rig.lines.append):
        pass
    with pytest.raises(UserError, match="not a PEM certificate and its key"), \
            flash_report.Collector(("127.0.0.1", 0), rig.ca.pem, rig.key, {}, rig.output, rig.lines.append):
        pass


def test_the_report_options_go_together() -> None:
    parser = flash_bmc.argparse.ArgumentParser()
    flash_bmc.add_arguments(parser)
    assert flash_bmc.report_options(parser.parse_args([])) == {}
    with pytest.raises(UserError, match="go together"):
        flash_bmc.report_options(parser.parse_args(["--report-listen", "10.0.0.5:8443", "--report-cert", "c.pem"]))
    args = parser.parse_args(["--report-listen", "[2001:db8::5]:8443", "--report-cert", "c.pem", "--report-key", "k.pem"])
    assert flash_bmc.report_options(args) == {"report_listen": ("2001:db8::5", 8443), "report_cert": Path("c.pem"),
                                              "report_key": Path("k.pem")}
    assert flash_bmc.listen_address("0.0.0.0:8443") == ("0.0.0.0", 8443)
    for bad in ("10.0.0.5", "10.0.0.5:http", "2001:db8::5:8443", ":8443", "10.0.0.5:70000"):
        with pytest.raises(UserError, match="not HOST:PORT"):
            flash_bmc.listen_address(bad)
