# SPDX-License-Identifier: MIT
"""The judge's rounds (appliance-judge.service): every engine.progress.interval_s, each replica's
unit state from systemd, its /metrics, its canary if one is due, its verdict (progress.judge), and
what follows from it.

- Not active (its unit activating: the start period, its warm-up; failed; restarting): "starting"
  or "restarting", never judged, its history dropped (a new process counts from zero).
- Stalled: at once the agent answers "down" for it (HAProxy takes it out) and /health counts it
  out, one line goes to the journal ("replica 1 stalled: no tokens for 170 s with 12 requests
  waiting"), and its unit is killed (SIGKILL to every process: a deadlocked engine core may never
  finish a graceful stop) and restarted through systemd: the unit's own path then runs again, its
  Requires= (appliance-shm-clean: the dead engine's offload file cleaned) and its ExecStartPre
  (the GPU self-test, then the stagger). It shows "restarting" until systemd reports a new start.
- Hive-wide faults (hive.py): each round the kernel log's fault lines and the replicas whose units
  exited together go to the ladder; when it says hold, every replica is stopped and held, and
  /health says why ("needs physical action: ...").

paths.JUDGE_STATE is rewritten (atomically) every round; the endpoints (endpoints.py) answer from
the last snapshot, which a stall updates before its restart is asked for.
"""

from __future__ import annotations

import collections
import concurrent.futures
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from appliance import paths
from appliance.atomic import write_record
from appliance.config import Config
from applianctl.judge import canary, hive
from applianctl.judge.progress import ALIVE, STALLED, Bounds, CanaryResult, Scrape, Track, judge
from applianctl.records import JudgeState, ReplicaJudgement

STARTING, RESTARTING, HELD = "starting", "restarting", "held"
CANARY_WINDOW_S = 3600.0  # JudgeState.canaries_last_hour
# A restart asked for that systemd never shows (no new start) is given up after this long: the
# replica is judged again from scratch rather than left "restarting" for ever.
RESTART_GRACE_S = 120.0


@dataclass(frozen=True)
class UnitState:
    """A replica's unit as systemd reports it: ActiveState, SubState, and when it last became
    active (ActiveEnterTimestamp, ISO 8601; None: never), which tells a new start from the old one."""

    active: str
    sub: str = ""
    active_since: str | None = None
    # NRestarts (systemd's automatic restarts after a failure) and Result: a unit stopped on purpose
    # (a shutdown, an update's reboot, the operator) ends with neither, and is no fault
    restarts: int = 0
    result: str = "success"


class Units(Protocol):
    """What the judge asks of systemd (SystemdUnits; a fake in tests)."""

    def states(self, names: Sequence[str]) -> dict[str, UnitState]: ...

    def restart(self, name: str) -> None: ...

    def stop(self, name: str) -> None: ...


class SystemdUnits:
    """The units' states over D-Bus (pydbus, as status reads them); the actions through systemctl
    (appliance/run.py), each bounded."""

    def __init__(self) -> None:
        self._bus: Any = None

    def states(self, names: Sequence[str]) -> dict[str, UnitState]:
        from applianctl.status import systemd

        if self._bus is None:
            self._bus = systemd.system_bus()
        try:
            units = systemd.read_units(names, self._bus)
        except Exception:
            self._bus = None  # a bus that went away: connect again next round
            raise
        return {u.name: UnitState(u.active_state, u.sub_state, u.active_since, u.restarts or 0, u.result or "success")
                for u in units}

    def restart(self, name: str) -> None:
        from appliance.run import call

        # SIGKILL to every process of the unit (podman's container is in its cgroup), then a restart
        # job at once (not the unit's own Restart= delay, which grows with each restart)
        call(["systemctl", "kill", "--kill-whom=all", "--signal=SIGKILL", name], timeout=30)
        done = call(["systemctl", "restart", "--no-block", name], timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"systemctl restart {name}: {(done.stderr or '').strip() or done.returncode}".splitlines()[0])

    def stop(self, name: str) -> None:
        from appliance.run import call

        call(["systemctl", "stop", "--no-block", name], timeout=30)


@dataclass
class Replica:
    index: int
    url: str
    unit: str
    state: str = STARTING
    reason: str = "not judged yet"
    since: str = ""
    track: Track = field(default_factory=Track)
    last_progress_at: str | None = None
    restarts: int = 0
    restarted_for: str = ""  # the judge restarted it for this; until systemd shows a new start
    restarted_from: str | None = None  # its unit's ActiveEnterTimestamp when the judge restarted it
    restarted_at: float = 0.0
    active_since: str | None = None
    restarts_seen: int = 0  # its unit's NRestarts at the judge's last round
    was_active: bool = False
    canary: concurrent.futures.Future[CanaryResult] | None = None


def _iso(moment: datetime.datetime) -> str:
    return moment.astimezone(datetime.UTC).isoformat(timespec="seconds")


def _wall() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def journal(line: str, warning: bool = True) -> None:
    """One line on stdout: the journal under systemd (with its priority), the terminal otherwise."""
    prefix = "<4>" if warning and os.environ.get("JOURNAL_STREAM") else ""
    print(prefix + line, flush=True)


class Judge:
    """The judge of CONFIG's replicas at URLS (one per replica, in order)."""

    def __init__(
        self,
        config: Config,
        urls: Sequence[str] | None = None,
        *,
        units: Units | None = None,
        act: bool = True,
        state_path: Path | None = None,
        ladder: hive.Ladder | None = None,
        kernel_log: Callable[[float | None], list[hive.Evidence]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime.datetime] = _wall,
        scrape: Callable[[str], Scrape] = canary.scrape,
        send_canary: Callable[[str, str, float], CanaryResult] | None = None,
        log: Callable[[str], None] = journal,
    ) -> None:
        self.config = config
        self.bounds = Bounds.of(config.engine.progress)
        urls = list(urls) if urls is not None else [f"http://127.0.0.1:{config.replica_port(i)}" for i in range(config.replicas)]
        if len(urls) != config.replicas:
            raise ValueError(f"{len(urls)} URLs for {config.replicas} replicas")
        self.replicas = [Replica(i, url, paths.engine_unit(i)) for i, url in enumerate(urls)]
        self.units = units or SystemdUnits()
        self.act = act
        self.state_path = state_path
        self.ladder = ladder
        self.kernel_log = kernel_log
        self.clock, self.wall = clock, wall
        self.scrape = scrape
        self.send_canary = send_canary or (lambda url, model, timeout: canary.send(url, model, timeout, clock))
        self.log = log
        self.hive = ""
        self._canaries: collections.deque[float] = collections.deque()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, 2 * config.replicas), thread_name_prefix="judge")
        self._lock = threading.Lock()
        self._snapshot: JudgeState | None = None
        self._snapshot_at: float | None = None
        self._exits: dict[int, float] = {}
        self._kernel_since: float | None = None
        self._units_problem = ""
        start = _iso(self.wall())
        for r in self.replicas:
            r.since = start

    # ------------------------------------------------------------------ what the endpoints read

    def snapshot(self) -> tuple[JudgeState | None, float | None]:
        """The last state published, and when (this judge's clock); (None, None) before the first round."""
        with self._lock:
            return self._snapshot, self._snapshot_at

    def _publish(self, now: float) -> JudgeState:
        while self._canaries and now - self._canaries[0] > CANARY_WINDOW_S:
            self._canaries.popleft()
        state = JudgeState(
            checked_at=_iso(self.wall()),
            replicas=tuple(ReplicaJudgement(replica=r.index, state=r.state, reason=r.reason, since=r.since,
                                            last_progress_at=r.last_progress_at,
                                            waiting=r.track.waiting + r.track.running if r.state == ALIVE or r.state == STALLED else 0,
                                            restarts=r.restarts)
                           for r in self.replicas),
            canaries_last_hour=len(self._canaries),
            alive=sum(r.state == ALIVE for r in self.replicas),
            hive=self.hive,
        )
        with self._lock:
            self._snapshot, self._snapshot_at = state, now
        return state

    # ------------------------------------------------------------------ one round

    def _set(self, r: Replica, state: str, reason: str) -> None:
        if state != r.state:
            r.since = _iso(self.wall())
        r.state, r.reason = state, reason

    def _forget(self, r: Replica) -> None:
        """R is no longer the process that was judged: its history and canary dropped."""
        r.track = Track()
        r.canary = None

    def round(self) -> JudgeState:
        """One round; the state published (and written to state_path when there is one)."""
        now = self.clock()
        names = [r.unit for r in self.replicas]
        try:
            states = self.units.states(names)
            self._units_problem = ""
        except Exception as e:  # GLib.Error from the bus: judge nothing, act on nothing this round
            problem = f"cannot ask systemd for the replicas' units: {e}".splitlines()[0]
            if problem != self._units_problem:
                self.log(f"judge: {problem}")
            self._units_problem = problem
            return self._finish(now)
        if self._hive_round(now, states):
            return self._finish(now)
        active = [r for r in self.replicas if self._ready(r, states.get(r.unit, UnitState("inactive")), now)]
        scrapes = {r.index: self._pool.submit(self._scrape_or_none, r.url) for r in active}
        for r in active:
            self._judge_one(r, scrapes[r.index].result(), now)
        return self._finish(now)

    def _finish(self, now: float) -> JudgeState:
        state = self._publish(now)
        if self.state_path is not None:
            write_record(self.state_path, state)
        return state

    def _scrape_or_none(self, url: str) -> Scrape | None:
        try:
            return self.scrape(url)
        except canary.ScrapeFailed:
            return None

    def _ready(self, r: Replica, unit: UnitState, now: float) -> bool:
        """Whether R's unit runs the instance to judge; its state set when not."""
        if r.restarted_for:
            new_start = unit.active == "active" and unit.active_since != r.restarted_from
            if not new_start and now - r.restarted_at < RESTART_GRACE_S + self.config.engine.health.start_period_s:
                self._forget(r)
                return False
            r.restarted_for, r.restarted_from = "", None
        if unit.active != "active":
            r.was_active = False  # its process ended (_hive_round has counted it)
            self._forget(r)
            if unit.active in ("failed", "deactivating") or unit.sub == "auto-restart":
                self._set(r, RESTARTING, f"its unit is {unit.active} ({unit.sub})" if unit.sub else f"its unit is {unit.active}")
            elif unit.active == "activating":
                self._set(r, STARTING, f"its unit is starting ({unit.sub})" if unit.sub else "its unit is starting")
            else:
                self._set(r, STARTING, f"its unit is {unit.active}: not running")
            return False
        if r.was_active and unit.active_since != r.active_since:
            self._forget(r)  # ended and started again between two rounds: a new process
        r.was_active, r.active_since = True, unit.active_since
        return True

    def _judge_one(self, r: Replica, scrape: Scrape | None, now: float) -> None:
        finished: CanaryResult | None = None
        if r.canary is not None and r.canary.done():
            finished, r.canary = r.canary.result(), None
        verdict = judge(r.track, scrape, now, self.bounds, canary=finished, canary_in_flight=r.canary is not None)
        r.track = verdict.track
        if verdict.track.progress_at is not None:
            r.last_progress_at = _iso(self.wall() - datetime.timedelta(seconds=max(0.0, now - verdict.track.progress_at)))
        if verdict.state == STALLED:
            self._stalled(r, verdict.reason, now)
            return
        if r.state != ALIVE:
            self._set(r, ALIVE, "")
        if verdict.send_canary:
            self._canaries.append(now)
            r.canary = self._pool.submit(self.send_canary, r.url, self.config.served_model, self.bounds.canary_timeout_s)

    def _stalled(self, r: Replica, reason: str, now: float) -> None:
        self._set(r, STALLED, f"stalled: {reason}")
        self._publish(now)  # out of the balancer and /health at once, before anything else
        self.log(f"replica {r.index} stalled: {reason}")
        if not self.act:
            return
        r.restarted_for, r.restarted_from, r.restarted_at = reason, r.active_since, now
        r.was_active = False  # the judge ended it: not an exit the hive ladder counts
        self._forget(r)
        try:
            self.units.restart(r.unit)
        except Exception as e:
            self.log(f"replica {r.index}: the restart of {r.unit} failed: {e}".splitlines()[0])
            r.restarted_for = ""
            return
        r.restarts += 1
        self._set(r, RESTARTING, f"restarted by the judge: {reason}")

    # ------------------------------------------------------------------ hive-wide faults

    def _hive_round(self, now: float, states: dict[str, UnitState]) -> bool:
        """The ladder's round; True when it holds every replica down (nothing else judged)."""
        if self.ladder is None:
            return False
        # which replicas' units ended since the last round (those the judge ended itself excepted)
        ended_now = []
        for r in self.replicas:
            unit = states.get(r.unit, UnitState("inactive"))
            failed = unit.restarts > r.restarts_seen or unit.result != "success"
            if (r.was_active and not r.restarted_for and failed
                    and (unit.active != "active" or unit.active_since != r.active_since)):
                ended_now.append(r.index)
            r.restarts_seen = unit.restarts
        wall = self.wall().timestamp()
        for i in ended_now:
            self._exits[i] = wall
        window = self.ladder.settings.together_s
        self._exits = {i: t for i, t in self._exits.items() if wall - t <= window}
        together = hive.died_together(self._exits, self.ladder.settings.together_replicas, window)
        if not set(together) & set(ended_now):
            together = ()
        evidence: list[hive.Evidence] = []
        if self.kernel_log is not None:
            try:
                evidence = self.kernel_log(self._kernel_since)
                self._kernel_since = wall
            except Exception as e:  # journalctl failed: the replicas' exits still count
                self.log(f"judge: cannot read the kernel log: {e}".splitlines()[0])
        decision = self.ladder.observe(wall, evidence, together)
        # once per decision: a hold is decided again every round, and says the same each time
        held_again = decision.action == hive.ACT_HOLD and decision.reason == self.hive
        if decision.reason and decision.action != hive.ACT_NONE and not held_again:
            self.log(f"hive: {decision.reason}")
        if decision.action != hive.ACT_HOLD:
            self.hive = ""
            return False
        self.hive = decision.reason
        for r in self.replicas:
            self._forget(r)
            r.was_active = False  # ended by the hold: after `applianctl remediation --clear`, no new fault
            self._set(r, HELD, decision.reason)
            unit = states.get(r.unit, UnitState("inactive"))
            if self.act and unit.active in ("active", "activating", "reloading"):
                try:
                    self.units.stop(r.unit)
                except Exception as e:
                    self.log(f"replica {r.index}: cannot stop {r.unit}: {e}".splitlines()[0])
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---------------------------------------------------------------------------------- the service


def sd_notify(message: str) -> None:
    """Tell systemd MESSAGE (READY=1, WATCHDOG=1) when run as a Type=notify service."""
    import socket

    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    target = "\0" + address[1:] if address.startswith("@") else address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.connect(target)
            s.sendall(message.encode())
        except OSError as e:
            print(f"judge: cannot notify systemd: {e}", file=sys.stderr)


def run_forever(j: Judge, health: str = paths.JUDGE_HEALTH, agent: str = paths.JUDGE_AGENT,
                stop: threading.Event | None = None) -> None:
    """The first round, then the endpoints on HEALTH and AGENT (host:port), then a round every
    interval until STOP is set; systemd hears READY after the first round, WATCHDOG after each."""
    from applianctl.judge import endpoints

    stop = stop or threading.Event()
    j.round()
    servers = endpoints.serve(j, health, agent, stale_after_s=endpoints.stale_after(j.bounds), clock=j.clock)
    sd_notify("READY=1")
    try:
        while not stop.wait(max(0.0, j.bounds.interval_s)):
            j.round()
            sd_notify("WATCHDOG=1")
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        j.close()

