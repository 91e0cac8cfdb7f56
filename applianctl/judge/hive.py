# SPDX-License-Identifier: MIT
"""Hive-wide GPU faults and the remediation ladder: restart, then one reboot, then "needs physical
action".

On MI300X a GPU hang or an uncorrectable error ends in an amdgpu reset, and a mode-1 reset of one
GPU of an XGMI hive resets every GPU of the hive (ROCm/rocm-systems#2657) and ends every process
holding /dev/kfd, whatever ROCR_VISIBLE_DEVICES says (ROCm/rocm-systems#7401, ROCm/rocm-systems#8504): one bad GPU
takes every replica down at once, and a GPU that faults again after each restart must not be
restarted for ever. So, as AMD's GPU Operator remediates (in rate-limited steps, then a request
for physical action), the judge (appliance-judge.service) calls `Ladder.observe` every round with

- `kernel_evidence`: this boot's kernel log lines of an amdgpu reset, a RAS fault, a GPU page fault
  or a ring timeout (`read_kernel_log`, `scan`; the patterns come from recorded public logs,
  tests/fixtures/gpu/kernel-log/README.md), each with the GPU it names;
- `died_together`: whether several replicas exited within a few seconds (`died_together`).

A fault is counted once per `engine.remediation.settle_s` (the rate limit: a reset's further
lines and the replicas dying one after the other are the same fault). The count picks the step:
the first `restarts` faults restart the replicas (systemd's own restart, staggered as every start
is; each replica's ExecStartPre runs `applianctl selftest --replica I` first, so no replica
comes back on a GPU that fails it), the next reboots the machine once, and one more stops: the
replicas are held down and status, the metrics, the alert and the proxy's /health say "needs
physical action" with the GPU and the evidence. The count is kept in paths.remediation_path() on
/var (written before a reboot is asked for, so the next boot reads it) and starts again after
`quiet_s` without a fault; "needs physical action" is not cleared by time (nothing runs to fault
again while it holds): `clear` is for whoever repaired the machine.

A damaged record (not JSON, wrong types, a negative count, a directory or a link in its place)
counts as one fault, never as none: a fault that damages the record must not reset the ladder
(the same rule as applianctl/slots/crashloop.py's boot count).
"""

from __future__ import annotations

import calendar
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from appliance import paths
from appliance.config.model import Remediation
from appliance.errors import UserError
from appliance.schema import load_record
from applianctl.records import LADDER_STEPS, RemediationState

NONE, RESTART, REBOOT, PHYSICAL = LADDER_STEPS
# what the judge does after an observation
ACT_NONE, ACT_RESTART, ACT_REBOOT, ACT_HOLD = "none", "restart", "reboot", "hold"
MAX_EVIDENCE = 5  # lines kept in the record
MAX_LINE = 240

# journalctl -k for this boot, each line with its time in seconds since the epoch ("short-unix")
KERNEL_LOG = ("journalctl", "-k", "-b", "0", "-o", "short-unix", "--no-pager", "-q")
MAX_LOG_CHARS = 4_000_000

# ----------------------------------------------------------------------------------- the kernel log

# Each kind of fault and the amdgpu lines that tell it (tests/fixtures/gpu/kernel-log/README.md
# names the public log each comes from). Only what a healthy GPU never prints: a ring named without
# "timeout" (set-up lines), a correctable RAS count, or "RAS: optional ras ta ucode" are no match.
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # amdgpu_device.c: "GPU reset begin!" (newer kernels add ". Source: N"), "GPU reset(%d) succeeded!",
    # the reset method ("MODE1 reset", "GPU mode1 reset", "MODE2 reset", "BACO reset"), "GPU reset succeeded, trying to resume"
    ("reset", re.compile(r"\bGPU reset begin!|\bGPU reset\(\d+\) succeeded!|\bGPU reset succeeded, trying to resume"
                         r"|\b(?:MODE[012]|BACO|GPU mode1) reset\Z", re.I)),
    # amdgpu_job.c's timeout: "[drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring sdma0 timeout, signaled seq=..." (older)
    # and "amdgpu BDF: amdgpu: ring gfx_0.0.0 timeout, signaled seq=..." (newer)
    ("ring timeout", re.compile(r"\bring \S+ timeout, signaled seq=")),
    # amdgpu_ras.c: uncorrectable, deferred or poison errors counted ("{2}socket: 0, die: 0, 1 new uncorrectable
    # hardware errors detected in umc block"), the fatal ATHUB interrupt, the bad-page table past its threshold
    # (the same lines applianctl/selftest/facts.py reads before an engine starts)
    ("ras", re.compile(r"\b[1-9][0-9]* (?:new )?(?:uncorrectable hardware errors|deferred hardware errors|poison consumption)"
                       r" detected|uncorrectable hardware error ?\(ERREVENT_ATHUB_INTERRUPT\) detected"
                       r"|RAS records: ?\d+ exceed threshold", re.I)),
    # gmc_v9_0.c / gmc_v11_0.c: "[gfxhub] page fault (src_id:...", "[mmhub0] retry page fault (src_id:..."
    ("page fault", re.compile(r"\[(?:gfxhub|mmhub)\d*\] (?:retry |no-retry )?page fault\b")),
    # ROCr (user space: the engine's stderr, not the kernel's): the line a process aborts with
    ("memory access fault", re.compile(r"\bMemory access fault by GPU node-\d+")),
)
_PCI = re.compile(r"\b([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7])\b")
_NODE = re.compile(r"\bGPU (node-\d+)\b")
_UNIX_TIME = re.compile(r"^([0-9]{9,11}\.[0-9]{1,9}) ")


@dataclass(frozen=True)
class Evidence:
    """One kernel log line that tells a fault: its KIND (PATTERNS), the GPU it names (a PCI address
    such as "0000:dd:00.0", a KFD node such as "node-1", or None), and its time (seconds since the
    epoch) when the log gave one."""

    kind: str
    line: str
    gpu: str | None = None
    at: float | None = None


def scan(text: str) -> list[Evidence]:
    """The fault lines of TEXT (a kernel log in any of journalctl's, dmesg's or syslog's forms),
    in order, at most 1000."""
    found: list[Evidence] = []
    for raw in text.splitlines():
        if len(found) >= 1000:
            break
        at = None
        if m := _UNIX_TIME.match(raw):
            at = float(m.group(1))
        for kind, pattern in PATTERNS:
            if pattern.search(raw.rstrip()):
                gpu = _PCI.search(raw) or _NODE.search(raw)
                found.append(Evidence(kind, raw.strip()[:MAX_LINE], gpu.group(1).lower() if gpu else None, at))
                break
    return found


def read_kernel_log(since: float | None = None, *, run: Callable[[Sequence[str]], str] | None = None,
                    path: Path | None = None) -> list[Evidence]:
    """This boot's fault lines (journalctl -k through appliance/run.py, or the file PATH in tests),
    those after SINCE (seconds since the epoch) only when given. UserError when journalctl fails."""
    if path is not None:
        text = path.read_text(encoding="utf-8", errors="replace")
    else:
        argv = [*KERNEL_LOG] + ([f"--since=@{int(since)}"] if since is not None else [])
        text = (run or _journalctl)(argv)
    evidence = scan(text[-MAX_LOG_CHARS:])
    return [e for e in evidence if since is None or e.at is None or e.at > since]


def _journalctl(argv: Sequence[str]) -> str:
    from appliance.run import run

    return run(argv, "journalctl -k", "is systemd-journald running? (systemctl status systemd-journald)", timeout=30.0)


# ----------------------------------------------------------------------------------- replicas together


def died_together(exits: Mapping[int, float], count: int, window_s: float) -> tuple[int, ...]:
    """The replicas (their numbers, in order) when at least COUNT of them exited within WINDOW_S
    seconds of one another; () otherwise. EXITS: each replica's last exit time (seconds)."""
    times = sorted((t, r) for r, t in exits.items())
    best: tuple[int, ...] = ()
    start = 0
    for end in range(len(times)):
        while times[end][0] - times[start][0] > window_s:
            start += 1
        if end - start + 1 >= count and end - start + 1 > len(best):
            best = tuple(sorted(r for _, r in times[start:end + 1]))
    return best


# ----------------------------------------------------------------------------------- the ladder


@dataclass(frozen=True)
class Decision:
    """What the judge does after an observation: ACTION is none, restart (let the replicas come back,
    staggered, each after its self-test), reboot (asked for already when observe returns), or hold
    (keep every replica down); REASON says why in one line; STATE is the ladder as recorded."""

    action: str
    reason: str
    state: RemediationState


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def epoch(text: str | None) -> float | None:
    if text is None:
        return None
    return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")))


def step_for(faults: int, restarts: int) -> str:
    """The ladder's step after FAULTS faults."""
    if faults == 0:
        return NONE
    if faults <= restarts:
        return RESTART
    return REBOOT if faults == restarts + 1 else PHYSICAL


def needs_physical_action(state: RemediationState | None) -> str:
    """One line for the judge's /health 503 and JudgeState.hive when STATE holds the replicas
    down; "" otherwise."""
    if state is None or state.step != PHYSICAL:
        return ""
    where = f"GPU {state.gpu}" if state.gpu else "a GPU"
    first = state.evidence[0] if state.evidence else "no evidence kept"
    return f"needs physical action: {where} faulted {state.faults} times (restarted, rebooted): {first}"[:400]


class Ladder:
    """The ladder as the judge holds it: SETTINGS (engine.remediation), the record at PATH
    (paths.remediation_path()), and REBOOT, which asks systemd to reboot (replaced in tests)."""

    def __init__(self, settings: Remediation | None = None, *, path: Path | None = None,
                 reboot: Callable[[], None] | None = None) -> None:
        self.settings = settings or Remediation()
        self.path = path or paths.remediation_path()
        self.reboot = reboot or _reboot

    def load(self) -> tuple[RemediationState | None, str | None]:
        """The record (None when there is none or it is damaged), and what is wrong with it."""
        try:
            record = load_record(RemediationState, self.path, lenient=True)
            if record is not None:
                epoch(record.last_fault_at)  # an unreadable time is damage too
                if record.step == PHYSICAL and record.faults == 0:
                    raise ValueError("needs physical action with no fault counted")
            return record, None
        except UserError as e:
            return None, e.message
        except ValueError as e:
            return None, f"{self.path}: {e}"

    def current(self, now: float) -> RemediationState:
        """The ladder at NOW, as the record says, after the quiet time (nothing written). A damaged
        record reads as one fault at NOW."""
        record, damage = self.load()
        if damage is not None:
            return self._damaged(now, damage)
        if record is None:
            return RemediationState(step=NONE, faults=0)
        last = epoch(record.last_fault_at)
        if record.step != PHYSICAL and (last is None or now - last >= self.settings.quiet_s):
            return RemediationState(step=NONE, faults=0)
        return record

    def _damaged(self, now: float, damage: str) -> RemediationState:
        return RemediationState(step=step_for(1, self.settings.restarts), faults=1, last_fault_at=iso(now),
                                evidence=(f"the ladder's record was damaged: {damage}"[:MAX_LINE],))

    def observe(self, now: float, kernel_evidence: Iterable[Evidence] = (), replicas_died_together: Sequence[int] = ()) -> Decision:
        """One round: the evidence seen since the last round (kernel log lines; the replicas that
        exited together), counted as at most one fault per settle_s. Writes the record when it
        changed, and asks for the reboot (after the record is written) when that is the step."""
        record, damage = self.load()
        state = self.current(now)
        if damage is not None:
            print(f"hive: {damage}; counted as one fault", file=sys.stderr)
        # after damage nothing says which lines were counted: all of them are new
        last = None if damage is not None else epoch(state.last_fault_at)
        fresh = [e for e in kernel_evidence if e.at is None or last is None or e.at > last]
        together = tuple(replicas_died_together)
        if state.step == PHYSICAL:
            self._write(state, record, damage)
            return Decision(ACT_HOLD, needs_physical_action(state), state)
        if not fresh and not together:
            self._write(state, record, damage)
            return Decision(ACT_NONE, "", state)
        lines = [e.line for e in fresh]
        if together:
            lines.append("replicas " + ", ".join(str(r) for r in together) + " exited together")
        gpu = next((e.gpu for e in fresh if e.gpu and e.kind in ("ras", "reset")), None) \
            or next((e.gpu for e in fresh if e.gpu), None)
        if damage is None and last is not None and now - last < self.settings.settle_s:
            # the same fault still unfolding: no step taken
            self._write(state, record, damage)
            return Decision(ACT_NONE, f"the same hive-wide fault as at {state.last_fault_at} (within "
                                      f"{self.settings.settle_s} s): {lines[0]}"[:400], state)
        faults = state.faults + 1
        state = RemediationState(step=step_for(faults, self.settings.restarts), faults=faults, last_fault_at=iso(now),
                                 evidence=tuple(x[:MAX_LINE] for x in lines[:MAX_EVIDENCE]), gpu=gpu or state.gpu)
        self._write(state, record, damage)
        why = f"hive-wide fault {faults}" + (f" on GPU {state.gpu}" if state.gpu else "") + f": {lines[0]}"
        if state.step == RESTART:
            return Decision(ACT_RESTART, f"{why}; the replicas restart, each after its GPU self-test"[:400], state)
        if state.step == REBOOT:
            print(f"hive: {why}; rebooting", file=sys.stderr)
            self.reboot()
            return Decision(ACT_REBOOT, f"{why}; rebooting once"[:400], state)
        return Decision(ACT_HOLD, needs_physical_action(state), state)

    def _write(self, state: RemediationState, record: RemediationState | None, damage: str | None) -> None:
        """The record holds STATE, when it does not already (a damaged one always is replaced)."""
        if damage is None and state == record:
            return
        if damage is None and record is None and state.faults == 0:
            return  # nothing to keep
        from applianctl.slots import history

        history.write(self.path, state)

    def clear(self) -> RemediationState:
        """After a repair: the ladder back at its first step (the record rewritten)."""
        state = RemediationState(step=NONE, faults=0)
        from applianctl.slots import history

        history.write(self.path, state)
        return state


def _reboot() -> None:
    from appliance.run import run

    run(["systemctl", "reboot"], "systemctl reboot", "the hive-wide fault ladder asked for a reboot: reboot by hand")

