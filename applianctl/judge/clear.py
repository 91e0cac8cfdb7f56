# SPDX-License-Identifier: MIT
"""`applianctl remediation`: the hive-wide GPU fault ladder (hive.py) as its record on /var says,
and `--clear` for whoever repaired the machine.

"Needs physical action" is never cleared by time: the judge (appliance-judge.service) keeps every
replica stopped while the record says so. `--clear` rewrites the record at the ladder's first step
(`hive.Ladder.clear`), waits for the judge's next round to let the replicas go (so that a round
which read the old record does not stop them again), then starts every replica's unit through
systemd (its start limit reset first: the faults used it up), each after its GPU self-test and the
stagger, as at boot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import cli_help, paths
from appliance.errors import UserError
from appliance.schema import dump_record, load_record
from applianctl.judge import hive
from applianctl.records import JudgeState, RemediationState

CLEAR_COMMAND = "applianctl remediation --clear"
# the judge answered: its round after the clear let the replicas go
RELEASED = "released"
# nothing to wait for: the ladder held nothing, or the judge's record is absent or old (it does not run)
NOT_HOLDING, NOT_RUNNING = "not holding", "not running"
NO_ANSWER = "no answer"


@dataclass(frozen=True)
class Cleared:
    """What `--clear` found and did: the ladder BEFORE (None when its record was absent), the damage
    found in it, the judge's answer (JUDGE: one of the words above), the units whose start was asked
    for, and those systemd refused (unit -> its message)."""

    before: RemediationState | None
    damage: str | None
    judge: str
    started: tuple[str, ...]
    refused: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"before": dump_record(self.before) if self.before is not None else None, "damaged": self.damage,
                "was_holding": self.held, "judge": self.judge, "started": list(self.started), "refused": self.refused}

    @property
    def held(self) -> bool:
        return self.before is not None and self.before.step == hive.PHYSICAL


def describe(state: RemediationState | None) -> str:
    """The ladder in one line, as an operator reads it."""
    if state is None or state.step == hive.NONE:
        return "no hive-wide GPU fault counted"
    where = f" on GPU {state.gpu}" if state.gpu else ""
    step = {hive.RESTART: "the replicas were restarted", hive.REBOOT: "the machine was rebooted once",
            hive.PHYSICAL: "needs physical action: every replica held down"}[state.step]
    return f"{state.faults} hive-wide GPU fault(s){where}, the last at {state.last_fault_at or 'an unknown time'}: {step}"


# ----------------------------------------------------------------------------------- the judge's round


def _checked_at(state: JudgeState) -> float | None:
    try:
        moment = datetime.datetime.fromisoformat(state.checked_at)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _judge_state(path: Path) -> JudgeState | None:
    try:
        return load_record(JudgeState, path, lenient=True)
    except UserError:
        return None


def wait_for_judge(cleared_at: float, interval_s: float, *, path: Path | None = None,
                   wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> str:
    """Until the judge's record shows a round at or after CLEARED_AT (seconds since the epoch) that
    holds nothing: RELEASED. NOT_RUNNING when its record is absent, unreadable or older than a few
    rounds (nobody is there to stop the replicas again); NO_ANSWER after a few rounds without one."""
    path = path or paths.JUDGE_STATE
    patience = 3 * interval_s + 10
    state = _judge_state(path)
    at = _checked_at(state) if state is not None else None
    if at is None or at < cleared_at - patience:
        return NOT_RUNNING
    # checked_at has whole seconds: a round published in the second of the clear may have read the
    # old record, unless it holds nothing
    since = math.floor(cleared_at)
    end = wall() + patience
    while True:
        state = _judge_state(path)
        at = _checked_at(state) if state is not None else None
        if state is not None and at is not None and at >= since and not state.hive:
            return RELEASED
        if wall() >= end:
            return NO_ANSWER
        sleep(0.5)


# ----------------------------------------------------------------------------------- systemd


def start_units(units: Sequence[str], run: Callable[[list[str]], tuple[int, str]] | None = None) -> dict[str, str]:
    """Each of UNITS started through systemd (its start limit reset first, without waiting for
    it to be up); the units systemd refused, with its message."""
    run = run or _systemctl
    run(["systemctl", "reset-failed", *units])
    refused = {}
    for unit in units:
        code, message = run(["systemctl", "start", "--no-block", unit])
        if code != 0:
            refused[unit] = message.strip().splitlines()[0] if message.strip() else f"exit status {code}"
    return refused


def _systemctl(argv: list[str]) -> tuple[int, str]:
    from appliance.run import call

    try:
        done = call(argv, timeout=60)
    except (OSError, TimeoutError) as e:
        return 1, str(e)
    except Exception as e:  # subprocess.TimeoutExpired: named through appliance/run.py only
        return 1, f"{type(e).__name__}: {e}"
    return done.returncode, (done.stderr or "") + (done.stdout or "")


# ----------------------------------------------------------------------------------- the command


def clear(ladder: hive.Ladder, replicas: int, interval_s: float, *, judge_path: Path | None = None,
          wall: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
          run: Callable[[list[str]], tuple[int, str]] | None = None) -> Cleared:
    """The ladder back at its first step; the judge's next round awaited when it held the replicas;
    every replica's unit started."""
    before, damage = ladder.load()
    cleared_at = wall()
    ladder.clear()
    # a damaged record reads as one fault (hive.Ladder.current): the judge held nothing for it
    holding = damage is None and before is not None and before.step == hive.PHYSICAL
    judge = wait_for_judge(cleared_at, interval_s, path=judge_path, wall=wall, sleep=sleep) if holding else NOT_HOLDING
    units = paths.engine_units(replicas)
    return Cleared(before, damage, judge, units, start_units(units, run))


def main(args: argparse.Namespace) -> int:
    from appliance.host_settings import load_device

    config = load_device()
    ladder = hive.Ladder(config.engine.remediation)
    if args.clear:
        done = clear(ladder, config.replicas, config.engine.progress.interval_s)
        if args.json:
            print(json.dumps(done.as_json(), indent=2, sort_keys=True))
        else:
            _print_cleared(done)
        return 1 if done.refused else 0
    now = time.time()
    _, damage = ladder.load()
    state = ladder.current(now)
    if args.json:
        print(json.dumps({**dump_record(state), "damaged": damage, "needs_physical_action": state.step == hive.PHYSICAL},
                         indent=2, sort_keys=True))
    else:
        print(describe(state))
        if damage is not None:
            print(f"the record is damaged (counted as one fault): {damage}")
        for line in state.evidence:
            print(f"  {line}")
        if state.step == hive.PHYSICAL:
            where = f"GPU {state.gpu}" if state.gpu else "the GPUs"
            print(f"check {where} (`applianctl selftest`, the kernel log), repair or replace it, then: {CLEAR_COMMAND}")
    return 1 if state.step == hive.PHYSICAL else 0


def _print_cleared(done: Cleared) -> None:
    if done.damage is not None:
        print(f"cleared a damaged record ({done.damage})")
    elif done.before is None or done.before.step == hive.NONE:
        print("nothing to clear: no hive-wide GPU fault counted")
    else:
        print(f"cleared: {describe(done.before)}")
        for line in done.before.evidence:
            print(f"  {line}")
    if done.judge == NO_ANSWER:
        print("the progress judge did not answer within a few rounds (appliance-judge.service): "
              "if it still holds the replicas, it stops them again")
    started = [u for u in done.started if u not in done.refused]
    if started:
        print(f"starting {', '.join(started)} (each after its GPU self-test, one after another); "
              "`applianctl status` shows them come back")
    for unit, message in done.refused.items():
        print(f"systemd refused to start {unit}: {message}")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = cli_help.verb_parser(
        sub, "remediation", "show the hive-wide GPU fault ladder; --clear it after a repair and start the replicas",
        examples=["applianctl remediation", CLEAR_COMMAND, f"{CLEAR_COMMAND} --json"],
        exit_codes=[(0, "nothing holds the replicas down; with --clear: cleared, every replica's start asked for"),
                    (1, "needs physical action (the replicas are held down); with --clear: systemd refused to start "
                        "a replica (its message)"),
                    cli_help.BAD_INPUT],
        details="An amdgpu reset or RAS fault, or the replicas dying together, restarts the replicas, then reboots "
                "once, then holds every replica down: needs physical action (engine.remediation). Time does not "
                "clear that; after checking the GPU it names (applianctl selftest), --clear puts the ladder back "
                "at its first step and starts every replica again, each after its GPU self-test.",
    )
    p.add_argument("--clear", action="store_true",
                   help="put the ladder back at its first step and start every replica (after a repair)")
    p.add_argument("--json", action="store_true", help="print the ladder (with --clear: what was cleared) as JSON")
    p.set_defaults(func=main)
