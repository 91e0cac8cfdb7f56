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
- `bench_flash_vs_direct`: `flash_fleet` to a serving appliance against the journey's direct
  install of the same ISO, each on a blank libvirt QEMU machine (testkit/libvirt_rig.py): the BMC
  path (sushy-tools' libvirt driver downloads the ISO, attaches it, powers the machine on; the
  flash polls the proxy and ejects) against the ISO attached by hand and the machine powered on,
  both until the appliance answers on its proxy as the plan's host, polled alike.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from appliance import config, paths
from bench.common import Figure, elapsed, measured
from builder import flash_bmc
from testkit import bmc_rig, libvirt_rig
from testkit.standin import free_port

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


NAME = "gpu-21"
SERIAL = "TARGET-0001"
DIRECT_GOAL = 1.2  # through the BMC / direct, at most
FLASH_POLL_S = 2.0  # how often both sides look at the proxy
SERVE_TIMEOUT_S = 3600.0


def _release_iso(demo: config.Config, work: Path) -> tuple[Path, Path]:
    """The demo's installer ISO with a plan for NAME (proxy NAME.example.net, the disk SERIAL): (ISO, plan directory).
    The demo's image must be built (make build-demo); the installer kernel image is built here."""
    from builder import build, installer_media, installer_uki, release, sign_plan

    out = build.output_dir(demo)
    if not (out / f"appliance_{demo.appliance.version}.raw").is_file():
        raise FileNotFoundError(f"{out}: build the demo first (make build-demo)")
    key = build.signing_key_for(demo, None)
    uki = installer_uki.build_uki(demo, output=work / "installer" / installer_uki.UKI_NAME)
    toml = work / f"{NAME}.toml"
    toml.write_text(f'hostname = "{NAME}"\n[proxy]\nhostname = "{NAME}.example.net"\n[target]\nserial = "{SERIAL}"\n')
    plan = work / "hosts" / NAME
    sign_plan.write(toml, key, plan, demo)
    release.make_bundle(demo, out, work / "bundle", key, None, None, with_install_image=True)
    iso = installer_media.make(out, demo.appliance.version, uki, plan, work / "media", ["iso"], work / "bundle")["iso"]
    return iso, plan


def _until_answers(host: flash_bmc.Host, target: flash_bmc.Target, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while flash_bmc.probe_proxy(host, target) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the directly installed appliance did not answer on its proxy within {timeout:.0f} s")
        time.sleep(FLASH_POLL_S)


def bench_flash_vs_direct(demo: config.Config) -> list[Figure]:
    """One blank libvirt QEMU machine installed from the ISO attached by hand and powered on (the
    journey's direct install), then another flashed by `flash_fleet` through sushy-tools' libvirt
    driver: each until the appliance answers on its proxy as the plan's host (the flash also ejects)."""
    lacks = libvirt_rig.missing()
    if lacks:
        raise RuntimeError("this host lacks " + ", ".join(lacks) + ": run `make setup`")
    from builder import weights_mirror

    work = Path(tempfile.mkdtemp(prefix="bench-flash-direct-"))
    try:
        iso, plan = _release_iso(demo, work)
        target = flash_bmc.read_target(plan, NAME)
        with weights_mirror.demo() as (url, ca):
            creds = {paths.MODEL_SOURCE_CREDENTIAL: url, paths.MODEL_SOURCE_CA_CREDENTIAL: ca}
            port = free_port()
            with libvirt_rig.server_with_medium(work / "direct", NAME, SERIAL, iso, port, creds) as machine:
                host = flash_bmc.Host(NAME, plan, "https://unused.invalid", Path("/dev/null"), address=f"127.0.0.1:{port}")

                def direct() -> None:
                    machine.power_on()
                    _until_answers(host, target, SERVE_TIMEOUT_S)

                direct_s = elapsed(direct)
            lines: list[str] = []
            status: list[int] = []
            with libvirt_rig.server_behind_bmc(work / "bmc", NAME, SERIAL, plan, iso, free_port(), creds) as server:
                options = flash_bmc.Options(output=work / "flash", poll_interval=FLASH_POLL_S, install_timeout=SERVE_TIMEOUT_S,
                                            media_ca=server.ca.read_text())
                flash_s = elapsed(lambda: status.append(
                    flash_bmc.flash_fleet(server.fleet, server.media_url, options, parallel=1, echo=lines.append)))
            if status != [0]:
                raise RuntimeError("the flash failed: " + " | ".join(lines[-4:]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [measured("builder flash --bmc to a serving appliance vs direct", flash_s, direct_s, "s", at_most=DIRECT_GOAL,
                     note="one blank libvirt QEMU machine each (TCG, Secure Boot firmware, swtpm): the ISO through "
                          "sushy-tools' libvirt driver vs attached by hand; until the proxy answers as the plan's host")]
