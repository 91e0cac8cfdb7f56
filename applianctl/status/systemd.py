# SPDX-License-Identifier: MIT
"""The appliance's units as systemd reports them over D-Bus (pydbus)."""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from applianctl.status.document import UnitsDetails, UnitStatus
from applianctl.status.probes import DEGRADED, DOWN, NOT_CONFIGURED, OK, Part, first_reason, worst

BUS_NAME = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
PROPERTIES_IFACE = "org.freedesktop.DBus.Properties"
CALL_TIMEOUT_S = 1


@dataclass
class Unit:
    name: str
    load_state: str = "not-found"
    active_state: str = "inactive"
    sub_state: str = "dead"
    result: str | None = None
    restarts: int | None = None
    active_since: str | None = None
    changed: str | None = None
    started: str | None = None  # when it last left "inactive": a oneshot that ran never becomes "active"
    # its Condition...= checked and not met (the journal upload without a collector): not configured here
    condition_unmet: bool = False

    def judge(self) -> tuple[str, str]:
        """(state, reason) of this unit."""
        if self.load_state == "not-found":
            return NOT_CONFIGURED, "not installed"
        if self.condition_unmet and self.active_state == "inactive":
            return NOT_CONFIGURED, "not configured on this appliance (its condition is not met)"
        if self.load_state not in ("loaded", "stub"):
            return DOWN, f"load state {self.load_state}"
        if self.active_state == "failed":
            return DOWN, f"failed ({self.result or self.sub_state})"
        if self.active_state in ("activating", "reloading", "deactivating"):
            return DEGRADED, f"{self.active_state} ({self.sub_state})"
        if self.active_state == "inactive":
            if self.result not in (None, "success"):
                return DOWN, f"stopped: {self.result}"
            if self.active_since is None and self.started is None:
                return DEGRADED, "never started"
            # a oneshot that ran and exited successfully
        if self.restarts:
            return DEGRADED, f"restarted {self.restarts} time(s) since boot"
        return OK, ""


def _timestamp(usec: Any) -> str | None:
    """A systemd realtime timestamp (µs since the epoch; 0: never) as ISO 8601."""
    if not isinstance(usec, int) or usec <= 0:
        return None
    return datetime.datetime.fromtimestamp(usec / 1e6, datetime.UTC).isoformat(timespec="seconds")


def system_bus() -> Any:
    import pydbus

    return pydbus.SystemBus()


def unit_path(bus: Any, manager: Any, name: str) -> str | None:
    from gi.repository import GLib

    try:
        return str(manager.GetUnit(name, timeout=CALL_TIMEOUT_S))
    except GLib.Error:
        pass  # not loaded: ask systemd to load it (real systemd answers with LoadState not-found)
    try:
        return str(manager.LoadUnit(name, timeout=CALL_TIMEOUT_S))
    except (GLib.Error, AttributeError):
        return None


def read_unit(bus: Any, manager: Any, name: str) -> Unit:
    from gi.repository import GLib

    path = unit_path(bus, manager, name)
    if path is None:
        return Unit(name)
    obj = bus.get(BUS_NAME, path)
    props: dict[str, Any] = dict(obj[PROPERTIES_IFACE].GetAll(UNIT_IFACE, timeout=CALL_TIMEOUT_S))
    if name.endswith(".service"):
        with contextlib.suppress(GLib.Error):
            props.update(obj[PROPERTIES_IFACE].GetAll(SERVICE_IFACE, timeout=CALL_TIMEOUT_S))
    restarts = props.get("NRestarts")
    return Unit(
        name=name,
        load_state=str(props.get("LoadState", "not-found")),
        active_state=str(props.get("ActiveState", "inactive")),
        sub_state=str(props.get("SubState", "")),
        result=str(props["Result"]) if "Result" in props else None,
        restarts=int(restarts) if isinstance(restarts, int) else None,
        active_since=_timestamp(props.get("ActiveEnterTimestamp")),
        changed=_timestamp(props.get("StateChangeTimestamp")),
        started=_timestamp(props.get("InactiveExitTimestamp")),
        condition_unmet=props.get("ConditionResult") is False and bool(props.get("ConditionTimestamp")),
    )


def read_units(names: Sequence[str], bus: Any) -> list[Unit]:
    manager = bus.get(BUS_NAME, MANAGER_PATH)
    return [read_unit(bus, manager, name) for name in names]


def probe(names: Sequence[str], bus_factory: Callable[[], Any] | None = None) -> Part:
    try:
        bus = (bus_factory or system_bus)()
        units = read_units(names, bus)
    except Exception as e:  # GLib.Error from a missing bus, or a broken reply
        return Part(DOWN, f"cannot ask systemd: {e}".splitlines()[0])
    judged = [(u, *u.judge()) for u in units]
    details = UnitsDetails(units={u.name: unit_status(u, state, reason) for u, state, reason in judged})
    if all(state == NOT_CONFIGURED for _, state, _ in judged):
        return Part(NOT_CONFIGURED, "none of the appliance's units is installed", details)
    counted = [(u.name, Part(state, reason)) for u, state, reason in judged if state != NOT_CONFIGURED]
    missing = [u.name for u, state, _ in judged if state == NOT_CONFIGURED and not u.condition_unmet]
    state = worst([p.state for _, p in counted])
    reason = first_reason(counted)
    if missing and state == OK:
        state, reason = DEGRADED, f"{missing[0]}: not installed"
    return Part(state, reason, details)


def unit_status(u: Unit, state: str, reason: str) -> UnitStatus:
    """U as the document shows it, judged STATE for REASON."""
    return UnitStatus(load_state=u.load_state, active_state=u.active_state, sub_state=u.sub_state, result=u.result,
                      restarts=u.restarts, active_since=u.active_since, changed=u.changed, started=u.started,
                      condition_unmet=u.condition_unmet, state=state, reason=reason)
