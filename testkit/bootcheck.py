# SPDX-License-Identifier: MIT
"""The boot check (demo images only, from appliance-bootcheck.service): waits, bounded, for a
healthy engine, then writes the facts a test host asserts as one JSON report between marker lines
to a serial port: `applianctl status --json`, failed units, how /usr is mounted and protected, the
partition table, file system sizes. With the credential appliance.bootcheck=poweroff it then
powers off so the host can read the report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from appliance import efivars, paths
from appliance.atomic import write_json_atomic
from appliance.config.model import SMOKE_PROMPT
from appliance.host_settings import load_device
from applianctl import __version__
from applianctl.slots.machine import Host, efi_var

BEGIN, END = "APPLIANCE-REPORT-BEGIN", "APPLIANCE-REPORT-END"


def _run(cmd: list[str], timeout: float = 20) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"error: {e}"


def _json(cmd: list[str], timeout: float = 20) -> Any:
    try:
        return json.loads(_run(cmd, timeout=timeout))
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
        status = {"state": "unknown", "error": _tail(raw, 500)}
    return status, _run(["/usr/bin/applianctl", "status", "--timeout-scale", "20"], timeout=90)


# The units the engine Requires=: when one of them failed, the engine will not start.
ENGINE_REQUIREMENTS = ("appliance-verify.service", "appliance-preflight.service", "appliance-shm-clean.service",
                       "appliance-engine-store.service", "appliance-model-verify.service")


def wait_for_engine(deadline_s: float) -> bool:
    """Until every replica's unit is active (podman's health check passed, Notify=healthy), a unit
    they require failed, a replica used up its restarts, or the deadline."""
    replicas = paths.engine_units(load_device().replicas)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        states = _run(["systemctl", "is-active", *replicas]).split()
        if states == ["active"] * len(replicas):
            return True
        if _run(["systemctl", "is-failed", *ENGINE_REQUIREMENTS]).split().count("failed"):
            return False
        for unit, state in zip(replicas, states, strict=False):
            if state == "failed" and _run(["systemctl", "show", "-P", "NRestarts", unit]).strip() == "5":
                return False
        time.sleep(3)
    return False


def wait_for_assessment(deadline_s: float) -> None:
    """On a boot under trial, until the boot assessment and systemd-bless-boot are done (or the
    deadline), so that the report shows the verdict."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        jobs = _run(["systemctl", "list-jobs", "--no-legend", "--no-pager"])
        if not any(u in jobs for u in ("appliance-assess.service", "boot-complete.target", "systemd-bless-boot.service")):
            return
        time.sleep(3)




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


def smoke_proxy(deadline_s: float = 60) -> str:
    """`applianctl smoke` through the proxy, tried again (up to DEADLINE_S) while the proxy has no
    replica to send it to: with several replicas, its health check admits one only once it has
    answered its warm-up request, up to one check interval (10 s) after its unit started."""
    end = time.monotonic() + deadline_s
    while True:
        out = _run(["/usr/bin/applianctl", "smoke"], timeout=120)
        if "ok: " in out or time.monotonic() > end or "HTTP 503" not in out:
            return out
        time.sleep(3)


def _ppid(pid: str) -> str | None:
    try:
        # the command name (field 2) is in parentheses and may hold spaces
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1]
    except (OSError, IndexError):
        return None


def engine_environment() -> dict[str, Any]:
    """The engine process's environment from /proc/PID/environ (the exact bytes it got), and the
    image's own variables for comparison. With RunInit the engine is the container init's child."""
    inspected = _json(["podman", "inspect", paths.engine_container(0)]) or [{}]
    container = inspected[0] if isinstance(inspected, list) and inspected else {}
    pid = str(container.get("State", {}).get("Pid") or "")
    if not pid or pid == "0":
        return {"error": f"no running {paths.engine_container(0)} container: {str(container)[:300]}"}
    children = sorted((p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p.name) == pid), key=int)
    engine_pid = children[0] if children else pid
    try:
        raw = Path(f"/proc/{engine_pid}/environ").read_bytes()
    except OSError as e:
        return {"error": f"/proc/{engine_pid}/environ: {e}"}
    image = _json(["podman", "image", "inspect", str(container.get("Image", ""))]) or [{}]
    image_env = (image[0] if isinstance(image, list) and image else {}).get("Config", {}).get("Env") or []
    return {
        "pid": engine_pid,
        "init_pid": pid,
        "cmdline": Path(f"/proc/{engine_pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"),
        "environ": [v.decode(errors="replace") for v in raw.split(b"\0") if v],
        "image_env": image_env,
    }


def sealed() -> dict[str, Any]:
    """How sealed this boot is: Secure Boot as the firmware reports it, a TPM, and the signed PCR
    policy systemd-stub found in the kernel image (it leaves it under /run/systemd)."""
    state = efivars.secure_boot_state()
    return {
        "secure_boot": state.secure_boot,
        "setup_mode": state.setup_mode,
        "tpm": Path("/sys/class/tpm/tpm0").exists(),
        "pcr_signature": Path("/run/systemd/tpm2-pcr-signature.json").exists(),
    }


def replica_starts(replicas: int) -> dict[str, Any]:
    """When each replica's unit was started, its engine's container started and the unit became
    active (healthy), in µs since boot, and what its stagger step said (units/appliance-engine@.container.j2)."""
    names = {"InactiveExitTimestampMonotonic": "started", "ExecMainStartTimestampMonotonic": "main_started",
             "ActiveEnterTimestampMonotonic": "active"}
    starts: dict[str, Any] = {}
    for i, unit in enumerate(paths.engine_units(replicas)):
        # KEY=VALUE lines: systemctl prints properties in its own order, not the order asked for
        shown = _run(["systemctl", "show", *(f"--property={key}" for key in names), unit])
        starts[unit] = {names[key]: int(value) for key, _, value in (line.partition("=") for line in shown.splitlines())
                        if key in names and value.isdigit()}
        starts[unit]["stagger"] = [line for line in _run(["journalctl", "-b", "-o", "cat", "--no-pager", "-u", unit]).splitlines()
                                   if line.startswith(f"replica {i}: ")][-3:]
    return starts


def boot_entries() -> list[dict[str, Any]]:
    """The boot menu as bootctl lists it: each entry's id, title, whether it is the default and the
    one booted now (the factory reset entries are profiles of each kernel image)."""
    entries = _json(["bootctl", "--no-pager", "list", "--json=short"]) or []
    return [{k: e.get(k) for k in ("id", "title", "isDefault", "isSelected")} for e in entries if isinstance(e, dict)]


def loader_vars() -> dict[str, str | None]:
    """What systemd-boot and systemd-stub say of this boot: the entry booted (a reset entry is
    "FILE.efi@PROFILE"), the counted file of a trial, the UKI profile number systemd-stub ran."""
    host = Host()
    return {name: efi_var(host, name) for name in ("LoaderEntrySelected", "LoaderBootCountPath", "StubProfile")}


def collect() -> dict[str, Any]:
    usr_source = _run(["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "/usr"]).split()
    root_disk = _run(["lsblk", "-no", "PKNAME", _run(["findmnt", "-no", "SOURCE", "/"]).strip()]).strip()
    config = load_device()
    smoke = smoke_engine(config.engine.port, config.served_model)
    proxy_smoke = smoke_proxy()
    status, status_text = _status()
    units = _json(["systemctl", "list-units", "--failed", "--output=json"]) or []
    engine_env = engine_environment()  # before the fault scenarios restart the engine
    return {
        "replica_starts": replica_starts(config.replicas),
        "boot_entries": boot_entries(),
        "loader": loader_vars(),
        "sealed": sealed(),
        "etc": etc_state(),
        "engine_env": engine_env,
        "applianctl_version": _run(["/usr/bin/applianctl", "--version"], timeout=90).strip(),
        "bootcheck_version": __version__,
        "failed_units": [u.get("unit") for u in units if isinstance(u, dict)],
        "usr_mount": usr_source,
        "usr_verity": _run(["veritysetup", "status", "usr"]),
        # what the initrd's appliance-usr-signature.service said, and the signature it handed to dm-verity
        "usr_signature": {"file": Path("/run/appliance/usr-roothash.p7s").is_file(),
                          "log": _tail(_run(["journalctl", "-b", "-o", "cat", "--no-pager", "-u",
                                             "appliance-usr-signature.service"]), 2000)},
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
            unit: _tail(_run(["journalctl", "-o", "cat", "-u", unit, "-n", "30", "--no-pager"]), 3000)
            for unit in dict.fromkeys(
                (*ENGINE_REQUIREMENTS, *paths.engine_units(config.replicas), "appliance-proxy.service", "appliance-tls.service",
                 *(str(u.get("unit")) for u in units if isinstance(u, dict)))
            )
        },
        "smoke_engine": smoke,
        "smoke_proxy": proxy_smoke,
        "status": status,
        "status_text": status_text,
    }


# ------------------------------------------------------------------------- fault scenarios
# With the plan step {"do": "faults"} (below), the boot check drives the stand-in engine's
# fault switches (a JSON file it reads at start) through the production unit, and records what
# systemd and the /dev/shm cleaner did about each fault.

FAULTS_FILE = Path("/run/appliance/standin/faults.json")
# The scenarios' replica (the faults file names it); any other replica must not notice them.
ENGINE = paths.engine_unit(0)


def _engine_prop(name: str, unit: str = ENGINE) -> str:
    return _run(["systemctl", "show", "-P", name, unit]).strip()


def _others() -> dict[str, dict[str, str]]:
    """Every other replica's unit: its main PID and restarts (unchanged: it was not restarted)."""
    return {unit: {"pid": _engine_prop("MainPID", unit), "restarts": _engine_prop("NRestarts", unit),
                   "active": _engine_prop("ActiveState", unit)}
            for unit in paths.engine_units(load_device().replicas)[1:]}


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
    FAULTS_FILE.write_text(json.dumps({"replica": 0, **faults}))
    start = time.monotonic()
    # The operator's restart of replica 0 alone (it resets the start limit, which the scenarios
    # together would use up); returns once healthy (Notify=healthy) or failed.
    _run(["/usr/bin/applianctl", "restart", "engine@0"], timeout=900)
    return time.monotonic() - start


def run_fault_scenarios() -> dict[str, Any]:
    results: dict[str, Any] = {"others_before": _others()}
    # A slow start inside the start period is not killed: active, and no automatic restart.
    restarts = int(_engine_prop("NRestarts") or 0)
    took = _restart_with({"load_seconds": 60})
    results["slow_start"] = {
        "active": _engine_prop("ActiveState") == "active",
        "automatic_restarts": int(_engine_prop("NRestarts") or 0) - restarts,
        "seconds_to_healthy": round(took, 1),
    }
    # Replica 0's engine killed (SIGKILL: its offload file left behind) while clients stream
    # requests through the proxy: only those in flight on it may fail; it restarts alone, the
    # stale file removed first, and replica 1 serves meanwhile.
    FAULTS_FILE.unlink()  # the restarted engine runs clean
    before, restarts = _offload_owners(), int(_engine_prop("NRestarts") or 0)
    stream = ProxyStream(load_device())
    stream.start()
    time.sleep(10)
    killed = _kill_engine(0)
    restarted = _wait(lambda: int(_engine_prop("NRestarts") or 0) > restarts and _engine_prop("ActiveState") == "active", 600)
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
        "cleaner_log": _tail(_run(["journalctl", "-o", "cat", "-u", "appliance-shm-clean.service", "--no-pager"]), 4000),
    }
    # A hang (health checks failing) is detected and the engine restarted.
    _restart_with({"hang_after_s": 45})
    restarts = int(_engine_prop("NRestarts") or 0)
    FAULTS_FILE.unlink()
    restarted = _wait(lambda: int(_engine_prop("NRestarts") or 0) > restarts and _engine_prop("ActiveState") == "active", 300)
    log = _run(["journalctl", "-o", "cat", "-u", ENGINE, "-n", "40", "--no-pager"])
    results["hang"] = {"restarted": restarted, "engine_log": _tail(log, 4000)}
    results["others_after"] = _others()
    return results


def _kill_engine(replica: int) -> dict[str, Any]:
    """SIGKILL replica REPLICA's engine process (the container init's child), as a crash would end it."""
    inspected = _json(["podman", "inspect", paths.engine_container(replica)]) or [{}]
    init = str((inspected[0] if isinstance(inspected, list) and inspected else {}).get("State", {}).get("Pid") or "")
    children = sorted((p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p.name) == init), key=int)
    if not init or init == "0" or not children:
        return {"error": f"no engine process in {paths.engine_container(replica)} (init {init!r})"}
    os.kill(int(children[0]), signal.SIGKILL)
    # the loss is when it is gone: requests sent before may have reached it
    end = time.monotonic() + 30
    while time.monotonic() < end and _proc_state(children[0]) not in ("gone", "Z"):
        time.sleep(0.05)
    return {"pid": int(children[0]), "at": time.monotonic()}


def _proc_state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "gone"


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

    def stop(self, killed_at: float) -> dict[str, Any]:
        self.done.set()
        for t in self.threads:
            t.join(70)
        with self.lock:
            records = list(self.records)
        sent_after = [r for r in records if r[0] >= killed_at]
        return {
            "clients": len(self.threads),
            "sent": len(records),
            "sent_after_kill": len(sent_after),
            "ok_after_kill": sum(r[2] == "ok" for r in sent_after),
            # failed requests sent before the kill (in flight on the killed replica) and after it
            "failed_before_kill": [r[2] for r in records if r[0] < killed_at and r[2] != "ok"],
            "failed_after_kill": [(round(r[0] - killed_at, 2), r[2]) for r in sent_after if r[2] != "ok"],
        }


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


# ------------------------------------------------------------------------- the plan
# A test host passes the credential appliance.plan, JSON: {VERSION: [STEP, ...]}: what to do on
# a boot of VERSION after the first look. Each step runs once per disk (a marker under
# /var/lib/appliance/bootcheck records its outcome), so a plan can span reboots and power cuts:
#   {"do": "faults"}                          the fault scenarios above
#   {"do": "refusals", "bundles": {N: URL}}   `applianctl update URL` of bundles that must be
#                                             refused; the inactive slot's write counters before and after
#   {"do": "update", "url": URL}              `applianctl update URL`, then a reboot into it
#   {"do": "download-only", "url": URL}       `applianctl update --download-only URL`: staged on
#                                             /var, no slot written
#   {"do": "apply"}                           `applianctl update --apply`, then a reboot into it;
#                                             like "update", the engine partitions hashed before
#                                             and after
#   {"do": "rollback", "force": BOOL}         `applianctl rollback [--force]`, then a reboot into
#                                             the other slot's version, with its engine
#   {"do": "netprobe"}                        the host probes the guest from a network
#                                             namespace on its second NIC (builder.qemu.ProbeNet)
#                                             while the engine serves; the guest waits for it
#   {"do": "etc-dropin"}                      a drop-in for the engine placed in /etc (as someone
#                                             with root would, to change what it runs), then
#                                             `applianctl verify --json`; the file is left for
#                                             the next boot's initrd to remove
#   {"do": "scrape"}                          the metrics refreshed (appliance-metrics.service),
#                                             then the host scrapes them through the proxy's
#                                             metrics site (make demo: builder boot --metrics-out)
#   {"do": "rollout-hold", "url": URL}        URL is a channel index whose rollout has not
#                                             reached this appliance: `applianctl update --check
#                                             URL`, then `applianctl update URL`, which must
#                                             install nothing (the inactive slot's write counters before and after)
#   {"do": "update-on-trial", "url": URL}     while this version is still on trial (run by
#                                             appliance-bootcheck-trial.service, ordered before
#                                             the assessment): `applianctl update URL` must be
#                                             refused; both slots' write counters before and after
# The CA for https:// URLs comes in the credential appliance.update_ca (PEM). An update runs
# after the report is written, its output on the console, its outcome in the next report: a
# power cut in the middle leaves no marker, so the next boot runs it again.

MARKER_DIR = Path("/var/lib/appliance/bootcheck")
STEPS = ("faults", "refusals", "update", "netprobe", "download-only", "apply", "rollback", "etc-dropin", "rollout-hold", "scrape")
# not from the signed image: `applianctl verify` must name it, the next boot must not run with it
ETC_DROPIN = Path("/etc/systemd/system/appliance-engine@.service.d/50-not-signed.conf")  # every replica
UPDATES = ("update", "apply", "rollback")  # each run after the report, then a reboot
TRIAL_STEPS = ("update-on-trial",)
ASK = "APPLIANCE-ASK"
REPORT_PORT = "/dev/ttyS1"


def _marker(version: str, step: dict[str, Any]) -> Path:
    key = json.dumps([version, step], sort_keys=True).encode()
    return MARKER_DIR / f"{step['do']}-{hashlib.sha256(key).hexdigest()[:16]}.json"


def _plan(version: str) -> list[dict[str, Any]]:
    try:
        plan = json.loads(credential("appliance.plan") or "{}")
    except json.JSONDecodeError:
        return []
    steps = plan.get(version, []) if isinstance(plan, dict) else []
    return [s for s in steps if isinstance(s, dict) and s.get("do") in (*STEPS, *TRIAL_STEPS)]


def _update_command(url: str, *options: str) -> list[str]:
    ca = Path(os.environ.get("CREDENTIALS_DIRECTORY", "/nonexistent")) / "appliance.update_ca"
    return ["/usr/bin/applianctl", "update", *options, url, "--yes"] + (["--ca", str(ca)] if ca.exists() else [])


def _inactive_slot_writes(version: str) -> dict[str, str]:
    """The inactive slot's partitions, each with its label and the kernel's write counters: what the
    updater writes (systemd-sysupdate, blkdiscard) goes through these partitions' nodes, so equal
    counters before and after prove nothing was written, without reading a GiB under emulation."""
    from applianctl.slots.machine import Host
    from applianctl.slots.partitions import slots

    inactive = next(s for s in slots(Host(), version) if not s.booted)
    parts = [p for p in (inactive.usr, inactive.verity) if p is not None]
    return {p.node: f"{p.label} {_sectors_written(p.node)}" for p in parts}


def _tail(text: str, limit: int) -> str:
    """The end of TEXT, at most LIMIT characters, from the start of a line."""
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    return cut.split("\n", 1)[1] if "\n" in cut else cut


def run_refusals(version: str, bundles: dict[str, str]) -> dict[str, Any]:
    before = _inactive_slot_writes(version)
    results = {}
    for name, url in bundles.items():
        proc = subprocess.run(_update_command(url), capture_output=True, text=True, timeout=1800, check=False)
        results[name] = {"url": url, "exit": proc.returncode, "stdout": _tail(proc.stdout, 2000), "stderr": _tail(proc.stderr, 2000)}
    return {"bundles": results, "inactive_before": before, "inactive_after": _inactive_slot_writes(version)}


USR_TYPES = {"8484680C-9521-48C6-9C11-B0720656F69E": "usr", "77FF5F63-E7B6-4633-ACF4-1565B864C0E6": "usr-verity",
             "E7BB33FB-06CF-4E81-8273-E543B413E2E2": "usr-verity-sig"}


def _sectors_written(node: str) -> str:
    """The kernel's counts of sectors written (zeroing included) and discarded through this
    partition since boot (/sys/class/block/NAME/stat, fields 7 and 14): any write by the updater
    shows here."""
    fields = Path(f"/sys/class/block/{Path(node).name}/stat").read_text().split()
    return f"written {fields[6]} sectors, discarded {fields[13] if len(fields) > 13 else '?'}"


def _partitions() -> list[dict[str, Any]]:
    """The boot disk's partitions, as sfdisk -J lists them."""
    root_disk = _run(["lsblk", "-no", "PKNAME", _run(["findmnt", "-no", "SOURCE", "/"]).strip()]).strip()
    return list((_json(["sfdisk", "-J", f"/dev/{root_disk}"]) or {}).get("partitiontable", {}).get("partitions", []))


def _slot_writes() -> dict[str, str]:
    """Every /usr and /usr verity partition with its label (a relabel is an install too) and the
    kernel's write counters (_inactive_slot_writes), and the ESP's boot entries."""
    parts = [p for p in _partitions() if p.get("type", "").upper() in USR_TYPES]
    hashes = {f"{p['node']} {p.get('name', '')}": _sectors_written(p["node"]) for p in parts}
    esp = next((Path(d) / "EFI/Linux" for d in ("/efi", "/boot") if (Path(d) / "EFI/Linux").is_dir()), None)
    entries = sorted(e.name for e in esp.iterdir()) if esp else []
    return {**hashes, "entries": " ".join(entries)}


def _on_trial() -> dict[str, Any]:
    """Whether this boot is under boot counting (systemd-boot's LoaderBootCountPath or a +LEFT
    entry name) and how far the assessment got."""
    from applianctl.slots.machine import Host, boot_counting

    counting = boot_counting(Host())
    return {
        "counting": counting,
        "assess_state": _run(["systemctl", "show", "-P", "ActiveState", "appliance-assess.service"]).strip(),
        "boot_complete": _run(["systemctl", "is-active", "boot-complete.target"]).strip(),
    }


def run_update_on_trial(url: str) -> dict[str, Any]:
    """`applianctl update URL` while this version is not judged yet: it must be refused (one
    line), and neither slot nor the boot entries may change."""
    trial = _on_trial()
    before = _slot_writes()
    proc = subprocess.run(_update_command(url), capture_output=True, text=True, timeout=1800, check=False)
    return {
        "url": url,
        "trial": trial,
        "exit": proc.returncode,
        "stdout": _tail(proc.stdout, 2000),
        "stderr": _tail(proc.stderr, 2000),
        "slots_before": before,
        "slots_after": _slot_writes(),
        "trial_after": _on_trial(),
    }


NETPROBE_DONE = "/appliance-netprobe-done"


def _http_status(url: str) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError as e:
        return str(e)


def _proxy_saw(path: str, since: str) -> bool:
    return path in _run(["journalctl", "-o", "cat", "-u", "appliance-proxy.service", "--since", since, "--no-pager"])


def run_netprobe(wait_s: float = 120) -> dict[str, Any]:
    """Have the host probe this appliance from its network (a host namespace on the guest's second
    NIC): the engine's port and bridge address must not answer, the proxy must. The guest waits
    (bounded) for the host's last request, to NETPROBE_DONE, in the proxy's log, and checks the
    engine's health itself before and after, so a refusal does not mean the engine was down."""
    config = load_device()
    inspected = _json(["podman", "inspect", paths.engine_container(0)]) or [{}]
    networks = (inspected[0] if isinstance(inspected, list) and inspected else {}).get("NetworkSettings", {}).get("Networks") or {}
    bridge = next((n.get("IPAddress") for n in networks.values() if n.get("IPAddress")), "")
    port = config.engine.port
    health = config.engine.health.path
    inside_before = _http_status(f"http://{bridge}:{port}{health}") if bridge else "no bridge address"
    # the metrics the host scrapes: written now (the timer's unit, run at once), and the status
    # document of the same moment, whose part states the scraped gauges must repeat
    metrics_unit = subprocess.run(["systemctl", "start", "appliance-metrics.service"], capture_output=True, text=True,
                                  timeout=300, check=False)
    status_now = _json(["/usr/bin/applianctl", "status", "--json", "--timeout-scale", "20"], timeout=180) or {}
    since = _run(["date", "+%Y-%m-%d %H:%M:%S"]).strip()
    question = {"bridge": bridge, "engine_port": port, "https_port": config.proxy.https_port,
                "http_port": 80, "done_path": NETPROBE_DONE, "metrics_port": config.metrics.port}
    with open(REPORT_PORT, "w") as report_port:
        report_port.write(f"\n{ASK} netprobe {json.dumps(question)}\n")
    started = time.monotonic()
    seen = _wait(lambda: _proxy_saw(NETPROBE_DONE, since), wait_s)
    return {
        **question,
        "host_done_seen": seen,
        "waited_s": round(time.monotonic() - started, 1),
        "inside_before": inside_before,
        "inside_after": _http_status(f"http://{bridge}:{port}{health}") if bridge else "no bridge address",
        "ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
        "addresses": _run(["ip", "-br", "addr"]),
        "nft_tables": _run(["nft", "list", "tables"]),
        "metrics_unit": {"exit": metrics_unit.returncode, "stderr": _tail(metrics_unit.stderr, 500)},
        "part_states": {name: part.get("state") for name, part in (status_now.get("parts") or {}).items()},
        "units": {name: {k: u.get(k) for k in ("state", "reason", "active_state", "sub_state")}
                  for name, u in ((status_now.get("parts") or {}).get("units", {}).get("units") or {}).items()},
    }


SCRAPE_DONE = "/appliance-scrape-done"


def run_scrape(wait_s: float = 180) -> dict[str, Any]:
    """Have the host scrape this appliance's metrics through the proxy's metrics site, fresh: the
    metrics unit runs first. The guest waits (bounded) for the host's last request, to SCRAPE_DONE,
    in the proxy's log."""
    config = load_device()
    unit = subprocess.run(["systemctl", "start", "appliance-metrics.service"], capture_output=True, text=True, timeout=300, check=False)
    since = _run(["date", "+%Y-%m-%d %H:%M:%S"]).strip()
    question = {"metrics_port": config.metrics.port, "done_path": SCRAPE_DONE}
    with open(REPORT_PORT, "w") as report_port:
        report_port.write(f"\n{ASK} scrape {json.dumps(question)}\n")
    started = time.monotonic()
    seen = _wait(lambda: _proxy_saw(SCRAPE_DONE, since), wait_s)
    return {**question, "metrics_unit": {"exit": unit.returncode, "stderr": _tail(unit.stderr, 500)}, "host_done_seen": seen,
            "waited_s": round(time.monotonic() - started, 1)}


def _engine_partitions() -> dict[str, Any]:
    """Both engine slots' partitions: label, SHA-256 of every byte (a slot is 64 MiB in the demo)
    and the sectors written through each since boot; and the one appliance-engine-store.service
    opened this boot."""
    from appliance.bundle import ENGINE_TYPE, ENGINE_VERITY_TYPE
    from applianctl.slots import engine as engine_slots

    parts = [p for p in _partitions() if p.get("type", "").upper() in (ENGINE_TYPE, ENGINE_VERITY_TYPE)]
    opened = engine_slots.opened()
    return {"running": opened.partition if opened is not None else None,
            "partitions": {p["node"]: {"label": p.get("name", ""), "sha256": _run(["sha256sum", p["node"]], timeout=600).split(" ")[0],
                                       "written": _sectors_written(p["node"])} for p in parts}}


def run_etc_dropin() -> dict[str, Any]:
    """Place ETC_DROPIN, make systemd read it, and ask `applianctl verify` what it sees."""
    ETC_DROPIN.parent.mkdir(parents=True, exist_ok=True)
    ETC_DROPIN.write_text("[Service]\nEnvironment=APPLIANCE_UNSIGNED_DROPIN=1\n")
    _run(["systemctl", "daemon-reload"], timeout=120)
    proc = subprocess.run(["/usr/bin/applianctl", "verify", "--json"], capture_output=True, text=True, timeout=300, check=False)
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        result = {"unreadable": _tail(proc.stdout, 2000)}
    return {"path": str(ETC_DROPIN), "drop_in_paths": _engine_prop("DropInPaths"), "verify_exit": proc.returncode,
            "verify": result, "stderr": _tail(proc.stderr, 2000)}


def etc_state() -> dict[str, Any]:
    """What the initrd's /etc reset did on this boot, and whether the engine runs with a drop-in
    from /etc."""
    return {
        "etc_dropin_present": ETC_DROPIN.exists(),
        "engine_drop_in_paths": _engine_prop("DropInPaths"),
        "engine_environment": _engine_prop("Environment"),
        "reset_log": _tail(_run(["journalctl", "-b", "-o", "cat", "--no-pager", "-u", "appliance-etc-reset.service"]), 3000),
    }


def run_download_only(url: str) -> dict[str, Any]:
    """`applianctl update --download-only URL`: staged on /var, no slot written."""
    proc = subprocess.run(_update_command(url, "--download-only"), capture_output=True, text=True, timeout=3600, check=False)
    return {"url": url, "exit": proc.returncode, "output": _tail(proc.stdout + proc.stderr, 4000)}


def run_update(command: list[str], url: str | None) -> dict[str, Any]:
    """`applianctl update ...`, its output streamed to the console (a host that cuts the power
    watches for it) and kept for the report, with the engine partitions before and after."""
    engines_before = _engine_partitions()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return {"url": url, "exit": proc.wait(), "output": _tail("".join(lines), 4000), "engines_before": engines_before,
            "engines_after": _engine_partitions()}


def run_step(version: str, step: dict[str, Any], engine_healthy: bool) -> dict[str, Any] | None:
    """Run STEP once (None when it ran on an earlier boot); record its outcome in its marker."""
    marker = _marker(version, step)
    if _read_marker(marker) is not None:
        return None
    started = time.monotonic()
    if step["do"] == "faults":
        outcome: dict[str, Any] = run_fault_scenarios() if engine_healthy else {"skipped": "the engine never became healthy"}
    elif step["do"] == "refusals":
        outcome = run_refusals(version, dict(step.get("bundles", {})))
    elif step["do"] == "netprobe":
        outcome = run_netprobe() if engine_healthy else {"skipped": "the engine never became healthy"}
    elif step["do"] == "scrape":
        outcome = run_scrape() if engine_healthy else {"skipped": "the engine never became healthy"}
    elif step["do"] == "rollout-hold":
        check = subprocess.run(_update_command(str(step["url"]), "--check"), capture_output=True, text=True, timeout=600, check=False)
        outcome = {"check": {"exit": check.returncode, "stdout": _tail(check.stdout, 2000), "stderr": _tail(check.stderr, 2000)},
                   **run_refusals(version, {"held": str(step["url"])})}
    elif step["do"] == "update-on-trial":
        outcome = run_update_on_trial(str(step["url"]))
    elif step["do"] == "etc-dropin":
        outcome = run_etc_dropin()
    elif step["do"] == "download-only":
        outcome = run_download_only(str(step["url"]))
    elif step["do"] == "apply":
        outcome = run_update(["/usr/bin/applianctl", "update", "--apply", "--yes"], None)
    elif step["do"] == "rollback":
        outcome = run_update(["/usr/bin/applianctl", "rollback", *(["--force"] if step.get("force") else [])], None)
    else:
        outcome = run_update(_update_command(str(step["url"])), str(step["url"]))
    # how long each step took, for whoever makes the journey shorter
    outcome = {"do": step["do"], "version": version, **outcome, "seconds": round(time.monotonic() - started, 1)}
    # durable before the next step: the host may cut the power at any moment after it
    write_json_atomic(marker, outcome)
    return outcome


def _read_marker(path: Path) -> dict[str, Any] | None:
    """A step's recorded outcome; None when it has none (or a file a power cut left empty)."""
    try:
        outcome = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return outcome if isinstance(outcome, dict) else None


def step_outcomes() -> list[dict[str, Any]]:
    """What the plan's steps did on this and earlier boots, oldest first."""
    if not MARKER_DIR.is_dir():
        return []
    found = sorted(MARKER_DIR.glob("*.json"), key=lambda p: p.stat().st_mtime)
    return [o for o in map(_read_marker, found) if o is not None]


def _write_report(path: str, report: dict[str, Any]) -> None:
    with open(path, "w") as port:
        port.write(f"\n{BEGIN}\n{json.dumps(report)}\n{END}\n")
        port.flush()


def _running_version() -> str:
    return load_device().appliance.version


def main_trial(args: argparse.Namespace) -> int:
    """appliance-bootcheck-trial.service: the plan's trial steps, before the assessment starts."""
    version = _running_version()
    for step in _plan(version):
        if step["do"] in TRIAL_STEPS:
            outcome = run_step(version, step, engine_healthy=False)
            if outcome is not None:
                print(json.dumps(outcome)[:2000], flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    global REPORT_PORT
    REPORT_PORT = args.report
    if args.trial:
        return main_trial(args)
    engine_healthy = wait_for_engine(float(credential("appliance.wait") or args.wait))
    if engine_healthy:
        wait_for_assessment(300)
    report = collect()
    report["engine_became_healthy"] = engine_healthy
    version = report["status"].get("parts", {}).get("os", {}).get("version") or ""
    plan = _plan(version)
    # The checks come after the first look, which shows the appliance as it booted.
    for step in plan:
        if step["do"] in STEPS and step["do"] not in UPDATES:
            run_step(version, step, engine_healthy)
    outcomes = step_outcomes()
    faults = [o for o in outcomes if o["do"] == "faults"]
    report["scenarios"] = faults[-1] if faults else None
    report["steps"] = outcomes
    _write_report(args.report, report)
    print(report["status_text"])
    # One update per boot: a plan may list several, each installed after the previous one's
    # boots (and perhaps its rollback) are over.
    update = next((u for step in plan if step["do"] in UPDATES for u in [run_step(version, step, engine_healthy)] if u), None)
    if update is not None and update["exit"] == 0:
        subprocess.run(["systemctl", "--no-block", "reboot"], check=False)  # into the new version
    elif _unjudged_trial():
        # The verdict on a version on trial is the appliance's (its assessment, its boot
        # deadline): powering off here would end the try in the appliance's place.
        print("this version is on trial and not judged yet: the appliance reboots it (no power-off)", flush=True)
    elif credential("appliance.bootcheck") == "poweroff":
        subprocess.run(["systemctl", "--no-block", "poweroff"], check=False)
    return 0


def _unjudged_trial() -> bool:
    try:
        trial = _on_trial()
    except Exception:  # a boot check that cannot tell powers off as before
        return False
    return bool(trial["counting"]) and trial["boot_complete"] != "active"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m testkit.bootcheck", description="Report the booted appliance's state to a test host.")
    p.add_argument("--report", default="/dev/ttyS1", help="where to write the JSON report")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for a healthy engine")
    p.add_argument("--trial", action="store_true", help="run only the plan's steps for a version on trial, then exit")
    return p


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
