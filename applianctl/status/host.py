"""Status part `host`: the per-host settings (the signed install plan, else the image's defaults),
as appliance-host.service applied them on this boot, and the addresses the host has now."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

from appliance import plan as plan_model
from appliance.config import Config
from appliance.errors import UserError
from appliance.schema import load_record, plain
from applianctl.records import HostResult
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


def probe_host(config: Config, src: Sources, result: Path) -> Part:
    details: dict[str, Any] = {"source": None, "hostname": socket.gethostname(), "addresses": addresses(src),
                               "network_files": [], "settings": plan_model.Plan().effective(config)}
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
    return Part(OK, "", details)
