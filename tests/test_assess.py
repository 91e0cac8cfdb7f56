# SPDX-License-Identifier: MIT
"""`applianctl assess` judges what clients get: the smoke completion through the real Caddy (the
Caddyfile the builder renders), over TLS with the appliance's own CA (applianctl.tls), on the
public port, in front of the stand-in engine. A version whose proxy never listens, whose TLS is
not the appliance's, or whose engine answers wrong is recorded as rolled back and the machine (a
fake systemctl) reboots."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakeprog import calls, fake_program

import appliance.config
from appliance import paths
from appliance.caddyfile import render_caddyfile
from appliance.config import Config
from applianctl import tls
from applianctl.slots import assess
from applianctl.slots.machine import EFI_LOADER_GUID, Host
from testkit.standin import StandinProcess, free_port, port_open

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)

ROOT = Path(__file__).resolve().parents[1]
CADDY = shutil.which("caddy") or "/usr/bin/caddy"
MODEL = "standin/tiny-demo"


def _efi_var(directory: Path, name: str, value: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}-{EFI_LOADER_GUID}").write_bytes(b"\x06\0\0\0" + (value + "\0").encode("utf-16-le"))


@dataclasses.dataclass(frozen=True)
class Live:
    config: Config  # the proxy's public port and the engine's port as running here
    tls_dir: Path


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The stand-in engine behind the real Caddy with the appliance's own certificates."""
    if not os.access(CADDY, os.X_OK):
        pytest.skip("needs Debian's caddy (apt install caddy)")
    base = tmp_path_factory.mktemp("assess-live")
    engine = StandinProcess(["--served-model-name", MODEL]).wait_ready()
    caddy = None
    sock_dir = Path(tempfile.mkdtemp(prefix="as-"))  # a unix socket path must stay short
    try:
        demo = appliance.config.load(ROOT / "appliance.toml", "demo")
        config = dataclasses.replace(
            demo,
            proxy=dataclasses.replace(demo.proxy, https_port=free_port(), http="redirect", tls="internal"),
            engine=dataclasses.replace(demo.engine, port=engine.port),
            topology=dataclasses.replace(demo.topology, gpus=1, layout="1x1"),  # one stand-in behind the proxy
        )
        assert config.served_model == MODEL
        tls_dir = base / "tls"
        tls.generate(tls_dir, config.proxy.hostname, tls.host_addresses(), group="appliance-no-such-group")
        caddyfile = base / "Caddyfile"
        caddyfile.write_text(render_caddyfile(config, tls_dir=tls_dir, http_port=free_port(), admin=f"unix/{sock_dir}/admin.sock"))
        env = {**os.environ, "HOME": str(base), "XDG_DATA_HOME": str(base / "data"), "XDG_CONFIG_HOME": str(base / "config")}
        log = (base / "caddy.log").open("wb")
        caddy = subprocess.Popen([CADDY, "run", "--config", str(caddyfile), "--adapter", "caddyfile"], env=env, stdout=log, stderr=log)
        end = time.monotonic() + 20
        while not port_open(config.proxy.https_port):
            if caddy.poll() is not None or time.monotonic() > end:
                pytest.fail(f"caddy did not listen:\n{(base / 'caddy.log').read_text()[-3000:]}")
            time.sleep(0.1)
        yield Live(config, tls_dir)
    finally:
        if caddy is not None:
            caddy.terminate()
            caddy.wait(timeout=10)
        engine.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, live: Live) -> Host:
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")
    monkeypatch.setattr(paths, "TLS_DIR", live.tls_dir)
    monkeypatch.setattr(paths, "MANIFEST", tmp_path / "no-manifest.json")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_program(bin_dir, "systemctl", log=tmp_path / "calls.log")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return Host(efivars=tmp_path / "efivars", cmdline=tmp_path / "cmdline", esp=tmp_path / "esp", disk="/dev/null")


def _on_trial(host: Host) -> None:
    _efi_var(host.efivars, "LoaderEntrySelected", "appliance_2.0.0+2-1.efi")
    _efi_var(host.efivars, "LoaderBootCountPath", "\\EFI\\Linux\\appliance_2.0.0+2-1.efi")


def _version(config: Config) -> Config:
    return dataclasses.replace(config, appliance=dataclasses.replace(config.appliance, version="2.0.0"))


def _calls(tmp_path: Path) -> list[list[str]]:
    return calls(tmp_path / "calls.log")


def _record() -> dict[str, object]:
    data: dict[str, object] = json.loads(paths.last_assessment_path().read_text())
    return data


def test_a_version_that_serves_through_the_proxy_is_judged_good(tmp_path: Path, host: Host, live: Live) -> None:
    _on_trial(host)
    code = assess.assess(_version(live.config), host=host, deadline_s=20, poll_s=0.2, say=lambda s: None)
    assert code == 0
    record = _record()
    assert record["ok"] is True and record["version"] == "2.0.0" and record["tries_left"] == 2
    assert record["through"] == f"https://127.0.0.1:{live.config.proxy.https_port} as {live.config.proxy.hostname}"
    assert _calls(tmp_path) == []


def test_a_version_whose_proxy_never_listens_is_rolled_back_though_the_engine_serves(
    tmp_path: Path, host: Host, live: Live
) -> None:
    _on_trial(host)
    silent = dataclasses.replace(live.config, proxy=dataclasses.replace(live.config.proxy, https_port=free_port()))
    assert port_open(live.config.engine.port)  # the engine itself answers on loopback
    code = assess.assess(_version(silent), host=host, deadline_s=2, poll_s=0.2, say=lambda s: None)
    assert code == 1
    reason = str(_record()["reason"])
    assert reason.startswith(f"rolled back: no right smoke completion through https://127.0.0.1:{silent.proxy.https_port}")
    assert "within 2 s" in reason and f"could not reach https://127.0.0.1:{silent.proxy.https_port} (GET /v1/models)" in reason
    assert _calls(tmp_path) == [["systemctl", "reboot"]]


def test_a_proxy_with_a_certificate_the_appliance_ca_did_not_sign_is_rolled_back(
    tmp_path: Path, host: Host, live: Live, monkeypatch: pytest.MonkeyPatch
) -> None:
    _on_trial(host)
    other = tmp_path / "other-tls"
    tls.generate(other, live.config.proxy.hostname, tls.host_addresses(), group="appliance-no-such-group")
    monkeypatch.setattr(paths, "TLS_DIR", other)  # the CA this version trusts is not the proxy's
    code = assess.assess(_version(live.config), host=host, deadline_s=2, poll_s=0.2, say=lambda s: None)
    assert code == 1
    assert "TLS failed" in str(_record()["reason"])
    assert _calls(tmp_path) == [["systemctl", "reboot"]]


def test_a_missing_appliance_ca_is_rolled_back(tmp_path: Path, host: Host, live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    _on_trial(host)
    monkeypatch.setattr(paths, "TLS_DIR", tmp_path / "no-tls")
    code = assess.assess(_version(live.config), host=host, deadline_s=1, poll_s=0.2, say=lambda s: None)
    assert code == 1
    assert "does not exist" in str(_record()["reason"])


def test_a_wrong_smoke_answer_is_rolled_back(tmp_path: Path, host: Host, live: Live) -> None:
    _on_trial(host)
    args = tuple("some/other-model" if a == MODEL else a for a in live.config.engine.args)
    other_model = dataclasses.replace(live.config, engine=dataclasses.replace(live.config.engine, args=args))
    assert other_model.served_model == "some/other-model"
    code = assess.assess(_version(other_model), host=host, deadline_s=2, poll_s=0.2, say=lambda s: None)
    assert code == 1
    assert "does not list some/other-model" in str(_record()["reason"])
    assert _calls(tmp_path) == [["systemctl", "reboot"]]


def test_a_version_judged_good_is_never_assessed_or_rolled_back(tmp_path: Path, host: Host, live: Live) -> None:
    _efi_var(host.efivars, "LoaderEntrySelected", "appliance_2.0.0.efi")  # blessed: no counter
    silent = dataclasses.replace(live.config, proxy=dataclasses.replace(live.config.proxy, https_port=free_port()))
    code = assess.assess(_version(silent), host=host, deadline_s=1, poll_s=0.1, say=lambda s: None)
    assert code == 0
    assert not paths.last_assessment_path().exists()
    assert _calls(tmp_path) == []


def _unit(name: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values]}} (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for line in (ROOT / "units" / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def test_the_unit_is_ordered_before_boot_complete() -> None:
    unit = _unit("appliance-assess.service")
    assert unit["Unit"]["Before"] == ["boot-complete.target"]
    # the deadline counts from boot: not after the engine's start job, which lasts the start period
    after = " ".join(unit["Unit"]["After"]).split()
    assert not [u for u in after if u.startswith("appliance-engine")]
    assert "appliance-proxy.service" in " ".join(unit["Unit"]["Wants"]).split()  # the replicas: multi-user.target's
    assert unit["Service"]["Type"] == ["oneshot"]
    assert unit["Service"]["ExecStart"] == ["/usr/bin/applianctl assess"]
    assert unit["Install"]["RequiredBy"] == ["boot-complete.target"]
    # loopback only (the proxy), and the ESP writable for demote_newer
    assert unit["Service"]["IPAddressDeny"] == ["any"] and unit["Service"]["IPAddressAllow"] == ["localhost"]
    assert "-/efi" in unit["Service"]["ReadWritePaths"][0].split()


def test_a_downgrade_judged_good_marks_newer_entries_out_of_tries(tmp_path: Path, host: Host, live: Live) -> None:
    from appliance import atomic

    _on_trial(host)
    assert host.esp is not None
    linux = host.esp / "EFI/Linux"
    linux.mkdir(parents=True)
    (linux / "appliance_2.0.0+2-1.efi").write_bytes(b"uki 2")
    (linux / "appliance_3.0.0.efi").write_bytes(b"uki 3")
    atomic.write_json_atomic(paths.last_update_path(), {"version": "2.0.0", "downgrade": True})
    assert assess.assess(_version(live.config), host=host, deadline_s=20, poll_s=0.2, say=lambda s: None) == 0
    assert sorted(p.name for p in linux.iterdir()) == ["appliance_2.0.0+2-1.efi", "appliance_3.0.0+0.efi"]
    assert _record()["demoted"] == ["appliance_3.0.0+0.efi"]


def test_a_damaged_record_never_keeps_a_failed_version_from_rebooting(tmp_path: Path, host: Host, live: Live,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A directory where last-assessment.json goes made the write fail before the reboot: the bad
    version kept running. Now it is moved aside, the verdict recorded, the machine rebooted."""
    _on_trial(host)
    paths.last_assessment_path().mkdir(parents=True)
    silent = dataclasses.replace(live.config, proxy=dataclasses.replace(live.config.proxy, https_port=free_port()))
    assert assess.assess(_version(silent), host=host, deadline_s=0.5, poll_s=0.2, say=lambda s: None) == 1
    assert _calls(tmp_path) == [["systemctl", "reboot"]]
    assert _record()["ok"] is False and paths.last_assessment_path().with_name("last-assessment.json.damaged").is_dir()
    err = capsys.readouterr().err
    assert "last-assessment.json: was a directory, not a record" in err


def test_a_record_that_cannot_be_written_never_changes_the_verdict(tmp_path: Path, host: Host, live: Live,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from appliance.errors import UserError
    from applianctl.slots import history

    def refuse(path: Path, record: object) -> None:
        raise UserError(f"{path}: cannot write (Read-only file system)", hint="")

    monkeypatch.setattr(history, "write", refuse)
    _on_trial(host)
    assert assess.assess(_version(live.config), host=host, deadline_s=20, poll_s=0.2, say=lambda s: None) == 0
    silent = dataclasses.replace(live.config, proxy=dataclasses.replace(live.config.proxy, https_port=free_port()))
    assert assess.assess(_version(silent), host=host, deadline_s=0.5, poll_s=0.2, say=lambda s: None) == 1
    assert _calls(tmp_path) == [["systemctl", "reboot"]]
    assert capsys.readouterr().err.count("the verdict stands, unrecorded") == 2


def test_a_damaged_update_record_is_one_line_and_the_version_still_judged(tmp_path: Path, host: Host, live: Live,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    _on_trial(host)
    paths.last_update_path().parent.mkdir(parents=True)
    os.mkfifo(paths.last_update_path())  # a plain read would wait here
    assert assess.assess(_version(live.config), host=host, deadline_s=20, poll_s=0.2, say=lambda s: None) == 0
    assert _record()["ok"] is True
    assert "last-update.json: is a FIFO, not a regular file; taken as no record" in capsys.readouterr().err
