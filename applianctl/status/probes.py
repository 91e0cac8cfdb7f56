# SPDX-License-Identifier: MIT
"""The `Part` each `applianctl status` probe returns (state, one-line reason, details), and the
machinery that runs the probes: daemon threads under one deadline, so a probe that hangs (an engine
that never answers, a GPU tool stuck in the driver) costs no more than the deadline and never
keeps the command from exiting. Probes read the machine through `Sources`, which tests redirect.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.run import call
from applianctl.status import document

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


# What a probe returns: state, one-line reason and its typed details (applianctl.status.document).
Part = document.Part


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
        proc = call(argv, timeout)
    except FileNotFoundError:
        raise ToolMissing(argv[0]) from None
    return proc.returncode, proc.stdout


@dataclass(frozen=True)
class Sources:
    """Where the probes look; every field can be pointed elsewhere by tests."""

    engine_url: str | None = None  # replica 0; default: http://127.0.0.1:{engine.port}
    replica_urls: tuple[str, ...] = ()  # replicas 1, 2, ...; default: http://127.0.0.1:{replica_port(i)}
    proxy_address: str = "127.0.0.1"  # where the proxy probe connects (the public port on loopback)
    os_release: Path = Path("/usr/lib/os-release")
    proc: Path = Path("/proc")
    run: Runner = run_command
    bus: Callable[[], Any] | None = None  # a pydbus bus; default: the system bus
    slots_host: Any = None  # an applianctl.slots.machine.Host; default: Host() (the machine, or its APPLIANCE_* overrides)


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
