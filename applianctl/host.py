# SPDX-License-Identifier: MIT
"""Per-host settings on every boot (appliance-host.service, before the network): the signed
install plan in /var/lib/appliance/host rendered into /run, so each version renders it with its
own code and no older rendering lingers. Rendered: systemd-networkd files, the host name, SSH keys
(a file sshd reads besides the image's), and for the proxy's settings a Caddyfile plus
host-settings.json, which load_device() lays over the image's configuration. An absent plan, or
one not signed by a trusted key, leaves the image's defaults (DHCP, its host name and keys). A
signed plan whose values this version refuses (its own checks, or laid over the image's
configuration: the Caddyfile's) fails the unit in one line: its network, host name and SSH keys
still apply when they pass on their own, so that the host can be reached and fixed; its proxy,
metrics, update, log and weights settings do not. Status shows the result.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import Any

from appliance import caddyfile, host_settings, paths
from appliance.atomic import atomic_write, write_record
from appliance.config import Config, load_image
from appliance.errors import ConfigError, UserError
from appliance.run import call
from appliance.schema import dump_record, from_json, load_record
from appliance.signed import install_plan
from applianctl.records import EffectiveSettings, HostResult

HOST_DIR = paths.STATE_DIR / "host"  # plan.json, plan.json.sig, authorized_keys
NETWORK_RUN_DIR = Path(os.environ.get("APPLIANCE_NETWORK_RUN_DIR", "/run/systemd/network"))
RESULT = paths.RUN_DIR / "host.json"  # what status shows
PREFIX = "10-appliance-host"  # sorts before the image's 80-appliance-ethernet.network
BOND = "bond0"
# In paths.RUN_DIR (beside RESULT): the proxy's per-host Caddyfile, the unit's environment naming it, the settings.
CADDYFILE = "Caddyfile"
PROXY_ENV = "proxy.env"
HOST_SETTINGS = host_settings.SETTINGS_FILE
FIX_HINT = ("put a plan that `python3 -m builder plan` signs for this release into /var/lib/appliance/host and "
            "restart appliance-host.service, or go back to the version that applied it (applianctl rollback)")


def _match(interface: str) -> str:
    return f"MACAddress={interface}" if host_settings.MAC.fullmatch(interface) else f"Name={interface}"


def _section(name: str, lines: list[str]) -> str:
    return f"[{name}]\n" + "".join(line + "\n" for line in lines)


def network_files(net: host_settings.Network) -> dict[str, str]:
    """FILE NAME -> CONTENT of the systemd-networkd files for NET."""
    files: dict[str, str] = {}
    head = "# Rendered by appliance-host.service from the signed install plan; do not edit.\n"
    mtu = [f"MTUBytes={net.mtu}"] if net.mtu else []
    uplink = BOND if net.bond else None
    ip_link = f"vlan{net.vlan}" if net.vlan else None

    if net.bond:
        bond = ["Mode=" + net.bond, "MIIMonitorSec=100ms"]
        if net.bond == "802.3ad":
            bond += ["LACPTransmitRate=fast", "TransmitHashPolicy=layer3+4"]
        files[f"{PREFIX}-{BOND}.netdev"] = head + _section("NetDev", [f"Name={BOND}", "Kind=bond", *mtu]) + "\n" + _section("Bond", bond)
        for i, member in enumerate(net.interfaces):
            files[f"{PREFIX}-member{i}.network"] = (
                head + _section("Match", [_match(member), "Type=ether"]) + "\n" + (_section("Link", mtu) + "\n" if mtu else "")
                + _section("Network", [f"Bond={BOND}"])
            )
    if net.vlan:
        files[f"{PREFIX}-vlan{net.vlan}.netdev"] = (
            head + _section("NetDev", [f"Name=vlan{net.vlan}", "Kind=vlan", *mtu]) + "\n" + _section("VLAN", [f"Id={net.vlan}"])
        )

    addressing = ["DHCP=yes" if net.dhcp else "DHCP=no"]
    addressing += [f"Address={a}" for a in net.addresses]
    addressing += [f"Gateway={g}" for g in net.gateways]
    addressing += [f"DNS={d}" for d in net.dns]
    if net.domains:
        addressing.append("Domains=" + " ".join(net.domains))
    addressing += [f"NTP={n}" for n in net.ntp]

    # The link that carries the addresses: the VLAN, else the bond, else the one interface.
    carrier_match = _section("Match", [f"Name={uplink}"]) if uplink else _section("Match", [_match(net.interfaces[0]), "Type=ether"])
    if ip_link:
        carrier = [f"VLAN={ip_link}", "LinkLocalAddressing=no", "ConfigureWithoutCarrier=yes"]
        files[f"{PREFIX}-uplink.network"] = (
            head + carrier_match + "\n" + (_section("Link", mtu) + "\n" if mtu else "") + _section("Network", carrier)
        )
        files[f"{PREFIX}-{ip_link}.network"] = head + _section("Match", [f"Name={ip_link}"]) + "\n" + _section("Network", addressing)
    else:
        files[f"{PREFIX}-uplink.network"] = (
            head + carrier_match + "\n" + (_section("Link", mtu) + "\n" if mtu else "") + _section("Network", addressing)
        )
    return files


def render(plan: install_plan.Plan, config: Config) -> dict[str, str]:
    """Path (relative to the rendering root) -> content of every file the plan sets; ConfigError
    when a setting laid over the image's configuration is refused (the Caddyfile's checks too)."""
    out: dict[str, str] = {}
    if plan.network is not None:
        out.update({f"network/{name}": text for name, text in network_files(plan.network).items()})
    if plan.hostname:
        out["hostname"] = plan.hostname + "\n"
    if plan.ssh is not None:
        out["authorized_keys"] = "".join(k + "\n" for k in plan.ssh.authorized_keys)
    settings = plan.overlay_values()
    if settings:
        # Checked as every reader will check it (and as `builder plan` did), then rendered through
        # the image's own template.
        effective = host_settings.laid_over(config, plan, "install plan")
        out[HOST_SETTINGS] = json.dumps(settings, indent=2, sort_keys=True) + "\n"
        if plan.proxy is not None or plan.metrics is not None:
            out[CADDYFILE] = caddyfile.render_caddyfile(effective)
    return out


def effective_config(config: Config, files: dict[str, str]) -> Config:
    """The image's CONFIG with the settings RENDER wrote laid over it (checked there already)."""
    if HOST_SETTINGS not in files:
        return config
    return host_settings.overlay(config, json.loads(files[HOST_SETTINGS]), "install plan")


def write_service_files(run_dir: Path, config: Config) -> None:
    """Files other units read, from the effective configuration (the image's or the plan's): the
    metrics site's client CAs, the log collector's CA and URL. Absent when not configured, so the
    journal upload's unit (ConditionPathExists=) does not start at all."""
    wanted = {
        run_dir / paths.METRICS_CLIENT_CA.name: config.metrics.client_ca,
        run_dir / paths.JOURNAL_UPLOAD_CA.name: config.logs.upload_ca if config.logs.upload_url else "",
        # checks.is_https_url admitted only URL characters: nothing an EnvironmentFile= would expand
        run_dir / paths.JOURNAL_UPLOAD_ENV.name: f"UPLOAD_URL={config.logs.upload_url}\n" if config.logs.upload_url else "",
    }
    for path, text in wanted.items():
        if text:
            atomic_write(path, (text if text.endswith("\n") else text + "\n").encode(), 0o644)
        else:
            path.unlink(missing_ok=True)


def _clear_rendered(directory: Path) -> None:
    for old in directory.glob(f"{PREFIX}-*"):
        old.unlink()


def _clear_proxy(run_dir: Path) -> None:
    # proxy.env first: from then on the proxy takes the image's Caddyfile.
    for name in (PROXY_ENV, CADDYFILE, HOST_SETTINGS):
        (run_dir / name).unlink(missing_ok=True)


def _write_settings(run_dir: Path, files: dict[str, str]) -> None:
    # 0644: the proxy runs as caddy; every reader of the configuration reads the settings.
    if CADDYFILE in files:
        atomic_write(run_dir / CADDYFILE, files[CADDYFILE].encode(), 0o644)
    atomic_write(run_dir / HOST_SETTINGS, files[HOST_SETTINGS].encode(), 0o644)
    if CADDYFILE in files:
        # Last: the unit takes the per-host Caddyfile only once both files are whole.
        atomic_write(run_dir / PROXY_ENV, f"CADDYFILE={run_dir / CADDYFILE}\n".encode(), 0o644)


def apply(config: Config, host_dir: Path = HOST_DIR, network_dir: Path = NETWORK_RUN_DIR, result: Path = RESULT,
          trusted_keys: Path = paths.TRUSTED_KEYS_DIR, set_hostname: bool = True) -> HostResult:
    """Verify the plan in HOST_DIR and render it; write RESULT (status reads it) and the proxy's
    files beside it (the runtime directory). Returns what RESULT holds.
    CONFIG is the image's (load_image), never one with an earlier rendering's settings over it."""
    run_dir = result.parent
    network_dir.mkdir(parents=True, exist_ok=True)
    _clear_rendered(network_dir)
    _clear_proxy(run_dir)
    (host_dir / "proxy.json").unlink(missing_ok=True)  # written by earlier versions, read by none
    try:
        doc = install_plan.load_signed_document(host_dir, trusted_keys)
    except install_plan.PlanRefused as e:
        write_service_files(run_dir, config)
        return _result(result, HostResult(False, f"plan refused: {e.message}", "image defaults"))
    if doc is None:
        write_service_files(run_dir, config)
        return _result(result, HostResult(True, "", "image defaults", _shown(_defaults(config))))
    where = str(host_dir / install_plan.PLAN_JSON)
    refused = ""
    try:
        plan = install_plan.from_plain(doc, where)
        files = render(plan, config)
    except ConfigError as e:
        # Signed, so not silently: the unit fails (privileged(), the last step) and status says why.
        rest = _rest_of(doc, where, config)
        refused = f"the signed install plan does not apply on this version: {e.message} ({e.hint}); " + (
            "its network, host name and SSH keys apply, its proxy, metrics, update, log and weights settings do not"
            if rest else "nothing of it applies")
        if rest is None:
            write_service_files(run_dir, config)
            return _result(result, HostResult(False, refused, "plan"))
        plan, files = rest
    for name, text in files.items():
        if name.startswith("network/"):
            atomic_write(network_dir / name.removeprefix("network/"), text.encode())
    # sshd reads this besides the image's own file (AuthorizedKeysFile names both).
    keys = host_dir / "authorized_keys"
    if "authorized_keys" in files:
        atomic_write(keys, files["authorized_keys"].encode(), 0o644)
    else:
        keys.unlink(missing_ok=True)
    if HOST_SETTINGS in files:
        _write_settings(run_dir, files)
    write_service_files(run_dir, effective_config(config, files))
    if set_hostname and plan.hostname:
        # Transient: /etc belongs to the factory image; the plan on /var is the lasting record.
        try:
            socket.sethostname(plan.hostname)
        except OSError as e:
            return _result(result, HostResult(False, f"cannot set the host name: {e.strerror}", "plan"))
    settings = plan.effective(config)
    rendered = tuple(sorted(n.removeprefix("network/") for n in files if n.startswith("network/")))
    return _result(result, HostResult(not refused, refused, "plan", _shown(settings), rendered))


def _rest_of(doc: dict[str, Any], where: str, config: Config) -> tuple[install_plan.Plan, dict[str, str]] | None:
    """The plan in DOC without the settings laid over the image's configuration, and its files;
    None when even that is refused."""
    overlaid = {host_settings.HOST_SECTION.get(s, s) for s in host_settings.OVERLAY}
    try:
        plan = install_plan.from_plain({k: v for k, v in doc.items() if k not in overlaid}, where)
        return plan, render(plan, config)
    except ConfigError:
        return None


def _defaults(config: Config) -> dict[str, Any]:
    return install_plan.Plan().effective(config)


def _shown(settings: dict[str, Any]) -> EffectiveSettings:
    return from_json(EffectiveSettings, settings, "the effective host settings", lenient=False)


def _result(path: Path, result: HostResult) -> HostResult:
    write_record(path, result)
    return result


def addresses() -> list[str]:
    """The host's global addresses (for the console and the install summary)."""
    try:
        proc = call(["ip", "-j", "address", "show", "scope", "global"], timeout=2)
        data = json.loads(proc.stdout or "[]")
    except (OSError, ValueError):
        return []
    return [f"{a['local']}/{a['prefixlen']}" for link in data for a in link.get("addr_info", []) if "local" in a]


def privileged(result: Path = RESULT, runner: Any = call) -> list[str]:
    """The steps that need privileges, from what `apply` (sandboxed, unprivileged) decided: the host
    name, and SSH when the plan brings keys (the image's firewall and preset open it only for the
    image's own keys). Returns what was done."""
    try:
        doc = load_record(HostResult, result, lenient=True)
    except UserError:
        return []
    if doc is None or doc.source != "plan":
        return []
    done = []
    # Also when part of a signed plan was refused: its host name and keys, when they passed, make
    # the host reachable to be fixed.
    settings = doc.settings
    if settings is not None and settings.hostname:
        socket.sethostname(settings.hostname)
        done.append(f"host name {settings.hostname}")
    if settings is not None and settings.ssh_authorized_keys:
        runner(["nft", "add", "rule", "inet", "appliance", "input", "tcp", "dport", "22", "accept"])
        runner(["systemctl", "--no-block", "start", "ssh.service"])
        done.append("SSH opened for the plan's keys")
    if not doc.ok:
        # The last step of appliance-host.service: failing here fails the unit, after the above.
        raise UserError(doc.reason or "the signed install plan was not applied", hint=FIX_HINT)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m applianctl.host", description="render the install plan's per-host settings")
    parser.add_argument("action", choices=["apply", "privileged", "show"],
                        help="apply: render the plan (unprivileged); privileged: host name and SSH; show: what was applied")
    args = parser.parse_args(argv)
    if args.action == "privileged":
        print("; ".join(privileged()) or "nothing to do")
        return 0
    config = load_image()
    if args.action == "apply":
        doc = apply(config, set_hostname=False)
        print(doc.reason or f"host settings from the {doc.source}")
        # A plan not signed by a trusted key leaves the image's defaults: the boot goes on, status
        # reports it. A signed one this version refuses fails the unit in the privileged step,
        # which runs only after this one succeeded and still applies its host name and SSH keys.
        return 0
    shown = load_record(HostResult, RESULT, lenient=True)
    print(json.dumps(dump_record(shown) if shown is not None else {}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    from appliance.errors import run_reporting

    raise SystemExit(run_reporting(lambda: main(), prefix="error: ", debug=False))
