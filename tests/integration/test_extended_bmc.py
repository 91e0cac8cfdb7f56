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

import http.server
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance import config
from builder import build, installer_media, installer_uki, qemu, release, sign_plan, weights_mirror
from builder.https_server import HTTPSServer
from testkit import bmc_rig, libvirt_rig
from testkit.standin import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration, pytest.mark.extended]

NAME = "gpu-11"
PROXY_NAME = "gpu-11.example.net"
SERIAL = "TARGET-0001"
GUEST_SEES_HOST = "10.0.2.2"  # QEMU's user networking
INSTALL_TIMEOUT_S = 2400


def _media_server(root: Path, crt: Path, key: Path) -> HTTPSServer:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *args: Any) -> None:
            pass

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, key)
    server = HTTPSServer(("127.0.0.1", 0), Quiet, ctx)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


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
        reports = [r for r in qemu.parse_reports(machine.report_log) if "status" in r]
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

    ca = bmc_rig.make_ca(work, "test-ca")
    bmc_crt, bmc_key = ca.server(work, "bmc", dns=("localhost",), ips=("127.0.0.1",))
    media_crt, media_key = ca.server(work, "media", dns=("localhost",), ips=("127.0.0.1",))
    report_crt, report_key = ca.server(work, "collector", ips=(GUEST_SEES_HOST, "127.0.0.1"))
    report_key.chmod(0o600)
    report_port = free_port()

    plan_toml = work / f"{NAME}.toml"
    plan_toml.write_text(f'hostname = "{NAME}"\n[proxy]\nhostname = "{PROXY_NAME}"\n[target]\nserial = "{SERIAL}"\n'
                         f'[report]\nurl = "https://{GUEST_SEES_HOST}:{report_port}/"\nca = """{ca.pem.read_text()}"""\n')
    plan = work / "hosts" / NAME
    sign_plan.write(plan_toml, key, plan, demo)
    bundle = work / "bundle"
    release.make_bundle(demo, result.disk_image.parent, bundle, key, None, None, with_install_image=True)
    iso = installer_media.make(result.disk_image.parent, demo.appliance.version, uki, plan, work / "media-out", ["iso"], bundle)["iso"]
    (work / "www" / NAME).mkdir(parents=True)
    shutil.move(iso, work / "www" / NAME / "installer.iso")
    shutil.rmtree(work / "media-out")

    proxy_port = free_port()
    bmc_port = free_port()
    htpasswd = work / "htpasswd"
    import bcrypt

    htpasswd.write_text(f"{bmc_rig.USER}:{bcrypt.hashpw(bmc_rig.PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()}\n")
    credentials = bmc_rig.write_credentials(work / "bmc-credentials")

    with weights_mirror.demo() as (weights_url, weights_ca), libvirt_rig.daemon(work), \
            libvirt_rig.media_pool(work / "pool") as pool, \
            libvirt_rig.machine(NAME, work / "machine", SERIAL, 16, ((proxy_port, 443),),
                                {qemu.MODEL_SOURCE: weights_url, qemu.MODEL_SOURCE_CA: weights_ca}) as machine:
        media = _media_server(work / "www", media_crt, media_key)
        try:
            emulator_conf = libvirt_rig.emulator_config(work, bmc_port, bmc_crt, bmc_key, htpasswd, machine.uuid, pool)
            with libvirt_rig.emulator(work, emulator_conf, bmc_port):
                fleet = bmc_rig.write_fleet(work / "fleet.toml", [{
                    "name": NAME, "plan": str(plan), "bmc": f"https://127.0.0.1:{bmc_port}", "credentials": str(credentials),
                    "bmc_ca": str(ca.pem), "system": f"/redfish/v1/Systems/{machine.uuid}",
                    "address": f"127.0.0.1:{proxy_port}", "secure_boot": "as-is"}])
                argv = ["--bmc", str(fleet), "--media-url", f"https://127.0.0.1:{media.server_address[1]}/{{name}}/installer.iso",
                        "--media-ca", str(ca.pem), "--output", str(work / "flash"), "--poll-interval", "10",
                        "--install-timeout", str(INSTALL_TIMEOUT_S), "--report-listen", f"127.0.0.1:{report_port}",
                        "--report-cert", str(report_crt), "--report-key", str(report_key)]
                first = _flash(argv, work / "flash-first.log")
                state_after_first = (work / "flash" / "state" / f"{NAME}.json").read_bytes() if first.returncode == 0 else b""
                report = _boot_report(machine, 1800) if first.returncode == 0 else {}
                served = _through_proxy(proxy_port, "POST", "/v1/completions",
                                        json.dumps({"model": "standin/tiny-demo", "prompt": "Hello", "max_tokens": 8}).encode()) \
                    if first.returncode == 0 else (0, b"")
                emulator_log_before = (work / "libvirt-emulator.log").read_text()
                second = _flash(argv, work / "flash-second.log")
                emulator_log_after = (work / "libvirt-emulator.log").read_text()
                yield {"first": first, "second": second, "report": report, "served": served, "machine": machine, "work": work,
                       "state_after_first": state_after_first,
                       "second_requests": emulator_log_after[len(emulator_log_before):], "running": machine.running()}
        finally:
            media.shutdown()
            media.server_close()


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
    assert state["status"] == "installed" and state["proxy"]["health"] == 200 and PROXY_NAME in state["proxy"]["names"], state


def test_the_installers_report_came_back_over_the_plans_channel(flash_run: dict[str, Any]) -> None:
    assert flash_run["first"].returncode == 0, _explain(flash_run)
    stored = json.loads((flash_run["work"] / "flash" / "reports" / f"{NAME}.json").read_text())
    assert stored["host"] == PROXY_NAME or stored["host"] == NAME, stored
    assert stored["disk"]["serial"] == SERIAL and stored["version"] == "1.0.0", stored
    assert "RECOVERY" not in stored["summary"], stored["summary"]
    # the summary line says what the installer wrote, from its report
    assert SERIAL in flash_run["first"].stdout and "the installer's own summary is on its console only" not in flash_run["first"].stdout


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
