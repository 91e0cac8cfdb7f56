"""The install plan: what one host is (name, network, SSH keys, proxy, update URL, weights source)
and which disk of it receives the appliance.

Written by the operator as TOML (`python3 -m builder plan PLAN.toml` checks and signs it), carried
to the installer on the medium or as a systemd credential, and kept on the appliance in
/var/lib/appliance/host (outside the A/B slots, so it survives every upgrade and rollback). The
device accepts it only as canonical JSON (`plan.json`) with a detached Ed25519 signature
(`plan.json.sig`) by a key the release trusts: the same canonical form, signature encoding and keys
as the release manifest.

The same frozen dataclasses and the same schema loader as appliance.toml check it: unknown keys,
wrong types and bad values are one line naming the file, the key and the value, and a hint.
A setting the plan leaves out (None) keeps the image's default (appliance.toml at build).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import config as cfg
from appliance import manifest, schema
from appliance.errors import ConfigError, UserError

PLAN_JSON = "plan.json"
PLAN_SIG = "plan.json.sig"
MAX_PLAN_BYTES = 256 * 1024
GIB = 1 << 30

_IFNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,14}\Z")  # the kernel's IFNAMSIZ (15) and no '/', ':' or spaces
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}\Z")
_SERIAL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._:/+-]{0,63}\Z")
_WWN = re.compile(r"^(0x[0-9a-f]{16}([0-9a-f]{16})?|eui\.[0-9a-f]{16,32}|nvme\.[0-9a-f-]{8,120}|naa\.[0-9a-f]{16,32})\Z")
_BY_PATH = re.compile(r"^(/dev/disk/by-path/)?[A-Za-z0-9][A-Za-z0-9:._-]{0,127}\Z")
BOND_MODES = ("802.3ad", "active-backup", "balance-rr", "balance-xor", "balance-tlb", "balance-alb")


def _is_interface(value: str) -> str | None:
    if _MAC.fullmatch(value) or (_IFNAME.fullmatch(value) and value not in (".", "..")):
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
    return None if _is_ip(value) is None or cfg.is_dns_name(value) is None else "an address or a DNS name of an NTP server"


def _pattern(regex: re.Pattern[str], hint: str) -> dict[str, Any]:
    return schema.check(lambda v: None if regex.fullmatch(v) else hint)


def _each(regex: re.Pattern[str], hint: str) -> dict[str, Any]:
    return schema.each(lambda v: None if regex.fullmatch(v) else hint)


def _optional(regex: re.Pattern[str], hint: str) -> dict[str, Any]:
    """"" (not given) or a value matching REGEX."""
    return schema.check(lambda v: None if v == "" or regex.fullmatch(v) else hint)


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
    domains: tuple[str, ...] = field(default=(), metadata=schema.each(cfg.is_dns_name))
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
    authorized_keys: tuple[str, ...] = field(
        metadata=_each(cfg._SSH_KEY, "an OpenSSH public key line, e.g. ssh-ed25519 AAAA... user@host")
    )


@dataclass(frozen=True)
class Proxy:
    hostname: str | None = field(default=None, metadata=schema.check(cfg.is_dns_name))
    allowed_cidrs: tuple[str, ...] | None = field(default=None, metadata=schema.each(cfg._is_cidr))
    acme_email: str | None = field(
        default=None, metadata=schema.check(lambda v: None if cfg._EMAIL.fullmatch(v) else "an e-mail address such as ops@example.net")
    )


@dataclass(frozen=True)
class Update:
    url: str = field(metadata=schema.check(cfg._is_url))


@dataclass(frozen=True)
class Weights:
    source: str = field(metadata=schema.check(cfg._is_weights_source))


@dataclass(frozen=True)
class Target:
    """Which disk receives the appliance. Every selector given must match; exactly one disk may."""

    serial: str = field(default="", metadata=_optional(_SERIAL, "a disk serial as lsblk shows it"))
    wwn: str = field(default="", metadata=_optional(_WWN, "a WWN as lsblk shows it, e.g. 0x5000c500a1b2c3d4 or eui.00253852a1b2c3d4"))
    model: str = field(default="", metadata=_optional(_SERIAL, "a disk model as lsblk shows it"))
    by_path: str = field(default="", metadata=_optional(_BY_PATH, "a /dev/disk/by-path name such as pci-0000:41:00.0-nvme-1"))
    # Whole GiB (the signed form has no floats); max 0: no upper limit.
    min_size_gib: int = field(default=0, metadata=_when(lambda v: 0 <= v <= cfg.MAX_GIB, f"0 to {cfg.MAX_GIB:g}"))
    max_size_gib: int = field(default=0, metadata=_when(lambda v: 0 <= v <= cfg.MAX_GIB, f"0 (no limit) to {cfg.MAX_GIB:g}"))
    # A disk with partitions or a file system signature is written only when this is true.
    wipe_existing_data: bool = False

    @property
    def selectors(self) -> dict[str, str]:
        """The identity selectors the plan gives (not the size range)."""
        given = {"serial": self.serial, "wwn": self.wwn, "model": self.model, "by_path": self.by_path}
        return {k: v for k, v in given.items() if v}


@dataclass(frozen=True)
class Plan:
    hostname: str | None = field(default=None, metadata=schema.check(cfg.is_dns_name))
    network: Network | None = None
    ssh: Ssh | None = None
    proxy: Proxy | None = None
    update: Update | None = None
    weights: Weights | None = None
    target: Target | None = None

    def effective(self, config: cfg.Config) -> dict[str, Any]:
        """The host's settings: the plan's, and the image's configuration where the plan is silent."""
        proxy = self.proxy or Proxy()
        return {
            "hostname": self.hostname or config.os.hostname,
            "network": self.network.summary() if self.network else "DHCP on every Ethernet link (image default)",
            "ssh_authorized_keys": list(self.ssh.authorized_keys if self.ssh else config.os.ssh_authorized_keys),
            "proxy_hostname": proxy.hostname or config.proxy.hostname,
            "proxy_allowed_cidrs": list(proxy.allowed_cidrs if proxy.allowed_cidrs is not None else config.proxy.allowed_cidrs),
            "proxy_acme_email": proxy.acme_email if proxy.acme_email is not None else config.proxy.acme_email,
            "update_url": self.update.url if self.update else config.update.url,
            "weights_source": self.weights.source if self.weights else config.model.source,
        }


def _cross_checks(where: str, plan: Plan) -> None:
    net = plan.network
    if net is not None:
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
    target = plan.target
    if target is not None:
        if not target.selectors:
            raise ConfigError(f"{where}: target names no disk", hint="give target.serial, target.wwn, target.model or target.by_path")
        if target.max_size_gib and target.min_size_gib > target.max_size_gib:
            raise ConfigError(f"{where}: target.min_size_gib is larger than target.max_size_gib", hint="swap them")


def from_plain(data: Any, where: str) -> Plan:
    """DATA (a parsed TOML or JSON document) as a Plan, checked."""
    plan: Plan = cfg._Loader(Path(where)).load(Plan, data)  # worded as appliance.toml's faults
    _cross_checks(where, plan)
    return plan


def load_toml(path: Path) -> Plan:
    """The operator's plan file, checked (one line and a hint on any fault)."""
    import tomllib

    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file", hint="write an install plan (see docs/install.md)") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}", hint="fix the syntax at the line named") from None
    return from_plain(raw, str(path))


def to_document(plan: Plan, signer: str) -> dict[str, Any]:
    """The signed form: the plan's settings (silent ones left out) and the signer's key id."""
    doc = {k: v for k, v in schema.plain(plan).items() if v is not None}
    for section in ("proxy",):
        if section in doc:
            doc[section] = {k: v for k, v in doc[section].items() if v is not None}
    doc["signer"] = signer
    return doc


def dumps(plan: Plan, signer: str) -> bytes:
    return manifest.canonical(to_document(plan, signer))


def sign(plan: Plan, private_key_path: Path) -> tuple[bytes, bytes]:
    """(plan.json bytes, plan.json.sig bytes) signed with the release key at PRIVATE_KEY_PATH."""
    key = manifest.load_private_key(private_key_path)
    data = dumps(plan, manifest.key_id(key.public_key()))
    return data, manifest.encode_signature(key.sign(data))


class PlanRefused(UserError):
    """A plan that is not signed by a trusted key, or not exactly what was signed."""


def verify(data: bytes, sig: bytes, trusted_keys_dir: Path, where: str = PLAN_JSON) -> Plan:
    """The plan in DATA, only if SIG is a trusted key's signature over exactly these bytes."""
    if len(data) > MAX_PLAN_BYTES:
        raise PlanRefused(f"{where}: {len(data)} bytes, more than {MAX_PLAN_BYTES}", hint="this is not an install plan")
    try:
        signature = manifest.decode_signature(sig)
    except manifest.ManifestError as e:
        raise PlanRefused(f"{where}: {e.message}", hint="sign the plan: python3 -m builder plan PLAN.toml") from None
    keys = manifest.trusted_keys(trusted_keys_dir)
    signed_by = manifest.signer_of(data, signature, keys)
    if signed_by is None:
        raise PlanRefused(f"{where}: not signed by a key this release trusts",
                          hint="sign it with the release key: python3 -m builder plan PLAN.toml")
    try:
        doc = manifest.parse_canonical(data)
    except manifest.ManifestError as e:
        raise PlanRefused(f"{where}: {e.message}", hint="the plan was changed after it was signed") from None
    if not isinstance(doc, dict) or doc.pop("signer", None) != signed_by:
        raise PlanRefused(f"{where}: names another signer than the key that signed it", hint="the plan is inconsistent")
    return from_plain(doc, where)


def load_signed(directory: Path, trusted_keys_dir: Path) -> Plan | None:
    """The verified plan in DIRECTORY (plan.json + plan.json.sig); None when there is no plan.
    A plan without its signature, or with a bad one, is refused: nothing unsigned is used."""
    data_path, sig_path = directory / PLAN_JSON, directory / PLAN_SIG
    if not data_path.exists() and not sig_path.exists():
        return None
    try:
        data, sig = data_path.read_bytes(), sig_path.read_bytes()
    except FileNotFoundError as e:
        raise PlanRefused(f"{e.filename}: missing (a plan needs plan.json and plan.json.sig)",
                          hint="sign the plan: python3 -m builder plan PLAN.toml") from None
    return verify(data, sig, trusted_keys_dir, str(data_path))
