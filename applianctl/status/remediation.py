# SPDX-License-Identifier: MIT
"""Status part `remediation`: the hive-wide GPU fault ladder (applianctl/judge/hive.py) as its
record on /var says: ok with no fault counted, degraded while it restarts or has rebooted, down
when it holds the replicas down ("needs physical action", with the GPU and the evidence, and what
the operator does: check that GPU, then `applianctl remediation --clear`)."""

from __future__ import annotations

import time

from appliance.config import Config
from applianctl.judge import clear, hive
from applianctl.records import RemediationState
from applianctl.status.document import RemediationDetails
from applianctl.status.probes import DEGRADED, DOWN, OK, Part

MAX_REASON = 400


def probe_remediation(config: Config, now: float | None = None) -> Part:
    settings = config.engine.remediation
    ladder = hive.Ladder(settings)
    now = time.time() if now is None else now
    _, damage = ladder.load()
    state = ladder.current(now)
    last = hive.epoch(state.last_fault_at)
    details = RemediationDetails(
        step=state.step, faults=state.faults, last_fault_at=state.last_fault_at, gpu=state.gpu, evidence=state.evidence,
        resets_at=hive.iso(last + settings.quiet_s) if last is not None and state.step != hive.PHYSICAL else None,
        damaged=damage is not None)
    if state.step == hive.PHYSICAL:
        return Part(DOWN, held_reason(state), details)
    if damage is not None:
        return Part(DEGRADED, f"the ladder's record is damaged (counted as one fault): {damage}", details)
    if state.step == hive.NONE:
        return Part(OK, "", details)
    first = state.evidence[0] if state.evidence else ""
    did = "restarted the replicas" if state.step == hive.RESTART else "rebooted once"
    return Part(DEGRADED, f"{state.faults} hive-wide GPU fault(s) since {state.last_fault_at}, {did}: {first}"[:400], details)


def held_reason(state: RemediationState) -> str:
    """The down part's reason: the judge's line (the GPU, the count, the first evidence), cut so
    that what to do next always fits: check the GPU it names, then clear the ladder."""
    where = f"GPU {state.gpu}" if state.gpu else "the GPUs"
    todo = f"; check {where} (applianctl selftest, the kernel log), repair or replace it, then run: {clear.CLEAR_COMMAND}"
    return hive.needs_physical_action(state)[:MAX_REASON - len(todo)] + todo
