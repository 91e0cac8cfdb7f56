"""`applianctl bootcheck`: the facts a test host asserts about a booted appliance.

Waits (bounded) for the engine to be healthy, then writes one JSON report between marker
lines to a serial port: `applianctl status --json`, failed units, how /usr is mounted and
protected, the partition table, file system sizes. When the host passed the credential
appliance.bootcheck=poweroff, the machine then powers off so the host can read the report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import time
import urllib.request
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
    # Under emulation (TCG) everything is ~20x slower than on the appliance's hardware.
    raw = _run(["/usr/bin/applianctl", "status", "--json", "--timeout-scale", "20"], timeout=90)
    try:
        status = json.loads(raw)
    except json.JSONDecodeError:
        status = {"state": "unknown", "error": raw[-500:]}
    return status, _run(["/usr/bin/applianctl", "status", "--timeout-scale", "20"], timeout=90)


# The units the engine Requires=: when one of them failed, the engine will not start.
ENGINE_REQUIREMENTS = ("appliance-verify.service", "appliance-preflight.service", "appliance-shm-clean.service",
                       "appliance-engine-store.service")


def wait_for_engine(deadline_s: float) -> bool:
    """Until the engine unit is active (podman's health check passed, Notify=healthy), a unit it
    requires failed, or the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        state = _run(["systemctl", "is-active", "appliance-engine.service"]).strip()
        if state == "active":
            return True
        if _run(["systemctl", "is-failed", *ENGINE_REQUIREMENTS]).split().count("failed"):
            return False
        if state == "failed" and _run(["systemctl", "show", "-P", "NRestarts", "appliance-engine.service"]).strip() == "5":
            return False
        time.sleep(3)
    return False


SMOKE_PROMPT = "Calculate 17 * 23. Answer with the number only."


def smoke_engine(port: int, model: str) -> dict[str, Any]:
    """The runbook's smoke completion straight to the engine's port (the proxy is tested apart)."""
    body = json.dumps({"model": model, "prompt": SMOKE_PROMPT, "temperature": 0, "max_tokens": 32}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())["choices"][0]["text"]
            return {"answer": answer, "answers_variant": response.headers.get("X-Standin-Answers")}
    except (OSError, ValueError, KeyError, IndexError) as e:
        return {"answer": "", "error": str(e)}


def collect() -> dict[str, Any]:
    usr_source = _run(["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "/usr"]).split()
    root_disk = _run(["lsblk", "-no", "PKNAME", _run(["findmnt", "-no", "SOURCE", "/"]).strip()]).strip()
    config = json.loads(Path("/usr/lib/appliance/appliance.json").read_text())
    smoke = smoke_engine(config["engine"]["port"], config["engine"]["served_model_name"])
    proxy_smoke = _run(["/usr/bin/applianctl", "smoke"], timeout=120)
    status, status_text = _status()
    units = _json(["systemctl", "list-units", "--failed", "--output=json"]) or []
    return {
        "applianctl_version": _run(["/usr/bin/applianctl", "--version"]).strip(),
        "bootcheck_version": __version__,
        "failed_units": [u.get("unit") for u in units if isinstance(u, dict)],
        "usr_mount": usr_source,
        "usr_verity": _run(["veritysetup", "status", "usr"]),
        "partitions": _json(["sfdisk", "-J", f"/dev/{root_disk}"]) if root_disk else None,
        "filesystems": {
            "filesystems": [
                fs
                for target in ("/", "/var", "/usr")
                for fs in (_json(["findmnt", "-J", "-b", "-o", "TARGET,SOURCE,FSTYPE,SIZE,OPTIONS", target]) or {}).get(
                    "filesystems", []
                )
            ]
        },
        "cmdline": Path("/proc/cmdline").read_text().strip(),
        # the last lines of each appliance unit's journal, for whoever reads a failed test
        "journal": {
            unit: _run(["journalctl", "-o", "cat", "-u", unit, "-n", "30", "--no-pager"])[-3000:]
            for unit in (*ENGINE_REQUIREMENTS, ENGINE, "appliance-proxy.service", "appliance-tls.service")
        },
        "smoke_engine": smoke,
        "smoke_proxy": proxy_smoke,
        "status": status,
        "status_text": status_text,
    }


# ------------------------------------------------------------------------- fault scenarios
# With the credential appliance.scenario=faults, the boot check drives the stand-in engine's
# fault switches (a JSON file it reads at start) through the production unit, and records what
# systemd and the /dev/shm cleaner did about each fault.

FAULTS_FILE = Path("/run/appliance/standin/faults.json")
ENGINE = "appliance-engine.service"


def _engine_prop(name: str) -> str:
    return _run(["systemctl", "show", "-P", name, ENGINE]).strip()


def _offload_files() -> list[str]:
    return sorted(str(p) for p in Path("/dev/shm").glob("vllm_offload_*.mmap"))


def _wait(predicate: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(2)
    return False


def _restart_with(faults: dict[str, Any]) -> float:
    FAULTS_FILE.write_text(json.dumps(faults))
    start = time.monotonic()
    _run(["systemctl", "restart", ENGINE], timeout=900)  # returns once healthy (Notify=healthy) or failed
    return time.monotonic() - start


def run_fault_scenarios() -> dict[str, Any]:
    results: dict[str, Any] = {}
    # A slow start inside the start period is not killed: active, and no automatic restart.
    restarts = int(_engine_prop("NRestarts") or 0)
    took = _restart_with({"load_seconds": 60})
    results["slow_start"] = {
        "active": _engine_prop("ActiveState") == "active",
        "automatic_restarts": int(_engine_prop("NRestarts") or 0) - restarts,
        "seconds_to_healthy": round(took, 1),
    }
    # A crash that leaves its offload file behind: restarted, the stale file removed first.
    took = _restart_with({"crash_after_s": 45, "crash_leave_mmap": True})
    before, restarts = _offload_files(), int(_engine_prop("NRestarts") or 0)
    FAULTS_FILE.unlink()  # the restarted engine runs clean
    restarted = _wait(lambda: int(_engine_prop("NRestarts") or 0) > restarts and _engine_prop("ActiveState") == "active", 600)
    after = _offload_files()
    results["crash"] = {
        "restarted": restarted,
        "offload_files_before": before,
        "offload_files_after": after,
        "cleaner_log": _run(["journalctl", "-o", "cat", "-u", "appliance-shm-clean.service", "--no-pager"])[-4000:],
    }
    # A hang (health checks failing) is detected and the engine restarted.
    _restart_with({"hang_after_s": 45})
    restarts = int(_engine_prop("NRestarts") or 0)
    FAULTS_FILE.unlink()
    restarted = _wait(lambda: int(_engine_prop("NRestarts") or 0) > restarts and _engine_prop("ActiveState") == "active", 300)
    log = _run(["journalctl", "-o", "cat", "-u", ENGINE, "-n", "40", "--no-pager"])
    results["hang"] = {"restarted": restarted, "engine_log": log[-4000:]}
    return results


# ------------------------------------------------------------------------- update scenario
# With appliance.scenario=update, appliance.update_url and appliance.update_ca (PEM), the boot
# check installs the bundle at that URL once (`applianctl update --reboot`), then reports again
# on the next boot, whichever version that is.

UPDATE_MARKER_DIR = Path("/var/lib/appliance/bootcheck")


def run_update_scenario() -> dict[str, Any] | None:
    url = credential("appliance.update_url")
    if not url:
        return None
    marker = UPDATE_MARKER_DIR / ("update-" + hashlib.sha256(url.encode()).hexdigest()[:16])
    if marker.exists():
        return {"url": url, "attempted": True, "this_boot": False, "output": marker.read_text()}
    UPDATE_MARKER_DIR.mkdir(parents=True, exist_ok=True)
    ca = Path(os.environ.get("CREDENTIALS_DIRECTORY", "/nonexistent")) / "appliance.update_ca"
    cmd = ["/usr/bin/applianctl", "update", url, "--yes"] + (["--ca", str(ca)] if ca.exists() else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    output = f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
    marker.write_text(output)
    return {"url": url, "attempted": True, "this_boot": True, "exit": proc.returncode, "output": output}


def main(args: argparse.Namespace) -> int:
    engine_healthy = wait_for_engine(float(credential("appliance.wait") or args.wait))
    report = collect()
    report["engine_became_healthy"] = engine_healthy
    # The fault scenarios come after the first look, which shows the appliance as it booted.
    wanted = credential("appliance.scenario") == "faults"
    report["scenarios"] = run_fault_scenarios() if engine_healthy and wanted else None
    update = run_update_scenario() if credential("appliance.scenario") == "update" else None
    report["update"] = update
    text = f"\n{BEGIN}\n{json.dumps(report)}\n{END}\n"
    with open(args.report, "w") as port:
        port.write(text)
        port.flush()
    print(report["status_text"])
    if update and update.get("this_boot") and update.get("exit") == 0:
        subprocess.run(["systemctl", "--no-block", "reboot"], check=False)  # into the new version
    elif credential("appliance.bootcheck") == "poweroff":
        subprocess.run(["systemctl", "--no-block", "poweroff"], check=False)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bootcheck", help="report the booted appliance's state to a test host")
    p.add_argument("--report", default="/dev/ttyS1", help="where to write the JSON report")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for a healthy engine")
    p.set_defaults(func=main)
