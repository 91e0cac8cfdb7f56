# SPDX-License-Identifier: MIT
"""Units read through real pydbus from python-dbusmock's systemd template on a private bus."""

from __future__ import annotations

from typing import Any

import pytest

dbus = pytest.importorskip("dbus")
dbusmock = pytest.importorskip("dbusmock")
pydbus = pytest.importorskip("pydbus")

from mock_systemd import MockSystemd  # noqa: E402

from applianctl.status import probes, systemd  # noqa: E402


def test_running_units_are_ok(mock_systemd: MockSystemd) -> None:
    mock_systemd.add("ok0.service", restarts=0, result="success")
    mock_systemd.add("b.service", "active", "exited", restarts=0, result="success")
    part = systemd.probe(["ok0.service", "b.service"], mock_systemd.bus)
    assert part.state == probes.OK, part.reason
    a = part.to_json()["units"]["ok0.service"]
    assert (a["active_state"], a["sub_state"], a["restarts"], a["result"]) == ("active", "running", 0, "success")
    assert a["active_since"] == "2026-11-18T11:06:40+00:00"


def test_activating_and_restarted_units_are_degraded(mock_systemd: MockSystemd) -> None:
    mock_systemd.add("ok1.service", restarts=0, result="success")
    mock_systemd.add("engine.service", "activating", "start", restarts=0, result="success")
    part = systemd.probe(["ok1.service", "engine.service"], mock_systemd.bus)
    assert part.state == probes.DEGRADED
    assert part.reason == "engine.service: activating (start)"

    mock_systemd.add("flappy.service", restarts=3, result="success")
    part = systemd.probe(["ok1.service", "flappy.service"], mock_systemd.bus)
    assert (part.state, part.reason) == (probes.DEGRADED, "flappy.service: restarted 3 time(s) since boot")


def test_failed_unit_is_down(mock_systemd: MockSystemd) -> None:
    mock_systemd.add("ok2.service", restarts=0, result="success")
    mock_systemd.add("verify.service", "failed", "failed", restarts=0, result="exit-code")
    part = systemd.probe(["ok2.service", "verify.service"], mock_systemd.bus)
    assert (part.state, part.reason) == (probes.DOWN, "verify.service: failed (exit-code)")


def test_oneshot_that_ran_is_ok_one_that_never_ran_is_degraded(mock_systemd: MockSystemd) -> None:
    mock_systemd.add("ran.service", "inactive", "dead", restarts=0, result="success", ran=True)
    assert systemd.probe(["ran.service"], mock_systemd.bus).state == probes.OK
    mock_systemd.add("never.service", "inactive", "dead", restarts=0, result="success")
    part = systemd.probe(["ran.service", "never.service"], mock_systemd.bus)
    assert (part.state, part.reason) == (probes.DEGRADED, "never.service: never started")


def test_a_unit_whose_condition_is_not_met_is_not_configured_and_not_missing(mock_systemd: MockSystemd) -> None:
    # the journal upload without a log collector: skipped by ConditionPathExists=, nothing wrong
    mock_systemd.add("ok3.service", restarts=0, result="success")
    mock_systemd.add("upload.service", "inactive", "dead", restarts=0, result="success", condition_unmet=True)
    part = systemd.probe(["ok3.service", "upload.service"], mock_systemd.bus)
    assert part.state == probes.OK, part.reason
    assert part.to_json()["units"]["upload.service"]["state"] == probes.NOT_CONFIGURED
    # the same unit when its condition held and it never ran is a fault, as before
    mock_systemd.add("upload2.service", "inactive", "dead", restarts=0, result="success")
    assert systemd.probe(["ok3.service", "upload2.service"], mock_systemd.bus).state == probes.DEGRADED


def test_units_that_do_not_exist(mock_systemd: MockSystemd) -> None:
    # The template has no LoadUnit: GetUnit fails and the unit is "not installed".
    part = systemd.probe(["appliance-engine.service"], mock_systemd.bus)
    assert part.state == probes.NOT_CONFIGURED
    mock_systemd.add("ok4.service", restarts=0, result="success")
    part = systemd.probe(["ok4.service", "appliance-engine.service"], mock_systemd.bus)
    assert (part.state, part.reason) == (probes.DEGRADED, "appliance-engine.service: not installed")


def test_load_unit_is_asked_when_get_unit_fails(mock_systemd: MockSystemd) -> None:
    # Real systemd loads an unloaded unit on LoadUnit; give the mock that method too.
    mock_systemd.add("loaded-late.service", restarts=0, result="success")
    mock_systemd.main.AddMethod(
        systemd.BUS_NAME + ".Manager",
        "LoadUnit",
        "s",
        "o",
        "ret = self.units[args[0].replace('alias-', '')]",
        dbus_interface=dbusmock.MOCK_IFACE,
    )
    part = systemd.probe(["alias-loaded-late.service"], mock_systemd.bus)
    assert part.state == probes.OK, part.reason


def test_no_bus_is_down() -> None:
    def no_bus() -> Any:
        return pydbus.connect("unix:path=/nonexistent/bus")

    part = systemd.probe(["ok6.service"], no_bus)
    assert part.state == probes.DOWN
    assert part.reason.startswith("cannot ask systemd")


# ----------------------------------------------------------------------------------- logs, restart


def test_logs_and_restart_command_lines() -> None:
    import argparse

    from appliance.errors import UserError
    from applianctl import units

    parser = argparse.ArgumentParser()
    units.add_parser(parser.add_subparsers())
    a = parser.parse_args(["logs", "startup", "-f", "-n", "50"])
    assert units.logs_argv(a) == [
        "journalctl",
        "--no-pager",
        "-u",
        "appliance-startup-report.service",
        "-f",
        "-n",
        "50",
    ]
    assert units.logs_argv(parser.parse_args(["logs"]))[3] == "appliance-engine@*.service"  # every replica
    assert units.logs_argv(parser.parse_args(["logs", "engine@2"]))[3] == "appliance-engine@2.service"
    with pytest.raises(SystemExit):
        parser.parse_args(["logs", "engine@01"])
    assert units.restart_argv("proxy") == ["systemctl", "restart", "appliance-proxy.service"]
    with pytest.raises(UserError) as e:
        units.restart_argv("verify")
    assert e.value.exit_status == 2
    assert e.value.message == "cannot restart 'verify': only engine or proxy (or one replica, engine@I)"
    with pytest.raises(SystemExit):
        parser.parse_args(["logs", "sshd"])
