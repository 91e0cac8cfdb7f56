# SPDX-License-Identifier: MIT
"""python3 -m installer: install the appliance onto the one disk the signed plan names.

The release comes from the medium's payload (USB or ISO) or, without one (UEFI HTTP boot), from a
bundle over HTTPS (--source, else the plan's [update] url). The plan comes from --plan, the
appliance.install-plan(.sig) credentials, or the medium's plan/. Plan, bundle index and manifest are
each checked against the keys this installer trusts before anything is read from them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from appliance import cli_help, paths, run
from appliance.errors import UserError, run_reporting
from appliance.signed import install_plan, release_manifest
from installer import install, remote

MEDIUM_LABELS = ("/dev/disk/by-partlabel/appliance-payload", "/dev/disk/by-label/APPLIANCE_INSTALLER")
CREDENTIAL = "appliance.install-plan"


def find_medium(runner: install.Runner = install._run) -> Path | None:
    """Mount the medium's payload read-only at /run/installer/medium (once); None without a medium."""
    mnt = Path("/run/installer/medium")
    if (mnt / "bundle.json").exists():
        return mnt
    for device in MEDIUM_LABELS:
        if Path(device).exists():
            mnt.mkdir(parents=True, exist_ok=True)
            runner(["mount", "-o", "ro", device, str(mnt)])
            return mnt
    return None


NO_RELEASE = UserError(
    "no installer medium (no partition labelled appliance-payload, no APPLIANCE_INSTALLER ISO) and no release URL",
    hint="attach the medium made by python3 -m builder installer, or give the plan an [update] url of a bundle "
         "released with --install-image, or pass --source URL",
)


def find_plan(medium: Path | None, given: str | None) -> Path:
    """The directory holding plan.json and plan.json.sig: --plan, a credential pair, or the medium's plan/."""
    if given:
        return Path(given)
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if creds and (Path(creds) / CREDENTIAL).exists():
        staged = Path(tempfile.mkdtemp(prefix="install-plan-"))
        (staged / install_plan.PLAN_JSON).write_bytes((Path(creds) / CREDENTIAL).read_bytes())
        sig = Path(creds) / f"{CREDENTIAL}.sig"
        if sig.exists():
            (staged / install_plan.PLAN_SIG).write_bytes(sig.read_bytes())
        return staged
    if medium is None:
        raise NO_RELEASE
    return medium / "plan"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m installer")
    cli_help.describe(
        parser, __doc__.splitlines()[0].split(": ", 1)[1],
        examples=["python3 -m installer --dry-run", "python3 -m installer --source https://updates.example/appliance/1.4.0/"],
        exit_codes=[(0, "installed (or, --dry-run, the disk it would write shown)"),
                    (1, "refused: the release or the plan is not authentic, not intact, or not for this host"),
                    cli_help.FAILED_STEP],
    )
    parser.add_argument("--dry-run", action="store_true", help="show the disk that would be written, and write nothing")
    parser.add_argument("--json", action="store_true", help="the candidates as JSON instead of a table")
    parser.add_argument("--medium", help="the release's directory (default: the installer medium, mounted read-only)")
    parser.add_argument("--source", help="a release bundle's https:// URL (or directory) to install from instead of a medium "
                                         "(default without a medium: the plan's [update] url)")
    parser.add_argument("--ca", help="the CA of the --source server, PEM (default: credential appliance.install-ca, else the system's)")
    parser.add_argument("--plan", help="the signed plan's directory (default: credential appliance.install-plan, else the medium's plan/)")
    parser.add_argument("--no-reboot", action="store_true", help="stay in the installer after the summary")
    parser.add_argument("--debug", action="store_true", help="each command line before it runs, and tracebacks")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run.set_debug(args.debug)

    def go() -> int:
        medium = Path(args.medium) if args.medium else None if args.source else find_medium()
        trusted = paths.TRUSTED_KEYS_DIR
        plan_dir = find_plan(medium, args.plan)
        plan = install_plan.load_signed(plan_dir, trusted)
        if plan is None:
            raise UserError(f"{plan_dir}: no install plan", hint="sign one with python3 -m builder plan PLAN.toml and put it on the medium")
        if medium is None:
            # only a verified plan may say where the release comes from
            url = args.source or (plan.update.url if plan.update else None) or ""
            if not url:
                raise NO_RELEASE
            medium = remote.download(url, args.ca or remote.credential_ca(), trusted)
        payload = install.load_payload(medium, trusted)
        signer = release_manifest.claimed_signer((plan_dir / install_plan.PLAN_JSON).read_bytes()) or "?"
        return install.install(payload, plan, plan_dir, trusted_keys=trusted, dry_run=args.dry_run, json_out=args.json,
                               signer=signer, reboot=not args.no_reboot)

    return run_reporting(go, prefix="installer: ", debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
