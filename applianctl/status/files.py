"""Status parts `verify`, `preflight` and `shm-check`: the result files other units write."""

from __future__ import annotations

import json
from pathlib import Path

from applianctl.status.parts import DEGRADED, DOWN, NOT_CONFIGURED, OK, Part


def probe_check(path: Path, what: str) -> Part:
    """A result file written by another unit: {"ok": bool, "reason": str, ...}."""
    try:
        result = json.loads(path.read_text())
        ok = result["ok"]
    except FileNotFoundError:
        return Part(NOT_CONFIGURED, f"{what} has not run ({path} absent)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Part(DEGRADED, f"{path}: unreadable ({type(e).__name__})")
    details = {k: v for k, v in result.items() if k not in ("ok", "reason", "state")}
    if ok is True:
        return Part(OK, "", details)
    return Part(DOWN, str(result.get("reason") or f"{what} failed"), details)
