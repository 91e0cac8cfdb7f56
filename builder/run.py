# SPDX-License-Identifier: MIT
"""The builder's subprocesses (appliance.run.checked underneath): logged under --debug, a failure reported once."""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from appliance.errors import UserError
from appliance.run import checked

log = logging.getLogger("builder")

HOST_CACHE = Path(os.environ.get("APPLIANCE_HOST_CACHE", "/var/cache/appliance-host"))
MKOSI_PYTHONPATH = HOST_CACHE / "mkosi/usr/lib/python3/dist-packages"


def run(
    cmd: Sequence[str | Path],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    capture: bool = False,
    what: str = "",
    hint: str = "",
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """checked() with the build host's defaults: output on the terminal unless CAPTURE, no timeout."""
    args = [str(c) for c in cmd]
    log.debug("+ %s", shlex.join(args))
    return checked(
        args,
        what or args[0],
        hint or "run again with --debug to see the command and its output",
        timeout,
        capture=capture,
        cwd=cwd,
        env=env,
        missing_hint="run `make setup` to install the host's tools",
    )


def mkosi_command() -> list[str]:
    """mkosi 25 as `make setup` installed it (Debian 13's package, unpacked on Debian 12)."""
    if not (MKOSI_PYTHONPATH / "mkosi").is_dir():
        raise UserError("mkosi 25 is not installed on this host", hint="run `make setup` first")
    return ["env", f"PYTHONPATH={MKOSI_PYTHONPATH}", "/usr/bin/python3", "-m", "mkosi"]
