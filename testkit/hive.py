# SPDX-License-Identifier: MIT
"""The whole-hive reset as a fault: every engine replica killed at once.

On an MI300X host the eight GPUs form one XGMI hive; a mode-1 reset of any of them resets the whole
hive (ROCm/rocm-systems#2657: `amd-smi reset -G` resets every GPU of the hive), and every process
holding /dev/kfd is terminated whatever ROCR_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES says
(ROCm/rocm-systems#8504 and ROCm/rocm-systems#7401, the reset's blast radius and the KFD teardown). So one bad GPU ends
every replica in the same instant, whichever GPUs each was given.

The stand-in has no GPU, so the fault is made from outside: each replica's engine process is found
first, a pidfd opened on each (so that no PID reused meanwhile is hit), then all are sent SIGKILL
back to back, as the kernel ends them. The engines' containers, their init and podman's conmon live
on, as they do after a real reset: systemd and the appliance see every engine die together.

- in the guest (demo images; `reset_guest_hive()`, for the boot check's plan): every replica's
  engine is the child of its container's init (quadlet `appliance-engine@I`, `RunInit=true`);
- on the test host: `testkit.standin.hive_reset(processes)` for stand-ins started as processes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any


def kill_at_once(pids: Sequence[int]) -> list[int]:
    """SIGKILL every one of PIDS, together: every pidfd opened before the first signal is sent. The
    PIDs signalled (one already gone is left out)."""
    opened: list[tuple[int, int]] = []
    try:
        for pid in pids:
            try:
                opened.append((pid, os.pidfd_open(pid)))
            except ProcessLookupError:
                continue
        killed = []
        for pid, fd in opened:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(pid)
        return killed
    finally:
        for _, fd in opened:
            os.close(fd)


def guest_engine_pids(replicas: int) -> dict[int, int]:
    """Replica number -> its engine process's PID (the first child of its container's init), for
    every replica whose engine runs."""
    from appliance import paths
    from testkit.guest_commands import children_of, run_json

    found = {}
    for replica in range(replicas):
        inspected = run_json(["podman", "inspect", paths.engine_container(replica)]) or [{}]
        state = (inspected[0] if isinstance(inspected, list) and inspected else {}).get("State", {})
        init = str(state.get("Pid") or "")
        children = children_of(init) if init and init != "0" else []
        if children:
            found[replica] = int(children[0])
    return found


def reset_guest_hive(replicas: int | None = None, gone_within_s: float = 30.0) -> dict[str, Any]:
    """The whole-hive reset in the guest: every replica's engine killed at once. Returns the PIDs by
    replica, those killed, when (time.monotonic()), and whether all were gone within GONE_WITHIN_S."""
    from appliance.host_settings import load_device
    from testkit.guest_commands import proc_state

    count = load_device().replicas if replicas is None else replicas
    pids = guest_engine_pids(count)
    if len(pids) < count:
        return {"error": f"{count - len(pids)} of {count} replicas have no engine process", "pids": pids}
    at = time.monotonic()
    killed = kill_at_once(list(pids.values()))
    end = at + gone_within_s
    while time.monotonic() < end and any(proc_state(str(p)) not in ("gone", "Z") for p in killed):
        time.sleep(0.05)
    return {"pids": pids, "killed": killed, "at": at,
            "gone": all(proc_state(str(p)) in ("gone", "Z") for p in killed)}
