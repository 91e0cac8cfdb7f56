# SPDX-License-Identifier: MIT
"""Status part `host`: the per-host settings (the signed install plan, else the image's defaults),
as appliance-host.service applied them on this boot, the addresses the host has now, and the
factory reset: one asked for and not yet run (degraded: the next boot wipes /var), the last that ran."""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path

from appliance import paths
from appliance.config import Config
from appliance.errors import UserError
from appliance.run import TimeoutExpired
from appliance.schema import load_record
from appliance.signed import install_plan
from applianctl.records import EffectiveSettings, FactoryResetRequest, HostResult, LastFactoryReset
from applianctl.status import probes
from applianctl.status.document import DocumentLoader, FactoryResetStatus, HostDetails
from applianctl.status.probes import DEGRADED, NOT_CONFIGURED, OK, Part, Sources


def addresses(src: Sources) -> tuple[str, ...] | None:
    """Global addresses with prefix length (ip -j address), None when they cannot be read."""
    try:
        code, out = src.run(["ip", "-j", "address", "show", "scope", "global"], probes.COMMAND_TIMEOUT_S)
        links = json.loads(out) if code == 0 else None
    except (probes.ToolMissing, TimeoutExpired, ValueError):
        return None
    if not isinstance(links, list):
        return None
    return tuple(f"{a['local']}/{a['prefixlen']}" for link in links for a in link.get("addr_info", []) if "local" in a)


def factory_reset() -> tuple[FactoryResetStatus, str | None]:
    """The pending and the last factory reset (records on /var), and the reason to show when one
    is pending."""
    from applianctl.factory_reset import not_a_request

    odd = not_a_request(paths.factory_reset_request_path())
    if odd is not None:
        # Not a request: the boot's reset removes it without a wipe (applianctl/factory_reset.py).
        odd_file = (f"{paths.factory_reset_request_path()} is {odd}, not a factory reset request: the next boot removes it "
                    f"without a reset (applianctl factory-reset --cancel removes it now)")
        return FactoryResetStatus(pending=None, last=None), odd_file
    why: str | None = None
    try:
        pending = load_record(FactoryResetRequest, paths.factory_reset_request_path(), lenient=True)
    except UserError as e:
        pending, why = None, f"a factory reset is pending, its request unreadable ({e.message}): the next boot wipes /var"
    if pending is not None:
        from applianctl.factory_reset import describe

        why = f"a factory reset is pending (asked {pending.requested_at}): the next boot wipes /var and {describe(pending)}"
    try:
        last = load_record(LastFactoryReset, paths.last_factory_reset_path(), lenient=True)
    except UserError:
        last = None
    return FactoryResetStatus(pending=pending, last=last), why


def image_settings(config: Config) -> EffectiveSettings:
    """The image's own per-host settings (no plan), as the document shows them."""
    settings: EffectiveSettings = DocumentLoader("the image's settings").load(EffectiveSettings, install_plan.Plan().effective(config))
    return settings


def probe_host(config: Config, src: Sources, result: Path) -> Part:
    reset, reset_pending = factory_reset()
    details = HostDetails(source=None, hostname=socket.gethostname(), addresses=addresses(src), network_files=(),
                          settings=image_settings(config), factory_reset=reset)
    try:
        applied = load_record(HostResult, result, lenient=True)
    except UserError as e:
        return Part(DEGRADED, e.message, details)
    if applied is None:
        return Part(NOT_CONFIGURED, f"appliance-host has not run ({result} absent): the image's defaults apply", details)
    # network_files none: no plan rendered
    details = dataclasses.replace(details, source=applied.source, network_files=tuple(applied.network_files or ()),
                                  settings=applied.settings or details.settings)
    if not applied.ok:
        # The image's defaults apply: the host runs, but not as its plan says.
        return Part(DEGRADED, applied.reason or "the install plan was not applied", details)
    if reset_pending:
        return Part(DEGRADED, reset_pending, details)
    return Part(OK, "", details)
