# SPDX-License-Identifier: MIT
"""The boot check without a guest: its plan logic (testkit/boot_steps.py: which steps run where, one
update per boot, no power-off while the booted version is on trial and not judged), and its report
(testkit/boot_report.py) as the guest writes it and the host loads it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from appliance.errors import UserError
from testkit import boot_facts, boot_report, boot_steps, bootcheck, engine_scenarios, guest_commands
from testkit.boot_report import (
    BootEntry,
    BootReport,
    EngineEnvironment,
    EtcState,
    LoaderVars,
    ReplicaStart,
    Sealed,
    SmokeAnswer,
    UsrSignature,
)


def first_look(version: str = "1.0.0") -> BootReport:
    """A first look as a demo guest's boot check takes it, every part filled in."""
    return BootReport(
        replica_starts={"appliance-engine@0.service": ReplicaStart(stagger=(), started=1, main_started=2, active=3),
                        "appliance-engine@1.service": ReplicaStart(stagger=("replica 1: starting",))},
        boot_entries=(BootEntry(id="appliance_1.0.0.efi", title="Appliance", isDefault=True, isSelected=True),
                      BootEntry(id=None, title=None, isDefault=None, isSelected=False)),
        loader=LoaderVars(LoaderEntrySelected="appliance_1.0.0.efi", LoaderBootCountPath=None, StubProfile="0"),
        sealed=Sealed(secure_boot=True, setup_mode=False, tpm=True, pcr_signature=True),
        etc=EtcState(etc_dropin_present=False, engine_drop_in_paths="", engine_environment="A=1", reset_log=""),
        engine_env=EngineEnvironment(pid="12", init_pid="11", cmdline="vllm serve", environ=("A=1",), image_env=()),
        applianctl_version="applianctl 1.0.0",
        bootcheck_version="1.0.0",
        failed_units=(),
        usr_mount=("/dev/mapper/usr", "erofs", "ro"),
        usr_verity="type:        VERITY\n",
        usr_signature=UsrSignature(file=True, log="the signature of /usr's root hash"),
        partitions={"partitiontable": {"partitions": [{"node": "/dev/vda1", "size": 2048}]}},
        filesystems={"filesystems": [{"target": "/usr", "size": 1 << 30}]},
        cmdline="usrhash=ab",
        journal={"appliance-proxy.service": "started"},
        smoke_engine=SmokeAnswer(answer=" 391", answers_variant="overlay-demo"),
        smoke_proxy="ok: 391",
        status={"state": "ok", "parts": {"os": {"version": version}}},
        status_text="ok",
    )


@pytest.fixture
def guest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A boot check whose outside world is recorded: credentials in a directory, markers under
    tmp_path, every step and systemctl call noted instead of run."""
    creds = tmp_path / "creds"
    creds.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    monkeypatch.setattr(boot_steps, "MARKER_DIR", tmp_path / "markers")
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

    for name in ("refusals", "netprobe", "update_on_trial", "update", "download_only"):
        monkeypatch.setattr(boot_steps, f"run_{name}", step(name))
    monkeypatch.setattr(engine_scenarios, "run_fault_scenarios", step("fault_scenarios"))
    monkeypatch.setattr(bootcheck, "wait_for_engine", lambda _: True)
    monkeypatch.setattr(bootcheck, "wait_for_assessment", lambda _: None)
    monkeypatch.setattr(boot_facts, "collect", first_look)
    monkeypatch.setattr(bootcheck, "running_version", lambda: "1.0.0")
    monkeypatch.setattr(boot_steps, "on_trial", lambda: world["trial"] or {"counting": None, "boot_complete": "inactive"})
    monkeypatch.setattr(subprocess, "run", lambda cmd, **_: world["systemctl"].append(cmd[-1]))
    return world


def _boot(world: dict[str, Any], tmp_path: Path, plan: dict[str, Any], trial: bool = False, report: str = os.devnull) -> None:
    (world["creds"] / "appliance.plan").write_text(json.dumps(plan))
    (world["creds"] / "appliance.bootcheck").write_text("poweroff")
    args = argparse.Namespace(report=report, wait=1.0, trial=trial)
    assert bootcheck.main(args) == 0


def test_trial_steps_run_only_in_trial_mode_and_once(guest: dict[str, Any], tmp_path: Path) -> None:
    plan = {"1.0.0": [{"do": "update-on-trial", "url": "https://u/v3/"}, {"do": "netprobe"}, {"do": "faults"}]}
    _boot(guest, tmp_path, plan, trial=True)
    assert guest["ran"] == [("update_on_trial", "https://u/v3/")]
    _boot(guest, tmp_path, plan)
    assert guest["ran"][1:] == [("netprobe", os.devnull), ("fault_scenarios",)]  # netprobe asks the host on the report port
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
    # ppid reads /proc/PID/stat, whose command name may hold spaces and parentheses
    assert guest_commands.ppid(str(os.getpid())) == str(os.getppid())
    assert guest_commands.ppid("0") is None


def test_a_marker_a_power_cut_left_empty_means_the_step_runs_again(guest: dict[str, Any], tmp_path: Path) -> None:
    plan = {"1.0.0": [{"do": "netprobe"}]}
    _boot(guest, tmp_path, plan)
    (marker,) = boot_steps.MARKER_DIR.glob("*.json")
    marker.write_text("")  # written, not yet on disk, when the power went
    _boot(guest, tmp_path, plan)
    assert [r[0] for r in guest["ran"]] == ["netprobe", "netprobe"]
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

    monkeypatch.setattr(boot_facts, "run_text", run)
    starts = boot_facts.replica_starts(2)
    assert starts["appliance-engine@1.service"] == ReplicaStart(started=154567611, main_started=182230003, active=196841999,
                                                                stagger=(said,))
    first, second = starts["appliance-engine@0.service"], starts["appliance-engine@1.service"]
    assert first.active is not None and second.main_started is not None and second.main_started >= first.active


# ------------------------------------------------------------------------- the report


def test_the_report_the_guest_writes_is_the_one_the_host_loads(guest: dict[str, Any], tmp_path: Path) -> None:
    """Through the port as the guest writes it, back as typed attributes: the first look, the
    engine's health and the plan's outcomes (the last fault scenarios apart)."""
    port = tmp_path / "ttyS1"
    _boot(guest, tmp_path, {"1.0.0": [{"do": "faults"}, {"do": "netprobe"}]}, report=str(port))
    (report,) = boot_report.parse_reports(port.read_text())
    assert [s["do"] for s in report.steps] == ["faults", "netprobe"] and report.scenarios == report.steps[0]
    assert report == dataclasses.replace(first_look(), engine_became_healthy=True, scenarios=report.steps[0], steps=report.steps)
    assert report.os_version == "1.0.0" and report.sealed.secure_boot is True and report.failed_units == ()
    # the keys the JSON carries are the fields' names; a part left empty is no key at all
    written = boot_report.parse_blocks(port.read_text())[0]
    assert written["smoke_engine"] == {"answer": " 391", "answers_variant": "overlay-demo"}
    assert "main_started" not in written["replica_starts"]["appliance-engine@1.service"]
    assert written["loader"]["LoaderBootCountPath"] is None and written["boot_entries"][0]["isDefault"] is True


def test_other_blocks_and_a_block_cut_short_are_not_reports() -> None:
    """A test's own guest script writes its blocks between the same markers (weights_guest.py), and
    a power cut may end a block before its end marker."""
    text = (boot_report.report_block(first_look("1.0.0"))
            + f"{boot_report.BEGIN}\n{json.dumps({'weights_scenario': {'stage': 'cut'}})}\n{boot_report.END}\n"
            + boot_report.report_block(first_look("1.1.0")) + boot_report.report_block(first_look("1.2.0"))[:-40])
    assert [r.os_version for r in boot_report.parse_reports(text)] == ["1.0.0", "1.1.0"]
    assert len(boot_report.parse_blocks(text)) == 3


@pytest.mark.parametrize(("change", "named"), [
    (lambda d: d.update(failed_units="appliance-proxy.service"), "failed_units"),
    (lambda d: d["sealed"].update(tpm="yes"), "sealed.tpm"),
    (lambda d: d["replica_starts"]["appliance-engine@0.service"].update(active=1.5), "appliance-engine@0.service.active"),
    (lambda d: d.update(unheard_of=1), "unheard_of"),
    (lambda d: d.pop("status"), "status"),
])
def test_a_report_the_host_cannot_read_is_refused_in_one_line_naming_the_key(change: Any, named: str) -> None:
    data = json.loads(boot_report.report_block(first_look()).split("\n")[2])
    change(data)
    with pytest.raises(UserError) as e:
        boot_report.load_report(data, "boot 2's report")
    assert "\n" not in str(e.value) and named in str(e.value) and str(e.value).startswith("boot 2's report")
