# SPDX-License-Identifier: MIT
"""The boot check's hive-wide fault scenario (the plan step {"do": "hive-reset"}, demo images
only): the whole hive reset three times, and the remediation ladder (applianctl/judge/hive.py)
climbing restart, one reboot, needs physical action, until `applianctl remediation --clear`.

Each fault is both signals the judge reads: a recorded amdgpu reset line (the plan's
`kernel_line`, from tests/fixtures/gpu/kernel-log/, which a stand-in cannot make the kernel print)
written into the kernel log through /dev/kmsg, where `journalctl -k` shows it (a line written from
user space carries the user facility, which journald's kernel transport keeps), then every
replica's engine killed at once (testkit/hive.py), as the KFD teardown of a real reset ends them.
The line comes first, as the kernel prints it before the processes die, so that the fault the
judge counts names the GPU whichever round sees it.

    boot 1  fault 1: the replicas restart (systemd's own restart) and are judged alive again; once
            engine.remediation.settle_s has passed (the ladder's rate limit), fault 2: the judge
            records it and reboots the machine. The scenario's progress is on /var before fault 2.
    boot 2  the ladder says "reboot" (its record survived it); fault 3: the judge holds every
            replica down. Status (remediation down with the GPU and the evidence, the engine part
            held), the metric appliance_needs_physical_action 1, the proxy's and the judge's
            /health 503 with the reason; then `applianctl remediation --clear` and the replicas
            back, status ok, /health 200.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.atomic import write_json_atomic
from testkit.guest_commands import run_json, run_text, tail, unit_property, wait_until

KMSG = Path("/dev/kmsg")
KMSG_LEVEL = 6  # amdgpu's "GPU reset begin!" is dev_info; the facility becomes user (the kernel's rule for /dev/kmsg)
KMSG_MAX = 900  # bytes of one record: /dev/kmsg takes at most 1024
# what precedes the message in a recorded line: dmesg's "[seconds] ", syslog's "Mon DD HH:MM:SS host kernel: "
_PREFIX = re.compile(r"^(?:\[\s*\d+\.\d+\]\s*|[A-Z][a-z]{2} +\d+ \d\d:\d\d:\d\d \S+ kernel: (?:\[\s*\d+\.\d+\]\s*)?)")
PHASE_REBOOTING = "rebooting"
REBOOT_WAIT_S = 900.0  # how long boot 1 waits for the judge's reboot before it reports that none came
METRIC = "appliance_needs_physical_action"


def recorded_message(line: str) -> str:
    """A recorded kernel log LINE without its dmesg or syslog prefix: the message the kernel logged."""
    return _PREFIX.sub("", line.strip(), count=1)


def kmsg_record(message: str) -> bytes:
    """MESSAGE as one /dev/kmsg record: a level prefix, one line, bounded."""
    text = " ".join(message.split())
    return f"<{KMSG_LEVEL}>{text}\n".encode()[:KMSG_MAX]


def write_kmsg(message: str, path: Path = KMSG) -> None:
    """MESSAGE into the kernel log (PATH: /dev/kmsg), in one write: one write is one record."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, kmsg_record(message))
    finally:
        os.close(fd)


def phase(progress: dict[str, Any] | None, boot_id: str) -> str:
    """Where the scenario stands: "start" (nothing done yet), "after-reboot" (fault 2 was made on
    an earlier boot), "no-reboot" (fault 2 was made on this boot and the machine is still up)."""
    if not progress or progress.get("phase") != PHASE_REBOOTING:
        return "start"
    return "no-reboot" if progress.get("boot_id") == boot_id else "after-reboot"


def settled_after(last_fault_at: str | None, settle_s: float, interval_s: float) -> float:
    """When (seconds since the epoch) a fault is a new one after the last counted at LAST_FAULT_AT:
    past the ladder's settle time, and two of the judge's rounds more."""
    from applianctl.judge import hive

    last = hive.epoch(last_fault_at)
    return 0.0 if last is None else last + settle_s + 2 * interval_s + 1


def read_progress(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ----------------------------------------------------------------------------------- the guest


class Guest:
    """What the scenario asks of the guest (a fake on the test host)."""

    def __init__(self) -> None:
        from appliance.host_settings import load_device

        self.config = load_device()
        self.units = paths.engine_units(self.config.replicas)

    def boot_id(self) -> str:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def ladder(self) -> dict[str, Any]:
        from appliance.schema import dump_record
        from applianctl.judge import hive

        record, damage = hive.Ladder(self.config.engine.remediation).load()
        return {**(dump_record(record) if record is not None else {"step": "none", "faults": 0}), "damaged": damage}

    def judge(self) -> dict[str, Any]:
        try:
            data = json.loads(paths.JUDGE_STATE.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def unit_states(self) -> dict[str, dict[str, str]]:
        return {u: {k: unit_property(u, k) for k in ("ActiveState", "SubState", "MainPID", "NRestarts")} for u in self.units}

    def fault(self, message: str) -> dict[str, Any]:
        """One hive-wide fault: MESSAGE into the kernel log, seen by `journalctl -k`, then every
        replica's engine killed at once."""
        from applianctl.judge import hive
        from testkit.hive import reset_guest_hive

        def seen_in_kernel_log() -> bool:
            try:
                return any(message in e.line for e in hive.read_kernel_log(at - 1))
            except Exception:  # journalctl failed: not seen (yet)
                return False

        at = self.wall()
        write_kmsg(message)
        seen = wait_until(seen_in_kernel_log, 30)
        return {"written_at": hive.iso(at), "in_kernel_log": seen, "reset": reset_guest_hive(self.config.replicas)}

    def status(self) -> dict[str, Any]:
        doc = run_json(["/usr/bin/applianctl", "status", "--json", "--timeout-scale", "20"], timeout=180) or {}
        parts = doc.get("parts") or {}
        return {"state": doc.get("state"), "remediation": parts.get("remediation"), "engine": parts.get("engine")}

    def metric(self) -> list[str]:
        text = run_text(["/usr/bin/applianctl", "status", "--prometheus", "--timeout-scale", "20"], timeout=180)
        return [line for line in text.splitlines() if line.startswith(METRIC)]

    def proxy_health(self) -> dict[str, Any]:
        from applianctl.engine import smoke

        url = f"https://127.0.0.1:{self.config.proxy.https_port}"
        try:
            r = smoke.session_for(url, self.config.proxy.hostname, str(paths.TLS_DIR / "ca.crt")).get(f"{url}/health", timeout=30)
            return {"status": r.status_code, "body": tail(r.text, 1000)}
        except Exception as e:  # the outcome says what happened, the host asserts
            return {"status": None, "error": f"{type(e).__name__}: {e}"}

    def judge_health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://{paths.JUDGE_HEALTH}/health", timeout=10) as r:
                return {"status": int(r.status), "body": tail(r.read().decode(errors="replace"), 1000)}
        except urllib.error.HTTPError as e:
            return {"status": int(e.code), "body": tail(e.read().decode(errors="replace"), 1000)}
        except OSError as e:
            return {"status": None, "error": str(e)}

    def clear(self) -> dict[str, Any]:
        import subprocess

        proc = subprocess.run(["/usr/bin/applianctl", "remediation", "--clear", "--json"], capture_output=True, text=True,
                              timeout=600, check=False)
        try:
            said: Any = json.loads(proc.stdout)
        except ValueError:
            said = tail(proc.stdout, 2000)
        return {"exit": proc.returncode, "said": said, "stderr": tail(proc.stderr, 2000)}

    def judge_log(self) -> str:
        return tail(run_text(["journalctl", "-b", "0", "-o", "cat", "-u", "appliance-judge.service", "--no-pager"]), 4000)

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        return wait_until(predicate, timeout)


# ----------------------------------------------------------------------------------- the scenario


def _all_active(g: Any) -> bool:
    return all(s["ActiveState"] == "active" for s in g.unit_states().values())


def _none_active(g: Any) -> bool:
    return all(s["ActiveState"] != "active" for s in g.unit_states().values())


def _all_alive(g: Any) -> bool:
    judged = g.judge()
    return bool(judged.get("replicas")) and all(r.get("state") == "alive" for r in judged["replicas"])


def _all_held(g: Any) -> bool:
    judged = g.judge()
    return bool(judged.get("hive")) and all(r.get("state") == "held" for r in judged.get("replicas") or [])


def _serving(g: Any) -> dict[str, Any]:
    """Until every replica's unit is active and the judge calls each alive; what was seen."""
    active = g.wait(lambda: _all_active(g), 900)
    alive = g.wait(lambda: _all_alive(g), 600) if active else False
    return {"active": active, "alive": alive, "units": g.unit_states()}


def _settle(g: Any, settings: dict[str, Any]) -> None:
    """Until a fault would be a new one: past the ladder's settle time after the last counted."""
    until = settled_after(g.ladder().get("last_fault_at"), settings["settle_s"], settings["interval_s"])
    while g.wall() < until:
        g.sleep(min(5.0, until - g.wall()))


def _fault_counted(g: Any, faults: int, message: str, settings: dict[str, Any]) -> dict[str, Any]:
    """Fault number FAULTS, once the last one has settled; until the judge counted it."""
    _settle(g, settings)
    made = g.fault(message)
    counted = g.wait(lambda: g.ladder().get("faults", 0) >= faults, 180)
    return {**made, "counted": counted, "ladder": g.ladder()}


def run(progress_path: Path, kernel_line: str, guest: Any = None) -> dict[str, Any]:
    """The scenario, resumed from PROGRESS_PATH after the reboot; its outcome (on the second boot,
    or when something it waits for does not come)."""
    g = guest or Guest()
    message = recorded_message(kernel_line)
    progress = read_progress(progress_path)
    where = phase(progress, g.boot_id())
    remediation = g.config.engine.remediation
    settings = {"settle_s": remediation.settle_s, "restarts": remediation.restarts, "together_s": remediation.together_s,
                "quiet_s": remediation.quiet_s, "interval_s": g.config.engine.progress.interval_s}
    if where == "no-reboot":
        assert progress is not None
        return {**progress, "error": "the judge did not reboot after the second fault", "judge_log": g.judge_log()}
    if where == "start":
        first: dict[str, Any] = {"ladder_before": g.ladder(), "serving_before": _serving(g)}
        first["fault"] = _fault_counted(g, 1, message, settings)
        first["back"] = _serving(g)
        first["status"] = g.status()
        first["judge_log"] = g.judge_log()
        progress = {"phase": PHASE_REBOOTING, "boot_id": g.boot_id(), "kernel_message": message, "settings": settings,
                    "restart": first}
        _settle(g, settings)
        # durable before the fault that reboots: the next boot's boot check reads it. The judge may
        # reboot as soon as it reads the line, before the replicas are killed: what the fault did
        # is kept when there was time, and the ladder's record on the next boot says what it counted.
        write_json_atomic(progress_path, progress)
        progress["reboot_fault"] = g.fault(message)
        write_json_atomic(progress_path, progress)
        g.sleep(REBOOT_WAIT_S)  # the judge reboots the machine meanwhile
        return {**progress, "error": "the judge did not reboot after the second fault", "judge_log": g.judge_log()}
    assert progress is not None
    after: dict[str, Any] = {"boot_id": g.boot_id(), "ladder": g.ladder(), "serving": _serving(g), "status": g.status()}
    held: dict[str, Any] = {"fault": _fault_counted(g, 3, message, settings)}
    held["judged_held"] = g.wait(lambda: _all_held(g), 120)
    held["stopped"] = g.wait(lambda: _none_active(g), 300)
    # and kept down: systemd's own restarts, if any, are stopped again round after round
    g.sleep(4 * settings["interval_s"])
    held.update(units=g.unit_states(), judge=g.judge(), status=g.status(), metric=g.metric(),
                proxy_health=g.proxy_health(), judge_health=g.judge_health(), ladder=g.ladder())
    cleared: dict[str, Any] = {"command": g.clear(), "ladder": g.ladder()}
    cleared["serving"] = _serving(g)
    cleared.update(status=g.status(), metric=g.metric(), proxy_health=g.proxy_health(), judge_health=g.judge_health())
    outcome = {**progress, "after_reboot": after, "held": held, "cleared": cleared, "judge_log": g.judge_log()}
    outcome.pop("phase", None)
    progress_path.unlink(missing_ok=True)
    return outcome
