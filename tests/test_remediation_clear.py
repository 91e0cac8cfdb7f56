# SPDX-License-Identifier: MIT
"""`applianctl remediation [--clear]` (applianctl/judge/clear.py): the ladder cleared after a repair,
the judge's next round awaited before the replicas are started (so that a round that read the old
record does not stop them again), the units started through systemd with their start limit reset;
the judge that counts no new fault when the replicas it held come back; status's hint."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

import pytest

import appliance.config
import applianctl.__main__
from appliance import paths
from appliance.atomic import write_record
from appliance.config import Config
from appliance.config.model import Remediation
from appliance.schema import load_record
from applianctl.judge import clear, daemon, hive
from applianctl.judge.progress import Scrape
from applianctl.records import JudgeState, RemediationState
from applianctl.status import remediation
from applianctl.status.probes import DOWN

ROOT = Path(__file__).resolve().parents[1]
T0 = 1_900_000_000.0
HELD = RemediationState(step="physical", faults=3, last_fault_at=hive.iso(T0 - 600),
                        evidence=("1900000000.1 host kernel: amdgpu 0000:dd:00.0: amdgpu: GPU reset begin!",
                                  "replicas 0, 1 exited together"), gpu="0000:dd:00.0")
UNITS = ("appliance-engine@0.service", "appliance-engine@1.service")


def _config() -> Config:
    return appliance.config.load(ROOT / "appliance.toml", "demo")


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")


def _judge_record(path: Path, at: float, hive_line: str) -> None:
    write_record(path, JudgeState(checked_at=_iso(at), replicas=(), canaries_last_hour=0, alive=0, hive=hive_line))


class World:
    """A wall clock, the judge's record it rewrites each round (ROUNDS: the hive line of each round
    to come, "" lets the replicas go), and systemctl, each event in order."""

    def __init__(self, tmp_path: Path, rounds: list[str] | None, refuse: tuple[str, ...] = ()) -> None:
        self.now = T0
        self.judge_path = tmp_path / "judge.json"
        self.rounds = list(rounds) if rounds is not None else None
        self.refuse = refuse
        self.events: list[str] = []
        self.sleeps = 0
        self.next_round = T0 + 5
        if self.rounds is not None:
            _judge_record(self.judge_path, T0 - 2, hive.needs_physical_action(HELD))

    def wall(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        if self.rounds and self.now >= self.next_round:
            line = self.rounds.pop(0)
            _judge_record(self.judge_path, self.now, line)
            self.events.append(f"judge round: {'held' if line else 'released'}")
            self.next_round += 5

    def run(self, argv: list[str]) -> tuple[int, str]:
        self.events.append(" ".join(argv))
        if argv[1] == "start" and argv[-1] in self.refuse:
            return 5, f"Failed to start {argv[-1]}: Unit {argv[-1]} is masked.\n"
        return 0, ""


def _ladder(tmp_path: Path, state: RemediationState | None = HELD) -> hive.Ladder:
    ladder = hive.Ladder(Remediation(), path=tmp_path / "remediation.json", reboot=lambda: pytest.fail("no reboot here"))
    if state is not None:
        write_record(ladder.path, state)
    return ladder


def _clear(tmp_path: Path, world: World, ladder: hive.Ladder) -> clear.Cleared:
    return clear.clear(ladder, 2, 5, judge_path=world.judge_path, wall=world.wall, sleep=world.sleep, run=world.run)


def test_clear_waits_for_the_judge_to_let_go_then_starts_every_replica(tmp_path: Path) -> None:
    ladder = _ladder(tmp_path)
    # the round in progress during the clear read the old record and still holds; the next lets go
    world = World(tmp_path, ["needs physical action: still", ""])
    done = _clear(tmp_path, world, ladder)
    assert done.before == HELD and done.held and done.judge == clear.RELEASED and done.refused == {}
    assert load_record(RemediationState, ladder.path, lenient=True) == RemediationState(step="none", faults=0)
    assert ladder.current(T0 + 10).step == "none"
    assert world.events == [
        "judge round: held", "judge round: released",
        "systemctl reset-failed " + " ".join(UNITS),  # the faults used up their start limit
        *(f"systemctl start --no-block {u}" for u in UNITS),
    ]


def test_a_judge_record_from_before_the_clear_is_no_answer(tmp_path: Path) -> None:
    ladder = _ladder(tmp_path)
    world = World(tmp_path, [])  # the judge stuck: its last round (holding) is from before the clear
    _judge_record(world.judge_path, T0 - 1, "")  # and one that held nothing, also from before
    done = _clear(tmp_path, world, ladder)
    assert done.judge == clear.NO_ANSWER and world.sleeps >= 2 * (3 * 5 + 10)
    # started anyway: whatever holds them stops them again, nothing leaves them down for ever
    assert world.events[-2:] == [f"systemctl start --no-block {u}" for u in UNITS]


@pytest.mark.parametrize("record", ["absent", "old", "damaged"])
def test_no_judge_running_means_no_wait(tmp_path: Path, record: str) -> None:
    ladder = _ladder(tmp_path)
    world = World(tmp_path, None)
    if record == "old":
        _judge_record(world.judge_path, T0 - 3600, hive.needs_physical_action(HELD))
    elif record == "damaged":
        world.judge_path.write_text("{")
    done = _clear(tmp_path, world, ladder)
    assert done.judge == clear.NOT_RUNNING and world.sleeps == 0
    assert [e.split()[1] for e in world.events] == ["reset-failed", "start", "start"]


@pytest.mark.parametrize("state", [None, RemediationState(step="restart", faults=1, last_fault_at=hive.iso(T0 - 60),
                                                           evidence=("replicas 0, 1 exited together",))])
def test_a_ladder_that_holds_nothing_is_cleared_without_waiting(tmp_path: Path, state: RemediationState | None) -> None:
    ladder = _ladder(tmp_path, state)
    world = World(tmp_path, ["needs physical action: never read"])
    done = _clear(tmp_path, world, ladder)
    assert done.judge == clear.NOT_HOLDING and world.sleeps == 0 and not done.held
    assert load_record(RemediationState, ladder.path, lenient=True) == RemediationState(step="none", faults=0)


def test_a_damaged_record_is_replaced_and_said(tmp_path: Path) -> None:
    ladder = _ladder(tmp_path, None)
    ladder.path.write_text('{"format": 1, "step": "physical", "faults": 0}')
    world = World(tmp_path, None)
    done = _clear(tmp_path, world, ladder)
    assert done.damage is not None and done.judge == clear.NOT_HOLDING
    assert ladder.load() == (RemediationState(step="none", faults=0), None)


# ----------------------------------------------------------------------------------- the command line


@pytest.fixture
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The command on a device whose /var and /run are TMP_PATH; systemctl recorded."""
    import appliance.host_settings

    config = _config()
    monkeypatch.setattr(appliance.host_settings, "load_device", lambda *a, **kw: config)
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path)
    monkeypatch.setattr(paths, "JUDGE_STATE", tmp_path / "judge.json")
    calls: list[list[str]] = []
    refuse: set[str] = set()

    def systemctl(argv: list[str]) -> tuple[int, str]:
        calls.append(argv)
        return (5, f"Failed to start {argv[-1]}: Unit {argv[-1]} not found.") if argv[-1] in refuse else (0, "")

    monkeypatch.setattr(clear, "_systemctl", systemctl)
    return {"calls": calls, "refuse": refuse, "path": tmp_path / "remediation.json", "config": config}


def test_the_verb_shows_the_ladder_and_what_to_do(device: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    assert applianctl.__main__.main(["remediation"]) == 0
    assert capsys.readouterr().out.strip() == "no hive-wide GPU fault counted"
    write_record(device["path"], HELD)
    assert applianctl.__main__.main(["remediation"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("3 hive-wide GPU fault(s) on GPU 0000:dd:00.0") and "GPU reset begin!" in out
    assert out.strip().endswith("then: applianctl remediation --clear")
    assert applianctl.__main__.main(["remediation", "--json"]) == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["step"] == "physical" and shown["gpu"] == "0000:dd:00.0" and shown["needs_physical_action"] is True
    assert device["calls"] == []  # showing starts nothing


def test_the_verb_clears_and_says_what(device: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    write_record(device["path"], HELD)
    assert applianctl.__main__.main(["remediation", "--clear"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cleared: 3 hive-wide GPU fault(s) on GPU 0000:dd:00.0") and "needs physical action" in out
    assert "GPU reset begin!" in out and "starting appliance-engine@0.service, appliance-engine@1.service" in out
    assert load_record(RemediationState, device["path"], lenient=True) == RemediationState(step="none", faults=0)
    assert device["calls"][-2:] == [["systemctl", "start", "--no-block", u] for u in UNITS]
    # again, as JSON: nothing held any more; a unit systemd refuses is exit status 1
    device["refuse"].add(UNITS[1])
    assert applianctl.__main__.main(["remediation", "--clear", "--json"]) == 1
    done = json.loads(capsys.readouterr().out)
    assert done["was_holding"] is False and done["judge"] == clear.NOT_HOLDING
    assert done["started"] == list(UNITS) and list(done["refused"]) == [UNITS[1]]


def test_a_record_that_cannot_be_written_is_a_fault_to_fix(device: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    write_record(device["path"], HELD)

    def refused(path: Path, record: Any) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("appliance.atomic.write_record", refused)
    assert applianctl.__main__.main(["remediation", "--clear"]) == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and "hint:" in err
    assert device["calls"] == []  # nothing started while the ladder still holds


# ----------------------------------------------------------------------------------- status's hint


@pytest.mark.parametrize("evidence", ["amdgpu 0000:dd:00.0: amdgpu: GPU reset begin!", "x" * 240])
def test_status_down_says_to_check_the_gpu_then_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, evidence: str) -> None:
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path)
    write_record(tmp_path / "remediation.json", dataclasses.replace(HELD, evidence=(evidence,)))
    part = remediation.probe_remediation(_config(), now=T0)
    assert part.state == DOWN and part.reason.startswith("needs physical action: GPU 0000:dd:00.0 faulted 3 times")
    assert part.reason.endswith("; check GPU 0000:dd:00.0 (applianctl selftest, the kernel log), repair or replace it, "
                                "then run: applianctl remediation --clear")
    assert len(part.reason) <= remediation.MAX_REASON
    parsed = applianctl.__main__.build_parser().parse_args(clear.CLEAR_COMMAND.split()[1:])
    assert parsed.clear and parsed.func is clear.main


# ----------------------------------------------------------------------------------- the judge after a clear


class FakeUnits:
    def __init__(self) -> None:
        self.unit = {u: daemon.UnitState("active", "running", "2030-01-01T00:00:00+00:00") for u in UNITS}
        self.actions: list[tuple[str, str]] = []

    def states(self, names: list[str]) -> dict[str, daemon.UnitState]:
        return {n: self.unit[n] for n in names}

    def restart(self, name: str) -> None:
        self.actions.append(("restart", name))

    def stop(self, name: str) -> None:
        self.actions.append(("stop", name))
        self.unit[name] = daemon.UnitState("inactive", "dead")


def test_the_replicas_the_judge_held_coming_back_after_a_clear_are_no_new_fault(tmp_path: Path) -> None:
    now = {"t": 1000.0}
    reboots: list[str] = []
    config = _config()
    ladder = hive.Ladder(dataclasses.replace(config.engine.remediation, restarts=1, settle_s=10),
                         path=tmp_path / "remediation.json", reboot=lambda: reboots.append("reboot"))
    units = FakeUnits()
    j = daemon.Judge(config, ["http://r0", "http://r1"], units=units, state_path=tmp_path / "judge.json", ladder=ladder,
                     kernel_log=lambda since: [], clock=lambda: now["t"],
                     wall=lambda: datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(seconds=now["t"]),
                     scrape=lambda url: Scrape(now["t"], 1, 0, 0), log=lambda line: None)

    restarts = {"n": 0}

    def round_(states: tuple[str, str] | None = None, since: str = "") -> JudgeState:
        if states is not None:
            if states[1] == "auto-restart":  # systemd's own restart after the processes died: counted
                restarts["n"] += 1
            for u in UNITS:
                units.unit[u] = daemon.UnitState(*states, since or None, restarts["n"])
        now["t"] += 5
        return j.round()

    try:
        round_()
        for step in range(3):  # restart, reboot, hold: the replicas die together three times
            round_(("active", "running"), f"2030-01-01T0{step}:00:00+00:00")
            now["t"] += 60
            state = round_(("activating", "auto-restart"))
        assert state.hive.startswith("needs physical action") and reboots == ["reboot"]
        for _ in range(3):  # held: what systemd does is stopped again, rounds after rounds
            state = round_(("activating", "start"))
        assert [r.state for r in state.replicas] == ["held", "held"] and ("stop", UNITS[0]) in units.actions
        ladder.clear()
        state = round_(("inactive", "dead"))
        assert state.hive == "" and [r.state for r in state.replicas] == ["starting", "starting"]
        state = round_(("activating", "start"))
        state = round_(("active", "running"), "2030-01-01T05:00:00+00:00")
        assert ladder.load() == (RemediationState(step="none", faults=0), None)
        assert [r.state for r in state.replicas] == ["alive", "alive"] and reboots == ["reboot"]
    finally:
        j.close()
