"""`applianctl assess` against the stand-in engine: a version that serves is judged good; one whose
engine never becomes ready is recorded as rolled back and the machine (a fake systemctl) reboots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from appliance import paths
from applianctl import assess, slots
from standin.testing import StandinProcess

MODEL = "standin/tiny-demo"


def _efi_var(directory: Path, name: str, value: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}-{slots.EFI_LOADER_GUID}").write_bytes(b"\x06\0\0\0" + (value + "\0").encode("utf-16-le"))


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> slots.Host:
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "state")
    monkeypatch.setattr(paths, "MANIFEST", tmp_path / "no-manifest.json")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "systemctl"
    fake.write_text('#!/bin/sh\necho "systemctl $*" >> "$FAKE_LOG"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.log"))
    return slots.Host(efivars=tmp_path / "efivars", cmdline=tmp_path / "cmdline", esp=tmp_path / "esp", disk="/dev/null")


def _on_trial(host: slots.Host) -> None:
    _efi_var(host.efivars, "LoaderEntrySelected", "appliance_2.0.0+2-1.efi")
    _efi_var(host.efivars, "LoaderBootCountPath", "\\EFI\\Linux\\appliance_2.0.0+2-1.efi")


def _config(port: int, deadline: int = 600) -> dict[str, Any]:
    return {
        "appliance": {"version": "2.0.0"},
        "engine": {"port": port, "served_model_name": MODEL, "health": {"path": "/health"}},
        "model": {"id": MODEL},
        "update": {"assessment_deadline_s": deadline},
    }


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_a_version_that_serves_is_judged_good(tmp_path: Path, host: slots.Host) -> None:
    _on_trial(host)
    engine = StandinProcess(["--served-model-name", MODEL]).wait_ready()
    try:
        code = assess.assess(_config(engine.port), host=host, deadline_s=20, poll_s=0.2, say=lambda s: None)
    finally:
        engine.stop()
    assert code == 0
    record = json.loads(slots.last_assessment_path().read_text())
    assert record["ok"] is True and record["version"] == "2.0.0" and record["tries_left"] == 2
    assert _calls(tmp_path) == []


def test_an_engine_that_never_becomes_ready_is_rolled_back(tmp_path: Path, host: slots.Host) -> None:
    _on_trial(host)
    engine = StandinProcess(["--served-model-name", MODEL], env={"STANDIN_NEVER_READY": "1"})
    try:
        code = assess.assess(_config(engine.port), host=host, deadline_s=2, poll_s=0.2, say=lambda s: None)
    finally:
        engine.stop()
    assert code == 1
    record = json.loads(slots.last_assessment_path().read_text())
    assert record["ok"] is False and record["version"] == "2.0.0"
    assert record["reason"] == "rolled back: engine not healthy within 2 s"
    assert _calls(tmp_path) == ["systemctl reboot"]


def test_a_wrong_smoke_answer_is_rolled_back(tmp_path: Path, host: slots.Host) -> None:
    _on_trial(host)
    engine = StandinProcess(["--served-model-name", "some/other-model"]).wait_ready()
    try:
        code = assess.assess(_config(engine.port), host=host, deadline_s=2, poll_s=0.2, say=lambda s: None)
    finally:
        engine.stop()
    assert code == 1
    assert "smoke completion not right" in json.loads(slots.last_assessment_path().read_text())["reason"]
    assert _calls(tmp_path) == ["systemctl reboot"]


def test_a_version_judged_good_is_never_assessed_or_rolled_back(tmp_path: Path, host: slots.Host) -> None:
    _efi_var(host.efivars, "LoaderEntrySelected", "appliance_2.0.0.efi")  # blessed: no counter
    code = assess.assess(_config(1), host=host, deadline_s=1, poll_s=0.1, say=lambda s: None)
    assert code == 0
    assert not slots.last_assessment_path().exists()
    assert _calls(tmp_path) == []


def test_the_unit_is_ordered_before_boot_complete() -> None:
    import configparser

    unit = Path(__file__).resolve().parents[1] / "units/appliance-assess.service"
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(unit.read_text())
    assert parser["Unit"]["Before"] == "boot-complete.target"
    # the deadline counts from boot: not after the engine's start job, which lasts the start period
    assert "appliance-engine.service" not in parser["Unit"]["After"].split()
    assert "appliance-engine.service" in parser["Unit"]["Wants"].split()
    assert parser["Service"]["Type"] == "oneshot"
    assert parser["Service"]["ExecStart"] == "/usr/bin/applianctl assess"
    assert parser["Install"]["RequiredBy"] == "boot-complete.target"
