# SPDX-License-Identifier: MIT
"""Extended QEMU scenario (make test-extended GROUPS=bmc): a blank server flashed through its BMC alone.

    rig     a libvirt QEMU machine (OVMF's Secure Boot firmware in setup mode, a software TPM, one
            blank 16 GiB disk of serial TARGET-0001, no medium, powered off) behind sushy-tools'
            emulator with its libvirt driver, HTTPS and an account (testkit/libvirt_rig.py says
            where the emulator is not a BMC and what the rig does about it); the host's ISO on an
            HTTPS media server; the demo's weights mirror
    flash   `python3 -m builder flash --bmc FLEET` (the CLI, as an operator runs it): the BMC
            downloads the ISO and attaches it as the machine's CD, powers it on; the installer
            installs from the ISO's plan, sends its report to the run's collector (the CA the plan
            names), enrolls the Secure Boot keys and reboots into the appliance, which comes up
            sealed and answers on its proxy as the plan's host; the medium is ejected
    again   the same command with the same plan: already installed, nothing asked of the BMC
            but a login, nothing written

The machine's boot check (demo images) reports on its second serial port and leaves it running.
"""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance import config, paths
from builder import build, installer_media, installer_uki, qemu, release, sign_plan, weights_mirror
from testkit import bmc_rig, libvirt_rig
from testkit.standin import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.extended]

NAME = "gpu-11"
PROXY_NAME = "gpu-11.example.net"
SERIAL = "TARGET-0001"
GUEST_SEES_HOST = "10.0.2.2"  # QEMU's user networking
INSTALL_TIMEOUT_S = 2400


def _flash(argv: list[str], log: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "builder", "flash", *argv], cwd=ROOT, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S + 600, check=False)
    log.write_text(proc.stdout + proc.stderr)
    return proc


def _through_proxy(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """METHOD PATH on the appliance's proxy (through QEMU's forward), TLS for its name, not verified
    here (flash checked its certificate's name)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=60) as raw, ctx.wrap_socket(raw, server_hostname=PROXY_NAME) as tls:
        head = (f"{method} {path} HTTP/1.1\r\nHost: {PROXY_NAME}\r\nConnection: close\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        tls.sendall(head + body)
        data = b""
        while chunk := tls.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _boot_report(machine: libvirt_rig.Machine, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reports = [r for r in qemu.parse_reports(machine.report_log + machine.console) if "status" in r]
        if reports:
            return reports[-1]
        time.sleep(10)
    raise AssertionError(f"no boot check report within {timeout:.0f} s; console:\n{machine.console[-4000:]}")


@pytest.fixture(scope="module")
def flash_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    lacks = libvirt_rig.missing()
    if lacks:
        pytest.fail("this host lacks " + ", ".join(lacks) + ": run `make setup`")
    work = tmp_path_factory.mktemp("bmc")
    demo = config.load(ROOT / "appliance.toml", "demo")
    result = build.build(demo, output=work / "build")
    uki = installer_uki.build_uki(demo, output=work / "installer" / installer_uki.UKI_NAME)
    key = build.signing_key_for(demo, None)

    # the run's collector: its certificate for the address the guest sees the host at, from a CA the plan names
    collector_ca = bmc_rig.make_ca(work, "collector-ca")
    report_crt, report_key = collector_ca.server(work, "collector", ips=(GUEST_SEES_HOST, "127.0.0.1"))
    report_key.chmod(0o600)
    report_port = free_port()
    # the operator's recovery key pair: the installer seals /var's recovery key to its public half
    keygen = subprocess.run([sys.executable, "-m", "builder", "recovery-key", "new", "--out", str(work / "recovery")], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    plan_toml = work / f"{NAME}.toml"
    plan_toml.write_text(f'hostname = "{NAME}"\n[proxy]\nhostname = "{PROXY_NAME}"\n[target]\nserial = "{SERIAL}"\n'
                         f'[report]\nurl = "https://{GUEST_SEES_HOST}:{report_port}/"\nca = """{collector_ca.pem.read_text()}"""\n'
                         + keygen.stdout.strip() + "\n")
    plan = work / "hosts" / NAME
    sign_plan.write(plan_toml, key, plan, demo)
    bundle = work / "bundle"
    release.make_bundle(demo, result.disk_image.parent, bundle, key, None, None, with_install_image=True)
    iso = installer_media.make(result.disk_image.parent, demo.appliance.version, uki, plan, work / "media", ["iso"], bundle)["iso"]

    proxy_port = free_port()
    with weights_mirror.demo() as (weights_url, weights_ca), libvirt_rig.server_behind_bmc(
            work / "rig", NAME, SERIAL, plan, iso, proxy_port,
            {paths.MODEL_SOURCE_CREDENTIAL: weights_url, paths.MODEL_SOURCE_CA_CREDENTIAL: weights_ca,
             # the installer's summary on the serial console too, for the failure's explanation
             "systemd.unit-dropin.appliance-installer.service":
                 "[Service]\nStandardOutput=journal+console\nStandardError=journal+console\n"}) as server:
        argv = ["--bmc", str(server.fleet), "--media-url", server.media_url, "--media-ca", str(server.ca),
                "--output", str(work / "flash"), "--poll-interval", "10", "--install-timeout", str(INSTALL_TIMEOUT_S),
                "--report-listen", f"127.0.0.1:{report_port}", "--report-cert", str(report_crt), "--report-key", str(report_key)]
        first = _flash(argv, work / "flash-first.log")
        ok = first.returncode == 0
        state_after_first = (work / "flash" / "state" / f"{NAME}.json").read_bytes() if ok else b""
        report = _boot_report(server.machine, 1800) if ok else {}
        opened = subprocess.run([sys.executable, "-m", "builder", "recovery-key", "open", "--key", str(work / "recovery" / "recovery.key"),
                                 str(work / "flash" / "reports" / f"{NAME}.json")], cwd=ROOT, capture_output=True, text=True, check=False)
        served = _through_proxy(proxy_port, "POST", "/v1/completions",
                                json.dumps({"model": "standin/tiny-demo", "prompt": "Hello", "max_tokens": 8}).encode()) \
            if ok else (0, b"")
        before = server.emulator_log.read_text()
        second = _flash(argv, work / "flash-second.log")
        yield {"first": first, "second": second, "report": report, "served": served, "machine": server.machine, "work": work,
               "opened": opened,
               "state_after_first": state_after_first, "second_requests": server.emulator_log.read_text()[len(before):],
               "running": server.machine.running()}


def _explain(run: dict[str, Any]) -> str:
    machine: libvirt_rig.Machine = run["machine"]
    return (run["first"].stdout + run["first"].stderr)[-4000:] + "\n--- console\n" + machine.console[-4000:]


def test_a_blank_machine_is_flashed_through_its_bmc_alone(flash_run: dict[str, Any]) -> None:
    first = flash_run["first"]
    assert first.returncode == 0, _explain(flash_run)
    out = first.stdout
    for step in ("checking the system", "inserting the medium", "power-cycling", "waiting for the appliance", "ejecting the medium"):
        assert f"{NAME}: {step}" in out, out
    assert re.search(rf"{NAME}\s+installed\s", out), out
    state = json.loads(flash_run["state_after_first"])
    # installed once its proxy answers as the plan's host: 503 while the engine still starts (it serves below)
    assert state["status"] == "installed" and state["proxy"]["health"] in (200, 503) and PROXY_NAME in state["proxy"]["names"], state


def test_the_installers_report_came_back_over_the_plans_channel(flash_run: dict[str, Any]) -> None:
    assert flash_run["first"].returncode == 0, _explain(flash_run)
    stored = json.loads((flash_run["work"] / "flash" / "reports" / f"{NAME}.json").read_text())
    assert stored["host"] == PROXY_NAME or stored["host"] == NAME, stored
    assert stored["disk"]["serial"] == SERIAL and stored["version"] == "1.0.0", stored
    assert "RECOVERY" not in stored["summary"], stored["summary"]
    # the summary line says what the installer wrote, from its report
    assert SERIAL in flash_run["first"].stdout and "the installer's own summary is on its console only" not in flash_run["first"].stdout


def test_the_recovery_key_sealed_to_the_operator_is_the_one_the_console_showed(flash_run: dict[str, Any]) -> None:
    assert flash_run["first"].returncode == 0, _explain(flash_run)
    shown = re.findall(r" RECOVERY    (\S+)", flash_run["machine"].console)  # the installer's summary, on the serial console too
    opened = flash_run["opened"]
    assert opened.returncode == 0, opened.stderr
    assert shown and opened.stdout.strip() == shown[-1], (opened.stdout, shown)
    stored = (flash_run["work"] / "flash" / "reports" / f"{NAME}.json").read_text()
    assert shown[-1] not in stored  # sealed, never in the clear


def test_the_flashed_appliance_is_sealed_and_serves_through_its_proxy(flash_run: dict[str, Any]) -> None:
    assert flash_run["first"].returncode == 0, _explain(flash_run)
    report = flash_run["report"]
    sealed = report["status"]["parts"]["sealed"]
    assert (sealed.get("var_encrypted"), sealed.get("var_sealed")) == (True, True), sealed
    assert report["status"]["parts"]["host"]["settings"]["hostname"] == NAME, report["status"]["parts"]["host"]
    status, body = flash_run["served"]
    assert status == 200 and json.loads(body)["choices"], (status, body[:500])


def test_a_second_run_reports_already_installed_and_writes_nothing(flash_run: dict[str, Any]) -> None:
    second = flash_run["second"]
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"{NAME}: already installed with this plan" in second.stdout, second.stdout
    state = (flash_run["work"] / "flash" / "state" / f"{NAME}.json").read_bytes()
    assert state == flash_run["state_after_first"]
    changes = [line for line in flash_run["second_requests"].splitlines() if re.search(r"(POST|PATCH|PUT|DELETE) /redfish", line)
               and "SessionService/Sessions" not in line]
    assert changes == [], changes
    assert flash_run["running"]


def test_no_bmc_password_in_the_runs_logs(flash_run: dict[str, Any]) -> None:
    work: Path = flash_run["work"]
    for path in [*(work / "flash").rglob("*"), work / "flash-first.log", work / "flash-second.log"]:
        if path.is_file():
            assert bmc_rig.PASSWORD not in path.read_text(errors="replace"), path
    assert not os.path.exists(work / "flash" / "credentials")
