# SPDX-License-Identifier: MIT
"""Status parts `verify`, `preflight` and `shm-check`: the result files other units write."""

from __future__ import annotations

from pathlib import Path

from appliance.errors import UserError
from appliance.safe_read import MAX_RECORD_BYTES, loads_bounded, read_capped
from appliance.schema import from_json
from applianctl.records import CheckResult
from applianctl.status.document import CheckFileDetails
from applianctl.status.probes import DEGRADED, DOWN, NOT_CONFIGURED, OK, Part


def probe_check(path: Path, what: str, record: type[CheckResult] = CheckResult) -> Part:
    """A result file written by another unit, a RECORD. The details are the file's other keys as
    written (also those a newer release adds), besides ok, reason and format."""
    try:
        raw = read_capped(path, MAX_RECORD_BYTES, what="a result file")
        if raw is None:
            return Part(NOT_CONFIGURED, f"{what} has not run ({path} absent)")
        doc = loads_bounded(raw.decode("utf-8"))
        result = from_json(record, doc, str(path), lenient=True)
    except ValueError as e:
        return Part(DEGRADED, f"{path}: unreadable ({type(e).__name__})")
    except UserError as e:
        return Part(DEGRADED, e.message)
    details = CheckFileDetails(written={k: v for k, v in doc.items() if k not in ("ok", "reason", "state", "format")})
    if result.ok:
        return Part(OK, "", details)
    return Part(DOWN, result.reason or f"{what} failed", details)
