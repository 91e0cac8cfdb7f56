"""Fault switches: STANDIN_* environment variables and the optional JSON file STANDIN_FAULTS_FILE.

The file's keys are the variable names lower-cased without STANDIN_; it is read at start and wins
over the environment, so a test can inject a fault into an engine whose unit sets the variables.
With several replicas sharing one file, its optional key "replica" names the one it is for (the
replica number in APPLIANCE_REPLICA, 0 when unset); the others ignore the file.

While serving, the stand-in reads the file again whenever it changes (`Watcher`): a switch written
then takes effect at once, its seconds and requests counted from that moment, so that a host test
can deadlock a running replica and clear it again. A file removed while serving changes nothing
(write `{}` to clear every switch); the start-only keys (load_seconds, never_ready,
kv_cache_tokens) matter at start only.

Each fault kind has two triggers, `KIND_after_s` (seconds of serving) and `KIND_after_requests`
(completion requests that have ended, answered or aborted: 0 means from the first one); whichever
comes first switches it on, for the requests then in flight too. Each kind fails the way the public evidence in `SOURCES` shows vLLM fail.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# The fault kinds, in the order one wins over another when several are on at once.
KINDS = ("gpu_fault", "crash", "hang", "engine_dead", "deadlock", "collapse")

# What each kind does, and the public threads it reproduces (named by repository and number).
SOURCES: dict[str, tuple[str, str]] = {
    "hang": (
        "the whole server stops answering, /health included: connections accepted, no byte sent",
        "the failure podman's health check already catches",
    ),
    "crash": (
        "EngineCore dies and the process exits 1 (with crash_leave_mmap, an os._exit that leaves "
        "the offload file behind)",
        "vllm-project/vllm#24495, vllm-project/vllm#42362: EngineDeadError, then the API server shuts down",
    ),
    "deadlock": (
        "the engine core freezes, the HTTP server lives: /health, /ping, /version, /v1/models and "
        "/metrics answer 200; completions are accepted and never answered (no byte, the connection "
        "held); the token counters stop while vllm:num_requests_waiting grows with each request; "
        "nothing is logged",
        "vllm-project/vllm#39863 (EngineCore deadlocks silently under load, /version 200, requests "
        "pile up as Waiting), vllm-project/vllm#36451 (/health 200 while EngineCore's busy loop is "
        "frozen), vllm-project/vllm#17972 "
        "(GET /health 200 beside 0.0 tokens/s); azrtydxb/Fastllm-proxy#19 (GET /v1/models 200 for "
        "85 minutes of a deadlocked engine)",
    ),
    "engine_dead": (
        "the engine core is dead and the server stays up: /health 503, every completion 500 with "
        "vLLM's EngineDeadError body (as vLLM with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1, or before its "
        "server shuts down)",
        "vllm-project/vllm#24897 (/health 503 when the engine is dead), vllm-project/vllm#24495 (the 500 body), "
        "vllm-project/vllm#42362 (the EngineDeadError log line)",
    ),
    "collapse": (
        "throughput collapse: tokens keep coming at collapse_factor times the usual rate",
        "vllm-project/vllm#17972 (generation throughput near zero while /health stays 200)",
    ),
    "gpu_fault": (
        "a GPU memory access fault: the line ROCm's runtime prints on stderr, then abort() (SIGABRT), "
        "the offload file left behind",
        "ROCm/pytorch#797, ROCm/legacy-rocm-build#4554 and ROCm/legacy-rocm-build#5051 (the line, then 'Aborted (core "
        "dumped)'; systemd-coredump: signal 6/ABRT)",
    ),
}

# The collapsed rate's base when the stand-in otherwise generates without delay (token_seconds 0):
# a plausible per-stream decode step.
NOMINAL_TOKEN_SECONDS = 0.01

START_ONLY = ("load_seconds", "never_ready", "kv_cache_tokens")


class FaultsError(Exception):
    pass


@dataclass(frozen=True)
class Faults:
    load_seconds: float = 2.0  # how long "loading" lasts (port closed)
    crash_after_s: float | None = None  # exit 1 after this many seconds of serving
    crash_after_requests: int | None = None
    hang_after_s: float | None = None  # stop answering anything after this many seconds of serving
    hang_after_requests: int | None = None
    crash_leave_mmap: bool = False  # the crash is an os._exit that leaves the mmap file behind
    never_ready: bool = False  # stay loading forever
    token_seconds: float = 0.0  # delay between generated tokens
    kv_cache_tokens: int = 65536  # the GPU KV cache size reported (lower it for a degraded start)
    deadlock_after_s: float | None = None  # the engine core freezes, the server answers
    deadlock_after_requests: int | None = None
    engine_dead_after_s: float | None = None  # /health 503, completions 500 EngineDeadError
    engine_dead_after_requests: int | None = None
    collapse_after_s: float | None = None  # tokens at collapse_factor times the rate
    collapse_after_requests: int | None = None
    collapse_factor: float = 0.01  # the collapsed rate as a fraction of the usual one (0 < f <= 1)
    gpu_fault_after_s: float | None = None  # ROCm's memory access fault line, then SIGABRT
    gpu_fault_after_requests: int | None = None


_FLAGS = ("crash_leave_mmap", "never_ready")
_COUNTS = ("kv_cache_tokens",)


def _number(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise FaultsError(f"{name} = {value!r}: not a number") from None
    if isinstance(value, bool) or number < 0 or number != number or number == float("inf"):
        raise FaultsError(f"{name} = {value!r}: must be a number >= 0")
    return number


def _whole(name: str, value: Any, least: int) -> int:
    number = _number(name, value)
    if number != int(number) or number < least:
        raise FaultsError(f"{name} = {value!r}: must be a whole number >= {least}")
    return int(number)


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise FaultsError(f"{name} = {value!r}: must be 1 or 0")


def _value(name: str, raw: Any) -> Any:
    if name in _FLAGS:
        return _flag(name, raw)
    if name in _COUNTS:
        return _whole(name, raw, 1)
    if name.endswith("_after_requests"):
        return _whole(name, raw, 0)
    number = _number(name, raw)
    if name == "collapse_factor" and not 0 < number <= 1:
        raise FaultsError(f"{name} = {raw!r}: must be above 0 and at most 1")
    return number


def load(environ: Mapping[str, str] | None = None) -> Faults:
    env = os.environ if environ is None else environ
    names = [f.name for f in fields(Faults)]
    raw: dict[str, Any] = {}
    for name in names:
        if (value := env.get("STANDIN_" + name.upper())) not in (None, ""):
            raw[name] = value
    if path := env.get("STANDIN_FAULTS_FILE"):
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            data = {}
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FaultsError(f"{path}: cannot read faults file: {e}") from None
        if not isinstance(data, dict):
            raise FaultsError(f"{path}: the faults file must hold a JSON object")
        unknown = sorted(set(data) - set(names) - {"replica"})
        if unknown:
            raise FaultsError(f"{path}: unknown key(s) {', '.join(unknown)}; known: replica, {', '.join(names)}")
        if str(data.get("replica", 0)) == (env.get("APPLIANCE_REPLICA") or "0"):
            raw.update({k: v for k, v in data.items() if v is not None and k != "replica"})
    return Faults(**{name: _value(name, raw[name]) for name in names if name in raw})


class Armed:
    """The faults in effect and since when: each switch's seconds and requests are counted from the
    moment its faults took effect (the start of serving, or a change of the faults file)."""

    def __init__(self, faults: Faults, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.faults = faults
        self.since = clock()
        self.requests = 0

    def replace(self, faults: Faults) -> bool:
        """Put FAULTS in effect from now, the start-only keys kept; False when nothing changed."""
        with self._lock:
            kept = {name: getattr(self.faults, name) for name in START_ONLY}
            new = Faults(**{**{f.name: getattr(faults, f.name) for f in fields(Faults)}, **kept})
            if new == self.faults:
                return False
            self.faults, self.since, self.requests = new, self._clock(), 0
            return True

    def restart_clock(self) -> None:
        """Serving starts now (after loading)."""
        with self._lock:
            self.since, self.requests = self._clock(), 0

    def count_request(self) -> None:
        """A completion request has ended (answered, aborted or cut short by a fault)."""
        with self._lock:
            self.requests += 1

    def on(self, kind: str) -> bool:
        with self._lock:
            after_s = getattr(self.faults, f"{kind}_after_s")
            after_requests = getattr(self.faults, f"{kind}_after_requests")
            return ((after_s is not None and self._clock() - self.since >= after_s)
                    or (after_requests is not None and self.requests >= after_requests))

    def mode(self) -> str | None:
        """The fault kind in effect now (the first of KINDS that is on), or None."""
        return next((kind for kind in KINDS if self.on(kind)), None)

    def token_seconds(self) -> float:
        """The delay before each generated token now (collapsed or not)."""
        base = self.faults.token_seconds
        if self.on("collapse"):
            return (base or NOMINAL_TOKEN_SECONDS) / self.faults.collapse_factor
        return base


Stamp = tuple[int, int, int]


def file_stamp(path: str | None) -> Stamp | None:
    """What tells one version of the faults file from another: inode, size, modification time."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class Watcher:
    """Reads the faults file again whenever it changes (its inode, size or modification time) and puts
    what it holds in effect. A file that cannot be read or holds a wrong value is reported through
    ON_ERROR and changes nothing."""

    def __init__(self, armed: Armed, environ: Mapping[str, str], on_change: Callable[[Faults], None],
                 on_error: Callable[[str], None], seen: Stamp | None = None) -> None:
        """SEEN is the file's stamp when the faults in effect were read (now, when not given)."""
        self.armed = armed
        self.environ = dict(environ)
        self.path = self.environ.get("STANDIN_FAULTS_FILE") or ""
        self.on_change = on_change
        self.on_error = on_error
        self._seen = seen if seen is not None else file_stamp(self.path)

    def poll(self) -> None:
        stamp = file_stamp(self.path)
        if stamp is None or stamp == self._seen:
            return  # no file (removed: nothing changes) or the same one
        self._seen = stamp
        try:
            faults = load(self.environ)
        except FaultsError as e:
            self.on_error(str(e))
            return
        if self.armed.replace(faults):
            self.on_change(self.armed.faults)
