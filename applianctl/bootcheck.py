"""`applianctl bootcheck`: the facts a test host asserts about a booted appliance.

Waits (bounded) for the engine to be healthy, then writes one JSON report between marker
lines to a serial port: `applianctl status --json`, failed units, how /usr is mounted and
protected, the partition table, file system sizes. When the host passed the credential
appliance.bootcheck=poweroff, the machine then powers off so the host can read the report.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from applianctl import __version__

BEGIN, END = "APPLIANCE-REPORT-BEGIN", "APPLIANCE-REPORT-END"


def _run(cmd: list[str], timeout: float = 20) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"error: {e}"


def _json(cmd: list[str]) -> Any:
    try:
        return json.loads(_run(cmd))
    except json.JSONDecodeError:
        return None


def credential(name: str) -> str | None:
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return None
    path = Path(directory) / name
    return path.read_text().strip() if path.exists() else None


def _status() -> tuple[dict[str, Any], str]:
    raw = _run(["/usr/bin/applianctl", "status", "--json"], timeout=30)
    try:
        status = json.loads(raw)
    except json.JSONDecodeError:
        status = {"state": "unknown", "error": raw[-500:]}
    return status, _run(["/usr/bin/applianctl", "status"], timeout=30)


def wait_for_engine(deadline_s: float) -> bool:
    """Until the engine unit is active (podman's health check passed, Notify=healthy) or the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        state = _run(["systemctl", "is-active", "appliance-engine.service"]).strip()
        if state == "active":
            return True
        if state == "failed" and _run(["systemctl", "show", "-P", "NRestarts", "appliance-engine.service"]).strip() == "5":
            return False
        time.sleep(3)
    return False


def collect() -> dict[str, Any]:
    usr_source = _run(["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "/usr"]).split()
    root_disk = _run(["lsblk", "-no", "PKNAME", _run(["findmnt", "-no", "SOURCE", "/"]).strip()]).strip()
    status, status_text = _status()
    units = _json(["systemctl", "list-units", "--failed", "--output=json"]) or []
    return {
        "applianctl_version": _run(["/usr/bin/applianctl", "--version"]).strip(),
        "bootcheck_version": __version__,
        "failed_units": [u.get("unit") for u in units if isinstance(u, dict)],
        "usr_mount": usr_source,
        "usr_verity": _run(["veritysetup", "status", "usr"]),
        "partitions": _json(["sfdisk", "-J", f"/dev/{root_disk}"]) if root_disk else None,
        "filesystems": _json(["findmnt", "-J", "-b", "-o", "TARGET,SOURCE,FSTYPE,SIZE,OPTIONS", "/", "/var", "/usr"]),
        "cmdline": Path("/proc/cmdline").read_text().strip(),
        "status": status,
        "status_text": status_text,
    }


def main(args: argparse.Namespace) -> int:
    engine_healthy = wait_for_engine(float(credential("appliance.wait") or args.wait))
    report = collect()
    report["engine_became_healthy"] = engine_healthy
    text = f"\n{BEGIN}\n{json.dumps(report)}\n{END}\n"
    with open(args.report, "w") as port:
        port.write(text)
        port.flush()
    print(report["status_text"])
    if credential("appliance.bootcheck") == "poweroff":
        subprocess.run(["systemctl", "--no-block", "poweroff"], check=False)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bootcheck", help="report the booted appliance's state to a test host")
    p.add_argument("--report", default="/dev/ttyS1", help="where to write the JSON report")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for a healthy engine")
    p.set_defaults(func=main)
