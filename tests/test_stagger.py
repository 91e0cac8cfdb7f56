# SPDX-License-Identifier: MIT
"""Staggered replica starts (applianctl/engine/stagger.py): replica I waits for replica I-1 as
systemd reports it over D-Bus (python-dbusmock's systemd on a private bus, real pydbus), and at most
I x topology.stagger_s."""

from __future__ import annotations

import pytest

pytest.importorskip("dbusmock")

from mock_systemd import MockSystemd

from appliance import paths
from applianctl.engine import stagger


class Clock:
    """A clock that moves only when the waiter sleeps; AT[t] runs once the time reaches t."""

    def __init__(self, at: dict[float, object] | None = None) -> None:
        self.now = 0.0
        self.at = dict(at or {})
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        for t in sorted(t for t in self.at if t <= self.now):
            self.at.pop(t)()  # type: ignore[operator]


def _wait(mock_systemd: MockSystemd, replica: int, stagger_s: int, clock: Clock) -> str:
    bus = mock_systemd.bus()
    return stagger.wait_for_previous(replica, stagger_s, lambda name: stagger.starting(bus, name), clock, clock.sleep)


def test_a_replica_waits_until_the_previous_one_is_healthy(mock_systemd: MockSystemd) -> None:
    previous = paths.engine_unit(1)
    mock_systemd.add(previous, "activating", "start", restarts=0, result="success")
    clock = Clock({42: lambda: mock_systemd.set(previous, "active")})  # Notify=healthy: the warm-up answered
    line = _wait(mock_systemd, 2, 300, clock)
    assert clock.now == 42 and "is not starting (after 42 s)" in line


def test_a_queued_start_counts_as_starting_and_a_failed_one_does_not(mock_systemd: MockSystemd) -> None:
    previous = paths.engine_unit(3)
    # still waiting for its own dependencies: inactive, with its start job queued
    mock_systemd.add(previous, "inactive", "dead", restarts=0, result="success", job=7)
    clock = Clock({5: lambda: mock_systemd.set(previous, "activating", job=7), 30: lambda: mock_systemd.set(previous, "failed")})
    assert "is not starting (after 30 s)" in _wait(mock_systemd, 4, 300, clock) and clock.now == 30


def test_a_previous_replica_stuck_in_its_start_delays_the_next_by_at_most_i_times_stagger(mock_systemd: MockSystemd) -> None:
    previous = paths.engine_unit(5)
    mock_systemd.add(previous, "activating", "start", restarts=0, result="success", job=9)
    clock = Clock()
    line = _wait(mock_systemd, 6, 20, clock)
    assert clock.now == 6 * 20 and "still starting after 120 s" in line and "starting anyway" in line
    assert max(clock.slept) <= stagger.POLL_S


def test_no_wait_with_the_previous_healthy_stopped_or_unknown_for_replica_0_or_stagger_0(mock_systemd: MockSystemd) -> None:
    mock_systemd.add(paths.engine_unit(6), "active", "running", restarts=0, result="success")
    mock_systemd.add(paths.engine_unit(7), "inactive", "dead", restarts=0, result="success")  # not asked to start
    for replica in (7, 8):
        clock = Clock()
        assert "is not starting (after 0 s)" in _wait(mock_systemd, replica, 300, clock) and clock.slept == []
    clock = Clock()
    assert "is not starting" in _wait(mock_systemd, 10, 300, clock) and clock.slept == []  # engine@9: not loaded at all
    mock_systemd.add(paths.engine_unit(10), "activating", "start", restarts=0, result="success")
    for replica, stagger_s in ((0, 300), (11, 0)):
        clock = Clock()
        assert "without waiting" in _wait(mock_systemd, replica, stagger_s, clock) and clock.slept == []


def test_a_bus_that_cannot_be_asked_never_keeps_the_replica_down(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    from pathlib import Path

    from appliance import config
    from applianctl.status import systemd

    demo = config.load(Path(__file__).resolve().parents[1] / "appliance.toml", "demo")
    monkeypatch.setattr("appliance.host_settings.load_device", lambda: demo)

    def no_bus() -> object:
        raise RuntimeError("Could not connect: No such file or directory")

    monkeypatch.setattr(systemd, "system_bus", no_bus)
    assert stagger.main(argparse.Namespace(replica=1)) == 0
    assert "cannot ask systemd about the previous replica (Could not connect" in capsys.readouterr().out
