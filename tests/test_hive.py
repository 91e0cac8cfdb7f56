# SPDX-License-Identifier: MIT
"""applianctl/judge/hive.py: the kernel log's amdgpu reset and RAS lines (recorded public logs,
tests/fixtures/gpu/kernel-log/README.md), replicas dying together, and the remediation ladder
(restart, one reboot, needs physical action): its rate limit, its record across a reboot, the quiet
time and a damaged record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import appliance.config
from appliance.config import Config
from appliance.config.model import Remediation
from appliance.schema import load_record
from applianctl.judge import hive
from applianctl.records import RemediationState
from applianctl.status import exposition, remediation
from applianctl.status.document import RemediationDetails, StatusDocument
from applianctl.status.probes import DEGRADED, DOWN, OK

FIXTURES = Path(__file__).parent / "fixtures"
KERNEL_LOGS = FIXTURES / "gpu" / "kernel-log"
T0 = 1_760_000_000.0  # any time: the ladder only compares times


# ----------------------------------------------------------------------------------- patterns

# each recording: the kinds it must show and the GPU the first fault line names
RECORDED = {
    "mi300x-hive-hang-athub-aca-rocm4021.txt": ({"ras"}, "0000:dd:00.0"),
    "mi300x-mmhub-retry-page-fault-rocm4021.txt": ({"page fault"}, "0000:3d:00.0"),
    "mode1-reset-ring-timeout-sway8458.txt": ({"ring timeout", "reset"}, "0000:0a:00.0"),
    "mode1-reset-journal-cat-wayvr650.txt": ({"ring timeout", "reset"}, "0000:2d:00.0"),
    "gfxhub-page-fault-reset-syslog-rocm3265.txt": ({"reset", "page fault"}, "0000:03:00.0"),
    "sdma-ring-timeout-old-format-rocm2533.txt": ({"ring timeout", "reset"}, None),
    "baco-reset-succeeded-cosmic-comp2626.txt": ({"ring timeout", "reset"}, None),
    "rocr-memory-access-fault-node1-rocm4554.txt": ({"memory access fault"}, "node-1"),
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_each_recorded_fault_log_is_recognised_with_the_gpu_it_names(name: str) -> None:
    kinds, first_gpu = RECORDED[name]
    found = hive.scan((KERNEL_LOGS / name).read_text())
    assert {e.kind for e in found} == kinds
    assert found[0].gpu == first_gpu
    assert all(e.line in (KERNEL_LOGS / name).read_text() for e in found)


def test_the_lines_that_name_each_reset_step_are_found() -> None:
    lines = [e.line for e in hive.scan((KERNEL_LOGS / "baco-reset-succeeded-cosmic-comp2626.txt").read_text())]
    assert any(line.endswith("GPU reset(2) succeeded!") for line in lines)
    assert any(line.endswith("BACO reset") for line in lines)
    mode1 = [e.line for e in hive.scan((KERNEL_LOGS / "mode1-reset-ring-timeout-sway8458.txt").read_text())]
    assert any(line.endswith("amdgpu: MODE1 reset") for line in mode1) and any(line.endswith("GPU mode1 reset") for line in mode1)
    begin = hive.scan((KERNEL_LOGS / "mode1-reset-journal-cat-wayvr650.txt").read_text())
    assert any("GPU reset begin!. Source: 1" in e.line for e in begin)


def test_the_mi300x_hive_fault_names_the_gpu_that_raised_it() -> None:
    found = hive.scan((FIXTURES / "gpu-faults" / "dmesg-ras-mi300x-rocm-issue-4021.txt").read_text())
    assert [(e.kind, e.gpu) for e in found] == [("ras", "0000:dd:00.0"), ("reset", "0000:dd:00.0")]


@pytest.mark.parametrize("name", ["healthy-probe-debian13-rocm5671.txt", "healthy-ring-setup-pop1543.txt"])
def test_healthy_logs_match_nothing(name: str) -> None:
    assert hive.scan((KERNEL_LOGS / name).read_text()) == []


def test_correctable_errors_and_aca_dumps_alone_are_no_fault() -> None:
    text = (FIXTURES / "gpu-faults" / "dmesg-ras-mi300x-rocm-issue-4021.txt").read_text().splitlines()
    healthy = [line for line in text if "correctable hardware errors" in line and "uncorrectable" not in line]
    healthy += [line for line in text if "aca entry" in line or "Failed to restore process queues" in line]
    assert len(healthy) > 10 and hive.scan("\n".join(healthy)) == []


def test_the_kernel_log_is_this_boots_through_journalctl_and_only_what_is_newer() -> None:
    asked: list[list[str]] = []
    log = (f"{T0 - 5:.6f} host kernel: amdgpu 0000:dd:00.0: amdgpu: GPU reset begin!\n"
           f"{T0 + 5:.6f} host kernel: amdgpu 0000:4e:00.0: amdgpu: MODE1 reset\n"
           f"{T0 + 6:.6f} host kernel: amdgpu 0000:4e:00.0: amdgpu: ring gfx_0.0.0 uses VM inv eng 0 on hub 0\n")

    def run(argv: list[str]) -> str:
        asked.append(list(argv))
        return log

    found = hive.read_kernel_log(since=T0, run=run)
    assert asked[0][:5] == ["journalctl", "-k", "-b", "0", "-o"] and f"--since=@{int(T0)}" in asked[0]
    assert [(e.gpu, e.at) for e in found] == [("0000:4e:00.0", T0 + 5)]
    assert len(hive.read_kernel_log(run=run)) == 2
    assert hive.read_kernel_log(path=KERNEL_LOGS / "healthy-ring-setup-pop1543.txt") == []


def test_replicas_dying_together_within_the_window() -> None:
    assert hive.died_together({0: 100.0, 1: 104.0, 2: 900.0}, 2, 30) == (0, 1)
    assert hive.died_together({0: 100.0, 1: 104.0, 2: 110.0, 3: 900.0}, 3, 30) == (0, 1, 2)
    assert hive.died_together({0: 100.0, 1: 200.0}, 2, 30) == ()
    assert hive.died_together({0: 100.0}, 2, 30) == ()  # one replica alone is a crash, not the hive


# ----------------------------------------------------------------------------------- the ladder


class Reboots:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: list[RemediationState | None] = []

    def __call__(self) -> None:  # what systemd would find on /var at the reboot
        self.calls.append(load_record(RemediationState, self.path, lenient=True))


def _ladder(tmp_path: Path, **settings: int) -> tuple[hive.Ladder, Reboots]:
    path = tmp_path / "remediation.json"
    reboots = Reboots(path)
    return hive.Ladder(Remediation(**settings), path=path, reboot=reboots), reboots


def _fault(at: float, gpu: str = "0000:dd:00.0") -> list[hive.Evidence]:
    return [hive.Evidence("reset", f"amdgpu {gpu}: amdgpu: GPU reset begin!", gpu, at)]


def test_restart_then_one_reboot_then_needs_physical_action(tmp_path: Path) -> None:
    ladder, reboots = _ladder(tmp_path)
    assert ladder.observe(T0).action == hive.ACT_NONE and not ladder.path.exists()
    first = ladder.observe(T0, _fault(T0))
    assert (first.action, first.state.step, first.state.faults, first.state.gpu) == ("restart", "restart", 1, "0000:dd:00.0")
    assert reboots.calls == []
    second = ladder.observe(T0 + 600, [], (0, 1))
    assert (second.action, second.state.step, second.state.faults) == ("reboot", "reboot", 2)
    # the record was on disk, saying "reboot", before systemd was asked
    assert len(reboots.calls) == 1 and reboots.calls[0] == second.state
    assert second.state.evidence == ("replicas 0, 1 exited together",) and second.state.gpu == "0000:dd:00.0"
    third = ladder.observe(T0 + 1200, _fault(T0 + 1190))
    assert (third.action, third.state.step, third.state.faults) == ("hold", "physical", 3)
    assert third.reason.startswith("needs physical action: GPU 0000:dd:00.0 faulted 3 times")
    assert len(reboots.calls) == 1  # one reboot, never two
    # held whatever comes next, and no further step
    assert ladder.observe(T0 + 5000, _fault(T0 + 4999)).action == "hold"
    assert ladder.observe(T0 + 90000).action == "hold"
    assert hive.needs_physical_action(ladder.current(T0 + 90000)) == third.reason


def test_more_evidence_within_the_settle_time_is_the_same_fault(tmp_path: Path) -> None:
    ladder, reboots = _ladder(tmp_path, settle_s=300)
    ladder.observe(T0, _fault(T0))
    # a hive reset prints on every GPU, then the replicas die: one fault, one step
    for dt in (5, 20, 299):
        again = ladder.observe(T0 + dt, _fault(T0 + dt, "0000:4e:00.0"), (0, 1))
        assert again.action == "none" and again.state.faults == 1 and "the same hive-wide fault" in again.reason
    assert reboots.calls == []
    assert ladder.observe(T0 + 301, _fault(T0 + 301)).action == "reboot"


def test_evidence_older_than_the_last_fault_is_not_counted_again(tmp_path: Path) -> None:
    ladder, reboots = _ladder(tmp_path, settle_s=10)
    ladder.observe(T0, _fault(T0))
    # the judge re-read the whole boot's log: the line counted already is no new fault
    assert ladder.observe(T0 + 100, _fault(T0 - 1)).action == "none"
    assert ladder.current(T0 + 100).faults == 1 and reboots.calls == []


def test_more_restarts_before_the_reboot_when_configured(tmp_path: Path) -> None:
    ladder, _ = _ladder(tmp_path, restarts=3, settle_s=10)
    steps = [ladder.observe(T0 + 100 * i, _fault(T0 + 100 * i)).action for i in range(5)]
    assert steps == ["restart", "restart", "restart", "reboot", "hold"]
    ladder0, _ = _ladder(tmp_path / "none", restarts=0)
    (tmp_path / "none").mkdir()
    assert ladder0.observe(T0, _fault(T0)).action == "reboot"


def test_the_count_survives_a_reboot(tmp_path: Path) -> None:
    ladder, _ = _ladder(tmp_path)
    ladder.observe(T0, _fault(T0))
    ladder.observe(T0 + 600, _fault(T0 + 600))  # reboot asked for
    after, reboots = _ladder(tmp_path)  # the next boot's judge: a new ladder that only has the record
    assert after.current(T0 + 900).step == "reboot"
    decision = after.observe(T0 + 900, _fault(T0 + 890))
    assert decision.action == "hold" and reboots.calls == []


@pytest.mark.programs
def test_a_new_process_reads_the_record_the_last_one_wrote(tmp_path: Path) -> None:
    ladder, _ = _ladder(tmp_path)
    ladder.observe(T0, _fault(T0))
    ladder.observe(T0 + 600, _fault(T0 + 600))
    code = ("import sys; from pathlib import Path; from applianctl.judge import hive\n"
            "l = hive.Ladder(path=Path(sys.argv[1]), reboot=lambda: print('REBOOT'))\n"
            f"print(l.current({T0 + 900}).step, l.observe({T0 + 900}, [], (0, 1)).action)\n")
    out = subprocess.run([sys.executable, "-c", code, str(ladder.path)], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).parent.parent, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["reboot", "hold"]


def test_the_ladder_starts_again_after_the_quiet_time(tmp_path: Path) -> None:
    ladder, reboots = _ladder(tmp_path, quiet_s=3600)
    ladder.observe(T0, _fault(T0))
    assert ladder.current(T0 + 3599).faults == 1
    assert ladder.current(T0 + 3600) == RemediationState(step="none", faults=0)
    assert ladder.observe(T0 + 3600).action == "none"
    assert load_record(RemediationState, ladder.path, lenient=True) == RemediationState(step="none", faults=0)
    # the next fault restarts again instead of rebooting
    assert ladder.observe(T0 + 4000, _fault(T0 + 4000)).action == "restart" and reboots.calls == []


def test_needs_physical_action_is_not_cleared_by_time_only_by_clear(tmp_path: Path) -> None:
    ladder, _ = _ladder(tmp_path, restarts=0, quiet_s=600, settle_s=10)
    ladder.observe(T0, _fault(T0))
    assert ladder.observe(T0 + 100, _fault(T0 + 100)).action == "hold"
    assert ladder.current(T0 + 30 * 86400).step == "physical"
    assert ladder.clear() == RemediationState(step="none", faults=0)
    assert ladder.observe(T0 + 30 * 86400).action == "none"


@pytest.mark.parametrize("damage", ["not json", '{"format": 1, "step": "restart", "faults": -1}',
                                    '{"format": 1, "step": "sideways", "faults": 1}',
                                    '{"format": 1, "step": "restart", "faults": 1, "last_fault_at": "yesterday"}',
                                    '{"format": 1, "step": "physical", "faults": 0}', "directory"])
def test_a_damaged_record_counts_as_one_fault_never_as_none(tmp_path: Path, damage: str) -> None:
    ladder, reboots = _ladder(tmp_path)
    if damage == "directory":
        ladder.path.mkdir()
    else:
        ladder.path.write_text(damage)
    state = ladder.current(T0)
    assert state.faults == 1 and state.step == "restart" and "damaged" in state.evidence[0]
    # the damage is one fault: the next real fault is the second, which reboots
    assert ladder.observe(T0, _fault(T0)).action == "reboot" and len(reboots.calls) == 1
    assert load_record(RemediationState, ladder.path, lenient=True).faults == 2  # type: ignore[union-attr]


def test_a_damaged_record_without_a_fault_is_rewritten_as_one(tmp_path: Path) -> None:
    ladder, reboots = _ladder(tmp_path)
    ladder.path.write_text("{")
    assert ladder.observe(T0).action == "none" and reboots.calls == []
    written = json.loads(ladder.path.read_text())
    assert written["faults"] == 1 and written["step"] == "restart"


# ----------------------------------------------------------------------------------- status, metrics


def _config() -> Config:
    return appliance.config.load(Path(__file__).parent.parent / "appliance.toml", "demo")


def test_the_status_part_and_its_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance import paths

    monkeypatch.setattr(paths, "STATE_DIR", tmp_path)
    config = _config()
    part = remediation.probe_remediation(config, now=T0)
    assert part.state == OK and isinstance(part.details, RemediationDetails) and part.details.step == "none"
    ladder = hive.Ladder(path=tmp_path / "remediation.json", reboot=lambda: None)
    ladder.observe(T0, _fault(T0))
    part = remediation.probe_remediation(config, now=T0 + 10)
    assert part.state == DEGRADED and "restarted the replicas" in part.reason and "GPU reset begin!" in part.reason
    ladder.observe(T0 + 600, _fault(T0 + 600))
    ladder.observe(T0 + 1200, _fault(T0 + 1200))
    part = remediation.probe_remediation(config, now=T0 + 1300)
    assert part.state == DOWN and part.reason.startswith("needs physical action: GPU 0000:dd:00.0")
    assert isinstance(part.details, RemediationDetails) and part.details.gpu == "0000:dd:00.0" and part.details.evidence
    doc = StatusDocument(schema=1, state=DOWN, reason=part.reason, appliance="a", version="1", profile="demo",
                         generated_at="", elapsed_s=0.1, parts={"remediation": part})
    text = exposition.render(doc)
    assert "appliance_needs_physical_action 1" in text.splitlines()
    assert 'appliance_remediation_step{step="physical"} 1' in text and 'appliance_remediation_step{step="none"} 0' in text
    (tmp_path / "remediation.json").write_text("[]")
    assert remediation.probe_remediation(config, now=T0).state == DEGRADED
