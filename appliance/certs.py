# SPDX-License-Identifier: MIT
"""X.509 certificates of the appliance CA and the servers it signs: made here, used by the
device (applianctl.tls keeps the proxy's) and by the build host (builder.weights_mirror's own CA
for the demo's weights mirror)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 3650
SERVER_DAYS = 90
# Certificates start a little in the past: clocks of clients and a freshly booted device differ.
BACKDATE = datetime.timedelta(hours=1)

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# Always within the CA's name constraints: the proxy answers on loopback (assessment, status).
LOOPBACK_NETWORKS: tuple[IpNetwork, ...] = (ipaddress.IPv4Network("127.0.0.0/8"), ipaddress.IPv6Network("::1/128"))




def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def not_after(cert: x509.Certificate) -> datetime.datetime:
    """The expiry as an aware UTC datetime (cryptography 38 on the host, 43 on the device)."""
    value = getattr(cert, "not_valid_after_utc", None)
    if isinstance(value, datetime.datetime):
        return value
    return cert.not_valid_after.replace(tzinfo=datetime.UTC)


def not_before(cert: x509.Certificate) -> datetime.datetime:
    value = getattr(cert, "not_valid_before_utc", None)
    if isinstance(value, datetime.datetime):
        return value
    return cert.not_valid_before.replace(tzinfo=datetime.UTC)


def fingerprint(cert: x509.Certificate) -> str:
    """SHA-256 of the DER certificate as openssl prints it: AB:CD:..."""
    return ":".join(f"{b:02X}" for b in cert.fingerprint(hashes.SHA256()))


def san_names(cert: x509.Certificate) -> tuple[list[str], list[IpAddress]]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], []
    dns = [str(v) for v in san.get_values_for_type(x509.DNSName)]
    ips = [
        ip
        for ip in san.get_values_for_type(x509.IPAddress)
        if not isinstance(ip, ipaddress.IPv4Network | ipaddress.IPv6Network)
    ]
    return dns, ips


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def name_constraints(hostname: str, networks: Iterable[IpNetwork]) -> x509.NameConstraints:
    """What the appliance CA may sign for: HOSTNAME (and names below it) and NETWORKS plus loopback.

    A CA whose key sits on the device must not be able to vouch for any other site a client visits.
    """
    subtrees: list[x509.GeneralName] = [x509.DNSName(hostname)]
    subtrees += [x509.IPAddress(n) for n in _collapse([*LOOPBACK_NETWORKS, *networks])]
    return x509.NameConstraints(permitted_subtrees=subtrees, excluded_subtrees=None)


def _collapse(networks: Iterable[IpNetwork]) -> list[IpNetwork]:
    v4 = [n for n in networks if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in networks if isinstance(n, ipaddress.IPv6Network)]
    return [*ipaddress.collapse_addresses(v4), *ipaddress.collapse_addresses(v6)]


def ca_constraints(cert: x509.Certificate) -> tuple[list[str], list[IpNetwork]] | None:
    """The CA's permitted DNS names and networks; None when it has no (critical) name constraints."""
    try:
        ext = cert.extensions.get_extension_for_class(x509.NameConstraints)
    except x509.ExtensionNotFound:
        return None
    if not ext.critical or ext.value.excluded_subtrees or not ext.value.permitted_subtrees:
        return None
    dns = [str(g.value) for g in ext.value.permitted_subtrees if isinstance(g, x509.DNSName)]
    nets = [g.value for g in ext.value.permitted_subtrees if isinstance(g, x509.IPAddress)]
    return dns, [n for n in nets if isinstance(n, ipaddress.IPv4Network | ipaddress.IPv6Network)]


def within(ip: IpAddress, networks: Iterable[IpNetwork]) -> bool:
    return any(ip.version == n.version and ip in n for n in networks)


def _self_signed(key: ec.EllipticCurvePrivateKey, name: x509.Name, now: datetime.datetime, days: int) -> x509.CertificateBuilder:
    """A certificate of NAME, issued by itself, valid from a little before NOW for DAYS."""
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def make_ca(
    hostname: str, now: datetime.datetime, networks: Iterable[IpNetwork] = ()
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _new_key()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Appliance"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"Appliance CA {hostname} {now:%Y-%m-%d}"),
        ]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        _self_signed(key, name, now, CA_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        # Critical, so that a client that cannot enforce the constraints refuses the CA instead.
        .add_extension(name_constraints(hostname, networks), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_server(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    hostname: str,
    addresses: Iterable[IpAddress],
    now: datetime.datetime,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _new_key()
    names: list[x509.GeneralName] = [x509.DNSName(hostname)]
    names += [x509.IPAddress(ip) for ip in addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(now + datetime.timedelta(days=SERVER_DAYS), not_after(ca_cert)))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert
