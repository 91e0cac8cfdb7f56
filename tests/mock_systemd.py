# SPDX-License-Identifier: MIT
"""python-dbusmock's systemd template on a private system bus, read through real pydbus."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any

import pytest

dbus = pytest.importorskip("dbus")
dbusmock = pytest.importorskip("dbusmock")
pydbus = pytest.importorskip("pydbus")

from applianctl.status import systemd  # noqa: E402

UNIT_IFACE = "org.freedesktop.systemd1.Unit"

SERVICE_IFACE = "org.freedesktop.systemd1.Service"

T0 = 1_795_000_000_000_000  # µs since the epoch


@dataclass
class MockSystemd:
    address: str
    main: Any  # dbus-python proxy of the manager, with the mock interface

    def add(self, name: str, active: str = "active", sub: str = "running", **service: Any) -> None:
        """Add NAME to the mock with the given states and Service properties."""
        if "@" in name:
            # the template escapes only "." and "-": an instance's "@" would make an invalid path
            path = f"/org/freedesktop/systemd1/unit/{bus_escape(name)}"
            self.main.AddObject(path, UNIT_IFACE, {"Id": name, "Names": [name], "LoadState": "loaded",
                                                   "ActiveState": "inactive"}, [], dbus_interface=dbusmock.MOCK_IFACE)
            self.main.RegisterUnitPath(name, path, dbus_interface=dbusmock.MOCK_IFACE)
        else:
            self.main.AddMockUnit(name, dbus_interface=dbusmock.MOCK_IFACE)
        path = self.main.GetUnit(name, dbus_interface=systemd.BUS_NAME + ".Manager")
        obj = dbusmock.DBusTestCase.get_dbus(system_bus=True).get_object(systemd.BUS_NAME, path)
        enter = T0 if active not in ("inactive",) or service.pop("ran", False) else 0
        unmet = service.pop("condition_unmet", False)  # its Condition...= checked and not met
        job = service.pop("job", 0)  # the id of a job queued for it (0: none)
        obj.UpdateProperties(UNIT_IFACE, {"ActiveState": active}, dbus_interface=dbusmock.MOCK_IFACE)
        obj.AddProperties(
            UNIT_IFACE,
            {
                "SubState": sub,
                "ActiveEnterTimestamp": dbus.UInt64(enter),
                "StateChangeTimestamp": dbus.UInt64(T0 + 5_000_000),
                "ConditionResult": dbus.Boolean(not unmet),
                "ConditionTimestamp": dbus.UInt64(T0),
                "Job": _job(job),
            },
            dbus_interface=dbusmock.MOCK_IFACE,
        )
        if service:
            obj.AddProperties(
                SERVICE_IFACE,
                {"NRestarts": dbus.UInt32(service.get("restarts", 0)), "Result": service.get("result", "success")},
                dbus_interface=dbusmock.MOCK_IFACE,
            )

    def set(self, name: str, active: str, job: int = 0) -> None:
        """Change NAME's ActiveState and queued job, as systemd does while it starts a unit."""
        path = self.main.GetUnit(name, dbus_interface=systemd.BUS_NAME + ".Manager")
        obj = dbusmock.DBusTestCase.get_dbus(system_bus=True).get_object(systemd.BUS_NAME, path)
        obj.UpdateProperties(UNIT_IFACE, {"ActiveState": active}, dbus_interface=dbusmock.MOCK_IFACE)
        obj.Set(UNIT_IFACE, "Job", _job(job), dbus_interface="org.freedesktop.DBus.Properties")

    def bus(self) -> Any:
        return pydbus.connect(self.address)


def _job(job: int) -> Any:
    """The Unit's Job property as systemd sends it: (id, path), (0, "/") when none is queued."""
    path = f"/org/freedesktop/systemd1/job/{job}" if job else "/"
    return dbus.Struct((dbus.UInt32(job), dbus.ObjectPath(path)), signature="uo")


def start_mock_systemd() -> tuple[subprocess.Popen[bytes], MockSystemd]:
    """A private system bus with the systemd template on it; stop with stop_mock_systemd()."""
    dbusmock.DBusTestCase.start_system_bus()
    address = os.environ["DBUS_SYSTEM_BUS_ADDRESS"]
    proc, main = dbusmock.DBusTestCase.spawn_server_template("systemd", {}, stdout=subprocess.DEVNULL)
    main.AddMethod(dbusmock.MOCK_IFACE, "RegisterUnitPath", "so", "", "self.units[args[0]] = args[1]",
                   dbus_interface=dbusmock.MOCK_IFACE)
    return proc, MockSystemd(address, main)


def bus_escape(name: str) -> str:
    """A unit name as systemd puts it in an object path: every byte but [A-Za-z0-9] as _XX."""
    return "".join(c if c.isascii() and c.isalnum() else f"_{ord(c):02x}" for c in name)


def stop_mock_systemd(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(5)
    dbusmock.DBusTestCase.tearDownClass()
