# SPDX-License-Identifier: MIT
"""The build host's tools: where `make setup` unpacks those Debian 12 lacks (HOST_CACHE), mkosi 25
from there, and the hints for a host command that failed (the commands themselves run through
appliance.run, with no timeout and on the terminal unless their output is wanted)."""

from __future__ import annotations

import os
from pathlib import Path

from appliance.errors import UserError

HOST_CACHE = Path(os.environ.get("APPLIANCE_HOST_CACHE", "/var/cache/appliance-host"))
MKOSI_PYTHONPATH = HOST_CACHE / "mkosi/usr/lib/python3/dist-packages"

# a host command that failed, and one that is not there
FAILED_HINT = "run again with --debug to see the command and its output"
MISSING_HINT = "run `make setup` to install the host's tools"


def mkosi_command() -> list[str]:
    """mkosi 25 as `make setup` installed it (Debian 13's package, unpacked on Debian 12)."""
    if not (MKOSI_PYTHONPATH / "mkosi").is_dir():
        raise UserError("mkosi 25 is not installed on this host", hint="run `make setup` first")
    return ["env", f"PYTHONPATH={MKOSI_PYTHONPATH}", "/usr/bin/python3", "-m", "mkosi"]
