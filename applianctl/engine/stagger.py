# SPDX-License-Identifier: MIT
"""`applianctl stagger --replica I` (hidden; the ExecStartPre of replica I > 0): staggered starts.

Eight replicas that start at once read the same weights from the same disk at once. Replica I
waits until replica I-1 is no longer starting (healthy: its quadlet's Notify=healthy comes only once
it has answered its warm-up request; or failed, or not asked to start at all), and at the latest
I x topology.stagger_s from its own start, so that a replica stuck in its start period delays the
next by at most stagger_s and never stops it. A replica restarting alone later finds the previous
one healthy and starts at once. Its unit's TimeoutStartSec counts the wait on top of the start
period (builder/render.py).

An ordering (After=) cannot do this: it waits for the previous start job to finish, however long
the start period lasts.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from appliance import cli_help, paths
from appliance.errors import UserError

POLL_S = 1.0


def starting(bus: Any, name: str) -> bool:
    """Whether unit NAME is on its way up: activating, or inactive with a start job queued (it
    waits for its own dependencies)."""
    from applianctl.status.systemd import BUS_NAME, CALL_TIMEOUT_S, MANAGER_PATH, PROPERTIES_IFACE, UNIT_IFACE, unit_path

    path = unit_path(bus, bus.get(BUS_NAME, MANAGER_PATH), name)
    if path is None:
        return False
    props = bus.get(BUS_NAME, path)[PROPERTIES_IFACE]
    state = str(props.Get(UNIT_IFACE, "ActiveState", timeout=CALL_TIMEOUT_S))
    if state == "activating":
        return True
    job = props.Get(UNIT_IFACE, "Job", timeout=CALL_TIMEOUT_S)
    return state != "active" and isinstance(job, tuple) and bool(job) and job[0] != 0


def wait_for_previous(
    replica: int,
    stagger_s: int,
    is_starting: Callable[[str], bool],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Wait as the module says; the line that says why the wait ended."""
    if replica == 0 or stagger_s == 0:
        return f"replica {replica}: starts without waiting"
    previous = paths.engine_unit(replica - 1)
    limit = replica * stagger_s
    start = clock()
    while is_starting(previous):
        waited = clock() - start
        if waited >= limit:
            return f"replica {replica}: {previous} still starting after {waited:.0f} s ({replica} x topology.stagger_s); starting anyway"
        sleep(min(POLL_S, limit - waited))
    return f"replica {replica}: {previous} is not starting (after {clock() - start:.0f} s); starting"


def main(args: argparse.Namespace) -> int:
    from appliance.host_settings import load_device
    from applianctl.status.systemd import system_bus

    config = load_device()
    if not 0 <= args.replica < config.replicas:
        raise UserError(f"no replica {args.replica}: this appliance runs {config.replicas}",
                        hint=f"give a replica from 0 to {config.replicas - 1}")
    try:
        bus = system_bus() if args.replica and config.topology.stagger_s else None
        line = wait_for_previous(args.replica, config.topology.stagger_s, lambda name: starting(bus, name))
    except Exception as e:  # GLib.Error from the bus: a stagger that cannot ask never keeps a replica down
        line = f"replica {args.replica}: cannot ask systemd about the previous replica ({str(e).splitlines()[0]}); starting"
    print(line, flush=True)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # hidden (not listed): the ExecStartPre of each replica after the first
    p = cli_help.verb_parser(
        sub, "stagger", "wait for the previous replica to be healthy, at most I x topology.stagger_s",
        examples=["applianctl stagger --replica 1"],
        exit_codes=[(0, "the replica may start (the previous one is healthy, the wait is over, or systemd cannot be asked)"),
                    cli_help.BAD_INPUT],
        hidden=True,
    )
    p.add_argument("--replica", type=int, required=True, metavar="I", help="the replica about to start (1 .. replicas - 1)")
    p.set_defaults(func=main)
