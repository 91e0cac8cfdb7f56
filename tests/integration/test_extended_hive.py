# SPDX-License-Identifier: MIT
"""Extended QEMU scenario (make test-extended GROUPS=hive): the whole hive reset, again and again,
up to "needs physical action" and back (applianctl/judge/hive.py's ladder, with the demo's
engine.remediation: one restart, then one reboot, then hold).

A copy of the demo image, first boot; the plan's step {"do": "hive-reset"} (testkit/hive_scenario.py)
makes each fault as both signals the judge reads: a recorded amdgpu reset line
(tests/fixtures/gpu/kernel-log/, written into the kernel log through /dev/kmsg: the stand-in has no
GPU to print it) and every replica's engine killed at once (testkit/hive.py).

    boot 1  fault 1: the replicas restart and are judged alive again; past the ladder's settle time,
            fault 2: the judge records it and reboots the machine (no report from this boot)
    boot 2  the ladder's record survived the reboot; fault 3: every replica held down; status, the
            metric and both /health say so, naming the GPU and the evidence; `applianctl
            remediation --clear` brings the replicas back; the final report
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from appliance import config
from applianctl.judge import hive
from builder import build, qemu

pytestmark = [pytest.mark.integration, pytest.mark.extended]

ROOT = Path(__file__).resolve().parents[2]
# amdgpu's reset sequence in the newer kernels' format ("amdgpu BDF: amdgpu: ..."), as Debian 13's prints it
RECORDING = ROOT / "tests/fixtures/gpu/kernel-log/mode1-reset-ring-timeout-sway8458.txt"
GPU = "0000:0a:00.0"
CLEAR = "applianctl remediation --clear"


def recorded_reset_line() -> str:
    """The recording's first line that tells a reset and names its GPU."""
    return next(line for line in RECORDING.read_text().splitlines()
                if any(e.kind == "reset" and e.gpu == GPU for e in hive.scan(line)))


@pytest.fixture(scope="module")
def hive_run(demo_config: config.Config, demo_image: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    work = tmp_path_factory.mktemp("hive")
    disk = work / "disk.raw"
    subprocess.run(["cp", "--sparse=always", str(demo_image), str(disk)], check=True)
    plan = {demo_config.appliance.version: [{"do": "hive-reset", "kernel_line": recorded_reset_line()}]}
    guest = qemu.Guest(disk, work, enroll_cert=build.secure_boot_certificate(demo_config))
    run = guest.boot(timeout=3600, credentials={"appliance.plan": json.dumps(plan)})
    return run, guest.console_log.read_text(errors="replace")


@pytest.fixture(scope="module")
def outcome(hive_run: tuple[dict[str, Any], str]) -> dict[str, Any]:
    run, console = hive_run
    found = [s for s in run.get("steps") or [] if s.get("do") == "hive-reset"]
    assert found, f"no outcome of the hive-reset step; the console ends:\n{console[-3000:]}"
    assert "error" not in found[-1], (found[-1]["error"], found[-1].get("judge_log"))
    return found[-1]


def _fault_named_the_gpu(fault: dict[str, Any], faults: int, step: str) -> None:
    assert fault["in_kernel_log"], fault  # journalctl -k shows the line written to /dev/kmsg
    reset = fault["reset"]
    assert "error" not in reset and len(reset["killed"]) == 2 and reset["gone"], reset
    ladder = fault["ladder"]
    assert fault["counted"] and (ladder["step"], ladder["faults"]) == (step, faults), ladder
    assert ladder["gpu"] == GPU and "GPU reset begin!" in ladder["evidence"][0], ladder


def test_the_first_hive_reset_restarts_the_replicas(outcome: dict[str, Any]) -> None:
    first = outcome["restart"]
    assert first["ladder_before"]["step"] == "none" and first["serving_before"]["alive"], first
    _fault_named_the_gpu(first["fault"], 1, "restart")
    # one fault, though two signals (the line, the replicas dying together) and several rounds saw it
    assert first["back"]["active"] and first["back"]["alive"], first["back"]
    part = first["status"]["remediation"]
    assert part["state"] == "degraded" and "restarted the replicas" in part["reason"], part
    assert f"hive-wide fault 1 on GPU {GPU}" in first["judge_log"], first["judge_log"]


def test_the_second_reboots_once_and_its_count_survives_the_reboot(outcome: dict[str, Any], hive_run: tuple[dict[str, Any], str]) -> None:
    run, _ = hive_run
    # the judge may reboot on the line alone, before the replicas were killed: what the fault did
    # is there when the boot check had time to keep it; the ladder's record says what was counted
    fault = outcome.get("reboot_fault")
    assert fault is None or fault["in_kernel_log"], fault
    after = outcome["after_reboot"]
    assert after["boot_id"] != outcome["boot_id"], "the machine was not rebooted"
    assert (after["ladder"]["step"], after["ladder"]["faults"], after["ladder"]["gpu"]) == ("reboot", 2, GPU), after["ladder"]
    assert "GPU reset begin!" in after["ladder"]["evidence"][0], after["ladder"]
    part = after["status"]["remediation"]
    assert part["state"] == "degraded" and "rebooted once" in part["reason"], part
    assert after["serving"]["alive"], after["serving"]
    # the first boot wrote no report: the judge rebooted it in the middle of the step
    assert not any(s.get("do") == "hive-reset" for r in run["earlier_boots"] for s in r.get("steps") or []), run["earlier_boots"]


def test_the_third_needs_physical_action_and_says_so_everywhere(outcome: dict[str, Any]) -> None:
    held = outcome["held"]
    _fault_named_the_gpu(held["fault"], 3, "physical")
    assert held["judged_held"] and held["stopped"], (held["judge"], held["units"])
    # kept down: nothing restarted them since
    assert all(u["ActiveState"] != "active" for u in held["units"].values()), held["units"]
    assert [r["state"] for r in held["judge"]["replicas"]] == ["held", "held"], held["judge"]
    part = held["status"]["remediation"]
    assert part["state"] == "down", part
    assert part["reason"].startswith(f"needs physical action: GPU {GPU} faulted 3 times"), part["reason"]
    assert "GPU reset begin!" in part["reason"] and part["reason"].endswith(CLEAR), part["reason"]
    assert part["gpu"] == GPU and part["evidence"] and part["step"] == "physical", part
    engine = held["status"]["engine"]
    assert engine["state"] == "down" and "needs physical action" in engine["reason"], engine
    assert [r["judgement"]["state"] for r in engine["replicas"]] == ["held", "held"], engine["replicas"]
    assert held["metric"] == ["appliance_needs_physical_action 1"], held["metric"]
    for health in (held["proxy_health"], held["judge_health"]):
        assert health["status"] == 503, health
        message = json.loads(health["body"])["error"]["message"]
        assert message.startswith(f"needs physical action: GPU {GPU}") and "GPU reset begin!" in message, message


def test_clear_brings_every_replica_back(outcome: dict[str, Any]) -> None:
    cleared = outcome["cleared"]
    command = cleared["command"]
    assert command["exit"] == 0, command
    said = command["said"]
    assert said["was_holding"] is True and said["judge"] == "released" and said["refused"] == {}, said
    assert said["before"]["step"] == "physical" and said["before"]["gpu"] == GPU, said
    assert (cleared["ladder"]["step"], cleared["ladder"]["faults"]) == ("none", 0), cleared["ladder"]
    assert cleared["serving"]["active"] and cleared["serving"]["alive"], cleared["serving"]
    # the replicas the judge held coming back are no new fault
    assert cleared["status"]["remediation"]["state"] == "ok", cleared["status"]["remediation"]
    assert cleared["metric"] == ["appliance_needs_physical_action 0"], cleared["metric"]
    assert cleared["proxy_health"]["status"] == 200 and cleared["judge_health"]["status"] == 200, cleared
