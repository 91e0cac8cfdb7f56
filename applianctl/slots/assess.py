# SPDX-License-Identifier: MIT
"""`applianctl assess` (appliance-assess.service): judge a new version by what its clients get.

Only on a boot under boot counting; otherwise a no-op, so a good version whose engine fails later
is restarted by its unit, never rolled back. Within update.assessment_deadline_s the smoke
completion (applianctl.engine.smoke) must succeed as a client gets it: via 127.0.0.1 through the
proxy's public TLS port, the server name as SNI and Host, trusting the appliance CA (the system's
with ACME), so a broken proxy, TLS or engine is judged bad. Success: boot-complete.target and
systemd-bless-boot. Failure: the reason in update/last-assessment.json and a reboot; when no try
is left systemd-boot falls back to the previous version.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import atomic, cli_help, paths
from appliance.config import Config
from appliance.errors import UserError
from appliance.host_settings import load_device
from appliance.run import run
from appliance.signed import release_manifest
from applianctl.engine import smoke
from applianctl.records import LastAssessment
from applianctl.slots import history, release
from applianctl.slots.entries import BAD, entries
from applianctl.slots.machine import Host, boot_counting

POLL_S = 5.0
ATTEMPT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Target:
    """Where and how the assessment reaches the appliance, as a client does."""

    url: str
    server_name: str | None
    ca: Path | None  # None: the system's CAs

    def describe(self) -> str:
        return f"{self.url} as {self.server_name}" if self.server_name else self.url


def client_target(config: Config, url: str | None = None) -> Target:
    """The proxy's public port on loopback, its server name and the appliance CA (a --url
    overrides the address, for a test or a look at the engine alone)."""
    if url:
        return Target(url.rstrip("/"), None, None)
    ca = paths.TLS_DIR / "ca.crt" if config.proxy.tls == "internal" else None
    return Target(f"https://127.0.0.1:{config.proxy.https_port}", config.proxy.hostname, ca)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def wait_serving(target: Target, model: str, deadline_s: float, poll_s: float = POLL_S) -> tuple[bool, str]:
    """(True, "") once the smoke completion through TARGET is right within DEADLINE_S; else
    (False, why) naming the last thing that was wrong."""
    end = time.monotonic() + deadline_s
    why = f"nothing answered on {target.describe()}"
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return False, f"no right smoke completion through {target.describe()} within {deadline_s:g} s (last: {why})"
        if target.ca is not None and not target.ca.is_file():
            why = f"the appliance CA {target.ca} does not exist (appliance-tls.service)"
        else:
            verify: bool | str = str(target.ca) if target.ca is not None else True
            session = smoke.session_for(target.url, target.server_name, verify)
            try:
                result = smoke.smoke(session, target.url, model, timeout=min(ATTEMPT_TIMEOUT_S, max(left, 0.5)))
            finally:
                session.close()
            if result.ok:
                return True, ""
            why = result.message
        time.sleep(min(poll_s, max(end - time.monotonic(), 0)))


def demote_newer(host: Host, version: str) -> list[str]:
    """After a downgrade was judged good: mark newer entries bad (+0) so that the older version
    stays the default, as the operator asked."""
    demoted = []
    for entry in entries(host):
        if release_manifest.version_tuple(entry.version) > release_manifest.version_tuple(version) and entry.state != BAD:
            target = entry.renamed(0)
            entry.path.rename(target)
            atomic.fsync_dir(target.parent)
            demoted.append(target.name)
    return demoted


def assess(
    config: Config,
    *,
    host: Host | None = None,
    deadline_s: float | None = None,
    url: str | None = None,
    poll_s: float = POLL_S,
    reboot: Callable[[], None] | None = None,
    say: Callable[[str], None] = print,
) -> int:
    host = host or Host()
    counting = boot_counting(host)
    if counting is None:
        say("this boot is not on trial (no boot counting): the version was judged good already; nothing to assess")
        return 0
    try:
        version = release.running_manifest().version
    except UserError:
        version = config.appliance.version
    deadline = float(deadline_s if deadline_s is not None else config.update.assessment_deadline_s)
    model = config.served_model
    target = client_target(config, url)
    say(
        f"assessing {version} (entry {counting['entry']}, {counting['tries_left']} tries left): "
        f"the smoke completion through {target.describe()} within {deadline:g} s"
    )
    ok, why = wait_serving(target, model, deadline, poll_s)
    tries_left = counting["tries_left"]
    record = LastAssessment(version=version, ok=ok, reason="" if ok else f"rolled back: {why}", entry=counting["entry"],
                            tries_left=tries_left, deadline_s=deadline, through=target.describe(), at=_now())
    if ok:
        last = history.last_update()
        if last is not None and last.downgrade and last.version == version:
            record = dataclasses.replace(record, demoted=tuple(demote_newer(host, version)))
        _keep(record)
        say(f"{version} serves its clients: judged good")
        return 0
    _keep(record)
    say(f"{version} failed its assessment ({why}); rebooting (tries left: {tries_left})")
    (reboot or _reboot)()
    return 1


def _keep(record: LastAssessment) -> None:
    """Record the verdict; a record that cannot be written never changes what the verdict does."""
    try:
        history.write(paths.last_assessment_path(), record)
    except UserError as e:
        print(f"{e.message}; the verdict stands, unrecorded", file=sys.stderr)


def _reboot() -> None:
    run(["systemctl", "reboot"], "systemctl reboot", "reboot by hand: the entry's tries run out and the previous version boots")


def cmd_assess(args: argparse.Namespace) -> int:
    config = load_device()
    return assess(config, deadline_s=args.deadline, url=args.url, poll_s=args.poll)


def add_parser(subparsers: Any) -> None:
    p = cli_help.verb_parser(
        subparsers, "assess", "judge this boot's version by what its clients get (boot assessment)",
        examples=["applianctl assess", "applianctl assess --deadline 600"],
        exit_codes=[(0, "judged good, or this boot is not on trial (nothing to assess)"),
                    (1, "it failed its assessment: the reason recorded, and the machine reboots"), cli_help.BAD_INPUT],
        details="appliance-assess.service's step; the verdict is in `applianctl slots --json`.",
    )
    p.add_argument("--deadline", type=float, help="seconds to serve (default: update.assessment_deadline_s)")
    p.add_argument(
        "--url", help="base URL to judge instead of the proxy (default: https://127.0.0.1:{proxy.https_port} as proxy.hostname)"
    )
    p.add_argument("--poll", type=float, default=POLL_S, help="seconds between attempts (default 5)")
    p.set_defaults(func=cmd_assess)
