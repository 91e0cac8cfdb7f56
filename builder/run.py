"""Every subprocess goes through here: the command logged under --debug, a failure reported once."""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from appliance.errors import UserError

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
    args = [str(c) for c in cmd]
    log.debug("+ %s", shlex.join(args))
    full_env = {**os.environ, **(env or {})}
    try:
        result = subprocess.run(
            args, cwd=cwd, env=full_env, text=True, capture_output=capture, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise UserError(f"{args[0]}: command not found", hint="run `make setup` to install the host's tools") from None
    if result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-1:] if capture else []
        raise UserError(
            f"{what or args[0]} failed (exit status {result.returncode})" + (f": {detail[0]}" if detail else ""),
            hint=hint or "run again with --debug to see the command and its output",
        )
    return result


def mkosi_command() -> list[str]:
    """mkosi 25 as `make setup` installed it (Debian 13's package, unpacked on Debian 12)."""
    if not (MKOSI_PYTHONPATH / "mkosi").is_dir():
        raise UserError("mkosi 25 is not installed on this host", hint="run `make setup` first")
    return ["env", f"PYTHONPATH={MKOSI_PYTHONPATH}", "/usr/bin/python3", "-m", "mkosi"]
