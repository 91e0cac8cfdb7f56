# SPDX-License-Identifier: MIT
"""The boot check's first look at the booted appliance (demo images only): the facts a test host
asserts, gathered into one BootReport (testkit/boot_report.py) before any step of the plan changes
anything: `applianctl status --json`, failed units, how /usr is mounted and protected, the
partition table, file system sizes, the engine's environment, smoke completions."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

from appliance import efivars, paths
from appliance.config.model import SMOKE_PROMPT
from appliance.host_settings import load_device
from applianctl import __version__
from applianctl.slots.machine import Host, efi_var
from testkit.boot_report import (
    BootEntry,
    BootReport,
    EngineEnvironment,
    EtcState,
    LoaderVars,
    ReplicaStart,
    Sealed,
    SmokeAnswer,
    UsrSignature,
)
from testkit.guest_commands import children_of, run_json, run_text, tail, unit_property

# The units the engine Requires=: when one of them failed, the engine will not start.
ENGINE_REQUIREMENTS = ("appliance-verify.service", "appliance-preflight.service", "appliance-shm-clean.service",
                       "appliance-engine-store.service", "appliance-model-verify.service")
# not from the signed image: `applianctl verify` must name it, the next boot must not run with it
ETC_DROPIN = Path("/etc/systemd/system/appliance-engine@.service.d/50-not-signed.conf")  # every replica


def status() -> tuple[dict[str, Any], str]:
    """`applianctl status` as JSON (its state "unknown" and the output when that is not JSON) and as text."""
    # Under emulation (TCG) everything is ~20x slower than on the appliance's hardware.
    raw = run_text(["/usr/bin/applianctl", "status", "--json", "--timeout-scale", "20"], timeout=90)
    try:
        document = json.loads(raw)
    except json.JSONDecodeError:
        document = None
    if not isinstance(document, dict):
        document = {"state": "unknown", "error": tail(raw, 500)}
    return document, run_text(["/usr/bin/applianctl", "status", "--timeout-scale", "20"], timeout=90)


def smoke_engine(port: int, model: str) -> SmokeAnswer:
    """The runbook's smoke completion straight to the engine's port (the proxy is tested apart)."""
    body = json.dumps({"model": model, "prompt": SMOKE_PROMPT, "temperature": 0, "max_tokens": 32}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())["choices"][0]["text"]
            return SmokeAnswer(answer=str(answer), answers_variant=response.headers.get("X-Standin-Answers"))
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        return SmokeAnswer(answer="", error=str(e))


def smoke_proxy(deadline_s: float = 60) -> str:
    """`applianctl smoke` through the proxy, tried again (up to DEADLINE_S) while the proxy has no
    replica to send it to: with several replicas, its health check admits one only once it has
    answered its warm-up request, up to one check interval (10 s) after its unit started."""
    end = time.monotonic() + deadline_s
    while True:
        out = run_text(["/usr/bin/applianctl", "smoke"], timeout=120)
        if "ok: " in out or time.monotonic() > end or "HTTP 503" not in out:
            return out
        time.sleep(3)


def _first(inspected: Any) -> dict[str, Any]:
    """The first object of podman's inspect list, {} when there is none."""
    first = inspected[0] if isinstance(inspected, list) and inspected else {}
    return first if isinstance(first, dict) else {}


def engine_environment() -> EngineEnvironment:
    """The engine process's environment from /proc/PID/environ (the exact bytes it got), and the
    image's own variables for comparison. With RunInit the engine is the container init's child."""
    container = _first(run_json(["podman", "inspect", paths.engine_container(0)]))
    pid = str(container.get("State", {}).get("Pid") or "")
    if not pid or pid == "0":
        return EngineEnvironment(error=f"no running {paths.engine_container(0)} container: {str(container)[:300]}")
    children = children_of(pid)
    engine_pid = children[0] if children else pid
    try:
        raw = Path(f"/proc/{engine_pid}/environ").read_bytes()
    except OSError as e:
        return EngineEnvironment(error=f"/proc/{engine_pid}/environ: {e}")
    image = _first(run_json(["podman", "image", "inspect", str(container.get("Image", ""))]))
    image_env = image.get("Config", {}).get("Env") or []
    return EngineEnvironment(
        pid=engine_pid,
        init_pid=pid,
        cmdline=Path(f"/proc/{engine_pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"),
        environ=tuple(v.decode(errors="replace") for v in raw.split(b"\0") if v),
        image_env=tuple(str(v) for v in image_env),
    )


def sealed() -> Sealed:
    """How sealed this boot is: Secure Boot as the firmware reports it, a TPM, and the signed PCR
    policy systemd-stub found in the kernel image (it leaves it under /run/systemd)."""
    state = efivars.secure_boot_state()
    return Sealed(
        secure_boot=state.secure_boot,
        setup_mode=state.setup_mode,
        tpm=Path("/sys/class/tpm/tpm0").exists(),
        pcr_signature=Path("/run/systemd/tpm2-pcr-signature.json").exists(),
    )


REPLICA_TIMES = {"InactiveExitTimestampMonotonic": "started", "ExecMainStartTimestampMonotonic": "main_started",
                 "ActiveEnterTimestampMonotonic": "active"}


def replica_starts(replicas: int) -> dict[str, ReplicaStart]:
    """When each replica's unit was started, its engine's container started and the unit became
    active (healthy), in µs since boot, and what its stagger step said (units/appliance-engine@.container.j2)."""
    starts: dict[str, ReplicaStart] = {}
    for i, unit in enumerate(paths.engine_units(replicas)):
        # KEY=VALUE lines: systemctl prints properties in its own order, not the order asked for
        shown = run_text(["systemctl", "show", *(f"--property={key}" for key in REPLICA_TIMES), unit])
        times = {REPLICA_TIMES[key]: int(value) for key, _, value in (line.partition("=") for line in shown.splitlines())
                 if key in REPLICA_TIMES and value.isdigit()}
        stagger = [line for line in run_text(["journalctl", "-b", "-o", "cat", "--no-pager", "-u", unit]).splitlines()
                   if line.startswith(f"replica {i}: ")][-3:]
        starts[unit] = ReplicaStart(stagger=tuple(stagger), started=times.get("started"),
                                    main_started=times.get("main_started"), active=times.get("active"))
    return starts


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def boot_entries() -> tuple[BootEntry, ...]:
    """The boot menu as bootctl lists it: each entry's id, title, whether it is the default and the
    one booted now (the factory reset entries are profiles of each kernel image)."""
    entries = run_json(["bootctl", "--no-pager", "list", "--json=short"])
    return tuple(
        BootEntry(id=_text_or_none(e.get("id")), title=_text_or_none(e.get("title")),
                  isDefault=e.get("isDefault") if isinstance(e.get("isDefault"), bool) else None,
                  isSelected=e.get("isSelected") if isinstance(e.get("isSelected"), bool) else None)
        for e in (entries if isinstance(entries, list) else []) if isinstance(e, dict)
    )


def loader_vars() -> LoaderVars:
    """What systemd-boot and systemd-stub say of this boot: the entry booted (a reset entry is
    "FILE.efi@PROFILE"), the counted file of a trial, the UKI profile number systemd-stub ran."""
    host = Host()
    return LoaderVars(LoaderEntrySelected=efi_var(host, "LoaderEntrySelected"),
                      LoaderBootCountPath=efi_var(host, "LoaderBootCountPath"), StubProfile=efi_var(host, "StubProfile"))


def etc_state() -> EtcState:
    """What the initrd's /etc reset did on this boot, and whether the engine runs with a drop-in
    from /etc."""
    engine = paths.engine_unit(0)
    return EtcState(
        etc_dropin_present=ETC_DROPIN.exists(),
        engine_drop_in_paths=unit_property(engine, "DropInPaths"),
        engine_environment=unit_property(engine, "Environment"),
        reset_log=tail(run_text(["journalctl", "-b", "-o", "cat", "--no-pager", "-u", "appliance-etc-reset.service"]), 3000),
    )


def boot_disk() -> str:
    """The name of the disk / is on ("" when not found)."""
    return run_text(["lsblk", "-no", "PKNAME", run_text(["findmnt", "-no", "SOURCE", "/"]).strip()]).strip()


def filesystems() -> dict[str, Any]:
    found: list[Any] = []
    for target in ("/", "/var", "/usr"):
        listed = run_json(["findmnt", "-J", "-b", "-o", "TARGET,SOURCE,FSTYPE,SIZE,OPTIONS", target])
        found += listed.get("filesystems", []) if isinstance(listed, dict) else []
    return {"filesystems": found}


def collect() -> BootReport:
    """The first look: the report before the plan's steps (engine_became_healthy, scenarios and
    steps are the caller's)."""
    root_disk = boot_disk()
    config = load_device()
    smoke = smoke_engine(config.engine.port, config.served_model)
    proxy_smoke = smoke_proxy()
    document, status_text = status()
    units = run_json(["systemctl", "list-units", "--failed", "--output=json"])
    failed = tuple(str(u["unit"]) for u in (units if isinstance(units, list) else []) if isinstance(u, dict) and u.get("unit"))
    engine_env = engine_environment()  # before the fault scenarios restart the engine
    return BootReport(
        replica_starts=replica_starts(config.replicas),
        boot_entries=boot_entries(),
        loader=loader_vars(),
        sealed=sealed(),
        etc=etc_state(),
        engine_env=engine_env,
        applianctl_version=run_text(["/usr/bin/applianctl", "--version"], timeout=90).strip(),
        bootcheck_version=__version__,
        failed_units=failed,
        usr_mount=tuple(run_text(["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "/usr"]).split()),
        usr_verity=run_text(["veritysetup", "status", "usr"]),
        # what the initrd's appliance-usr-signature.service said, and the signature it handed to dm-verity
        usr_signature=UsrSignature(
            file=Path("/run/appliance/usr-roothash.p7s").is_file(),
            log=tail(run_text(["journalctl", "-b", "-o", "cat", "--no-pager", "-u", "appliance-usr-signature.service"]), 2000)),
        partitions=run_json(["sfdisk", "-J", f"/dev/{root_disk}"]) if root_disk else None,
        filesystems=filesystems(),
        cmdline=Path("/proc/cmdline").read_text().strip(),
        # the last lines of each appliance unit's journal, for whoever reads a failed test
        journal={
            unit: tail(run_text(["journalctl", "-o", "cat", "-u", unit, "-n", "30", "--no-pager"]), 3000)
            for unit in dict.fromkeys((*ENGINE_REQUIREMENTS, *paths.engine_units(config.replicas), "appliance-proxy.service",
                                       "appliance-tls.service", *failed))
        },
        smoke_engine=smoke,
        smoke_proxy=proxy_smoke,
        status=document,
        status_text=status_text,
    )
