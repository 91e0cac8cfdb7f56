"""The parts `applianctl status` reports, and the machinery that runs their probes.

Each probe is a function that returns a `Part`: a state, a one-line reason when the state is not
ok, and details. Probes run side by side in daemon threads under one deadline, so one that hangs
(an engine that accepts connections but never answers, a GPU tool stuck in the driver) costs no
more than the deadline and never keeps the command from exiting.

Everything a probe reads from the machine comes through `Sources`, so tests point it at a
temporary tree; the paths of the appliance's own files come from `appliance.paths`.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from appliance import paths
from applianctl import metrics

OK = "ok"
DEGRADED = "degraded"
DOWN = "down"
NOT_CONFIGURED = "not configured"

# How much each state weighs when the parts are combined: "not configured" does not count
# against the appliance (a part it does not use), "down" weighs most.
SEVERITY = {OK: 0, NOT_CONFIGURED: 0, DEGRADED: 1, DOWN: 2}

HTTP_TIMEOUT_S = 0.5
COMMAND_TIMEOUT_S = 1.0
ENGINE_BUDGET_S = 1.2  # all engine requests together
DEADLINE_S = 1.6  # the whole status run; stays under the 2 seconds promised to operators


def scale_timeouts(factor: float) -> None:
    """Stretch every timeout by FACTOR: for hosts that are slow by nature, such as an emulated
    (TCG) test VM where importing a library alone takes seconds."""
    global HTTP_TIMEOUT_S, COMMAND_TIMEOUT_S, ENGINE_BUDGET_S, DEADLINE_S
    HTTP_TIMEOUT_S *= factor
    COMMAND_TIMEOUT_S *= factor
    ENGINE_BUDGET_S *= factor
    DEADLINE_S *= factor

GIB = 1024**3
MIB = 1024**2


@dataclass
class Part:
    state: str
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, **self.details}


def worst(states: Sequence[str]) -> str:
    """The overall state: the most severe one; ok when all are ok or not configured."""
    top = OK
    for state in states:
        if SEVERITY[state] > SEVERITY[top]:
            top = state
    return top


def first_reason(parts: Sequence[tuple[str, Part]]) -> str:
    """The reason of the first part in the worst state, prefixed with the item's name."""
    state = worst([p.state for _, p in parts])
    for name, part in parts:
        if part.state == state and state != OK and part.reason:
            return f"{name}: {part.reason}"
    return ""


# ----------------------------------------------------------------------------------- sources


class ToolMissing(Exception):
    """The program is not installed."""


Runner = Callable[[Sequence[str], float], tuple[int, str]]


def run_command(argv: Sequence[str], timeout: float) -> tuple[int, str]:
    """Run ARGV; return its exit status and standard output. Raise ToolMissing when it is not
    installed and subprocess.TimeoutExpired when it takes longer than TIMEOUT seconds."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise ToolMissing(argv[0]) from None
    return proc.returncode, proc.stdout


@dataclass(frozen=True)
class Sources:
    """Where the probes look; every field can be pointed elsewhere by tests."""

    engine_url: str | None = None  # default: http://127.0.0.1:{engine.port}
    cmdline: Path = Path("/proc/cmdline")
    os_release: Path = Path("/usr/lib/os-release")
    by_partuuid: Path = Path("/dev/disk/by-partuuid")
    by_partlabel: Path = Path("/dev/disk/by-partlabel")
    sys_class_block: Path = Path("/sys/class/block")
    efivars: Path = Path("/sys/firmware/efi/efivars")
    proc: Path = Path("/proc")
    run: Runner = run_command
    bus: Callable[[], Any] | None = None  # a pydbus bus; default: the system bus


def run_probes(probes: Mapping[str, Callable[[], Part]], deadline_s: float = DEADLINE_S) -> dict[str, Part]:
    """Run every probe in its own daemon thread; a probe that has not answered by the deadline
    is reported down, one that raises is reported down with the exception."""
    results: dict[str, Part] = {}
    lock = threading.Lock()

    def runner(name: str, probe: Callable[[], Part]) -> None:
        try:
            part = probe()
        except Exception as e:  # a probe must never take status down with it
            part = Part(DOWN, f"probe failed: {type(e).__name__}: {e}".splitlines()[0])
        with lock:
            results[name] = part

    threads = []
    for name, probe in probes.items():
        t = threading.Thread(target=runner, args=(name, probe), name=f"probe-{name}", daemon=True)
        t.start()
        threads.append((name, t))
    end = time.monotonic() + deadline_s
    for _, t in threads:
        t.join(max(0.0, end - time.monotonic()))
    with lock:
        return {name: results.get(name, Part(DOWN, f"no answer within {deadline_s:g} s")) for name in probes}


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------------- os

EFI_LOADER_GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"
_BOOT_COUNT = re.compile(r"\+(\d+)(?:-(\d+))?$")
_USR_LABEL = re.compile(r"^appliance_([0-9][0-9.]*)$")


def read_os_release(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            out[key.strip()] = value.strip().strip("\"'")
    return out


def read_efi_string(path: Path) -> str:
    """An EFI variable holding a string: 4 bytes of attributes, then NUL-terminated UTF-16LE."""
    data = path.read_bytes()[4:]
    return data.decode("utf-16-le").split("\0", 1)[0]


def boot_counting(entry: str) -> dict[str, Any]:
    """The boot-counting state encoded in a boot entry name (`name+LEFT-DONE.conf|.efi`)."""
    stem = re.sub(r"\.(conf|efi)$", "", entry)
    m = _BOOT_COUNT.search(stem)
    if not m:
        return {"entry": entry, "state": "not counting"}
    left, done = int(m.group(1)), int(m.group(2) or 0)
    return {"entry": entry, "state": "on trial", "tries_left": left, "tries_done": done}


def _partuuid_from_usrhash(usrhash: str) -> str | None:
    """systemd derives the /usr partition UUID from the first 128 bits of the verity root hash."""
    if not re.fullmatch(r"[0-9a-fA-F]{64}", usrhash):
        return None
    h = usrhash[:32].lower()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def booted_usr(src: Sources) -> dict[str, Any]:
    """Which /usr partition is booted: its device, GPT label and slot (A: the lower-numbered
    of the appliance's labelled /usr partitions, B: the other)."""
    out: dict[str, Any] = {"slot": None, "partlabel": None, "device": None, "version": None}
    device: Path | None = None
    try:
        cmdline = src.cmdline.read_text().split()
    except OSError:
        cmdline = []
    usrhash = next((a.split("=", 1)[1] for a in cmdline if a.startswith("usrhash=")), None)
    uuid = _partuuid_from_usrhash(usrhash) if usrhash else None
    if uuid and (src.by_partuuid / uuid).exists():
        device = (src.by_partuuid / uuid).resolve()
        out["source"] = "usrhash"
    if device is None:
        try:
            rc, stdout = src.run(["findmnt", "-n", "-o", "SOURCE", "/usr"], COMMAND_TIMEOUT_S)
        except (ToolMissing, subprocess.TimeoutExpired):
            rc, stdout = 1, ""
        if rc == 0 and stdout.strip():
            device = Path(stdout.strip().splitlines()[0]).resolve()
            out["source"] = "findmnt"
    if device is None:
        return out
    out["device"] = str(device)
    usr_parts: dict[str, int] = {}  # label -> partition number
    try:
        labels = sorted(src.by_partlabel.iterdir())
    except OSError:
        labels = []
    for link in labels:
        target = link.resolve()
        if target == device:
            out["partlabel"] = link.name
        if _USR_LABEL.match(link.name):
            try:
                usr_parts[link.name] = int((src.sys_class_block / target.name / "partition").read_text())
            except (OSError, ValueError):
                continue
    label = out["partlabel"]
    if label and (m := _USR_LABEL.match(label)):
        out["version"] = m.group(1)
        if label in usr_parts:
            out["slot"] = "A" if usr_parts[label] == min(usr_parts.values()) else "B"
    return out


def probe_os(config: Mapping[str, Any], src: Sources) -> Part:
    details: dict[str, Any] = {"version": config.get("appliance", {}).get("version")}
    problems: list[str] = []
    try:
        details["image_version"] = read_os_release(src.os_release).get("IMAGE_VERSION")
    except OSError:
        details["image_version"] = None
    if details["image_version"] and details["version"] and details["image_version"] != details["version"]:
        problems.append(f"image version {details['image_version']} but appliance.json says {details['version']}")
    details["usr"] = booted_usr(src)
    var = src.efivars / f"LoaderEntrySelected-{EFI_LOADER_GUID}"
    try:
        details["boot_counting"] = boot_counting(read_efi_string(var))
    except (OSError, UnicodeDecodeError):
        details["boot_counting"] = {"entry": None, "state": NOT_CONFIGURED}
    bc = details["boot_counting"]
    if bc["state"] == "on trial" and bc["tries_left"] == 0:
        problems.append(f"boot entry {bc['entry']} has no tries left: the next failed boot falls back")
    return Part(DEGRADED if problems else OK, "; ".join(problems), details)


# ----------------------------------------------------------------------------------- engine


def engine_url(config: Mapping[str, Any], src: Sources) -> str:
    return src.engine_url or f"http://127.0.0.1:{config['engine']['port']}"


def served_model(config: Mapping[str, Any]) -> str:
    name = config["engine"].get("served_model_name") or config["model"]["id"]
    return str(name)


def probe_engine(config: Mapping[str, Any], src: Sources) -> Part:
    base = engine_url(config, src)
    end = time.monotonic() + ENGINE_BUDGET_S
    session = requests.Session()
    session.trust_env = False  # never through a proxy from the environment

    def get(path: str) -> requests.Response:
        left = min(HTTP_TIMEOUT_S, end - time.monotonic())
        if left <= 0:
            raise requests.Timeout(f"no time left for {path}")
        return session.get(base + path, timeout=(left, left))

    health_path = config["engine"].get("health", {}).get("path", "/health")
    details: dict[str, Any] = {"url": base}
    try:
        r = get(health_path)
    except requests.ConnectionError as e:
        if isinstance(e, requests.ConnectTimeout):
            return Part(DOWN, f"{base}{health_path}: no connection within {HTTP_TIMEOUT_S:g} s", details)
        return Part(DOWN, f"{base}{health_path}: connection refused", {**details, "refused": True})
    except requests.Timeout:
        return Part(DOWN, f"{base}{health_path}: no answer within {HTTP_TIMEOUT_S:g} s", details)
    except requests.RequestException as e:
        return Part(DOWN, f"{base}{health_path}: {type(e).__name__}", details)
    details["health"] = r.status_code
    if r.status_code != 200:
        return Part(DOWN, f"{health_path} answered HTTP {r.status_code}", details)

    problems: list[str] = []
    want = served_model(config)
    try:
        r = get("/v1/models")
        r.raise_for_status()
        details["models"] = [str(m.get("id")) for m in r.json().get("data", [])]
        if want not in details["models"]:
            problems.append(f"/v1/models does not list {want}")
    except (requests.RequestException, ValueError, AttributeError) as e:
        details["models"] = None
        problems.append(f"/v1/models: {type(e).__name__}")
    try:
        r = get("/metrics")
        r.raise_for_status()
        details["metrics"] = metrics.engine_summary(metrics.parse(r.text, r.headers.get("Content-Type", "")))
    except (requests.RequestException, metrics.ParseError) as e:
        details["metrics"] = None
        problems.append(f"/metrics: {type(e).__name__}: {e}".splitlines()[0])
    return Part(DEGRADED if problems else OK, "; ".join(problems), details)


# ----------------------------------------------------------------------------------- startup

FIGURES = ("model_memory_gib", "draft_params", "kv_cache_tokens", "max_concurrency", "offload_mmap_gb")


def probe_startup(config: Mapping[str, Any], path: Path | None = None) -> Part:
    path = path or paths.STARTUP_REPORT
    try:
        report = _read_json(path)
        state = report["state"]
    except FileNotFoundError:
        return Part(NOT_CONFIGURED, f"no startup report ({path})")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Part(DEGRADED, f"{path}: unreadable ({type(e).__name__})")
    figures = report.get("figures") or {}
    expected = report.get("expected") or config.get("expected") or {}
    details: dict[str, Any] = {
        "report_state": state,
        "figures": {k: {"value": figures.get(k), "expected": expected.get(k)} for k in FIGURES},
        "cuda_graphs": figures.get("cuda_graphs"),
        "ready": figures.get("ready"),
        "reached_s": report.get("reached_s") or {},
    }
    reason = str(report.get("reason") or "")
    if state == "ok":
        return Part(OK, "", details)
    if state == "loading":
        return Part(DEGRADED, reason or "the engine is still starting", details)
    if state == "degraded":
        return Part(DEGRADED, reason or "the start fell short of the expected figures", details)
    return Part(DEGRADED, f"unknown startup state {state!r}", details)


# ----------------------------------------------------------------------------------- checks


def probe_check(path: Path, what: str) -> Part:
    """A result file written by another unit: {"ok": bool, "reason": str, ...}."""
    try:
        result = _read_json(path)
        ok = result["ok"]
    except FileNotFoundError:
        return Part(NOT_CONFIGURED, f"{what} has not run ({path} absent)")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Part(DEGRADED, f"{path}: unreadable ({type(e).__name__})")
    details = {k: v for k, v in result.items() if k not in ("ok", "reason", "state")}
    if ok is True:
        return Part(OK, "", details)
    return Part(DOWN, str(result.get("reason") or f"{what} failed"), details)


# ----------------------------------------------------------------------------------- shm & disk

OFFLOAD_GLOB = "vllm_offload_*.mmap"


def _fs(path: Path) -> dict[str, int]:
    st = os.statvfs(path)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return {"total_bytes": total, "used_bytes": total - st.f_bfree * st.f_frsize, "free_bytes": free}


def mapped_files(proc: Path) -> tuple[set[tuple[int, int, int]], int]:
    """(major, minor, inode) of every file some process has mapped, and how many processes could
    not be read (their maps hidden from this user)."""
    mapped: set[tuple[int, int, int]] = set()
    unreadable = 0
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            text = (pid_dir / "maps").read_text(errors="replace")
        except FileNotFoundError:
            continue  # the process has gone
        except OSError:
            unreadable += 1
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) >= 6 and fields[4] != "0":
                major, _, minor = fields[3].partition(":")
                try:
                    mapped.add((int(major, 16), int(minor, 16), int(fields[4])))
                except ValueError:
                    continue
    return mapped, unreadable


def probe_shm(config: Mapping[str, Any], src: Sources, shm_dir: Path | None = None) -> Part:
    shm_dir = shm_dir or paths.SHM_DIR
    offload_gib = float(config["engine"].get("offload_gib") or 0.0)
    margin_gib = float(config["engine"].get("shm", {}).get("margin_gib", 0.0))
    if not shm_dir.is_dir():
        if offload_gib == 0:
            return Part(NOT_CONFIGURED, f"{shm_dir} absent and no CPU KV offload configured")
        return Part(DOWN, f"{shm_dir} is absent; the engine needs {offload_gib:g} GiB there")
    details: dict[str, Any] = {"path": str(shm_dir), **_fs(shm_dir)}
    problems: list[str] = []
    files = sorted(shm_dir.glob(OFFLOAD_GLOB))
    listed: list[dict[str, Any]] = []
    stale: list[str] = []
    if files:
        mapped, unreadable = mapped_files(src.proc)
        for f in files:
            try:
                st = f.stat()
            except FileNotFoundError:
                continue
            # Stale: mapped by no process whose maps could be read (root reads all of them on the
            # appliance; the count of unreadable ones is kept in the details).
            in_use = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in mapped
            listed.append({"name": f.name, "bytes": st.st_size, "in_use": in_use})
            if not in_use:
                stale.append(f.name)
        details["unreadable_maps"] = unreadable
    details["offload_files"] = listed
    details["stale_offload_files"] = stale
    if stale:
        problems.append(
            f"{len(stale)} stale offload file(s) in {shm_dir} ({stale[0]}...): the next engine start may "
            "fail with 'Bad address'; restart the engine to clean them"
        )
    need = (offload_gib + margin_gib) * GIB if offload_gib else 0
    details["needed_bytes"] = int(need)
    if need and details["total_bytes"] < need:
        problems.append(
            f"{shm_dir} holds {details['total_bytes'] / GIB:.1f} GiB; the CPU KV offload needs "
            f"{offload_gib:g} + {margin_gib:g} GiB"
        )
    return Part(DEGRADED if problems else OK, "; ".join(problems), details)


DISK_MIN_FREE_FRACTION = 0.05
DISK_MIN_FREE_BYTES = 1 * GIB


def tree_bytes(root: Path, budget_s: float = 0.3) -> tuple[int, bool]:
    """Bytes allocated under ROOT without following links; False when the walk ran out of time."""
    end = time.monotonic() + budget_s
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
        if time.monotonic() > end:
            return total, False
    return total, True


def probe_disk(config: Mapping[str, Any], state_dir: Path | None = None) -> Part:
    state_dir = state_dir or paths.STATE_DIR
    cache = Path(config["model"]["cache_dir"])
    details: dict[str, Any] = {}
    problems: list[str] = []
    try:
        details["var"] = {"path": str(state_dir), **_fs(state_dir)}
    except OSError as e:
        return Part(DOWN, f"{state_dir}: {e.strerror}", details)
    if cache.is_dir():
        used, complete = tree_bytes(cache)
        details["model_cache"] = {
            "path": str(cache),
            **_fs(cache),
            "cache_bytes": used,
            "cache_bytes_complete": complete,
        }
    else:
        details["model_cache"] = {"path": str(cache), "present": False}
    for key in ("var", "model_cache"):
        fs = details[key]
        if "total_bytes" not in fs:
            continue
        if fs["free_bytes"] < max(DISK_MIN_FREE_BYTES, fs["total_bytes"] * DISK_MIN_FREE_FRACTION):
            problems.append(f"{fs['path']}: only {fs['free_bytes'] / GIB:.1f} GiB free")
    return Part(DEGRADED if problems else OK, "; ".join(problems), details)


# ----------------------------------------------------------------------------------- tls

TLS_WARN_DAYS = 30


def probe_tls(config: Mapping[str, Any], tls_dir: Path | None = None, now: datetime.datetime | None = None) -> Part:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    path = (tls_dir or paths.TLS_DIR) / "ca.crt"
    mode = config.get("proxy", {}).get("tls", "internal")
    try:
        pem = path.read_bytes()
    except FileNotFoundError:
        why = "the proxy uses ACME certificates" if mode == "acme" else "no appliance CA yet"
        return Part(NOT_CONFIGURED, f"{path} absent: {why}", {"mode": mode})
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        return Part(DOWN, f"{path}: not a PEM certificate ({e})".splitlines()[0], {"mode": mode})
    fingerprint = cert.fingerprint(hashes.SHA256()).hex(":").upper()
    after = getattr(cert, "not_valid_after_utc", None) or cert.not_valid_after.replace(tzinfo=datetime.UTC)
    now = now or datetime.datetime.now(datetime.UTC)
    days = (after - now).total_seconds() / 86400
    details = {
        "mode": mode,
        "ca_sha256": fingerprint,
        "ca_subject": cert.subject.rfc4514_string(),
        "ca_not_after": after.isoformat(),
        "ca_days_left": int(days),
    }
    if days < 0:
        return Part(DOWN, f"the appliance CA expired on {after:%Y-%m-%d}", details)
    if days < TLS_WARN_DAYS:
        return Part(DEGRADED, f"the appliance CA expires on {after:%Y-%m-%d} ({int(days)} days)", details)
    return Part(OK, "", details)
