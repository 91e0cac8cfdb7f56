# SPDX-License-Identifier: MIT
"""testkit/bootcheck.py's plan logic without a guest: which steps run where, one update per boot,
and no power-off while the booted version is on trial and not judged."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from testkit import bootcheck


@pytest.fixture
def guest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A boot check whose outside world is recorded: credentials in a directory, markers under
    tmp_path, every step and systemctl call noted instead of run."""
    creds = tmp_path / "creds"
    creds.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    monkeypatch.setattr(bootcheck, "MARKER_DIR", tmp_path / "markers")
    world: dict[str, Any] = {"creds": creds, "ran": [], "systemctl": [], "trial": None, "update_exit": 0}

    def step(name: str) -> Any:
        def run(*args: Any) -> dict[str, Any]:
            if name == "update":  # (the command line, the URL or None for --apply)
                world["ran"].append((name, " ".join(args[0][1:3]), *args[1:]))
                if world["update_exit"] is None:
                    raise RuntimeError("the power is cut")
                return {"exit": world["update_exit"]}
            world["ran"].append((name, *args))
            return {"exit": 0} if name == "download_only" else {}
        return run

    for name in ("fault_scenarios", "refusals", "netprobe", "update_on_trial", "update", "download_only"):
        monkeypatch.setattr(bootcheck, f"run_{name}", step(name))
    monkeypatch.setattr(bootcheck, "wait_for_engine", lambda _: True)
    monkeypatch.setattr(bootcheck, "wait_for_assessment", lambda _: None)
    monkeypatch.setattr(bootcheck, "collect", lambda: {"status": {"parts": {"os": {"version": "1.0.0"}}}, "status_text": ""})
    monkeypatch.setattr(bootcheck, "_running_version", lambda: "1.0.0")
    monkeypatch.setattr(bootcheck, "_on_trial", lambda: world["trial"] or {"counting": None, "boot_complete": "inactive"})
    monkeypatch.setattr(bootcheck.subprocess, "run", lambda cmd, **_: world["systemctl"].append(cmd[-1]))
    return world


def _boot(world: dict[str, Any], tmp_path: Path, plan: dict[str, Any], trial: bool = False) -> None:
    (world["creds"] / "appliance.plan").write_text(json.dumps(plan))
    (world["creds"] / "appliance.bootcheck").write_text("poweroff")
    args = argparse.Namespace(report=os.devnull, wait=1.0, trial=trial)
    assert bootcheck.main(args) == 0


def test_trial_steps_run_only_in_trial_mode_and_once(guest: dict[str, Any], tmp_path: Path) -> None:
    plan = {"1.0.0": [{"do": "update-on-trial", "url": "https://u/v3/"}, {"do": "netprobe"}, {"do": "faults"}]}
    _boot(guest, tmp_path, plan, trial=True)
    assert guest["ran"] == [("update_on_trial", "https://u/v3/")]
    _boot(guest, tmp_path, plan)
    assert guest["ran"][1:] == [("netprobe",), ("fault_scenarios",)]
    _boot(guest, tmp_path, plan, trial=True)  # a later boot of the same version: already done
    assert len(guest["ran"]) == 3


def test_one_update_per_boot_then_power_off(guest: dict[str, Any], tmp_path: Path) -> None:
    plan = {"1.0.0": [{"do": "update", "url": "https://u/a/"}, {"do": "update", "url": "https://u/b/"}]}
    _boot(guest, tmp_path, plan)
    assert guest["ran"] == [("update", "update https://u/a/", "https://u/a/")] and guest["systemctl"] == ["reboot"]
    _boot(guest, tmp_path, plan)  # back on this version (the first one was rolled back)
    assert guest["ran"][-1] == ("update", "update https://u/b/", "https://u/b/") and guest["systemctl"][-1] == "reboot"
    _boot(guest, tmp_path, plan)
    assert len(guest["ran"]) == 2 and guest["systemctl"][-1] == "poweroff"


def test_a_staged_update_is_downloaded_before_the_report_and_applied_after_it(guest: dict[str, Any], tmp_path: Path) -> None:
    plan = {"1.0.0": [{"do": "download-only", "url": "https://u/a/"}, {"do": "apply"}]}
    guest["update_exit"] = None  # the power is cut while applying: no outcome, no marker
    with pytest.raises(RuntimeError):
        _boot(guest, tmp_path, plan)
    assert guest["ran"] == [("download_only", "https://u/a/"), ("update", "update --apply", None)]
    guest["update_exit"] = 0
    _boot(guest, tmp_path, plan)  # the next boot applies again; the download is not repeated
    assert guest["ran"][2:] == [("update", "update --apply", None)] and guest["systemctl"][-1] == "reboot"


def test_a_rollback_step_is_an_update_of_its_boot(guest: dict[str, Any], tmp_path: Path) -> None:
    plan = {"1.0.0": [{"do": "apply"}, {"do": "rollback", "force": True}, {"do": "rollback"}]}
    _boot(guest, tmp_path, plan)
    assert guest["ran"] == [("update", "update --apply", None)]
    _boot(guest, tmp_path, plan)  # back on this version: the next one, with its option
    assert guest["ran"][1] == ("update", "rollback --force", None) and guest["systemctl"][-1] == "reboot"
    _boot(guest, tmp_path, plan)
    assert guest["ran"][2] == ("update", "rollback", None)


def test_no_power_off_while_on_trial_and_not_judged(guest: dict[str, Any], tmp_path: Path) -> None:
    guest["trial"] = {"counting": {"tries_left": 0}, "boot_complete": "inactive"}
    _boot(guest, tmp_path, {})
    assert guest["systemctl"] == []  # the assessment or the boot deadline reboots it
    guest["trial"] = {"counting": {"tries_left": 0}, "boot_complete": "active"}  # judged good
    _boot(guest, tmp_path, {})
    assert guest["systemctl"] == ["poweroff"]


def test_engine_is_the_child_of_the_container_init() -> None:
    # _ppid reads /proc/PID/stat, whose command name may hold spaces and parentheses
    assert bootcheck._ppid(str(os.getpid())) == str(os.getppid())
    assert bootcheck._ppid("0") is None


def test_a_marker_a_power_cut_left_empty_means_the_step_runs_again(guest: dict[str, Any], tmp_path: Path) -> None:
    plan = {"1.0.0": [{"do": "netprobe"}]}
    _boot(guest, tmp_path, plan)
    (marker,) = bootcheck.MARKER_DIR.glob("*.json")
    marker.write_text("")  # written, not yet on disk, when the power went
    _boot(guest, tmp_path, plan)
    assert guest["ran"] == [("netprobe",), ("netprobe",)]
    assert json.loads(marker.read_text())["do"] == "netprobe"


def test_replica_starts_reads_systemctls_own_property_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """systemctl show prints the properties asked for in its own order (Service's before Unit's):
    each value goes by its key, never by position (the journey once compared the wrong timestamps)."""
    shown = {"appliance-engine@0.service": "ExecMainStartTimestampMonotonic=167190012\nInactiveExitTimestampMonotonic=154540971\n"
                                           "ActiveEnterTimestampMonotonic=178985427\n",
             "appliance-engine@1.service": "ExecMainStartTimestampMonotonic=182230003\nInactiveExitTimestampMonotonic=154567611\n"
                                           "ActiveEnterTimestampMonotonic=196841999\n"}

    said = "replica 1: appliance-engine@0.service is not starting (after 13 s); starting"

    def run(cmd: list[str], timeout: float = 20) -> str:
        if cmd[0] == "systemctl":
            return shown[cmd[-1]]
        return said + "\n" if cmd[-1].endswith("@1.service") else ""

    monkeypatch.setattr(bootcheck, "_run", run)
    starts = bootcheck.replica_starts(2)
    assert starts["appliance-engine@1.service"] == {"started": 154567611, "main_started": 182230003, "active": 196841999,
                                                    "stagger": [said]}
    assert starts["appliance-engine@1.service"]["main_started"] >= starts["appliance-engine@0.service"]["active"]
