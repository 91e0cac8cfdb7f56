# SPDX-License-Identifier: MIT
"""Status part `host`: the per-host settings (the signed install plan, else the image's defaults),
as appliance-host.service applied them on this boot, the addresses the host has now, and the
factory reset: one asked for and not yet run (degraded: the next boot wipes /var), the last that ran."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

from appliance import paths
from appliance import plan as plan_model
from appliance.config import Config
from appliance.errors import UserError
from appliance.schema import load_record, plain
from applianctl.records import FactoryResetRequest, HostResult, LastFactoryReset
from applianctl.status import probes
from applianctl.status.probes import DEGRADED, NOT_CONFIGURED, OK, Part, Sources


def addresses(src: Sources) -> list[str] | None:
    """Global addresses with prefix length (ip -j address), None when they cannot be read."""
    try:
        code, out = src.run(["ip", "-j", "address", "show", "scope", "global"], probes.COMMAND_TIMEOUT_S)
        links = json.loads(out) if code == 0 else None
    except (probes.ToolMissing, subprocess.TimeoutExpired, ValueError):
        return None
    if not isinstance(links, list):
        return None
    return [f"{a['local']}/{a['prefixlen']}" for link in links for a in link.get("addr_info", []) if "local" in a]


def factory_reset() -> tuple[dict[str, Any], str | None]:
    """The pending and the last factory reset (records on /var), and the reason to show when one
    is pending."""
    out: dict[str, Any] = {"pending": None, "last": None}
    why = None
    from applianctl.factory_reset import not_a_request

    odd = not_a_request(paths.factory_reset_request_path())
    if odd is not None:
        # Not a request: the boot's reset removes it without a wipe (applianctl/factory_reset.py).
        why = (f"{paths.factory_reset_request_path()} is {odd}, not a factory reset request: the next boot removes it "
               f"without a reset (applianctl factory-reset --cancel removes it now)")
        return out, why
    try:
        pending = load_record(FactoryResetRequest, paths.factory_reset_request_path(), lenient=True)
    except UserError as e:
        pending, why = None, f"a factory reset is pending, its request unreadable ({e.message}): the next boot wipes /var"
    if pending is not None:
        from applianctl.factory_reset import describe

        out["pending"] = plain(pending)
        why = f"a factory reset is pending (asked {pending.requested_at}): the next boot wipes /var and {describe(pending)}"
    try:
        last = load_record(LastFactoryReset, paths.last_factory_reset_path(), lenient=True)
        out["last"] = plain(last) if last is not None else None
    except UserError:
        pass
    return out, why


def probe_host(config: Config, src: Sources, result: Path) -> Part:
    reset, reset_pending = factory_reset()
    details: dict[str, Any] = {"source": None, "hostname": socket.gethostname(), "addresses": addresses(src),
                               "network_files": [], "settings": plan_model.Plan().effective(config), "factory_reset": reset}
    try:
        applied = load_record(HostResult, result, lenient=True)
    except UserError as e:
        return Part(DEGRADED, e.message, details)
    if applied is None:
        return Part(NOT_CONFIGURED, f"appliance-host has not run ({result} absent): the image's defaults apply", details)
    details["source"] = applied.source
    details["network_files"] = list(applied.network_files or ())  # none: no plan rendered
    if applied.settings is not None:
        details["settings"] = plain(applied.settings)
    if not applied.ok:
        # The image's defaults apply: the host runs, but not as its plan says.
        return Part(DEGRADED, applied.reason or "the install plan was not applied", details)
    if reset_pending:
        return Part(DEGRADED, reset_pending, details)
    return Part(OK, "", details)
