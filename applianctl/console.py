# SPDX-License-Identifier: MIT
"""The first console (tty1) as an operator on the BMC's console reads it before any login: the
appliance's name, its addresses, the appliance CA's fingerprint and `applianctl status`.

Written as /run/issue.d/50-appliance.issue, which agetty prints above its login prompt, by
appliance-console.service (again every 30 s from its timer; `agetty --reload` then redraws the
prompt). The text is escaped for agetty: a backslash starts an escape there.
"""

from __future__ import annotations

import argparse
import io
import socket
from pathlib import Path

from appliance.atomic import atomic_write
from appliance.config import Config
from appliance.host_settings import load_device
from applianctl.status import collect
from applianctl.status.probes import Sources

ISSUE = Path("/run/issue.d/50-appliance.issue")


def text(config: Config, src: Sources | None = None) -> str:
    doc = collect.collect(config, src or Sources())
    out = io.StringIO()
    collect.render(doc, out, colour=False)
    # the CA and the addresses come from the same (guarded) probes as status: one reading
    parts = doc.to_json()["parts"]
    tls, host = parts.get("tls", {}), parts.get("host", {})
    addresses = host.get("addresses")
    lines = [
        "",
        f"  {config.appliance.name} {config.appliance.version} on {socket.gethostname()}",
        f"  addresses:  {', '.join(addresses) if addresses else '(none yet)'}",
        f"  proxy:      https://{config.proxy.hostname}:{config.proxy.https_port}/",
        f"  CA SHA-256: {tls.get('ca_sha256') or '(' + str(tls.get('reason')) + ')'}",
        "",
        *("  " + line for line in out.getvalue().rstrip("\n").splitlines()),
        "",
    ]
    # agetty reads a backslash as the start of an escape sequence
    return "\n".join(lines).replace("\\", "\\\\") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m applianctl.console", description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(ISSUE), help="where to write the issue text")
    args = parser.parse_args(argv)
    atomic_write(Path(args.output), text(load_device()).encode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
