# SPDX-License-Identifier: MIT
"""`applianctl tls`: the appliance CA and the proxy's certificate (proxy.tls = "internal").

`generate` (appliance-tls.service, daily by its timer) makes the CA once and a server certificate
for the host name and addresses, renewed when under RENEW_DAYS remain, the names changed or it no
longer matches the CA; then reloads a running proxy. `show` prints what a client needs: the CA's
path and SHA-256 fingerprint (as openssl prints it), the server names and expiry dates.
In paths.TLS_DIR: ca.crt, ca.key (0600), server.crt, server.key (0640 root:caddy: the proxy's user).
"""

from __future__ import annotations

import argparse
import datetime
import grp
import ipaddress
import json
import shutil
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance import cli_help, paths
from appliance.atomic import atomic_write
from appliance.certs import (  # noqa: F401  (applianctl.tls.NAME, as before the move)
    BACKDATE,
    CA_DAYS,
    LOOPBACK_NETWORKS,
    SERVER_DAYS,
    IpAddress,
    IpNetwork,
    _collapse,
    _key_pem,
    _new_key,
    _now,
    _self_signed,
    ca_constraints,
    fingerprint,
    make_ca,
    make_server,
    name_constraints,
    not_after,
    not_before,
    san_names,
    within,
)
from appliance.errors import UserError
from appliance.host_settings import load_device
from appliance.run import SubprocessError, call

PROXY_UNIT = "appliance-proxy.service"
PROXY_GROUP = "caddy"  # Debian's caddy package creates it; appliance-proxy.service runs as caddy

RENEW_DAYS = 30


@dataclass(frozen=True)
class Files:
    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def server_crt(self) -> Path:
        return self.dir / "server.crt"

    @property
    def server_key(self) -> Path:
        return self.dir / "server.key"

    @property
    def client_crt(self) -> Path:
        return self.dir / "client.crt"

    @property
    def client_key(self) -> Path:
        return self.dir / "client.key"


@dataclass(frozen=True)
class Result:
    """What `generate` did."""

    created_ca: bool
    renewed: bool
    reason: str


# ------------------------------------------------------------------------------ host addresses


def _sorted_ips(ips: Iterable[IpAddress]) -> list[IpAddress]:
    return sorted(set(ips), key=lambda ip: (ip.version, int(ip)))


def host_addresses() -> list[IpAddress]:
    """127.0.0.1, ::1 and the host's addresses (`ip -j addr`), without IPv6 link-local ones."""
    return _sorted_ips(i.ip for i in host_interfaces())


def host_networks() -> list[IpNetwork]:
    """The networks the host's addresses are configured in (address/prefix of each interface)."""
    return _collapse(i.network for i in host_interfaces())


def host_interfaces() -> list[ipaddress.IPv4Interface | ipaddress.IPv6Interface]:
    found: list[ipaddress.IPv4Interface | ipaddress.IPv6Interface] = [
        ipaddress.IPv4Interface("127.0.0.1/8"),
        ipaddress.IPv6Interface("::1/128"),
    ]
    ip = shutil.which("ip") or "/usr/sbin/ip"
    try:
        proc = call([ip, "-j", "addr", "show"], timeout=10)
        if proc.returncode != 0:
            raise OSError(f"ip exited with status {proc.returncode}")
        links = json.loads(proc.stdout)
    except (OSError, SubprocessError, json.JSONDecodeError) as e:
        print(f"applianctl tls: cannot read the host's addresses ({e}); loopback only", file=sys.stderr)
        links = []
    for link in links:
        for info in link.get("addr_info", []):
            try:
                iface = ipaddress.ip_interface(f"{info.get('local', '')}/{int(info.get('prefixlen', -1))}")
            except ValueError:
                continue
            addr = iface.ip
            if addr.is_link_local or addr.is_multicast or addr.is_unspecified:
                continue
            found.append(iface)
    return found


# ------------------------------------------------------------------------------ files


def proxy_gid(group: str = PROXY_GROUP) -> int | None:
    """The proxy's group, or None where it does not exist (tests, a build host): no chown then."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        return None


def _load_cert(path: Path) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except (FileNotFoundError, ValueError):
        return None


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey | None:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (FileNotFoundError, ValueError, TypeError):
        return None
    return key if isinstance(key, ec.EllipticCurvePrivateKey) else None


def _same_public_key(key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> bool:
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return bool(key.public_key().public_bytes(*fmt) == cert.public_key().public_bytes(*fmt))


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    public = ca.public_key()
    if cert.issuer != ca.subject or not isinstance(public, ec.EllipticCurvePublicKey):
        return False
    hash_algorithm = cert.signature_hash_algorithm
    if hash_algorithm is None:
        return False
    try:
        public.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hash_algorithm))
    except Exception:
        return False
    return True


def _renew_reason(
    files: Files,
    ca_cert: x509.Certificate,
    hostname: str,
    addresses: list[IpAddress],
    now: datetime.datetime,
) -> str | None:
    cert = _load_cert(files.server_crt)
    key = _load_key(files.server_key)
    if cert is None or key is None:
        return "no server certificate yet"
    if not _same_public_key(key, cert):
        return "server.key does not match server.crt"
    if not _signed_by(cert, ca_cert):
        return "server certificate not signed by the current CA"
    left = not_after(cert) - now
    if left < datetime.timedelta(days=RENEW_DAYS):
        return f"server certificate expires in {max(left.days, 0)} days"
    dns, ips = san_names(cert)
    if dns != [hostname] or _sorted_ips(ips) != _sorted_ips(addresses):
        shown = ", ".join([hostname, *map(str, _sorted_ips(addresses))])
        return f"names changed to {shown}"
    return None


def _ca_reason(
    ca_cert: x509.Certificate | None, ca_key: ec.EllipticCurvePrivateKey | None, hostname: str, now: datetime.datetime
) -> str | None:
    """Why a new CA is needed, or None when the one on disk serves."""
    if ca_cert is None or ca_key is None or not _same_public_key(ca_key, ca_cert):
        return "no appliance CA yet"
    if not_after(ca_cert) <= now:
        return "the appliance CA expired"
    constraints = ca_constraints(ca_cert)
    if constraints is None:
        # A CA from before name constraints could sign for any site: replaced, clients must re-trust.
        return "the appliance CA is not name-constrained"
    if constraints[0] != [hostname]:
        return f"the appliance CA is for {', '.join(constraints[0])}, not {hostname}"
    return None


def generate(
    tls_dir: Path,
    hostname: str,
    addresses: Iterable[IpAddress],
    *,
    networks: Iterable[IpNetwork] | None = None,
    now: datetime.datetime | None = None,
    group: str = PROXY_GROUP,
) -> Result:
    """Make TLS_DIR hold a valid CA and server certificate for HOSTNAME and ADDRESSES; idempotent.

    A new CA is constrained to HOSTNAME, loopback and NETWORKS (default: each of ADDRESSES alone).
    Addresses outside the CA's constraints are left out of the server certificate, with a message:
    clients reach the proxy by its name then; the CA clients trust is never replaced for that.
    """
    now = _now() if now is None else now
    files = Files(tls_dir)
    addresses = _sorted_ips(addresses)
    if networks is None:
        networks = [ipaddress.ip_network(ip) for ip in addresses]
    tls_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    gid = proxy_gid(group)

    created_ca = False
    ca_cert = _load_cert(files.ca_crt)
    ca_key = _load_key(files.ca_key)
    ca_reason = _ca_reason(ca_cert, ca_key, hostname, now)
    if ca_reason is not None or ca_cert is None or ca_key is None:
        if ca_cert is not None:
            print(f"applianctl tls: new appliance CA: {ca_reason}", file=sys.stderr)
        ca_key, ca_cert = make_ca(hostname, now, networks)
        atomic_write(files.ca_key, _key_pem(ca_key), 0o600)
        atomic_write(files.ca_crt, ca_cert.public_bytes(serialization.Encoding.PEM), 0o644)
        created_ca = True

    constraints = ca_constraints(ca_cert)
    permitted = constraints[1] if constraints else []
    outside = [ip for ip in addresses if not within(ip, permitted)]
    if outside:
        print(
            f"applianctl tls: {', '.join(map(str, outside))} outside the appliance CA's networks "
            f"({', '.join(map(str, permitted))}): left out of the certificate; clients use {hostname}",
            file=sys.stderr,
        )
        addresses = [ip for ip in addresses if ip not in outside]

    reason = _renew_reason(files, ca_cert, hostname, addresses, now)
    if reason is None:
        return Result(created_ca=created_ca, renewed=False, reason="server certificate is current")
    key, cert = make_server(ca_key, ca_cert, hostname, addresses, now)
    # The key first: Caddy reads both only when told to reload, after both are in place.
    atomic_write(files.server_key, _key_pem(key), 0o640 if gid is not None else 0o600, gid)
    atomic_write(files.server_crt, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return Result(created_ca=created_ca, renewed=True, reason=reason)


CLIENT_DAYS = 3650


def make_client(hostname: str, now: datetime.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The appliance's own client identity (the journal upload presents it to the log collector):
    self-signed, so that it exists in every TLS mode (with ACME there is no appliance CA), named
    by the host, for client authentication only. A collector trusts each appliance's certificate
    (their concatenation as its trust file) or, on a trusted network, any (docs/fleet.md)."""
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Appliance"), x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    cert = (
        _self_signed(key, name, now, CLIENT_DAYS)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def ensure_client(tls_dir: Path, hostname: str, now: datetime.datetime | None = None) -> str | None:
    """Make TLS_DIR hold the client identity for HOSTNAME; a new one when there is none, it names
    another host, its key does not match, or it expires within RENEW_DAYS. The reason, or None."""
    now = _now() if now is None else now
    files = Files(tls_dir)
    cert, key = _load_cert(files.client_crt), _load_key(files.client_key)
    if cert is None or key is None:
        reason = "no client certificate yet"
    elif not _same_public_key(key, cert):
        reason = "the client key does not match its certificate"
    elif cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value != hostname:
        reason = f"the client certificate names another host than {hostname}"
    elif not_after(cert) - now < datetime.timedelta(days=RENEW_DAYS):
        reason = "the client certificate expires soon"
    else:
        return None
    tls_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    key, cert = make_client(hostname, now)
    atomic_write(files.client_key, _key_pem(key), 0o600)
    atomic_write(files.client_crt, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return reason


def reload_proxy() -> None:
    """Have a running proxy pick up the new certificate; nothing when it does not run."""
    if not Path("/run/systemd/system").is_dir():
        print("applianctl tls: not running under systemd; proxy not reloaded", file=sys.stderr)
        return
    done = call(["systemctl", "--no-block", "try-reload-or-restart", PROXY_UNIT])
    if done.returncode != 0:
        raise UserError(f"systemctl try-reload-or-restart {PROXY_UNIT} failed", hint=f"journalctl -u {PROXY_UNIT}")


# ------------------------------------------------------------------------------ show


def describe(tls_dir: Path) -> dict[str, Any]:
    files = Files(tls_dir)
    ca = _load_cert(files.ca_crt)
    server = _load_cert(files.server_crt)
    if ca is None or server is None:
        raise UserError(
            f"{tls_dir}: no appliance CA or server certificate yet",
            hint="systemctl start appliance-tls.service (or: applianctl tls generate)",
        )
    dns, ips = san_names(server)
    return {
        "ca_certificate": str(files.ca_crt),
        "ca_fingerprint_sha256": fingerprint(ca),
        "ca_subject": ca.subject.rfc4514_string(),
        "ca_not_after": not_after(ca).isoformat(),
        "server_certificate": str(files.server_crt),
        "server_names": dns + [str(ip) for ip in ips],
        "server_not_before": not_before(server).isoformat(),
        "server_not_after": not_after(server).isoformat(),
        "server_fingerprint_sha256": fingerprint(server),
    }


def _tls_mode() -> tuple[str, str]:
    proxy = load_device().proxy
    return proxy.tls, proxy.hostname


def cmd_show(args: argparse.Namespace) -> int:
    mode, hostname = _tls_mode()
    if mode != "internal":
        info: dict[str, Any] = {"mode": mode, "hostname": hostname}
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            print(f"TLS mode {mode}: Caddy obtains the certificate for {hostname} by ACME; no appliance CA.")
        return 0
    info = {"mode": mode, **describe(paths.TLS_DIR)}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"CA certificate (give this file to clients): {info['ca_certificate']}")
    print(f"CA SHA-256 fingerprint: {info['ca_fingerprint_sha256']}")
    print(f"CA valid until:         {info['ca_not_after']}")
    print(f"Server names:           {', '.join(info['server_names'])}")
    print(f"Server valid:           {info['server_not_before']} to {info['server_not_after']}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    mode, hostname = _tls_mode()
    # the host's own name (the install plan's, else the image's): the collector files its logs by it
    client_name = socket.gethostname() or hostname
    try:
        if (renewed := ensure_client(paths.TLS_DIR, client_name)) is not None:
            print(f"applianctl tls: new client certificate for {client_name}: {renewed}")
    except PermissionError as e:
        raise UserError(f"cannot write {paths.TLS_DIR}: {e.strerror}", hint="run as root (appliance-tls.service)") from None
    if mode != "internal":
        print(f"applianctl tls: TLS mode {mode}: Caddy manages the certificate; nothing to do")
        return 0
    if not hostname:
        raise UserError("the appliance configuration has no proxy.hostname", hint="the image is damaged; reinstall")
    try:
        result = generate(paths.TLS_DIR, hostname, host_addresses(), networks=host_networks())
    except PermissionError as e:
        raise UserError(
            f"cannot write {paths.TLS_DIR}: {e.strerror}", hint="run as root (appliance-tls.service)"
        ) from None
    if result.created_ca:
        print(f"applianctl tls: created a new appliance CA in {paths.TLS_DIR}")
    print(f"applianctl tls: {'renewed: ' if result.renewed else ''}{result.reason}")
    if result.renewed and not args.no_reload:
        reload_proxy()
    return 0


def add_parser(subparsers: Any) -> None:
    show_codes = [(0, "shown (also when there is no CA yet)"), cli_help.BAD_INPUT]
    p = cli_help.verb_parser(
        subparsers, "tls", "the appliance CA and the proxy's certificate",
        examples=["applianctl tls", "applianctl tls show --json", "applianctl tls generate"],
        exit_codes=[(0, "success"), cli_help.BAD_INPUT],
        details="Without an ACTION: show.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_show)
    sub = p.add_subparsers(dest="tls_command", metavar="ACTION")
    show = cli_help.verb_parser(sub, "show", "CA fingerprint, server names and expiry (the default)",
                                examples=["applianctl tls show --json"], exit_codes=show_codes)
    show.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    show.set_defaults(func=cmd_show)
    gen = cli_help.verb_parser(
        sub, "generate", "create the CA and (re)new the server certificate when due",
        examples=["applianctl tls generate", "applianctl tls generate --no-reload"],
        exit_codes=[(0, "the CA and the certificate are in place (renewed or not due)"),
                    (2, "bad input, or they cannot be written (not root; one line and a hint)")],
    )
    gen.add_argument("--no-reload", action="store_true", help="do not reload appliance-proxy.service after a renewal")
    gen.set_defaults(func=cmd_generate)
