# SPDX-License-Identifier: MIT
"""The boot check's test plan (demo images only): what a test host asks the guest to do on a boot of
a version, after the first look, each step once per disk, its outcome kept in a marker file so that
a plan spans reboots and power cuts.

A test host passes the credential appliance.plan, JSON: {VERSION: [STEP, ...]}:
  {"do": "faults"}                          the engine fault scenarios (testkit/engine_scenarios.py)
  {"do": "refusals", "bundles": {N: URL}}   `applianctl update URL` of bundles that must be
                                            refused; the inactive slot's write counters before and after
  {"do": "update", "url": URL}              `applianctl update URL`, then a reboot into it
  {"do": "download-only", "url": URL}       `applianctl update --download-only URL`: staged on
                                            /var, no slot written
  {"do": "apply"}                           `applianctl update --apply`, then a reboot into it;
                                            like "update", the engine partitions hashed before
                                            and after
  {"do": "rollback", "force": BOOL}         `applianctl rollback [--force]`, then a reboot into
                                            the other slot's version, with its engine
  {"do": "netprobe"}                        the host probes the guest from a network
                                            namespace on its second NIC (builder.qemu.ProbeNet)
                                            while the engine serves; the guest waits for it
  {"do": "etc-dropin"}                      a drop-in for the engine placed in /etc (as someone
                                            with root would, to change what it runs), then
                                            `applianctl verify --json`; the file is left for
                                            the next boot's initrd to remove
  {"do": "scrape"}                          the metrics refreshed (appliance-metrics.service),
                                            then the host scrapes them through the proxy's
                                            metrics site (make demo: builder boot --metrics-out)
  {"do": "rollout-hold", "url": URL}        URL is a channel index whose rollout has not
                                            reached this appliance: `applianctl update --check
                                            URL`, then `applianctl update URL`, which must
                                            install nothing (the inactive slot's write counters before and after)
  {"do": "update-on-trial", "url": URL}     while this version is still on trial (run by
                                            appliance-bootcheck-trial.service, ordered before
                                            the assessment): `applianctl update URL` must be
                                            refused; both slots' write counters before and after
  {"do": "attest"}                          the host proves, from the probe namespace, what this
                                            appliance booted (`builder attest` through the metrics
                                            site: a TPM quote over its nonce); the guest waits for it
  {"do": "hive-reset", "kernel_line": LINE} the whole hive reset three times, LINE (a recorded
                                            amdgpu reset line) into the kernel log each time:
                                            the ladder's restart, its reboot (the step resumes
                                            on the next boot), needs physical action, then
                                            `applianctl remediation --clear` (testkit/hive_scenario.py)
The CA for https:// URLs comes in the credential appliance.update_ca (PEM). An update runs after
the report is written, its output on the console, its outcome in the next report: a power cut in
the middle leaves no marker, so the next boot runs it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.atomic import write_json_atomic
from appliance.host_settings import load_device
from testkit import engine_scenarios
from testkit.boot_facts import ETC_DROPIN
from testkit.guest_commands import credential, run_json, run_text, tail, unit_property, wait_until

MARKER_DIR = Path("/var/lib/appliance/bootcheck")
STEPS = ("faults", "refusals", "update", "netprobe", "download-only", "apply", "rollback", "etc-dropin", "rollout-hold", "scrape",
         "hive-reset", "attest")
UPDATES = ("update", "apply", "rollback")  # each run after the report, then a reboot
TRIAL_STEPS = ("update-on-trial",)
# A question to the test host on the report port: `APPLIANCE-ASK NAME JSON` (builder/qemu.py answers)
ASK = "APPLIANCE-ASK"
NOT_HEALTHY = {"skipped": "the engine never became healthy"}


def _marker(version: str, step: dict[str, Any]) -> Path:
    key = json.dumps([version, step], sort_keys=True).encode()
    return MARKER_DIR / f"{step['do']}-{hashlib.sha256(key).hexdigest()[:16]}.json"


def plan(version: str) -> list[dict[str, Any]]:
    """The plan's steps for VERSION (none when the credential is absent or not JSON)."""
    try:
        steps_by_version = json.loads(credential("appliance.plan") or "{}")
    except json.JSONDecodeError:
        return []
    steps = steps_by_version.get(version, []) if isinstance(steps_by_version, dict) else []
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


def run_refusals(version: str, bundles: dict[str, str]) -> dict[str, Any]:
    before = _inactive_slot_writes(version)
    results = {}
    for name, url in bundles.items():
        proc = subprocess.run(_update_command(url), capture_output=True, text=True, timeout=1800, check=False)
        results[name] = {"url": url, "exit": proc.returncode, "stdout": tail(proc.stdout, 2000), "stderr": tail(proc.stderr, 2000)}
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
    from testkit.boot_facts import boot_disk

    return list((run_json(["sfdisk", "-J", f"/dev/{boot_disk()}"]) or {}).get("partitiontable", {}).get("partitions", []))


def _slot_writes() -> dict[str, str]:
    """Every /usr and /usr verity partition with its label (a relabel is an install too) and the
    kernel's write counters (_inactive_slot_writes), and the ESP's boot entries."""
    parts = [p for p in _partitions() if p.get("type", "").upper() in USR_TYPES]
    hashes = {f"{p['node']} {p.get('name', '')}": _sectors_written(p["node"]) for p in parts}
    esp = next((Path(d) / "EFI/Linux" for d in ("/efi", "/boot") if (Path(d) / "EFI/Linux").is_dir()), None)
    entries = sorted(e.name for e in esp.iterdir()) if esp else []
    return {**hashes, "entries": " ".join(entries)}


def on_trial() -> dict[str, Any]:
    """Whether this boot is under boot counting (systemd-boot's LoaderBootCountPath or a +LEFT
    entry name) and how far the assessment got."""
    from applianctl.slots.machine import Host, boot_counting

    counting = boot_counting(Host())
    return {
        "counting": counting,
        "assess_state": unit_property("appliance-assess.service", "ActiveState"),
        "boot_complete": run_text(["systemctl", "is-active", "boot-complete.target"]).strip(),
    }


def run_update_on_trial(url: str) -> dict[str, Any]:
    """`applianctl update URL` while this version is not judged yet: it must be refused (one
    line), and neither slot nor the boot entries may change."""
    trial = on_trial()
    before = _slot_writes()
    proc = subprocess.run(_update_command(url), capture_output=True, text=True, timeout=1800, check=False)
    return {
        "url": url,
        "trial": trial,
        "exit": proc.returncode,
        "stdout": tail(proc.stdout, 2000),
        "stderr": tail(proc.stderr, 2000),
        "slots_before": before,
        "slots_after": _slot_writes(),
        "trial_after": on_trial(),
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
    return path in run_text(["journalctl", "-o", "cat", "-u", "appliance-proxy.service", "--since", since, "--no-pager"])


def _ask(port: str, name: str, question: dict[str, Any]) -> None:
    """Ask the test host NAME (builder/qemu.py reads the report port while the guest runs)."""
    with open(port, "w") as report_port:
        report_port.write(f"\n{ASK} {name} {json.dumps(question)}\n")


def run_netprobe(port: str, wait_s: float = 120) -> dict[str, Any]:
    """Have the host probe this appliance from its network (a host namespace on the guest's second
    NIC): the engine's port and bridge address must not answer, the proxy must. The guest waits
    (bounded) for the host's last request, to NETPROBE_DONE, in the proxy's log, and checks the
    engine's health itself before and after, so a refusal does not mean the engine was down."""
    config = load_device()
    inspected = run_json(["podman", "inspect", paths.engine_container(0)]) or [{}]
    networks = (inspected[0] if isinstance(inspected, list) and inspected else {}).get("NetworkSettings", {}).get("Networks") or {}
    bridge = next((n.get("IPAddress") for n in networks.values() if n.get("IPAddress")), "")
    engine_port = config.engine.port
    health = config.engine.health.path
    inside_before = _http_status(f"http://{bridge}:{engine_port}{health}") if bridge else "no bridge address"
    # the metrics the host scrapes: written now (the timer's unit, run at once), and the status
    # document of the same moment, whose part states the scraped gauges must repeat
    metrics_unit = subprocess.run(["systemctl", "start", "appliance-metrics.service"], capture_output=True, text=True,
                                  timeout=300, check=False)
    status_now = run_json(["/usr/bin/applianctl", "status", "--json", "--timeout-scale", "20"], timeout=180) or {}
    since = run_text(["date", "+%Y-%m-%d %H:%M:%S"]).strip()
    question = {"bridge": bridge, "engine_port": engine_port, "https_port": config.proxy.https_port,
                "http_port": 80, "done_path": NETPROBE_DONE, "metrics_port": config.metrics.port}
    _ask(port, "netprobe", question)
    started = time.monotonic()
    seen = wait_until(lambda: _proxy_saw(NETPROBE_DONE, since), wait_s)
    return {
        **question,
        "host_done_seen": seen,
        "waited_s": round(time.monotonic() - started, 1),
        "inside_before": inside_before,
        "inside_after": _http_status(f"http://{bridge}:{engine_port}{health}") if bridge else "no bridge address",
        "ip_forward": Path("/proc/sys/net/ipv4/ip_forward").read_text().strip(),
        "addresses": run_text(["ip", "-br", "addr"]),
        "nft_tables": run_text(["nft", "list", "tables"]),
        "metrics_unit": {"exit": metrics_unit.returncode, "stderr": tail(metrics_unit.stderr, 500)},
        "part_states": {name: part.get("state") for name, part in (status_now.get("parts") or {}).items()},
        "units": {name: {k: u.get(k) for k in ("state", "reason", "active_state", "sub_state")}
                  for name, u in ((status_now.get("parts") or {}).get("units", {}).get("units") or {}).items()},
    }


ATTEST_DONE = "/appliance-attest-done"


def run_attest(port: str, wait_s: float = 300) -> dict[str, Any]:
    """Have the host attest this appliance through its metrics site (the host's namespace on the
    second NIC is the scraper the plan allows); the guest waits (bounded) for the host's last
    request, to ATTEST_DONE, in the proxy's log. The attestation unit's state and journal are
    kept for a verdict that is not proven."""
    config = load_device()
    since = run_text(["date", "+%Y-%m-%d %H:%M:%S"]).strip()
    question = {"metrics_port": config.metrics.port, "https_port": config.proxy.https_port, "done_path": ATTEST_DONE,
                "hostname": config.proxy.hostname,  # the name the site's certificate gives: the verifier's name for it
                # the appliance CA the metrics site's certificate chains to, as an operator would have it
                "ca": (paths.TLS_DIR / "ca.crt").read_text()}
    _ask(port, "attest", question)
    started = time.monotonic()
    seen = wait_until(lambda: _proxy_saw(ATTEST_DONE, since), wait_s)
    return {
        **{k: v for k, v in question.items() if k != "ca"},
        "host_done_seen": seen,
        "waited_s": round(time.monotonic() - started, 1),
        "unit": unit_property("appliance-attest.service", "ActiveState"),
        "journal": tail(run_text(["journalctl", "-o", "cat", "-u", "appliance-attest.service", "--since", since,
                                  "--no-pager"]), 3000),
    }


SCRAPE_DONE = "/appliance-scrape-done"


def run_scrape(port: str, wait_s: float = 180) -> dict[str, Any]:
    """Have the host scrape this appliance's metrics through the proxy's metrics site, fresh: the
    metrics unit runs first. The guest waits (bounded) for the host's last request, to SCRAPE_DONE,
    in the proxy's log."""
    config = load_device()
    unit = subprocess.run(["systemctl", "start", "appliance-metrics.service"], capture_output=True, text=True, timeout=300, check=False)
    since = run_text(["date", "+%Y-%m-%d %H:%M:%S"]).strip()
    question = {"metrics_port": config.metrics.port, "done_path": SCRAPE_DONE}
    _ask(port, "scrape", question)
    started = time.monotonic()
    seen = wait_until(lambda: _proxy_saw(SCRAPE_DONE, since), wait_s)
    return {**question, "metrics_unit": {"exit": unit.returncode, "stderr": tail(unit.stderr, 500)}, "host_done_seen": seen,
            "waited_s": round(time.monotonic() - started, 1)}


def _engine_partitions() -> dict[str, Any]:
    """Both engine slots' partitions: label, SHA-256 of every byte (a slot is 64 MiB in the demo)
    and the sectors written through each since boot; and the one appliance-engine-store.service
    opened this boot."""
    from appliance.signed.bundle_index import ENGINE_TYPE, ENGINE_VERITY_TYPE
    from applianctl.slots import engine

    parts = [p for p in _partitions() if p.get("type", "").upper() in (ENGINE_TYPE, ENGINE_VERITY_TYPE)]
    opened = engine.opened()
    return {"running": opened.partition if opened is not None else None,
            "partitions": {p["node"]: {"label": p.get("name", ""), "sha256": run_text(["sha256sum", p["node"]], timeout=600).split(" ")[0],
                                       "written": _sectors_written(p["node"])} for p in parts}}


def run_etc_dropin() -> dict[str, Any]:
    """Place ETC_DROPIN, make systemd read it, and ask `applianctl verify` what it sees."""
    ETC_DROPIN.parent.mkdir(parents=True, exist_ok=True)
    ETC_DROPIN.write_text("[Service]\nEnvironment=APPLIANCE_UNSIGNED_DROPIN=1\n")
    run_text(["systemctl", "daemon-reload"], timeout=120)
    proc = subprocess.run(["/usr/bin/applianctl", "verify", "--json"], capture_output=True, text=True, timeout=300, check=False)
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        result = {"unreadable": tail(proc.stdout, 2000)}
    return {"path": str(ETC_DROPIN), "drop_in_paths": unit_property(paths.engine_unit(0), "DropInPaths"),
            "verify_exit": proc.returncode, "verify": result, "stderr": tail(proc.stderr, 2000)}


def run_download_only(url: str) -> dict[str, Any]:
    """`applianctl update --download-only URL`: staged on /var, no slot written."""
    proc = subprocess.run(_update_command(url, "--download-only"), capture_output=True, text=True, timeout=3600, check=False)
    return {"url": url, "exit": proc.returncode, "output": tail(proc.stdout + proc.stderr, 4000)}


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
    return {"url": url, "exit": proc.wait(), "output": tail("".join(lines), 4000), "engines_before": engines_before,
            "engines_after": _engine_partitions()}


def run_step(version: str, step: dict[str, Any], engine_healthy: bool, port: str) -> dict[str, Any] | None:
    """Run STEP once (None when it ran on an earlier boot); record its outcome in its marker. PORT
    is where a step asks the test host."""
    marker = _marker(version, step)
    if _read_marker(marker) is not None:
        return None
    started = time.monotonic()
    if step["do"] == "faults":
        outcome: dict[str, Any] = engine_scenarios.run_fault_scenarios() if engine_healthy else NOT_HEALTHY
    elif step["do"] == "refusals":
        outcome = run_refusals(version, dict(step.get("bundles", {})))
    elif step["do"] == "netprobe":
        outcome = run_netprobe(port) if engine_healthy else NOT_HEALTHY
    elif step["do"] == "scrape":
        outcome = run_scrape(port) if engine_healthy else NOT_HEALTHY
    elif step["do"] == "attest":
        outcome = run_attest(port)
    elif step["do"] == "rollout-hold":
        check = subprocess.run(_update_command(str(step["url"]), "--check"), capture_output=True, text=True, timeout=600, check=False)
        outcome = {"check": {"exit": check.returncode, "stdout": tail(check.stdout, 2000), "stderr": tail(check.stderr, 2000)},
                   **run_refusals(version, {"held": str(step["url"])})}
    elif step["do"] == "update-on-trial":
        outcome = run_update_on_trial(str(step["url"]))
    elif step["do"] == "etc-dropin":
        outcome = run_etc_dropin()
    elif step["do"] == "hive-reset":
        from testkit import hive_scenario

        # its progress beside the markers, not among them (step_outcomes reads every marker): the
        # judge reboots the machine in the middle of this step
        outcome = hive_scenario.run(MARKER_DIR / "in-progress" / marker.name, str(step.get("kernel_line", ""))) \
            if engine_healthy else NOT_HEALTHY
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
