# SPDX-License-Identifier: MIT
"""What a signed install plan may set for one host, how each setting is checked, and `load_device`:
the image's configuration with the proxy settings appliance-host.service left in
/run/appliance/host-settings.json laid over it, for every reader on the device.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import caddyfile, paths, schema
from appliance.config import checks
from appliance.config.device import from_json, load_image, no_constant
from appliance.config.model import Config, MaintenanceWindow
from appliance.errors import ConfigError, UserError
from appliance.safe_read import MAX_RECORD_BYTES, loads_bounded, read_capped

IFNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}\Z")  # the kernel's IFNAMSIZ (15) and no '/', ':' or spaces
MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}\Z")
BOND_MODES = ("802.3ad", "active-backup", "balance-rr", "balance-xor", "balance-tlb", "balance-alb")


def _is_interface(value: str) -> str | None:
    if MAC.fullmatch(value) or (IFNAME.fullmatch(value) and value not in (".", "..")):
        return None
    return "an interface name such as enp65s0f0, or a MAC address in lower case such as 52:54:00:12:34:56"


def _is_interface_address(value: str) -> str | None:
    try:
        iface = ipaddress.ip_interface(value)
        if "%" in value or "/" not in value or str(iface) != value:
            raise ValueError(value)
        if iface.ip == iface.network.network_address and iface.network.prefixlen < iface.max_prefixlen - 1:
            raise ValueError(value)
    except ValueError:
        return "an address with its prefix length, written as Python writes it, e.g. 192.0.2.10/24 or 2001:db8::10/64"
    return None


def _is_ip(value: str) -> str | None:
    try:
        if "%" in value or str(ipaddress.ip_address(value)) != value:
            raise ValueError(value)
    except ValueError:
        return "an IPv4 or IPv6 address, e.g. 192.0.2.1 or 2001:db8::1"
    return None


def _is_ntp(value: str) -> str | None:
    return None if _is_ip(value) is None or checks.is_dns_name(value) is None else "an address or a DNS name of an NTP server"


def _when(ok: Any, hint: str) -> dict[str, Any]:
    return schema.check(lambda v: None if ok(v) else hint)


@dataclass(frozen=True)
class Network:
    """One uplink: a single interface, or a bond of several; optionally a VLAN on it.

    `interfaces` names the links by interface name or MAC address (a bond's members when `bond` is
    set). Addresses, gateways, DNS and NTP go on the uplink (the VLAN when there is one)."""

    interfaces: tuple[str, ...] = field(metadata=schema.each(_is_interface))
    dhcp: bool = False
    addresses: tuple[str, ...] = field(default=(), metadata=schema.each(_is_interface_address))
    gateways: tuple[str, ...] = field(default=(), metadata=schema.each(_is_ip))
    dns: tuple[str, ...] = field(default=(), metadata=schema.each(_is_ip))
    domains: tuple[str, ...] = field(default=(), metadata=schema.each(checks.is_dns_name))
    ntp: tuple[str, ...] = field(default=(), metadata=schema.each(_is_ntp))
    mtu: int = field(default=0, metadata=_when(lambda v: v == 0 or 576 <= v <= 9216, "0 (the link's default) or 576 to 9216"))
    bond: str = field(default="", metadata=_when(lambda v: v in ("", *BOND_MODES), '"" or a bonding mode: ' + ", ".join(BOND_MODES)))
    vlan: int = field(default=0, metadata=_when(lambda v: 0 <= v <= 4094, "0 (no VLAN) or a VLAN id from 1 to 4094"))

    def summary(self) -> str:
        """One line: the links, the addressing."""
        link = f"bond0 ({self.bond}: {', '.join(self.interfaces)})" if self.bond else self.interfaces[0]
        if self.vlan:
            link += f", VLAN {self.vlan}"
        if self.mtu:
            link += f", MTU {self.mtu}"
        addressing = [*self.addresses, *(["DHCP"] if self.dhcp else [])]
        via = f" via {', '.join(self.gateways)}" if self.gateways else ""
        return f"{link}: {', '.join(addressing)}{via}"


@dataclass(frozen=True)
class Ssh:
    # each parsed as OpenSSH parses it (checks.ssh_key_blob): the installer's summary fingerprints them
    authorized_keys: tuple[str, ...] = field(metadata=schema.each(checks.is_ssh_key))


@dataclass(frozen=True)
class Proxy:
    """The proxy settings a host may have of its own (OVERLAY takes their names)."""

    hostname: str | None = field(default=None, metadata=schema.check(checks.is_dns_name))
    allowed_cidrs: tuple[str, ...] | None = field(default=None, metadata=schema.each(checks.is_cidr))
    acme_email: str | None = field(default=None, metadata=schema.check(checks.is_email))


@dataclass(frozen=True)
class Update:
    url: str | None = field(default=None, metadata=schema.check(checks.is_url))
    maintenance_windows: tuple[MaintenanceWindow, ...] | None = None


@dataclass(frozen=True)
class Metrics:
    """Who may scrape this host's metrics (appliance.toml's [metrics])."""

    allowed_cidrs: tuple[str, ...] | None = field(default=None, metadata=schema.each(checks.is_cidr))
    client_ca: str | None = field(default=None, metadata=schema.multiline(checks.is_pem_certificates))


@dataclass(frozen=True)
class Logs:
    """Where this host's journal goes (appliance.toml's [logs])."""

    upload_url: str | None = field(default=None, metadata=schema.check(checks.is_https_url))
    upload_ca: str | None = field(default=None, metadata=schema.multiline(checks.is_pem_certificates))


@dataclass(frozen=True)
class Weights:
    source: str = field(metadata=schema.check(checks.is_weights_source))


@dataclass(frozen=True)
class HostSettings:
    """A host's settings; one left out (None) keeps the image's (appliance.toml at build)."""

    hostname: str | None = field(default=None, metadata=schema.check(checks.is_host_name))
    network: Network | None = None
    ssh: Ssh | None = None
    proxy: Proxy | None = None
    update: Update | None = None
    weights: Weights | None = None
    metrics: Metrics | None = None
    logs: Logs | None = None

    def effective(self, config: Config) -> dict[str, Any]:
        """The host's settings: these, and the image's configuration where these are silent."""
        proxy = self.proxy or Proxy()
        return {
            "hostname": self.hostname or config.os.hostname,
            "network": self.network.summary() if self.network else "DHCP on every Ethernet link (image default)",
            "ssh_authorized_keys": list(self.ssh.authorized_keys if self.ssh else config.os.ssh_authorized_keys),
            "proxy_hostname": proxy.hostname or config.proxy.hostname,
            "proxy_allowed_cidrs": list(proxy.allowed_cidrs if proxy.allowed_cidrs is not None else config.proxy.allowed_cidrs),
            "proxy_acme_email": proxy.acme_email if proxy.acme_email is not None else config.proxy.acme_email,
            "update_url": _given(self.update and self.update.url, config.update.url),
            "weights_source": self.weights.source if self.weights else config.model.source,
            "metrics_allowed_cidrs": list(_given(self.metrics and self.metrics.allowed_cidrs, config.metrics.allowed_cidrs)),
            "logs_upload_url": _given(self.logs and self.logs.upload_url, config.logs.upload_url),
        }

    def overlay_values(self) -> dict[str, dict[str, Any]]:
        """{SECTION: {KEY: VALUE}} of what these settings set of OVERLAY's keys, as load_device
        lays them over the image's configuration (appliance-host.service writes it)."""
        out: dict[str, dict[str, Any]] = {}
        for section, keys in OVERLAY.items():
            given = getattr(self, HOST_SECTION.get(section, section))
            values = {k: getattr(given, k) for k in keys if given is not None and getattr(given, k) is not None}
            if values:
                out[section] = schema.plain(values)
        return out


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def cross_checks(where: str, settings: HostSettings) -> None:
    """Rules that tie a host's settings together (the uplink's links, addresses and gateways), and
    what a list must hold that the schema checks element by element only."""
    if settings.proxy is not None and settings.proxy.allowed_cidrs == ():
        # An empty allowlist would admit no client: the Caddyfile refuses it (caddyfile._cidrs).
        raise ConfigError(f"{where}: proxy.allowed_cidrs is empty",
                          hint="list the networks that may reach the engine, or leave allowed_cidrs out to keep the image's")
    net = settings.network
    if net is None:
        return
    if not net.interfaces:
        raise ConfigError(f"{where}: network.interfaces is empty", hint="name the uplink's interface (or a bond's members)")
    if len(set(net.interfaces)) != len(net.interfaces):
        raise ConfigError(f"{where}: network.interfaces names a link twice", hint="list each interface once")
    if net.bond and len(net.interfaces) < 2:
        raise ConfigError(f"{where}: network.bond = {net.bond!r} needs at least two interfaces",
                          hint="list the bond's members in network.interfaces")
    if not net.bond and len(net.interfaces) > 1:
        raise ConfigError(f"{where}: network.interfaces names {len(net.interfaces)} links without a bond",
                          hint='set network.bond (e.g. "802.3ad") or name one interface')
    if not net.dhcp and not net.addresses:
        raise ConfigError(f"{where}: network has neither dhcp = true nor addresses", hint="give static addresses or set dhcp = true")
    ifaces = [ipaddress.ip_interface(a) for a in net.addresses]
    for gw in net.gateways:
        ip = ipaddress.ip_address(gw)
        on_link = any(i.version == ip.version and ip in i.network and ip != i.ip for i in ifaces)
        if not on_link and not (ip.version == 6 and ip.is_link_local):
            raise ConfigError(f"{where}: network.gateways has {gw}, outside every static address's network",
                              hint="a gateway must be on a network of network.addresses (or an IPv6 link-local address)")
    if net.mtu and net.mtu < 1280 and any(i.version == 6 for i in ifaces):
        raise ConfigError(f"{where}: network.mtu = {net.mtu} is below IPv6's minimum of 1280",
                          hint="raise the MTU or drop the IPv6 addresses")


# ----------------------------------------------------------------------------------- the overlay

# What of the image's configuration a host's settings replace: configuration section -> the keys
# of it that the host's dataclass has (of the same name, but [weights] source: model.source, the
# default source of `applianctl model fetch`).
OVERLAY = {section: tuple(f.name for f in dataclasses.fields(cls)) for section, cls in
           (("proxy", Proxy), ("update", Update), ("metrics", Metrics), ("logs", Logs), ("model", Weights))}
HOST_SECTION = {"model": "weights"}  # a configuration section the host's settings name otherwise
SETTINGS_FILE = "host-settings.json"
HINT = "systemctl restart appliance-host.service renders it again from the signed install plan"


def settings_path() -> Path:
    """Where appliance-host.service leaves the plan's settings on each boot (/run: this boot's code
    rendered them); APPLIANCE_HOST_SETTINGS moves it for tests."""
    return Path(os.environ.get("APPLIANCE_HOST_SETTINGS", str(paths.RUN_DIR / SETTINGS_FILE)))


def overlay(config: Config, settings: Any, where: str) -> Config:
    """CONFIG with SETTINGS ({"proxy": {"hostname": ..., "allowed_cidrs": [...], "acme_email": ...}})
    in place of the image's values, checked as appliance.json is and as the Caddyfile needs: a bad
    value raises ConfigError and never reaches a reader or a file."""
    if not isinstance(settings, dict) or not set(settings) <= set(OVERLAY):
        shown = sorted(settings) if isinstance(settings, dict) else type(settings).__name__
        raise ConfigError(f"{where}: {shown}: not per-host settings", hint=f"only {', '.join(OVERLAY)} may be set per host")
    data = config.to_json()
    for section, values in settings.items():
        if not isinstance(values, dict) or not set(values) <= set(OVERLAY[section]):
            shown = sorted(values) if isinstance(values, dict) else type(values).__name__
            raise ConfigError(f"{where}: {section} = {shown}: not per-host settings",
                              hint=f"{section} per host: {', '.join(OVERLAY[section])}")
        data[section] = {**data[section], **values}
    # The same loader and cross-checks as the image's own file (types, patterns, acme needs an e-mail).
    merged = from_json(data, Path(where))
    try:
        caddyfile.template_values(merged)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e.message}", hint=e.hint) from None
    return merged


def laid_over(config: Config, settings: HostSettings, where: str) -> Config:
    """CONFIG with a host's SETTINGS laid over it, by every check the device makes when it renders
    them (appliance-host.service) and reads them back (load_device): `builder plan` calls it before
    it signs, so that a plan that signs is a plan that renders on the image it was signed for."""
    cross_checks(where, settings)
    return overlay(config, settings.overlay_values(), where)


def load_device(path: Path | None = None, settings: Path | None = None) -> Config:
    """The device's configuration: the image's, with the per-host settings of the signed install
    plan (SETTINGS, written by appliance-host.service after it verified the plan) where there are."""
    config = load_image(path)
    settings = settings or settings_path()
    try:  # a regular file, capped, bounded JSON: every reader of the configuration reads it
        raw = read_capped(settings, MAX_RECORD_BYTES, what="the per-host settings", hint=HINT)
    except UserError as e:
        raise ConfigError(e.message, hint=e.hint) from None
    if raw is None:
        return config
    try:
        data = loads_bounded(raw.decode("utf-8"), parse_constant=no_constant)
    except ValueError as e:
        raise ConfigError(f"{settings}: not valid JSON ({e})", hint=HINT) from None
    return overlay(config, data, str(settings))
