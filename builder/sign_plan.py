# SPDX-License-Identifier: MIT
"""`python3 -m builder plan PLAN.toml`: check an install plan and sign it with the release key.

Writes plan.json (canonical JSON) and plan.json.sig into a new directory renamed into place. The
installer and the appliance accept only a plan signed by a key the release trusts (appliance/signed/install_plan.py);
every value is checked first as the appliance will render it over the profile's configuration.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import appliance.config
from appliance import cli_help, host_settings
from appliance.atomic import atomic_write, replace_dir
from appliance.config import Config
from appliance.signed import install_plan


def write(plan_toml: Path, key: Path, output: Path, config: Config) -> install_plan.Plan:
    """Check the plan at PLAN_TOML as the device will (laid over CONFIG, the image's configuration),
    then sign it with KEY into OUTPUT."""
    plan = install_plan.load_toml(plan_toml)
    host_settings.laid_over(config, plan, str(plan_toml))  # the device's checks, before anything is signed
    data, sig = install_plan.sign(plan, key, str(plan_toml))  # refuses what the device would (MAX_PLAN_BYTES)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    atomic_write(tmp / install_plan.PLAN_JSON, data)
    atomic_write(tmp / install_plan.PLAN_SIG, sig)
    replace_dir(tmp, output)
    return plan


def cmd_plan(args: argparse.Namespace) -> int:
    from builder import build

    config = appliance.config.load(Path(args.config), args.profile)
    key = build.signing_key_for(config, Path(args.signing_key) if args.signing_key else None)
    source = Path(args.plan)
    output = Path(args.output) if args.output else source.with_suffix("")
    plan = write(source, key, output, config)
    print(f"signed install plan in {output}/ ({install_plan.PLAN_JSON}, {install_plan.PLAN_SIG})")
    if args.show:
        print(json.dumps(plan.effective(config), indent=2))
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `plan` on the builder's subparsers."""
    p = cli_help.verb_parser(
        sub, "plan", "check an install plan (TOML) and sign it with the release key",
        examples=["python3 -m builder plan hosts/gpu-07.toml", "python3 -m builder plan hosts/gpu-07.toml --show"],
        exit_codes=[(0, "the plan is signed"), cli_help.BAD_INPUT],
        details="docs/install.md describes the plan.",
    )
    p.add_argument("plan", help="the plan, e.g. hosts/gpu-07.toml (docs/install.md)")
    p.add_argument("--output", help="the directory for plan.json and plan.json.sig (default: the plan's path without .toml)")
    p.add_argument("--signing-key", help="the release signing key (default: as for build)")
    p.add_argument("--show", action="store_true", help="print the host's settings, the image's defaults filled in")
    p.set_defaults(func=cmd_plan)
    return p
