"""python3 -m installer: install the appliance onto the one disk the signed plan names.

Runs on the installer medium (from RAM), never on the appliance. The release comes from the
medium's payload partition (or the ISO), the plan from the medium's plan/ directory or from the
systemd credentials appliance.install-plan and appliance.install-plan.sig (BMC automation, tests).
Nothing unsigned is used: the plan, the bundle index and the manifest are each checked against the
keys this installer's release trusts before anything is read from them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from appliance import manifest, paths
from appliance import plan as plan_model
from appliance.errors import UserError, run_reporting
from installer import install

MEDIUM_LABELS = ("/dev/disk/by-partlabel/appliance-payload", "/dev/disk/by-label/APPLIANCE_INSTALLER")
CREDENTIAL = "appliance.install-plan"


def find_medium(runner: install.Runner = install._run) -> Path:
    """Mount the medium's payload read-only under /run/installer/medium (once)."""
    mnt = Path("/run/installer/medium")
    if (mnt / "bundle.json").exists():
        return mnt
    for device in MEDIUM_LABELS:
        if Path(device).exists():
            mnt.mkdir(parents=True, exist_ok=True)
            runner(["mount", "-o", "ro", device, str(mnt)])
            return mnt
    raise UserError("no installer medium found (no partition labelled appliance-payload, no APPLIANCE_INSTALLER ISO)",
                    hint="attach the USB stick or the virtual medium made by python3 -m builder installer, or pass --medium DIR")


def find_plan(medium: Path, given: str | None) -> Path:
    """The directory holding plan.json and plan.json.sig: --plan, a credential pair, or the medium's plan/."""
    if given:
        return Path(given)
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds and (Path(creds) / CREDENTIAL).exists():
        staged = Path(tempfile.mkdtemp(prefix="install-plan-"))
        (staged / plan_model.PLAN_JSON).write_bytes((Path(creds) / CREDENTIAL).read_bytes())
        sig = Path(creds) / f"{CREDENTIAL}.sig"
        if sig.exists():
            (staged / plan_model.PLAN_SIG).write_bytes(sig.read_bytes())
        return staged
    return medium / "plan"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m installer", description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="show the disk that would be written, and write nothing")
    parser.add_argument("--json", action="store_true", help="the candidates as JSON instead of a table")
    parser.add_argument("--medium", help="the release's directory (default: the installer medium, mounted read-only)")
    parser.add_argument("--plan", help="the signed plan's directory (default: credential appliance.install-plan, else the medium's plan/)")
    parser.add_argument("--no-reboot", action="store_true", help="stay in the installer after the summary")
    parser.add_argument("--debug", action="store_true", help="tracebacks")
    args = parser.parse_args(argv)

    def go() -> int:
        medium = Path(args.medium) if args.medium else find_medium()
        trusted = paths.TRUSTED_KEYS_DIR
        payload = install.load_payload(medium, trusted)
        plan_dir = find_plan(medium, args.plan)
        plan = plan_model.load_signed(plan_dir, trusted)
        if plan is None:
            raise UserError(f"{plan_dir}: no install plan", hint="sign one with python3 -m builder plan PLAN.toml and put it on the medium")
        signer = manifest.claimed_signer((plan_dir / plan_model.PLAN_JSON).read_bytes()) or "?"
        return install.install(payload, plan, plan_dir, dry_run=args.dry_run, json_out=args.json, signer=signer,
                               reboot=not args.no_reboot)

    return run_reporting(go, prefix="installer: ", debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
