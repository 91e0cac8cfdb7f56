"""`applianctl assess`: judge a new version by whether it serves (appliance-assess.service).

Runs on a boot under boot counting only (systemd-boot set LoaderBootCountPath, or the booted
entry's name carries +LEFT[-DONE]); on any other boot the version was judged good already and
this is a no-op, so an engine that fails later on a good version is restarted by its unit, never
rolled back.

Within update.assessment_deadline_s the engine must answer its health check and then the
runbook's smoke completion ("Calculate 17 * 23..." must contain 391), straight on the engine's
loopback port. Success: exit 0, boot-complete.target is reached and systemd-bless-boot marks the
entry good. Failure: the reason goes to /var/lib/appliance/update/last-assessment.json and the
machine reboots; each boot uses up one try, and when none is left systemd-boot falls back to the
previous version by itself.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import requests

from appliance import atomic as state
from appliance import manifest
from appliance.errors import UserError
from appliance.run import run
from applianctl import config as appliance_config
from applianctl import slots, smoke

POLL_S = 5.0


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def wait_serving(base: str, health_path: str, model: str, deadline_s: float, poll_s: float = POLL_S) -> tuple[bool, str]:
    """(True, "") once the engine is healthy and the smoke completion right within DEADLINE_S;
    else (False, why) naming the last thing that was wrong."""
    session = requests.Session()
    session.trust_env = False
    end = time.monotonic() + deadline_s
    why = f"engine not healthy within {deadline_s:g} s"
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return False, why
        try:
            r = session.get(base + health_path, timeout=min(5.0, max(left, 0.1)))
            healthy = r.status_code == 200
        except requests.RequestException:
            healthy = False
        if healthy:
            result = smoke.smoke(session, base, model, timeout=min(120.0, max(end - time.monotonic(), 1.0)))
            if result.ok:
                return True, ""
            why = f"smoke completion not right within {deadline_s:g} s: {result.message}"
        time.sleep(min(poll_s, max(end - time.monotonic(), 0)))


def demote_newer(host: slots.Host, version: str) -> list[str]:
    """After a downgrade was judged good: mark newer entries bad (+0) so that the older version
    stays the default, as the operator asked."""
    demoted = []
    for entry in slots.entries(host):
        if manifest.version_tuple(entry.version) > manifest.version_tuple(version) and entry.state != "bad":
            target = entry.path.with_name(f"appliance_{entry.version}+0.efi")
            entry.path.rename(target)
            demoted.append(target.name)
    if demoted and host.esp is not None:
        state.fsync_dir(host.esp / "EFI" / "Linux")
    return demoted


def assess(
    config: dict[str, Any],
    *,
    host: slots.Host | None = None,
    deadline_s: float | None = None,
    engine_url: str | None = None,
    poll_s: float = POLL_S,
    reboot: Callable[[], None] | None = None,
    say: Callable[[str], None] = print,
) -> int:
    host = host or slots.Host()
    counting = slots.boot_counting(host)
    if counting is None:
        say("this boot is not on trial (no boot counting): the version was judged good already; nothing to assess")
        return 0
    try:
        version = slots.running_manifest()["version"]
    except UserError:
        version = config.get("appliance", {}).get("version")
    deadline = float(deadline_s if deadline_s is not None else config.get("update", {}).get("assessment_deadline_s", 3600))
    engine = config["engine"]
    base = (engine_url or f"http://127.0.0.1:{engine['port']}").rstrip("/")
    health_path = engine.get("health", {}).get("path", "/health")
    model = str(engine.get("served_model_name") or config["model"]["id"])
    say(f"assessing {version} (entry {counting.get('entry')}, {counting.get('tries_left')} tries left): serving within {deadline:g} s")
    ok, why = wait_serving(base, health_path, model, deadline, poll_s)
    record: dict[str, Any] = {
        "version": version,
        "ok": ok,
        "entry": counting.get("entry"),
        "tries_left": counting.get("tries_left"),
        "deadline_s": deadline,
        "at": _now(),
    }
    if ok:
        record["reason"] = ""
        last = slots.read_json(slots.last_update_path()) or {}
        if last.get("downgrade") and last.get("version") == version:
            record["demoted"] = demote_newer(host, version)
        state.write_json_atomic(slots.last_assessment_path(), record)
        say(f"{version} serves: judged good")
        return 0
    record["reason"] = f"rolled back: {why}"
    state.write_json_atomic(slots.last_assessment_path(), record)
    say(f"{version} failed its assessment ({why}); rebooting (tries left: {counting.get('tries_left')})")
    (reboot or _reboot)()
    return 1


def _reboot() -> None:
    run(["systemctl", "reboot"], "systemctl reboot", "reboot by hand: the entry's tries run out and the previous version boots")


def cmd_assess(args: argparse.Namespace) -> int:
    config = appliance_config.load()
    return assess(config, deadline_s=args.deadline, engine_url=args.url, poll_s=args.poll)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("assess", help="judge this boot's version by whether it serves (boot assessment)")
    p.add_argument("--deadline", type=float, help="seconds to serve (default: update.assessment_deadline_s)")
    p.add_argument("--url", help="the engine's base URL (default: http://127.0.0.1:{engine.port})")
    p.add_argument("--poll", type=float, default=POLL_S, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_assess)

