# SPDX-License-Identifier: MIT
"""The boot check's engine fault scenarios (the plan step {"do": "faults"}, demo images only): the
stand-in engine's fault switches (a JSON file it reads at start) driven through the production
unit, and what systemd, the progress judge and the /dev/shm cleaner did about each fault: a slow
start, a crash while clients stream requests through the proxy, a hang, and an engine core that
deadlocks under load while its /health stays 200."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config.model import SMOKE_PROMPT
from appliance.host_settings import load_device
from testkit.guest_commands import children_of, proc_state, run_json, run_text, tail, unit_property, wait_until

FAULTS_FILE = Path("/run/appliance/standin/faults.json")
# The scenarios' replica (the faults file names it); any other replica must not notice them.
ENGINE = paths.engine_unit(0)


def _engine_prop(name: str, unit: str = ENGINE) -> str:
    return unit_property(unit, name)


def _restarts() -> int:
    return int(_engine_prop("NRestarts") or 0)


def _others() -> dict[str, dict[str, str]]:
    """Every other replica's unit: its main PID and restarts (unchanged: it was not restarted)."""
    return {unit: {"pid": _engine_prop("MainPID", unit), "restarts": _engine_prop("NRestarts", unit),
                   "active": _engine_prop("ActiveState", unit)}
            for unit in paths.engine_units(load_device().replicas)[1:]}


def _offload_files() -> list[str]:
    return sorted(str(p) for p in Path("/dev/shm").glob("vllm_offload_*.mmap"))


def _restart_with(faults: dict[str, Any]) -> float:
    FAULTS_FILE.write_text(json.dumps({"replica": 0, **faults}))
    start = time.monotonic()
    # The operator's restart of replica 0 alone (it resets the start limit, which the scenarios
    # together would use up); returns once healthy (Notify=healthy) or failed.
    run_text(["/usr/bin/applianctl", "restart", "engine@0"], timeout=900)
    return time.monotonic() - start


def run_fault_scenarios() -> dict[str, Any]:
    results: dict[str, Any] = {"others_before": _others()}
    # A slow start inside the start period is not killed: active, and no automatic restart.
    restarts = _restarts()
    took = _restart_with({"load_seconds": 60})
    results["slow_start"] = {
        "active": _engine_prop("ActiveState") == "active",
        "automatic_restarts": _restarts() - restarts,
        "seconds_to_healthy": round(took, 1),
    }
    # Replica 0's engine killed (SIGKILL: its offload file left behind) while clients stream
    # requests through the proxy: only those in flight on it may fail; it restarts alone, the
    # stale file removed first, and replica 1 serves meanwhile.
    FAULTS_FILE.unlink()  # the restarted engine runs clean
    before, restarts = _offload_owners(), _restarts()
    stream = ProxyStream(load_device())
    stream.start()
    time.sleep(10)
    killed = _kill_engine(0)
    restarted = wait_until(lambda: _restarts() > restarts and _engine_prop("ActiveState") == "active", 600)
    time.sleep(10)  # and traffic once it is back
    after = _offload_owners()
    results["crash"] = {
        "restarted": restarted,
        "killed": killed,
        "stream": stream.stop(killed.get("at", 0.0)),
        "offload_files_before": sorted(f for f, r in before.items() if r == "0"),
        "offload_files_after": sorted(f for f, r in after.items() if r in ("0", "")),
        # the other replicas' live files, which the cleaner that ran before replica 0's restart kept
        "other_files_before": sorted(f for f, r in before.items() if r not in ("0", "")),
        "other_files_after": sorted(f for f, r in after.items() if r not in ("0", "")),
        "cleaner_log": tail(run_text(["journalctl", "-o", "cat", "-u", "appliance-shm-clean.service", "--no-pager"]), 4000),
    }
    # A hang (nothing answers, /metrics included) is detected by the judge and the engine restarted.
    _restart_with({"hang_after_s": 45})
    hung_pid = _engine_prop("MainPID")
    FAULTS_FILE.unlink()
    restarted = wait_until(lambda: _replaced(ENGINE, hung_pid), 300)
    log = run_text(["journalctl", "-o", "cat", "-u", ENGINE, "-n", "40", "--no-pager"])
    results["hang"] = {"restarted": restarted, "engine_log": tail(log, 4000)}
    results["others_after"] = _others()
    results["deadlock"] = _deadlock_under_load(1)
    return results


def _replaced(unit: str, old_pid: str) -> bool:
    """UNIT runs again under another main process: restarted, by systemd's Restart= or by the judge
    (whose restart is a job, which NRestarts does not count)."""
    return unit_property(unit, "MainPID") not in ("0", "", old_pid) and unit_property(unit, "ActiveState") == "active"


def _judged(replica: int) -> str:
    """Replica REPLICA's state in the judge's last record ("" when there is none)."""
    try:
        doc = json.loads(paths.JUDGE_STATE.read_text())
        return next((str(r["state"]) for r in doc["replicas"] if r["replica"] == replica), "")
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _deadlock_under_load(replica: int) -> dict[str, Any]:
    """Replica REPLICA's engine core deadlocks under a steady load through the proxy (vLLM's most
    common failure: /health and /metrics stay 200, requests are accepted and never answered, the
    token counters freeze): the judge must find it stalled within engine.progress's bound, HAProxy
    take it out, systemd restart it; only the requests in flight on it may fail. The scenario's own
    replica: the others were measured above (`others_after`) and must not notice it either."""
    unit = paths.engine_unit(replica)
    old_pid = unit_property(unit, "MainPID")
    stream = ProxyStream(load_device())
    stream.start()
    time.sleep(10)
    # at run time: the stand-in re-reads the faults file while it serves (standin/faults.py)
    FAULTS_FILE.write_text(json.dumps({"replica": replica, "deadlock_after_s": 0}))
    deadlocked_at = time.monotonic()
    judged = wait_until(lambda: _judged(replica) in ("stalled", "restarting"), 600)
    judged_at = time.monotonic()
    status = run_json(["/usr/bin/applianctl", "status", "--json"], timeout=120) or {}
    exposition = run_text(["/usr/bin/applianctl", "status", "--prometheus"], timeout=120)
    # the old process gone: the restarted engine must run clean (it reads the file at its start)
    gone = wait_until(lambda: unit_property(unit, "MainPID") != old_pid, 120)
    removed_at = time.monotonic()
    FAULTS_FILE.write_text("{}")
    restarted = wait_until(lambda: _replaced(unit, old_pid), 900)
    alive_again = wait_until(lambda: _judged(replica) == "alive", 300)
    time.sleep(15)  # and traffic once it is back
    engine = (status.get("parts") or {}).get("engine") or {}
    return {
        "judged": judged, "gone": gone, "restarted": restarted, "alive_again": alive_again,
        "seconds_to_judged": round(judged_at - deadlocked_at, 1),
        "seconds_to_removed": round(removed_at - deadlocked_at, 1),
        "stall_after_s": load_device().engine.progress.stall_after_s,
        "interval_s": load_device().engine.progress.interval_s,
        "stream": stream.stop(deadlocked_at, removed_at),
        "engine_part": engine,
        "replica_state_lines": [line for line in exposition.splitlines() if line.startswith("appliance_replica_state{")],
        "judge_log": tail(run_text(["journalctl", "-o", "cat", "-u", "appliance-judge.service", "--no-pager"]), 4000),
    }


def _kill_engine(replica: int) -> dict[str, Any]:
    """SIGKILL replica REPLICA's engine process (the container init's child), as a crash would end it."""
    inspected = run_json(["podman", "inspect", paths.engine_container(replica)]) or [{}]
    init = str((inspected[0] if isinstance(inspected, list) and inspected else {}).get("State", {}).get("Pid") or "")
    children = children_of(init)
    if not init or init == "0" or not children:
        return {"error": f"no engine process in {paths.engine_container(replica)} (init {init!r})"}
    os.kill(int(children[0]), signal.SIGKILL)
    # the loss is when it is gone: requests sent before may have reached it
    end = time.monotonic() + 30
    while time.monotonic() < end and proc_state(children[0]) not in ("gone", "Z"):
        time.sleep(0.05)
    return {"pid": int(children[0]), "at": time.monotonic()}


class ProxyStream:
    """CLIENTS threads each sending the smoke completion through the proxy (https, the appliance CA)
    one after another, each request's send time and outcome recorded."""

    def __init__(self, config: Any, clients: int = 4) -> None:
        from applianctl.engine import smoke

        self.url = f"https://127.0.0.1:{config.proxy.https_port}"
        self.sessions = [smoke.session_for(self.url, config.proxy.hostname, str(paths.TLS_DIR / "ca.crt"))
                         for _ in range(clients)]
        self.body = {"model": config.served_model, "prompt": SMOKE_PROMPT, "temperature": 0, "max_tokens": 32}
        self.done = threading.Event()
        self.records: list[tuple[float, float, str]] = []  # (sent, answered, "ok" or what failed)
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, args=(s,), daemon=True) for s in self.sessions]

    def _client(self, session: Any) -> None:
        while not self.done.is_set():
            sent = time.monotonic()
            try:
                r = session.post(f"{self.url}/v1/completions", json=self.body, timeout=60)
                outcome = "ok" if r.status_code == 200 and "391" in r.json()["choices"][0]["text"] else f"HTTP {r.status_code}"
            except Exception as e:  # every failure is counted, none ends the stream
                outcome = type(e).__name__
            with self.lock:
                self.records.append((sent, time.monotonic(), outcome))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self, killed_at: float, removed_at: float | None = None) -> dict[str, Any]:
        """The outcome around the fault at KILLED_AT; with REMOVED_AT (a deadlock: the replica was
        taken out then), requests sent between the two are in flight on it too and may fail."""
        self.done.set()
        for t in self.threads:
            t.join(70)
        with self.lock:
            records = list(self.records)
        after = killed_at if removed_at is None else removed_at
        sent_after = [r for r in records if r[0] >= after]
        result = {
            "clients": len(self.threads),
            "sent": len(records),
            "sent_after_kill": len(sent_after),
            "ok_after_kill": sum(r[2] == "ok" for r in sent_after),
            # failed requests sent before the kill (in flight on the killed replica) and after it
            "failed_before_kill": [r[2] for r in records if r[0] < killed_at and r[2] != "ok"],
            "failed_after_kill": [(round(r[0] - after, 2), r[2]) for r in sent_after if r[2] != "ok"],
        }
        if removed_at is not None:
            result["failed_until_removed"] = [(round(r[0] - killed_at, 2), r[2]) for r in records
                                              if killed_at <= r[0] < removed_at and r[2] != "ok"]
        return result


def _offload_owners() -> dict[str, str]:
    """Each offload file in /dev/shm and the replica whose engine holds it (APPLIANCE_REPLICA in the
    holder's environment; "" when no process holds it: a dead engine's)."""
    from applianctl.engine.shm import scan_holders

    holders = scan_holders()
    owners = {}
    for path in _offload_files():
        replica = ""
        try:
            for pid in sorted(holders.pids(path, os.stat(path))):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                replica = next((v[len(b"APPLIANCE_REPLICA="):].decode() for v in environ if v.startswith(b"APPLIANCE_REPLICA=")), "")
                if replica:
                    break
        except OSError:
            pass
        owners[path] = replica
    return owners
