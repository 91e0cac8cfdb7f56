# SPDX-License-Identifier: MIT
"""`make bench`, flashing a fleet through its BMCs (`builder flash --bmc`, builder/flash_bmc.py).

- `bench_flash_fleet`: the wall time of `flash_fleet` for HOSTS hosts at once (`--parallel HOSTS`)
  against one host, on sushy-tools' emulator (fake driver, HTTPS, an account: testkit/bmc_rig.py).
  Each host's appliance is a stand-in that is down until the emulator applies its system's power
  cycle and answers INSTALL_S after it: the install's own time, the installs overlapping as on real
  servers and their CPU aside. What is left is the BMC path's own round trips and waits: a Redfish
  session, the service root, the system, its manager and drives, the medium's CA, InsertMedia, the
  one-time boot, the reset, the polls of each proxy, EjectMedia, all HOSTS through one emulator
  process (a real rack has a BMC a host: one emulator for all is the harder case). Rounds alternate
  one then HOSTS, HOSTS then one, after one flash not timed (sushy's first login), each host a
  blank host again; the medians are the figure. A second figure, without a goal, is that BMC path
  alone (the wall time less INSTALL_S).
- `bench_flash_vs_direct`: `builder flash --bmc` to a serving appliance against the journey's
  direct install of the same image. It needs a QEMU machine behind sushy-tools' libvirt driver (the
  fake driver boots nothing), which is not built: it is not measured, and says why.
"""

from __future__ import annotations

import importlib.util
import shutil
import statistics
import tempfile
from pathlib import Path

from appliance import config
from bench.common import Figure, elapsed, measured
from builder import flash_bmc
from testkit import bmc_rig

GOAL = 1.5  # HOSTS at once / one, at most
HOSTS = 4
INSTALL_S = 10.0  # each host's install, from its power cycle to its proxy answering
ROUNDS = 3
POLL_S = 0.1  # --poll-interval: the figure's resolution


def _flash(rig: bmc_rig.Rig, fleet: Path, output: Path, parallel: int, install_s: float) -> float:
    """Seconds `flash_fleet` takes for FLEET, every host installed; else RuntimeError with its lines."""
    lines: list[str] = []
    options = flash_bmc.Options(output=output, poll_interval=POLL_S, install_timeout=install_s + 120,
                                media_ca=rig.media_ca.read_text())
    status = [1]

    def run() -> None:
        status[0] = flash_bmc.flash_fleet(fleet, rig.media_url, options, parallel=parallel, echo=lines.append)

    took = elapsed(run)
    if status[0] != 0:
        raise RuntimeError("the flash failed: " + " | ".join(lines[-4:]))
    return took


def bench_flash_fleet(demo: config.Config, hosts: int = HOSTS, install_s: float = INSTALL_S, rounds: int = ROUNDS) -> list[Figure]:
    names = tuple(f"gpu-{i:02d}" for i in range(1, hosts + 1))
    work = Path(tempfile.mkdtemp(prefix="bench-flash-"))
    times: dict[int, list[float]] = {1: [], hosts: []}
    try:
        with bmc_rig.running(work, names, install_s=install_s) as rig:
            fleets = {1: rig.fleet(hosts=names[:1], path=work / "fleet-1.toml"), hosts: rig.fleet(path=work / f"fleet-{hosts}.toml")}
            _flash(rig, fleets[1], work / "out-warm", 1, install_s)  # sushy's first login and imports: not a figure's
            for i in range(rounds):
                for n in ((1, hosts), (hosts, 1))[i % 2]:
                    for app in rig.apps.values():
                        app.blank()
                    times[n].append(_flash(rig, fleets[n], work / f"out-{i}-{n}", n, install_s))
                    if not all(len(rig.apps[name].cycles) == 1 for name in names[:n]):
                        raise RuntimeError(f"power cycles seen: { {name: len(rig.apps[name].cycles) for name in names[:n]} }, "
                                           "not one a host")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    many, one = statistics.median(times[hosts]), statistics.median(times[1])
    where = f"sushy-tools' fake driver, one emulator for all; median of {rounds}"
    return [measured(f"builder flash --bmc, {hosts} hosts at once vs 1 (emulator)", many, one, "s", at_most=GOAL,
                     note=f"each install {install_s:g} s after its power cycle; {where}"),
            measured(f"builder flash --bmc, the BMC path alone, {hosts} hosts vs 1", many - install_s, one - install_s, "s",
                     note=f"the wall time less the {install_s:g} s install; {where}")]


def libvirt_here() -> list[str]:
    """What sushy-tools' libvirt driver needs that this host lacks: a libvirt daemon, its Python binding."""
    missing = []
    if not any(shutil.which(d) for d in ("libvirtd", "virtqemud")):
        missing.append("libvirtd (libvirt-daemon-system)")
    if importlib.util.find_spec("libvirt") is None:
        missing.append("the libvirt Python binding (libvirt-python)")
    return missing


def bench_flash_vs_direct(demo: config.Config) -> list[Figure]:
    missing = libvirt_here()
    here = f"this host lacks {' and '.join(missing)}; " if missing else ""
    raise RuntimeError("builder flash --bmc to a serving appliance vs the journey's direct install needs a QEMU machine behind "
                       f"sushy-tools' libvirt driver: {here}that run is not built (the fake driver boots nothing)")
