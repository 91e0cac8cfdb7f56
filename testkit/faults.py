# SPDX-License-Identifier: MIT
"""Synthetic bad versions for the QEMU journey (demo profile only).

A bad version is the demo image built again under a new version number with a fault chosen by
words on its kernel command line (mkosi appends them to image/mkosi.conf's); the units that act
on those words live in testkit/units/ and are inert without them, so a production image has none.
An incremental mkosi build of it reuses the package cache (a few minutes under the builder).

    bad = faults.bad_version(demo, "1.0.3", "hang-before-boot-complete", assessment_deadline_s=60)
    build.build(bad.config, extra_mkosi_args=bad.mkosi_args, output=out)
    release.make_bundle(bad.config, out, ...)

The number of boot tries a version gets comes from the version that installs it
(update.boot_tries of the running image: systemd-sysupdate's TriesLeft=, set at build by
image/mkosi.postinst); build the installing version with boot_tries=1 for one-try scenarios.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from appliance.config import Config, with_version
from appliance.errors import UserError

# fault -> kernel command line words
FAULTS: dict[str, tuple[str, ...]] = {
    # The proxy never starts: the engine serves on loopback, clients get nothing.
    "proxy-never-listens": ("systemd.mask=appliance-proxy.service",),
    # A unit boot-complete.target waits for never finishes (testkit/units/appliance-demo-fault.service):
    # only the boot deadline (appliance-boot-deadline.timer) ends the boot.
    "hang-before-boot-complete": ("appliance.demo.fault=hang",),
    # The kernel panics before boot-complete.target (testkit/units/appliance-demo-panic.service);
    # panic=10 on the command line reboots it.
    "panic": ("appliance.demo.fault=panic",),
    # PID 1 is frozen before boot-complete.target (testkit/units/appliance-demo-freeze.service):
    # no timer fires, so only the hardware watchdog (systemd.watchdog_sec=) resets the machine.
    "freeze-pid1": ("appliance.demo.fault=freeze",),
    # Passes its assessment, is blessed, then crashes the kernel 20 s in, on every boot
    # (testkit/units/appliance-demo-crash.service): only the crash-loop guard rolls it back.
    "crash-after-blessing": ("appliance.demo.fault=crash-after-blessing",),
}


@dataclass(frozen=True)
class BadVersion:
    config: Config
    mkosi_args: tuple[str, ...]


def bad_version(config: Config, version: str, fault: str, assessment_deadline_s: int | None = None) -> BadVersion:
    """CONFIG as VERSION with FAULT. ASSESSMENT_DEADLINE_S shortens the assessment's deadline and
    with it the boot deadline (the assessment's plus 5 minutes), so that a test waits less."""
    if config.profile != "demo":
        raise UserError("synthetic bad versions are built from the demo profile only", hint="use --profile demo")
    if fault not in FAULTS:
        raise UserError(f"unknown fault {fault!r}", hint=f"one of: {', '.join(sorted(FAULTS))}")
    bad = with_version(config, version)
    if assessment_deadline_s is not None:
        bad = dataclasses.replace(bad, update=dataclasses.replace(bad.update, assessment_deadline_s=assessment_deadline_s))
    return BadVersion(bad, (f"--kernel-command-line={' '.join(FAULTS[fault])}",))
