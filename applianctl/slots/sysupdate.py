# SPDX-License-Identifier: MIT
"""What systemd-sysupdate sees installed."""

from __future__ import annotations

import json
import shutil
from typing import Any

from appliance.errors import UserError
from appliance.run import run


def sysupdate_list(program: str | None = None) -> dict[str, Any]:
    """`systemd-sysupdate list --json=short` (systemd 257: {"current": V, "all": [V...],
    "appstreamUrls": [...]}, "current+pending" instead of "current" while a version is pending)."""
    argv = [program or shutil.which("systemd-sysupdate") or "/usr/lib/systemd/systemd-sysupdate", "--no-pager", "list", "--json=short"]
    out = run(argv, "systemd-sysupdate list", "see journalctl -t systemd-sysupdate", timeout=30.0)
    try:
        data = json.loads(out)
    except ValueError as e:
        raise UserError(f"systemd-sysupdate list: not JSON ({e})", hint="systemd 257 or newer is needed") from None
    if not isinstance(data, dict):
        raise UserError("systemd-sysupdate list: not a JSON object", hint="systemd 257 or newer is needed")
    current = data.get("current", data.get("current+pending"))
    return {"current": current, "pending": "current+pending" in data, "all": [str(v) for v in data.get("all") or []]}

