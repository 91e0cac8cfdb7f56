# SPDX-License-Identifier: MIT
"""The boot check (demo images only, from appliance-bootcheck.service): waits, bounded, for a
healthy engine, takes the first look (testkit/boot_facts.py), runs the test plan's steps for this
version (testkit/boot_steps.py), and writes the report (testkit/boot_report.py) between marker
lines to a serial port. With the credential appliance.bootcheck=poweroff it then powers off so the
host can read the report; with a step that updates, it reboots into the new version instead.
appliance-bootcheck-trial.service runs it with --trial: the plan's steps for a version on trial only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time

from appliance import paths
from appliance.host_settings import load_device
from testkit import boot_facts, boot_steps
from testkit.boot_report import report_block
from testkit.guest_commands import credential, run_text


def wait_for_engine(deadline_s: float) -> bool:
    """Until every replica's unit is active (podman's health check passed, Notify=healthy), a unit
    they require failed, a replica used up its restarts, or the deadline."""
    replicas = paths.engine_units(load_device().replicas)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        states = run_text(["systemctl", "is-active", *replicas]).split()
        if states == ["active"] * len(replicas):
            return True
        if run_text(["systemctl", "is-failed", *boot_facts.ENGINE_REQUIREMENTS]).split().count("failed"):
            return False
        for unit, state in zip(replicas, states, strict=False):
            if state == "failed" and run_text(["systemctl", "show", "-P", "NRestarts", unit]).strip() == "5":
                return False
        time.sleep(3)
    return False


def wait_for_assessment(deadline_s: float) -> None:
    """On a boot under trial, until the boot assessment and systemd-bless-boot are done (or the
    deadline), so that the report shows the verdict."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        jobs = run_text(["systemctl", "list-jobs", "--no-legend", "--no-pager"])
        if not any(u in jobs for u in ("appliance-assess.service", "boot-complete.target", "systemd-bless-boot.service")):
            return
        time.sleep(3)


def running_version() -> str:
    return load_device().appliance.version


def main_trial(args: argparse.Namespace) -> int:
    """appliance-bootcheck-trial.service: the plan's trial steps, before the assessment starts."""
    version = running_version()
    for step in boot_steps.plan(version):
        if step["do"] in boot_steps.TRIAL_STEPS:
            outcome = boot_steps.run_step(version, step, engine_healthy=False, port=args.report)
            if outcome is not None:
                print(json.dumps(outcome)[:2000], flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    if args.trial:
        return main_trial(args)
    engine_healthy = wait_for_engine(float(credential("appliance.wait") or args.wait))
    if engine_healthy:
        wait_for_assessment(300)
    first_look = boot_facts.collect()
    version = first_look.os_version
    plan = boot_steps.plan(version)
    # The checks come after the first look, which shows the appliance as it booted.
    for step in plan:
        if step["do"] in boot_steps.STEPS and step["do"] not in boot_steps.UPDATES:
            boot_steps.run_step(version, step, engine_healthy, args.report)
    outcomes = boot_steps.step_outcomes()
    faults = [o for o in outcomes if o["do"] == "faults"]
    report = dataclasses.replace(first_look, engine_became_healthy=engine_healthy,
                                 scenarios=faults[-1] if faults else None, steps=tuple(outcomes))
    with open(args.report, "w") as port:
        port.write(report_block(report))
        port.flush()
    print(report.status_text)
    # One update per boot: a plan may list several, each installed after the previous one's
    # boots (and perhaps its rollback) are over.
    update = next((u for step in plan if step["do"] in boot_steps.UPDATES
                   for u in [boot_steps.run_step(version, step, engine_healthy, args.report)] if u), None)
    if update is not None and update["exit"] == 0:
        subprocess.run(["systemctl", "--no-block", "reboot"], check=False)  # into the new version
    elif unjudged_trial():
        # The verdict on a version on trial is the appliance's (its assessment, its boot
        # deadline): powering off here would end the try in the appliance's place.
        print("this version is on trial and not judged yet: the appliance reboots it (no power-off)", flush=True)
    elif credential("appliance.bootcheck") == "poweroff":
        subprocess.run(["systemctl", "--no-block", "poweroff"], check=False)
    return 0


def unjudged_trial() -> bool:
    try:
        trial = boot_steps.on_trial()
    except Exception:  # a boot check that cannot tell powers off as before
        return False
    return bool(trial["counting"]) and trial["boot_complete"] != "active"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m testkit.bootcheck", description="Report the booted appliance's state to a test host.")
    p.add_argument("--report", default="/dev/ttyS1", help="where to write the JSON report and ask the host")
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for a healthy engine")
    p.add_argument("--trial", action="store_true", help="run only the plan's steps for a version on trial, then exit")
    return p


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
