# SPDX-License-Identifier: MIT
"""`builder flash --bmc`: the flash sequence against sushy-tools' emulator (fake driver, HTTPS, an
account), and every refusal against recorded Redfish responses (tests/fixtures/redfish/, as the
vendor-differences tests read them) answered by a fake that records what it was sent. The
emulator, the media server and the appliance's proxy (a local HTTPS server with a test CA that drops
its first connection: the host is down while it installs) are testkit/bmc_rig.py's, which the
benchmark shares. The BMC password is searched for in the children's command lines,
the logs, the progress lines and the state files."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import plan_values
import pytest

import installer.report
from appliance import recovery_seal
from appliance.errors import UserError
from appliance.signed import install_plan
from builder import flash_bmc, flash_report
from builder.flash_bmc import Answer, BmcError, Options
from testkit import bmc_rig
from testkit.bmc_rig import PASSWORD, SERIAL, USER, Appliance, Rig, make_ca, sign_plan, write_credentials, write_fleet
from tests.repository import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "redfish"
SYSTEM = "/redfish/v1/Systems/437XR1138R2"


# ------------------------------------------------------------------------------ unit: input and credentials


def test_credentials_file_must_be_private_and_not_a_link(tmp_path: Path) -> None:
    creds = write_credentials(tmp_path / "bmc", mode=0o644)
    with pytest.raises(UserError) as e:
        flash_bmc.read_credentials(creds, "gpu-07")
    assert "can be read by others" in e.value.message and PASSWORD not in e.value.message + e.value.hint
    creds.chmod(0o600)
    assert flash_bmc.read_credentials(creds, "gpu-07").password == PASSWORD
    assert PASSWORD not in repr(flash_bmc.read_credentials(creds, "gpu-07"))
    link = tmp_path / "link"
    link.symlink_to(creds)
    with pytest.raises(UserError) as e:
        flash_bmc.read_credentials(link, "gpu-07")
    assert PASSWORD not in e.value.message


def test_credentials_file_faults_never_show_its_text(tmp_path: Path) -> None:
    bad = tmp_path / "bmc"
    bad.write_text(f'username = "{USER}"\npassword = {PASSWORD}\n')  # not TOML: the decoder's message would quote it
    bad.chmod(0o600)
    with pytest.raises(UserError) as e:
        flash_bmc.read_credentials(bad, "gpu-07")
    assert PASSWORD not in e.value.message + e.value.hint
    bad.write_text(f'user = "{USER}"\npassword = "{PASSWORD}"\n')
    with pytest.raises(UserError) as e:
        flash_bmc.read_credentials(bad, "gpu-07")
    assert "exactly username and password" in e.value.message and PASSWORD not in e.value.message


def test_fleet_refusals_are_bad_input(tmp_path: Path) -> None:
    plan = sign_plan(tmp_path, "gpu-07")
    creds = write_credentials(tmp_path / "bmc")
    base = {"name": "gpu-07", "plan": str(plan), "bmc": "https://bmc.example.net", "credentials": str(creds)}
    for change, words in [({"bmc": "http://bmc.example.net"}, "not an https:// URL"),
                          ({"bmc": f"https://{USER}:{PASSWORD}@bmc.example.net"}, "without credentials"),
                          ({"password": PASSWORD}, "unknown key"),
                          ({"secure_boot": "off"}, "secure_boot"),
                          ({"plan": str(tmp_path / "none")}, "no signed plan")]:
        fleet = write_fleet(tmp_path / "fleet.toml", [{**base, **change}])
        with pytest.raises(UserError) as e:
            flash_bmc.prepare(fleet, "https://media.example.net/{name}.iso")
        assert words in e.value.message, (change, e.value.message)
        assert PASSWORD not in e.value.message + e.value.hint
    fleet = write_fleet(tmp_path / "fleet.toml", [base, base])
    with pytest.raises(UserError, match="listed twice"):
        flash_bmc.prepare(fleet, "https://media.example.net/{name}.iso")
    fleet = write_fleet(tmp_path / "fleet.toml", [base])
    with pytest.raises(UserError, match="no installer medium"):
        flash_bmc.prepare(fleet, "")
    [job] = flash_bmc.prepare(fleet, "https://media.example.net/{name}/installer.iso")
    assert job.media_url == "https://media.example.net/gpu-07/installer.iso"
    assert job.target.proxy_name == "gpu-07.example.net" and job.target.serial == SERIAL


def test_a_plan_without_a_proxy_name_is_refused_before_any_bmc(tmp_path: Path) -> None:
    # the proxy's certificate names proxy.hostname (the image's when the plan has none), never the host name
    plan = sign_plan(tmp_path, "gpu-07")
    doc = {"hostname": "gpu-07", "target": {"serial": SERIAL}}
    data, sig = install_plan.sign(install_plan.from_plain(doc, "gpu-07"), tmp_path / "keys" / "release.key")
    (plan / install_plan.PLAN_JSON).write_bytes(data)
    (plan / install_plan.PLAN_SIG).write_bytes(sig)
    with pytest.raises(UserError, match=r"names no proxy\.hostname") as e:
        flash_bmc.read_target(plan, "gpu-07")
    assert "set proxy.hostname" in e.value.hint


# ------------------------------------------------------------------------------ recorded responses


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


class Recorded:
    """A BMC answering recorded JSON by path; POST and PATCH recorded, and answered with FAIL[path] (a
    BmcError) when set. Actions change the documents as a BMC would (insert, eject, reset)."""

    def __init__(self, docs: dict[str, dict[str, Any]]) -> None:
        self.docs = copy.deepcopy(docs)
        self.sent: list[tuple[str, str, dict[str, Any]]] = []
        self.fail: dict[tuple[str, str], BmcError] = {}

    def get(self, path: str) -> dict[str, Any]:
        if ("GET", path) in self.fail:
            raise self.fail["GET", path]
        if path not in self.docs:
            raise BmcError(404, f"HTTP 404: {path} not found")
        return copy.deepcopy(self.docs[path])

    def _send(self, method: str, path: str, body: dict[str, Any]) -> None:
        self.sent.append((method, path, body))
        if (method, path) in self.fail:
            raise self.fail[method, path]
        if path.endswith("/Actions/VirtualMedia.InsertMedia"):
            slot = self.docs[path.split("/Actions/")[0]]
            slot.update(Image=body["Image"], ImageName=body["Image"].rsplit("/", 1)[-1], Inserted=True, ConnectedVia="URI")
        elif path.endswith("/Actions/VirtualMedia.EjectMedia"):
            self.docs[path.split("/Actions/")[0]].update(Image=None, ImageName=None, Inserted=False, ConnectedVia="NotConnected")

    def post(self, path: str, body: dict[str, Any]) -> None:
        self._send("POST", path, body)

    def patch(self, path: str, body: dict[str, Any]) -> None:
        self._send("PATCH", path, body)

    def close(self) -> None:
        pass


def rackmount() -> dict[str, dict[str, Any]]:
    """DMTF's public-rackmount1 mockup as recorded; a Systems collection naming its one system (the
    recording leaves it out) and its CD1 slot free (recorded in use by an applet; a free slot is
    DMTF's `Inserted` false with no image)."""
    docs = {d["@odata.id"]: d for d in (fixture(f"dmtf-rackmount1-{n}.json") for n in (
        "serviceroot", "manager", "system", "virtualmedia", "virtualmedia-cd1", "virtualmedia-floppy1", "secureboot",
        "secureboot-databases", "secureboot-db", "secureboot-db-certificates"))}
    docs["/redfish/v1/Systems"] = {"Members": [{"@odata.id": SYSTEM}]}
    docs[f"{SYSTEM}/VirtualMedia/CD1"].update(Image=None, ImageName=None, Inserted=False, ConnectedVia="NotConnected")
    # the mockup's drives are not recorded: its SimpleStorage link answers 404, which is "lists none"
    return docs


def sign_report_plan(tmp_path: Path, report: dict[str, str]) -> Path:
    """bmc_rig's plan for gpu-07 with REPORT as its [report], signed with the same key."""
    plan = sign_plan(tmp_path, "gpu-07")
    doc = {"hostname": "gpu-07", "proxy": {"hostname": "gpu-07.example.net"}, "target": {"serial": SERIAL}, "report": report}
    data, sig = install_plan.sign(install_plan.from_plain(doc, "gpu-07"), tmp_path / "keys" / "release.key")
    (plan / install_plan.PLAN_JSON).write_bytes(data)
    (plan / install_plan.PLAN_SIG).write_bytes(sig)
    return plan


def recorded_job(tmp_path: Path, report: dict[str, str] | None = None, **host: Any) -> flash_bmc.Job:
    plan = sign_report_plan(tmp_path, report) if report else sign_plan(tmp_path, "gpu-07")
    target = flash_bmc.read_target(plan, "gpu-07")
    h = flash_bmc.Host(name="gpu-07", plan_dir=plan, bmc="https://bmc.example.net", credentials=tmp_path / "bmc", **host)
    return flash_bmc.Job(h, target, "https://media.example.net/gpu-07/installer.iso", flash_bmc.Credentials(USER, PASSWORD))


def run_recorded(tmp_path: Path, bmc: Recorded, probe: Any = None, options: Options | None = None, report: dict[str, str] | None = None,
                 **host: Any) -> tuple[flash_bmc.Outcome, list[str]]:
    job = recorded_job(tmp_path, report, **host)
    lines: list[str] = []
    options = options or Options(output=tmp_path / "out", poll_interval=0, install_timeout=5)
    (tmp_path / "out").mkdir(exist_ok=True)
    answers = iter([None, Answer(200, True, ("gpu-07.example.net",))])
    outcome = flash_bmc.flash_host(job, options, lines.append, lambda h, c: bmc, probe or (lambda h, t: next(answers)))
    for line in lines:
        assert PASSWORD not in line
    return outcome, lines


def test_recorded_rackmount_whole_sequence(tmp_path: Path) -> None:
    bmc = Recorded(rackmount())
    outcome, lines = run_recorded(tmp_path, bmc)
    assert outcome.status == "installed", lines
    sent = [(m, p.removeprefix(SYSTEM), b) for m, p, b in bmc.sent]
    assert sent == [
        ("POST", "/SecureBoot/Actions/SecureBoot.ResetKeys", {"ResetKeysType": "DeletePK"}),  # UserMode, DeletePK offered
        ("PATCH", "/SecureBoot", {"SecureBootEnable": True}),  # recorded disabled
        ("POST", "/VirtualMedia/CD1/Actions/VirtualMedia.InsertMedia",
         {"Image": "https://media.example.net/gpu-07/installer.iso", "Inserted": True, "WriteProtected": True}),
        ("PATCH", "", {"Boot": {"BootSourceOverrideTarget": "Cd", "BootSourceOverrideEnabled": "Once"}}),
        ("POST", "/Actions/ComputerSystem.Reset", {"ResetType": "ForceRestart"}),  # recorded On
        ("POST", "/VirtualMedia/CD1/Actions/VirtualMedia.EjectMedia", {}),
    ]
    steps = [line.removeprefix("gpu-07: ") for line in lines]
    for a, b in zip(flash_bmc.STEPS, flash_bmc.STEPS[1:], strict=False):
        assert steps.index(a) < steps.index(b)
    state = json.loads((tmp_path / "out" / "state" / "gpu-07.json").read_text())
    assert state["status"] == "installed" and state["done"] == list(flash_bmc.STEPS)
    assert (tmp_path / "out" / "state" / "gpu-07.json").stat().st_mode & 0o077 == 0


def _line(outcome: flash_bmc.Outcome) -> str:
    assert outcome.status == "failed"
    assert "\n" not in outcome.line and PASSWORD not in outcome.line
    return outcome.line


def _bmc_error(message: str, status: int = 400) -> BmcError:
    """As sushy reports a refusal: its @Message.ExtendedInfo message (bmc_answer)."""
    error = Exception()
    error.status_code = status  # type: ignore[attr-defined]
    error.extended_info = [{"MessageId": "Base.1.8.ActionParameterNotSupported", "Message": message}]  # type: ignore[attr-defined]
    error.detail = "general error"  # type: ignore[attr-defined]
    return BmcError(status, flash_bmc.bmc_answer(error))


REFUSALS: list[tuple[str, Any, str, str]] = [
    ("login", None, flash_bmc.STEP_BMC, "could not log in"),
    ("power", lambda d: d[SYSTEM].update(PowerState="PoweringOn"), flash_bmc.STEP_SYSTEM, "power state is PoweringOn"),
    ("legacy", lambda d: d[SYSTEM]["Boot"].update(BootSourceOverrideMode="Legacy"), flash_bmc.STEP_SYSTEM, "Legacy mode, not UEFI"),
    ("no secure boot", lambda d: d[SYSTEM].pop("SecureBoot"), flash_bmc.STEP_SECURE_BOOT, "no SecureBoot resource"),
    ("no reset keys", lambda d: d[f"{SYSTEM}/SecureBoot"].update(Actions={}), flash_bmc.STEP_SECURE_BOOT,
     "offers no way into setup mode (ResetKeys: no ResetKeys action)"),
    ("reset keys refused", "POST:/SecureBoot/Actions/SecureBoot.ResetKeys", flash_bmc.STEP_SECURE_BOOT,
     "the BMC answered: HTTP 400: The action parameter is not supported"),
    ("slot in use", lambda d: d[f"{SYSTEM}/VirtualMedia/CD1"].update(fixture("dmtf-rackmount1-virtualmedia-cd1.json")),
     flash_bmc.STEP_INSERT, "no free CD/DVD virtual media slot"),
    ("no virtual media", lambda d: d[SYSTEM].pop("VirtualMedia"), flash_bmc.STEP_INSERT, "no VirtualMedia collection"),
    ("insert refused", "POST:/VirtualMedia/CD1/Actions/VirtualMedia.InsertMedia", flash_bmc.STEP_INSERT,
     "refused to insert https://media.example.net/gpu-07/installer.iso; the BMC answered: HTTP 400"),
    ("no cd boot", lambda d: d[SYSTEM]["Boot"].update({"BootSourceOverrideTarget@Redfish.AllowableValues": ["Pxe", "Hdd"]}),
     flash_bmc.STEP_BOOT, "does not offer boot target Cd"),
    ("boot refused", "PATCH:", flash_bmc.STEP_BOOT, "refused the one-time boot"),
    ("reset not offered", lambda d: d[SYSTEM]["Actions"]["#ComputerSystem.Reset"].update(
        {"ResetType@Redfish.AllowableValues": ["On", "ForceOff"]}), flash_bmc.STEP_RESET, "offers none of ForceRestart, PowerCycle"),
    ("reset refused", "POST:/Actions/ComputerSystem.Reset", flash_bmc.STEP_RESET, "refused the reset (ForceRestart)"),
    ("eject refused", "POST:/VirtualMedia/CD1/Actions/VirtualMedia.EjectMedia", flash_bmc.STEP_EJECT, "refused to eject"),
]


@pytest.mark.parametrize(("case", "change", "step", "words"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_every_refusal_is_one_line_with_host_step_answer_and_hint(tmp_path: Path, case: str, change: Any, step: str,
                                                                  words: str) -> None:
    docs = rackmount()
    bmc = Recorded(docs)
    if callable(change):
        change(bmc.docs)
    elif isinstance(change, str):
        method, path = change.split(":", 1)
        bmc.fail[method, SYSTEM + path] = _bmc_error("The action parameter is not supported")
    if case == "login":
        job = recorded_job(tmp_path)
        (tmp_path / "out").mkdir()
        lines: list[str] = []

        def refuse(h: Any, c: Any) -> Recorded:
            raise _bmc_error("Invalid username or password", 401)
        outcome = flash_bmc.flash_host(job, Options(output=tmp_path / "out"), lines.append, refuse, lambda h, t: None)
    else:
        outcome, lines = run_recorded(tmp_path, bmc)
    line = _line(outcome)
    assert line.startswith(f"gpu-07: refused at {step}: "), line
    assert words in line, line
    assert "; do: " in line
    state = json.loads((tmp_path / "out" / "state" / "gpu-07.json").read_text())
    assert state["status"] == "failed" and state["failed_step"] == step


def test_secure_boot_setup_mode_and_db_enrollment(tmp_path: Path) -> None:
    docs = rackmount()
    docs[f"{SYSTEM}/SecureBoot"].update(SecureBootMode="SetupMode")
    bmc = Recorded(docs)
    outcome, lines = run_recorded(tmp_path / "a", bmc) if (tmp_path / "a").mkdir() is None else (None, [])
    assert outcome is not None and outcome.status == "installed"
    assert not any("SecureBoot" in p for _, p, _ in bmc.sent)
    assert "gpu-07: Secure Boot in setup mode: the installer enrolls the appliance's keys" in lines
    # enforcing, no ResetKeys, a db that takes certificates: the appliance's certificate goes there
    docs = rackmount()
    docs[f"{SYSTEM}/SecureBoot"].update(Actions={}, SecureBootEnable=True)
    bmc = Recorded(docs)
    (tmp_path / "b").mkdir()
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    outcome, lines = run_recorded(tmp_path / "b", bmc, options=Options(output=tmp_path / "b" / "out", poll_interval=0,
                                                                         secure_boot_cert=pem))
    assert outcome.status == "installed", lines
    assert ("POST", f"{SYSTEM}/SecureBoot/SecureBootDatabases/db/Certificates",
            {"CertificateString": pem, "CertificateType": "PEM"}) in bmc.sent


def test_wait_needs_the_host_down_first_and_the_plan_host_answering(tmp_path: Path) -> None:
    bmc = Recorded(rackmount())
    up = Answer(200, True, ("gpu-07.example.net",))
    answers = iter([up, up, None, up])  # an appliance already running answers before the reset takes hold
    outcome, _ = run_recorded(tmp_path, bmc, probe=lambda h, t: next(answers))
    assert outcome.status == "installed"
    assert next(answers, "spent") == "spent"
    bmc = Recorded(rackmount())
    (tmp_path / "b").mkdir()
    wrong = iter([None, Answer(0, False, (), "its certificate is not chained to ca.pem for gpu-07.example.net")])
    outcome, _ = run_recorded(tmp_path / "b", bmc, probe=lambda h, t: next(wrong))
    assert "refused at waiting for the appliance: the appliance answers, but its certificate is not chained" in _line(outcome)
    bmc = Recorded(rackmount())
    (tmp_path / "c").mkdir()
    outcome, _ = run_recorded(tmp_path / "c", bmc, probe=lambda h, t: None,
                              options=Options(output=tmp_path / "c" / "out", poll_interval=0.01, install_timeout=0.05))
    assert "did not answer on its proxy as gpu-07.example.net" in _line(outcome)
    # run again: it goes on waiting, and nothing is sent to the BMC until the appliance answers
    before = len(bmc.sent)
    outcome, lines = run_recorded(tmp_path / "c", bmc, options=Options(output=tmp_path / "c" / "out", poll_interval=0))
    assert outcome.status == "installed" and "gpu-07: resuming after power-cycling" in lines
    assert [p.rsplit("/", 1)[-1] for _, p, _ in bmc.sent[before:]] == ["VirtualMedia.EjectMedia"]


EFI_URL = "https://media.example.net/installer_1.4.0.efi"


def http_bootable(docs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """DMTF's rackmount System allowing UefiHttp with a URL: UefiHttp among its allowable targets (as
    DMTF's public-catfish and public-telemetry mockups list it) and Boot.HttpBootUri (ComputerSystem
    1.9 and later; null until set). No recording shows it (tests/fixtures/redfish/README.md)."""
    boot = docs[SYSTEM]["Boot"]
    boot["BootSourceOverrideTarget@Redfish.AllowableValues"].append("UefiHttp")
    boot["HttpBootUri"] = None
    return docs


def run_http(tmp_path: Path, bmc: Recorded, **kw: Any) -> tuple[flash_bmc.Outcome, list[str]]:
    plan = sign_plan(tmp_path, "gpu-07")
    host = flash_bmc.Host(name="gpu-07", plan_dir=plan, bmc="https://bmc.example.net", credentials=tmp_path / "bmc", boot="http")
    job = flash_bmc.Job(host, flash_bmc.read_target(plan, "gpu-07"), EFI_URL, flash_bmc.Credentials(USER, PASSWORD))
    (tmp_path / "out").mkdir(exist_ok=True)
    lines: list[str] = []
    answers = iter([None, Answer(200, True, ("gpu-07.example.net",))])
    outcome = flash_bmc.flash_host(job, Options(output=tmp_path / "out", poll_interval=0, **kw), lines.append, lambda h, c: bmc,
                                   lambda h, t: next(answers))
    assert not any(PASSWORD in line for line in lines)
    return outcome, lines


def test_recorded_http_boot_sequence_inserts_no_medium(tmp_path: Path) -> None:
    bmc = Recorded(http_bootable(rackmount()))
    outcome, lines = run_http(tmp_path, bmc)
    assert outcome.status == "installed", lines
    sent = [(m, p.removeprefix(SYSTEM), b) for m, p, b in bmc.sent]
    assert sent == [
        ("POST", "/SecureBoot/Actions/SecureBoot.ResetKeys", {"ResetKeysType": "DeletePK"}),
        ("PATCH", "/SecureBoot", {"SecureBootEnable": True}),
        ("PATCH", "", {"Boot": {"BootSourceOverrideTarget": "UefiHttp", "BootSourceOverrideEnabled": "Once",
                                "HttpBootUri": EFI_URL}}),
        ("POST", "/Actions/ComputerSystem.Reset", {"ResetType": "ForceRestart"}),
    ]
    steps = [line.removeprefix("gpu-07: ") for line in lines]
    assert flash_bmc.STEP_INSERT not in steps and flash_bmc.STEP_EJECT not in steps and flash_bmc.STEP_HTTP_BOOT in steps
    assert any("EFI file carries no plan" in line for line in lines)  # what this path needs, said where it is taken
    state = json.loads((tmp_path / "out" / "state" / "gpu-07.json").read_text())
    assert state["done"] == list(flash_bmc.HTTP_STEPS) and state["boot"] == "http" and "slot" not in state
    # a System that lists no allowable targets at all is asked too
    bmc = Recorded(http_bootable(rackmount()))
    del bmc.docs[SYSTEM]["Boot"]["BootSourceOverrideTarget@Redfish.AllowableValues"]
    (tmp_path / "b").mkdir()
    outcome, _ = run_http(tmp_path / "b", bmc)
    assert outcome.status == "installed"
    assert ("PATCH", SYSTEM, {"Boot": {"BootSourceOverrideTarget": "UefiHttp", "BootSourceOverrideEnabled": "Once",
                                       "HttpBootUri": EFI_URL}}) in bmc.sent


def _without_uri(docs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    del docs[SYSTEM]["Boot"]["HttpBootUri"]  # UefiHttp listed, no URL to give it: as the recorded iDRAC and Supermicro
    return docs


HTTP_REFUSALS: list[tuple[str, Any, str, str]] = [
    ("not listed", rackmount, flash_bmc.STEP_SYSTEM,
     "the BMC answered: Boot lists BootSourceOverrideTarget None, Pxe, Cd, Usb, Hdd, BiosSetup, Utilities, Diags, SDCard, "
     "UefiTarget, not UefiHttp"),
    ("no uri", lambda: _without_uri(http_bootable(rackmount())), flash_bmc.STEP_SYSTEM,
     "the BMC answered: Boot has no HttpBootUri"),
    ("patch refused", lambda: http_bootable(rackmount()), flash_bmc.STEP_HTTP_BOOT,
     f"the BMC refused the one-time UEFI HTTP boot from {EFI_URL}; the BMC answered: HTTP 400: The action parameter is not supported"),
]


@pytest.mark.parametrize(("case", "docs", "step", "words"), HTTP_REFUSALS, ids=[r[0] for r in HTTP_REFUSALS])
def test_http_boot_refusals_say_use_virtual_media(tmp_path: Path, case: str, docs: Any, step: str, words: str) -> None:
    bmc = Recorded(docs())
    if case == "patch refused":
        bmc.fail["PATCH", SYSTEM] = _bmc_error("The action parameter is not supported")
    outcome, _ = run_http(tmp_path, bmc)
    line = _line(outcome)
    assert line.startswith(f"gpu-07: refused at {step}: "), line
    assert words in line, line
    assert line.endswith(f"; do: {flash_bmc.USE_VIRTUAL_MEDIA}"), line
    assert not any("VirtualMedia" in p for _, p, _ in bmc.sent)
    if step == flash_bmc.STEP_SYSTEM:
        assert bmc.sent == []  # refused before anything on the host was changed


def test_fleet_boot_key(tmp_path: Path) -> None:
    plan = sign_plan(tmp_path, "gpu-07")
    creds = write_credentials(tmp_path / "bmc")
    base = {"name": "gpu-07", "plan": str(plan), "bmc": "https://bmc.example.net", "credentials": str(creds)}
    fleet = write_fleet(tmp_path / "fleet.toml", [{**base, "boot": "pxe"}])
    with pytest.raises(UserError, match="boot 'pxe'"):
        flash_bmc.prepare(fleet, "https://media.example.net/{name}.iso")
    fleet = write_fleet(tmp_path / "fleet.toml", [{**base, "boot": "http"}])
    with pytest.raises(UserError) as e:
        flash_bmc.prepare(fleet, "https://media.example.net/{name}/installer.iso")  # an ISO over HTTP is a RAM disk
    assert "boots the installer's EFI file" in e.value.message and "--form efi" in e.value.hint
    [job] = flash_bmc.prepare(fleet, EFI_URL)
    assert (job.host.boot, job.media_url) == ("http", EFI_URL)
    [job] = flash_bmc.prepare(write_fleet(tmp_path / "fleet.toml", [base]), "https://media.example.net/{name}/installer.iso")
    assert job.host.boot == "cd"


def test_a_changed_boot_starts_the_host_afresh(tmp_path: Path) -> None:
    outcome, _ = run_recorded(tmp_path, Recorded(http_bootable(rackmount())))
    assert outcome.status == "installed"
    (tmp_path / "out" / "state" / "gpu-07.json").write_text(
        (tmp_path / "out" / "state" / "gpu-07.json").read_text().replace('"boot": "cd"', '"boot": "http"'))
    outcome, lines = run_recorded(tmp_path, Recorded(http_bootable(rackmount())))
    assert outcome.status == "installed"
    assert "gpu-07: the plan, the medium or the boot changed since the last run: starting this host afresh" in lines


def test_probe_checks_the_chain_and_the_name(tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "appliance-ca")
    crt, key = ca.server(tmp_path, "gpu-07", dns=("gpu-07.example.net",))
    app = Appliance(crt, key, down=0)
    try:
        host = flash_bmc.Host("gpu-07", tmp_path, "https://b", tmp_path / "c", appliance_ca=ca.pem, address=f"127.0.0.1:{app.port}")
        target = flash_bmc.Target("0", "gpu-07.example.net", SERIAL, "", 0, 0)
        assert flash_bmc.probe_proxy(host, target) == Answer(200, True, ("gpu-07.example.net",))
        other = make_ca(tmp_path, "another-ca")
        wrong = flash_bmc.probe_proxy(flash_bmc.Host("gpu-07", tmp_path, "https://b", tmp_path / "c", appliance_ca=other.pem,
                                                     address=f"127.0.0.1:{app.port}"), target)
        assert wrong is not None and "not chained" in wrong.problem
        unverified = flash_bmc.probe_proxy(flash_bmc.Host("gpu-07", tmp_path, "https://b", tmp_path / "c",
                                                          address=f"127.0.0.1:{app.port}"), target)
        assert unverified == Answer(200, False, ("gpu-07.example.net",))
        elsewhere = flash_bmc.probe_proxy(host, flash_bmc.Target("0", "gpu-08.example.net", SERIAL, "", 0, 0))
        assert elsewhere is not None and "not chained" in elsewhere.problem
    finally:
        app.close()


# ------------------------------------------------------------------------------ the installer's report


def _report(sha256: str, **change: Any) -> dict[str, Any]:
    """What gpu-07's installer reports (installer/report.py's document())."""
    doc: dict[str, Any] = {
        "format": 1, "host": "gpu-07.example.net", "plan_sha256": sha256, "version": "1.4.0", "reinstalled": False,
        "disk": {"path": "/dev/nvme1n1", "model": "C123", "serial": SERIAL, "size_bytes": 960 << 30}, "usr_hash": "ab" * 32,
        "secure_boot": "secure boot keys enrolled (PK, KEK, db): the next boot enforces",
        "attestation": ["TPM EK      sha256:" + "e" * 64 + " (no EK certificate in the TPM)"], "steps": [], "seconds": 300,
        "summary": " Appliance 1.4.0 installed"}
    doc.update(change)
    return doc


def test_the_installers_report_is_collected_checked_and_said(tmp_path: Path) -> None:
    """The whole way: the collector of flash_fleet (--report-listen) takes the report the installer
    sends before its reboot (installer/report.py's send, here while the host is down), the wait
    finds it, and the host's line says what the installer wrote. A second run adds nothing."""
    ca = make_ca(tmp_path, "report-ca")
    crt, key = ca.server(tmp_path, "collector", ips=("127.0.0.1",))
    key.chmod(0o600)
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = install_plan.Report(url=f"https://127.0.0.1:{port}/", ca=ca.pem.read_text())
    plan = sign_report_plan(tmp_path, {"url": settings.url, "ca": settings.ca})
    fleet = write_fleet(tmp_path / "fleet.toml", [{"name": "gpu-07", "plan": str(plan), "bmc": "https://bmc.example.net",
                                                    "credentials": str(write_credentials(tmp_path / "bmc"))}])
    sha = flash_bmc.read_target(plan, "gpu-07").sha256
    sent: list[str] = []

    def probe(h: Any, t: Any) -> Answer | None:
        if not sent:  # the installer, before its reboot; then the appliance answers
            sent.append(installer.report.send(settings, _report(sha), wait_online=lambda s: None, timeout=5))
            return None
        return Answer(200, True, ("gpu-07.example.net",))

    options = Options(output=tmp_path / "out", poll_interval=0, install_timeout=5, report_listen=("127.0.0.1", port),
                      report_cert=crt, report_key=key, report_wait=5)
    lines: list[str] = []
    status = flash_bmc.flash_fleet(fleet, "https://media.example.net/{name}.iso", options, connect=lambda h, c: Recorded(rackmount()),
                                   probe=probe, echo=lines.append)
    assert status == 0, lines
    assert sent == [f"report sent to {settings.url} (HTTP 204)"]
    assert "gpu-07: the installer reported: appliance 1.4.0 on /dev/nvme1n1 (serial 1234570)" in lines
    [last] = [line for line in lines if line.startswith("gpu-07: installed: ")]
    stored = flash_report.report_path(tmp_path / "out", "gpu-07")
    assert last.endswith(f"the installer wrote appliance 1.4.0 on /dev/nvme1n1 (C123, serial {SERIAL}, 960.0 GiB), "
                         f"/usr abababababababab..., secure boot keys enrolled (PK, KEK, db): the next boot enforces, "
                         f"TPM EK sha256:{'e' * 64} (its report: {stored})"), last
    state = json.loads(flash_bmc.state_path(tmp_path / "out", "gpu-07").read_text())
    assert state["report"] == str(stored) and stored.stat().st_mode & 0o077 == 0
    # the same fleet again: already installed, nothing new about its report
    lines.clear()

    def never(h: Any, c: Any) -> Any:
        raise AssertionError("an installed host's BMC was asked again")
    assert flash_bmc.flash_fleet(fleet, "https://media.example.net/{name}.iso", options, connect=never, echo=lines.append) == 0
    assert [line for line in lines if line.startswith("gpu-07: ")] == [
        f"gpu-07: already installed with this plan (state {flash_bmc.state_path(tmp_path / 'out', 'gpu-07')}): nothing done"]


REPORT = {"url": "https://10.0.0.5:8443/", "ca": plan_values.CA_PEM}


def test_without_a_collector_a_plans_report_is_looked_for_once_and_its_absence_said(tmp_path: Path) -> None:
    outcome, lines = run_recorded(tmp_path, Recorded(rackmount()), report=REPORT)
    assert outcome.status == "installed", lines
    assert lines[0] == ("gpu-07: its installer's report will not be collected (give --report-listen, --report-cert and "
                        "--report-key for its plan's report.url https://10.0.0.5:8443/)")
    assert outcome.line.endswith("no report from its installer arrived at https://10.0.0.5:8443/ (its console shows its summary)")
    assert json.loads(flash_bmc.state_path(tmp_path / "out", "gpu-07").read_text())["report"] == ""
    # a plan without [report]: as before
    shutil.rmtree(tmp_path / "out")
    outcome, lines = run_recorded(tmp_path, Recorded(rackmount()))
    assert outcome.line.endswith("the installer's own summary is on its console only (docs/install.md)")
    assert not any("report" in line for line in lines)


def test_a_report_that_contradicts_the_plan_stops_the_host(tmp_path: Path) -> None:
    sha = flash_bmc.read_target(sign_report_plan(tmp_path, REPORT), "gpu-07").sha256
    stored = flash_report.report_path(tmp_path / "out", "gpu-07")
    stored.parent.mkdir(parents=True)
    stored.write_text(json.dumps(_report(sha, disk={"path": "/dev/sda", "model": "", "serial": "OTHER", "size_bytes": 1})))
    outcome, _ = run_recorded(tmp_path, Recorded(rackmount()), report=REPORT)
    assert _line(outcome).startswith(f"gpu-07: refused at {flash_bmc.STEP_WAIT}: its installer reports it wrote /dev/sda serial OTHER, "
                                     f"not the plan's disk (serial {SERIAL}); do: ")
    # a report of another plan: waited for up to report_wait, then refused
    stored.write_text(json.dumps(_report("0" * 64)))
    shutil.rmtree(tmp_path / "out" / "state")
    options = Options(output=tmp_path / "out", poll_interval=0, install_timeout=5, report_listen=("127.0.0.1", 0), report_wait=0.2)
    outcome, _ = run_recorded(tmp_path, Recorded(rackmount()), options=options, report=REPORT)
    assert f"the installer's report {stored} is for another plan (SHA-256 0000000000000000..." in _line(outcome)
    # the right one: installed, and said
    stored.write_text(json.dumps(_report(sha)))
    shutil.rmtree(tmp_path / "out" / "state")
    outcome, _ = run_recorded(tmp_path, Recorded(rackmount()), options=options, report=REPORT)
    assert outcome.status == "installed" and "the installer wrote appliance 1.4.0 on /dev/nvme1n1" in outcome.line


def test_the_hosts_line_says_where_its_sealed_recovery_key_is(tmp_path: Path) -> None:
    """A plan whose [report] names a recovery_recipient: the host's line names the report that holds
    the sealed key and the command that opens it; a report without one says why."""
    sealed_plan = {**REPORT, "recovery_recipient": plan_values.RECIPIENT_PEM}
    target = flash_bmc.read_target(sign_report_plan(tmp_path, sealed_plan), "gpu-07")
    assert target.recovery_recipient and not flash_bmc.read_target(sign_report_plan(tmp_path, REPORT), "gpu-07").recovery_recipient
    stored = flash_report.report_path(tmp_path / "out", "gpu-07")
    stored.parent.mkdir(parents=True)
    context = recovery_seal.report_context("gpu-07.example.net", target.sha256)
    sealed = recovery_seal.seal(plan_values.RECIPIENT_PEM, b"cbdefghi-" * 7 + b"cbdefghi", context)

    def run(doc: dict[str, Any], plan: dict[str, str]) -> str:
        stored.write_text(json.dumps(doc))
        shutil.rmtree(tmp_path / "out" / "state", ignore_errors=True)
        outcome, lines = run_recorded(tmp_path, Recorded(rackmount()), report=plan)
        assert outcome.status == "installed", lines
        return outcome.line

    line = run(_report(target.sha256, recovery_key_sealed=sealed), sealed_plan)
    assert line.endswith(f"(its report: {stored}); recovery key sealed to the plan's recipient in {stored} "
                         f"(python3 -m builder recovery-key open --key RECOVERY.key {stored})"), line
    line = run(_report(target.sha256, reinstalled=True), sealed_plan)
    assert line.endswith("; no recovery key in its report: a re-install makes none (the first install's key still opens /var)")
    line = run(_report(target.sha256), sealed_plan)
    assert line.endswith("; no recovery key in its report although its plan names a recipient: read it on its console (tty1)")
    # a plan without a recipient: the line as before
    plain_sha = flash_bmc.read_target(sign_report_plan(tmp_path, REPORT), "gpu-07").sha256
    assert run(_report(plain_sha), REPORT).endswith(f"(its report: {stored})")


# ------------------------------------------------------------------------------ sushy-tools' emulator


SYSTEMS = bmc_rig.system_ids(("gpu-07", "gpu-08"))


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    try:
        with bmc_rig.running(tmp_path, tuple(SYSTEMS)) as rig:
            yield rig
    except bmc_rig.EmulatorMissing as e:
        pytest.skip(str(e))


def _flash(rig: Rig, fleet: Path, **kw: Any) -> tuple[int, list[str]]:
    lines: list[str] = []
    options = Options(output=rig.tmp / "out", poll_interval=0.05, install_timeout=kw.pop("install_timeout", 30),
                      media_ca=rig.media_ca.read_text())
    status = flash_bmc.flash_fleet(fleet, rig.media_url, options, echo=lines.append, **kw)
    return status, lines


def _secret_nowhere(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file() and path.name not in ("bmc-credentials",):
            assert PASSWORD.encode() not in path.read_bytes(), path


@pytest.mark.programs
def test_emulator_two_hosts_then_already_installed(rig: Rig) -> None:
    status, lines = _flash(rig, rig.fleet())
    assert status == 0, "\n".join(lines)
    for name in SYSTEMS:
        mine = [line.removeprefix(f"{name}: ") for line in lines if line.startswith(f"{name}: ")]
        for step in flash_bmc.STEPS:
            assert step in mine, (step, mine)
        assert mine[-1].startswith("installed: answers on its proxy as"), mine
        assert "certificate NOT verified" in mine[-1]  # no appliance_ca in this fleet
        system = rig.system(name)
        assert system["Boot"]["BootSourceOverrideTarget"] == "Cd"  # the emulator keeps the override
        slot = rig.slot(name)
        assert slot["Inserted"] is False and not slot["Image"]  # ejected
        assert slot["VerifyCertificate"] is True  # the medium's CA was given to the BMC
    assert any("BMC standard" in line for line in lines)
    assert "summary:" in lines
    state_dir = rig.tmp / "out" / "state"
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in state_dir.iterdir()}
    emulator_log = (rig.tmp / "emulator.log").stat().st_size

    def never(h: Any, c: Any) -> Any:
        raise AssertionError("an installed host's BMC was asked again")
    status, lines = _flash(rig, rig.fleet(), connect=never)
    assert status == 0
    assert {line for line in lines if "already installed" in line and ": " in line and not line.startswith(" ")} == {
        f"{n}: already installed with this plan (state {state_dir / (n + '.json')}): nothing done" for n in SYSTEMS}
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in state_dir.iterdir()} == before
    assert (rig.tmp / "emulator.log").stat().st_size == emulator_log
    _secret_nowhere(rig.tmp / "out")


@pytest.mark.programs
def test_emulator_one_host_fails_the_other_goes_on(rig: Rig) -> None:
    status, lines = _flash(rig, rig.fleet(serial={"gpu-08": "NOT-THIS-ONE"}))
    assert status == 1
    [refusal] = [line for line in lines if line.startswith("gpu-08: refused")]
    assert refusal.startswith("gpu-08: refused at checking the system: the plan's disk (serial NOT-THIS-ONE) is not among")
    assert "serial 1234570" in refusal and "; do: " in refusal
    assert any(line.startswith("gpu-07: installed") for line in lines)
    assert not any(line.startswith("gpu-08: inserting") for line in lines)
    assert rig.slot("gpu-08")["Inserted"] is False
    _secret_nowhere(rig.tmp / "out")


@pytest.mark.programs
def test_emulator_resumes_where_each_host_stands(rig: Rig) -> None:
    rig.apps["gpu-07"].up = False  # it does not come back: the run stops at waiting
    status, lines = _flash(rig, rig.fleet(hosts=("gpu-07",)), install_timeout=0.5)
    assert status == 1
    assert lines[-1].startswith("  gpu-07  failed")
    assert rig.slot("gpu-07")["Inserted"] is True  # still in: the install may still need it
    rig.apps["gpu-07"].up = True
    status, lines = _flash(rig, rig.fleet(hosts=("gpu-07",)))
    assert status == 0, lines
    assert "gpu-07: resuming after power-cycling" in lines
    assert f"gpu-07: {flash_bmc.STEP_INSERT}" not in lines and f"gpu-07: {flash_bmc.STEP_RESET}" not in lines
    assert rig.slot("gpu-07")["Inserted"] is False


@pytest.mark.programs
def test_emulator_refusals(rig: Rig) -> None:
    # the emulator's Secure Boot is off in deployed mode with no ResetKeys: the appliance policy refuses
    status, lines = _flash(rig, rig.fleet(hosts=("gpu-07",), secure_boot="appliance"))
    assert status == 1
    [line] = [x for x in lines if x.startswith("gpu-07: refused")]
    assert line.startswith("gpu-07: refused at preparing Secure Boot: Secure Boot is disabled, DeployedMode (off: ")
    shutil.rmtree(rig.tmp / "out")
    # a wrong password: the BMC's answer, and the password appears nowhere
    fleet = rig.fleet(hosts=("gpu-07",))
    write_credentials(rig.tmp / "bmc-credentials", password="not-the-" + PASSWORD[:4])
    status, lines = _flash(rig, fleet)
    assert status == 1
    [line] = [x for x in lines if x.startswith("gpu-07: refused")]
    assert line.startswith("gpu-07: refused at checking the BMC: ") and "401" in line, line


@pytest.mark.programs
def test_emulator_http_boot(rig: Rig) -> None:
    """The fake driver lists UefiHttp and shows Boot.HttpBootUri, but cannot keep a URL (its
    set_http_boot_uri is not implemented; sushy-tools' libvirt driver's is): it answers the PATCH
    with 400 ("Unable to record HttpBootUri" in its log, after attaching the URL to its own virtual
    CD, which is how it emulates an HTTP boot), and the host is refused at that step. The flash
    itself sends no InsertMedia or EjectMedia."""
    system = rig.system("gpu-07")
    assert "UefiHttp" in system["Boot"]["BootSourceOverrideTarget@Redfish.AllowableValues"] and "HttpBootUri" in system["Boot"]
    status, lines = _flash(rig, rig.fleet(hosts=("gpu-07",), boot="http", media_url=rig.efi_url("gpu-07")))
    assert status == 1
    [line] = [x for x in lines if x.startswith("gpu-07: refused")]
    assert line.startswith(f"gpu-07: refused at {flash_bmc.STEP_HTTP_BOOT}: the BMC refused the one-time UEFI HTTP boot from "
                           f"{rig.efi_url('gpu-07')}; the BMC answered: HTTP 400"), line
    assert line.endswith(f"; do: {flash_bmc.USE_VIRTUAL_MEDIA}")
    assert not any(flash_bmc.STEP_INSERT in x or flash_bmc.STEP_EJECT in x for x in lines)
    sent = (rig.tmp / "emulator.log").read_text()
    assert "InsertMedia" not in sent and "EjectMedia" not in sent
    _secret_nowhere(rig.tmp / "out")


@pytest.mark.programs
def test_cli_password_never_in_argv_logs_or_state(rig: Rig) -> None:
    fleet = rig.fleet()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "builder", "flash", "--bmc", str(fleet), "--media-url", rig.media_url,
                             "--media-ca", str(rig.media_ca), "--output", str(rig.tmp / "out"), "--poll-interval", "0.2"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen: set[int] = set()
    while proc.poll() is None:
        for pid in [proc.pid, *_children(proc.pid)]:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            seen.add(pid)
            assert PASSWORD.encode() not in cmdline and PASSWORD.encode() not in environ
        time.sleep(0.05)
    out, err = proc.communicate()
    assert proc.returncode == 0, (out.decode(), err.decode())
    assert proc.pid in seen
    assert PASSWORD.encode() not in out + err
    assert PASSWORD.encode() not in Path(f"/proc/{rig.emulator.pid}/cmdline").read_bytes()
    log = (rig.tmp / "out" / "flash.log").read_text()
    assert all(f" {name}: installed: answers on its proxy" in log for name in SYSTEMS)
    assert "Systems" in (rig.tmp / "out" / "sushy.log").read_text()  # sushy's own log is there, and masked
    _secret_nowhere(rig.tmp / "out")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found + [g for c in found for g in _children(c)]
