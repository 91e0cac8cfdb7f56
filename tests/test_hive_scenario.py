# SPDX-License-Identifier: MIT
"""The boot check's hive-wide fault scenario (testkit/hive_scenario.py, the plan step
{"do": "hive-reset"}) on the host: the recorded reset line as /dev/kmsg takes it and as the judge
reads it back from `journalctl -k`, and the scenario's phases across the reboot the judge asks for,
against the real ladder with a simulated guest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import appliance.config
from appliance import paths
from appliance.config import Config
from applianctl.judge import clear, hive
from applianctl.status import remediation
from testkit import boot_steps, hive_scenario

ROOT = Path(__file__).resolve().parents[1]
KERNEL_LOGS = ROOT / "tests" / "fixtures" / "gpu" / "kernel-log"
T0 = 1_900_000_000.0


def _reset_lines() -> list[str]:
    """Every recorded line that tells a reset (dmesg's, syslog's and journalctl -o cat's forms)."""
    return [line for path in sorted(KERNEL_LOGS.glob("*.txt")) for line in path.read_text().splitlines()
            if any(e.kind == "reset" for e in hive.scan(line))]


@pytest.mark.parametrize("line", _reset_lines())
def test_a_recorded_reset_line_reads_back_from_the_kernel_log_as_the_same_fault(line: str) -> None:
    (recorded,) = hive.scan(line)
    message = hive_scenario.recorded_message(line)
    assert message.startswith(("amdgpu ", "[drm")), message  # no dmesg or syslog prefix left
    record = hive_scenario.kmsg_record(message)
    assert record.startswith(b"<6>") and record.endswith(b"\n") and record.count(b"\n") == 1
    # journalctl -k -o short-unix: a line written from user space has no "kernel" identifier
    shown = f"1900000000.250000 appliance unknown: {record[3:].decode().strip()}"
    (read,) = hive.scan(shown)
    assert (read.kind, read.gpu, read.at) == (recorded.kind, recorded.gpu, 1900000000.25)


def test_the_line_goes_to_the_kernel_log_in_one_write(tmp_path: Path) -> None:
    kmsg = tmp_path / "kmsg"
    kmsg.touch()
    hive_scenario.write_kmsg("amdgpu 0000:0a:00.0: amdgpu: GPU reset begin!\n", kmsg)
    assert kmsg.read_bytes() == b"<6>amdgpu 0000:0a:00.0: amdgpu: GPU reset begin!\n"
    assert len(hive_scenario.kmsg_record("x" * 5000)) == hive_scenario.KMSG_MAX


def test_the_phase_across_the_reboot() -> None:
    assert hive_scenario.phase(None, "b1") == "start"
    assert hive_scenario.phase({"phase": "rebooting", "boot_id": "b1"}, "b1") == "no-reboot"
    assert hive_scenario.phase({"phase": "rebooting", "boot_id": "b1"}, "b2") == "after-reboot"
    assert hive_scenario.settled_after(None, 300, 5) == 0.0
    assert hive_scenario.settled_after(hive.iso(T0), 300, 5) == T0 + 311


# ----------------------------------------------------------------------------------- the phases, simulated


class Rebooted(Exception):
    """The machine went down under the scenario (systemd ends the boot check)."""


class SimulatedGuest:
    """The guest as the scenario sees it, with the real ladder (paths.STATE_DIR: the test's) standing
    in for the judge: a fault is one observation of the line and the replicas dying together."""

    def __init__(self, config: Config, boot: int, clock: dict[str, float], reboots: bool = True) -> None:
        self.config = config
        self.boot = boot
        self.clock = clock
        self.reboots = reboots
        self.going_down = False
        self.faults_at: list[float] = []
        self.cleared = False
        self.ladder_ = hive.Ladder(config.engine.remediation, reboot=self._reboot)

    def _reboot(self) -> None:
        self.going_down = self.reboots

    def boot_id(self) -> str:
        return f"boot-{self.boot}"

    def wall(self) -> float:
        return self.clock["t"]

    def sleep(self, seconds: float) -> None:
        if self.going_down:
            raise Rebooted
        self.clock["t"] += seconds

    def wait(self, predicate: Any, timeout: float) -> bool:
        self.sleep(5)
        return bool(predicate())

    def ladder(self) -> dict[str, Any]:
        record, damage = self.ladder_.load()
        return {**(json.loads(json.dumps(record.__dict__)) if record else {"step": "none", "faults": 0}), "damaged": damage}

    def _held(self) -> bool:
        return self.ladder_.current(self.wall()).step == hive.PHYSICAL

    def judge(self) -> dict[str, Any]:
        state = "held" if self._held() else "alive"
        return {"replicas": [{"state": state}, {"state": state}],
                "hive": hive.needs_physical_action(self.ladder_.current(self.wall()))}

    def unit_states(self) -> dict[str, dict[str, str]]:
        return {u: {"ActiveState": "inactive" if self._held() else "active"} for u in paths.engine_units(2)}

    def fault(self, message: str) -> dict[str, Any]:
        now = self.wall()
        self.faults_at.append(now)
        line = f"{now:.6f} appliance unknown: {message}"
        self.ladder_.observe(now, hive.scan(line), (0, 1))
        if self.going_down:  # the judge rebooted on the line alone, before the replicas were killed
            raise Rebooted
        return {"in_kernel_log": True, "reset": {"killed": [11, 12], "gone": True}}

    def status(self) -> dict[str, Any]:
        part = remediation.probe_remediation(self.config, now=self.wall())
        return {"remediation": {"state": part.state, "reason": part.reason}}

    def metric(self) -> list[str]:
        return [f"appliance_needs_physical_action {int(self._held())}"]

    def proxy_health(self) -> dict[str, Any]:
        return {"status": 503 if self._held() else 200}

    judge_health = proxy_health

    def clear(self) -> dict[str, Any]:
        done = clear.clear(self.ladder_, 2, 5, wall=self.wall, sleep=self.sleep, run=lambda argv: (0, ""))
        return {"exit": 0, "said": done.as_json()}

    def judge_log(self) -> str:
        return ""


LINE = "[469021.979913] amdgpu 0000:0a:00.0: amdgpu: GPU reset begin!"


@pytest.fixture
def demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Config:
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "var")
    monkeypatch.setattr(paths, "JUDGE_STATE", tmp_path / "run" / "judge.json")
    return appliance.config.load(ROOT / "appliance.toml", "demo")


def test_restart_then_a_reboot_then_held_and_cleared(demo: Config, tmp_path: Path) -> None:
    progress = tmp_path / "var" / "bootcheck" / "in-progress" / "hive-reset-x.json"
    clock = {"t": T0}
    first = SimulatedGuest(demo, 1, clock)
    with pytest.raises(Rebooted):  # the judge reboots the machine in the middle of the step
        hive_scenario.run(progress, LINE, first)
    settle = demo.engine.remediation.settle_s
    assert len(first.faults_at) == 2 and first.faults_at[1] - first.faults_at[0] > settle  # past the rate limit
    kept = json.loads(progress.read_text())
    assert kept["phase"] == "rebooting" and kept["boot_id"] == "boot-1"
    assert kept["restart"]["fault"]["ladder"]["step"] == "restart" and "reboot_fault" not in kept
    assert kept["restart"]["status"]["remediation"]["state"] == "degraded"

    clock["t"] += 120  # a reboot under emulation
    second = SimulatedGuest(demo, 2, clock)
    outcome = hive_scenario.run(progress, LINE, second)
    assert not progress.exists()
    assert outcome["after_reboot"]["ladder"]["step"] == "reboot" and outcome["after_reboot"]["boot_id"] == "boot-2"
    assert second.faults_at[0] - first.faults_at[1] > settle
    held = outcome["held"]
    assert held["fault"]["ladder"]["step"] == "physical" and held["fault"]["ladder"]["gpu"] == "0000:0a:00.0"
    assert held["judged_held"] and held["stopped"] and held["metric"] == ["appliance_needs_physical_action 1"]
    assert held["status"]["remediation"]["reason"].endswith(clear.CLEAR_COMMAND)
    cleared = outcome["cleared"]
    assert cleared["command"]["said"]["was_holding"] and cleared["ladder"]["step"] == "none"
    assert cleared["serving"]["alive"] and cleared["metric"] == ["appliance_needs_physical_action 0"]
    assert "phase" not in outcome and outcome["kernel_message"] == "amdgpu 0000:0a:00.0: amdgpu: GPU reset begin!"


def test_no_reboot_is_reported_not_waited_for_for_ever(demo: Config, tmp_path: Path) -> None:
    progress = tmp_path / "progress.json"
    clock = {"t": T0}
    outcome = hive_scenario.run(progress, LINE, SimulatedGuest(demo, 1, clock, reboots=False))
    assert outcome["error"] == "the judge did not reboot after the second fault"
    # and a boot check started again on the same boot says the same at once
    again = hive_scenario.run(progress, LINE, SimulatedGuest(demo, 1, clock, reboots=False))
    assert again["error"] == outcome["error"]


def test_the_step_is_in_the_plan_and_keeps_its_progress_out_of_the_markers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(boot_steps, "MARKER_DIR", tmp_path)
    creds = tmp_path / "creds"
    creds.mkdir()
    step = {"do": "hive-reset", "kernel_line": LINE}
    (creds / "appliance.plan").write_text(json.dumps({"1.0.0": [step]}))
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    assert boot_steps.plan("1.0.0") == [step]
    seen: list[tuple[Path, str]] = []

    def fake_run(progress: Path, line: str) -> dict[str, Any]:
        seen.append((progress, line))
        progress.parent.mkdir(parents=True, exist_ok=True)
        progress.write_text(json.dumps({"phase": "rebooting"}))  # left by a boot the judge rebooted
        return {"held": {}}

    monkeypatch.setattr(hive_scenario, "run", fake_run)
    outcome = boot_steps.run_step("1.0.0", step, engine_healthy=True, port="/dev/null")
    assert outcome is not None and outcome["do"] == "hive-reset" and seen[0][1] == LINE
    assert seen[0][0].parent != tmp_path  # not a marker: step_outcomes reads every one
    assert [o["do"] for o in boot_steps.step_outcomes()] == ["hive-reset"]
    assert boot_steps.run_step("1.0.0", step, engine_healthy=True, port="/dev/null") is None  # once per disk
