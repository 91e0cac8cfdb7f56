# SPDX-License-Identifier: MIT
"""An install plan with every field set to a hostile value the plan still accepts: the longest names
and addresses, Unicode in the SSH keys' comments, keys of every type and size OpenSSH takes. Shared
by tests/test_plan.py (control characters in every string) and tests/test_install.py (the summary)."""

from __future__ import annotations

import base64
import dataclasses
import struct
import types
import typing
from collections.abc import Iterator
from typing import Any

from appliance import recovery_seal
from appliance.signed import install_plan


def _s(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _label(n: int) -> str:
    return "a" + "-9" * ((n - 2) // 2) + "z" * (1 + (n - 2) % 2)  # hyphens everywhere a DNS label allows them


LONGEST_DNS = ".".join([_label(63)] * 3 + [_label(61)])  # 253 characters
assert len(LONGEST_DNS) == 253 and all(len(x) <= 63 for x in LONGEST_DNS.split("."))
LONGEST_HOST_NAME = _label(31) + "." + _label(32)  # the kernel's limit for the host's own name
assert len(LONGEST_HOST_NAME) == 64

# made by ssh-keygen -t ed25519 / -t ecdsa -b 521 / -t rsa -b 1024
ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE50UnEzKriRoz0D1nsw3cmLy+5ttE9+lpa4CiQoTVX1"
ECDSA521 = ("ecdsa-sha2-nistp521 AAAAE2VjZHNhLXNoYTItbmlzdHA1MjEAAAAIbmlzdHA1MjEAAACFBAHBuzqTfnHeZ87BlRFpJ4JxB1HK0CwaUx5qRJedbF4kf68f"
            "nvJl0KqCZUJ+JGiLkLYeMTof5erTwkw89MpXytNYUwH6bnYalJWY6LKu83/aIdZ0MPkB6fYdVmoOINXkSLcsvreYXz5Y7KaWrcMc00N1Rrg/kSRX3LOy4JeUxMFG6wTgog==")
RSA1024 = ("ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAAAgQCzGxllP/LnrsOYPgKaj2lKVfU6Baw6WhrS2N2rI4cqveWGnj5Ym0mtBO0jRAz3mHDO3DEY+uiMMFgPL/xTkPqg"
           "CMTrnA8p5eCHE7uSAKW9vBOyKezZP2MBGF4f0eHKPA2nKkweJU7R5VE5fd6FSXAZbg6D2embOptKEYYKpylCGQ==")
# the largest RSA key OpenSSH reads (16384 bits), with an exponent written with a leading zero
_N = (1 << 16383) | 0xC0FFEE
RSA16384 = "ssh-rsa " + base64.b64encode(_s(b"ssh-rsa") + _s(b"\0\x01\0\x01") + _s(b"\0" + _N.to_bytes(2048, "big"))).decode()
SK = "sk-ssh-ed25519@openssh.com " + base64.b64encode(
    _s(b"sk-ssh-ed25519@openssh.com") + _s(bytes(range(32))) + _s("ssh:ünï".encode())).decode()



def _ca_pem(name: str) -> str:
    """A self-signed CA certificate in PEM (the metrics site's client CA, the log collector's CA)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM).decode()


CA_PEM = _ca_pem("scrapers' CA")
# the operator's key pair that a report's recovery key is sealed to (`builder recovery-key new`)
RECIPIENT_KEY, _RECIPIENT_PUB = recovery_seal.new_keypair()
RECIPIENT_PEM = _RECIPIENT_PUB.decode()

COMMENTS = [
    "jürgen@ßtraße 🚀",
    "\u202eevil\u202c right-to-left and isolates \u2067x\u2069",  # bidi controls are format characters, not control characters
    "e\u0301\u0301\u0301 combining, ＷＩＤＥ, 漢字, \u200b zero width, \ufeff BOM",
    "  leading spaces and a trailing one ",
    "x" * 4096,
]

HOSTILE: dict[str, Any] = {
    "hostname": LONGEST_HOST_NAME,
    "network": {
        "interfaces": ["x_.-9_.-9_.-9zz", "52:54:00:12:34:57"],
        "dhcp": True,
        "addresses": ["192.168.100.200/24", "2001:db8:ffff:ffff:ffff:ffff:ffff:fffe/64"],
        "gateways": ["192.168.100.254", "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff", "fe80::ffff:ffff:ffff:ffff"],
        "dns": ["255.255.255.255", "2001:db8:ffff:ffff:ffff:ffff:ffff:aaaa"],
        "domains": [LONGEST_DNS, "a"],
        "ntp": [LONGEST_DNS, "2001:db8:ffff:ffff:ffff:ffff:ffff:bbbb"],
        "mtu": 9216,
        "bond": "active-backup",
        "vlan": 4094,
    },
    "ssh": {"authorized_keys": [f"{ED25519} {COMMENTS[0]}", f"{ECDSA521} {COMMENTS[1]}", f"{RSA1024} {COMMENTS[2]}",
                                f"{RSA16384} {COMMENTS[3]}", f"{SK} {COMMENTS[4]}", ED25519]},
    "proxy": {
        "hostname": LONGEST_DNS,
        "allowed_cidrs": ["2001:db8:ffff:ffff:ffff:ffff:ffff:fff0/124", "0.0.0.0/0"],
        "acme_email": "o.p+s_1-x@" + LONGEST_DNS[10:],
    },
    "update": {"url": "https://" + LONGEST_DNS + ":65535/" + "a._~-/" * 100,
               "maintenance_windows": [{"start": "23:59", "duration_min": 1440, "days": ["sun", "mon"]}]},
    "metrics": {"allowed_cidrs": ["2001:db8:ffff:ffff:ffff:ffff:ffff:fff0/124", "0.0.0.0/0"], "client_ca": CA_PEM + CA_PEM},
    "logs": {"upload_url": "https://" + LONGEST_DNS + ":65535/" + "l._~-/" * 100, "upload_ca": CA_PEM},
    "attestation": {"ek_ca": CA_PEM + CA_PEM, "accept_software_tpm": True},
    "report": {"url": "https://" + LONGEST_DNS + ":65535/" + "r._~-/" * 100, "ca": CA_PEM + CA_PEM,
               "recovery_recipient": RECIPIENT_PEM},
    "weights": {"source": "https://" + LONGEST_DNS + ":443/" + "w._~-/" * 100},
    "target": {
        "serial": "S" + " ._:/+-" * 9,
        "model": "M" + "+-/:. _" * 9,
        "wwn": "nvme." + "0123456789abcdef-" * 7 + "0",
        "by_path": "/dev/disk/by-path/pci-0000:41:00.0-" + "nvme-1:._" * 10 + "x" * 2,
        "min_size_gib": 1,
        "max_size_gib": 1048576,
        "wipe_existing_data": True,
    },
}


def string_leaves(doc: Any, prefix: str = "") -> Iterator[tuple[str, list[Any] | dict[str, Any], str | int]]:
    """(key as the loader names it, the container, the index in it) of every string in DOC."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc)
    for k, v in items:
        key = f"{prefix}.{k}" if isinstance(doc, dict) and prefix else str(k) if isinstance(doc, dict) else f"{prefix}[{k}]"
        if isinstance(v, str):
            yield key, doc, k
        elif isinstance(v, dict | list):
            yield from string_leaves(v, key)


def string_fields(cls: type = install_plan.Plan, prefix: str = "") -> set[str]:
    """Every field of the plan's dataclasses that holds strings (a list of them counts once)."""
    out = set()
    for f in dataclasses.fields(cls):
        tp, key = typing.get_type_hints(cls)[f.name], f"{prefix}.{f.name}" if prefix else f.name
        if typing.get_origin(tp) in (types.UnionType, typing.Union):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if dataclasses.is_dataclass(tp):
            out |= string_fields(typing.cast(type, tp), key)
        elif tp is str or (typing.get_origin(tp) is tuple and typing.get_args(tp)[0] is str):
            out.add(key)
        elif typing.get_origin(tp) is tuple and dataclasses.is_dataclass(typing.get_args(tp)[0]) and string_fields(typing.get_args(tp)[0]):
            out.add(key)  # a list of tables with strings (maintenance windows): the loader names them KEY[i].FIELD
    return out


def every_field_set(value: Any, prefix: str = "") -> list[str]:
    """The fields of VALUE (a dataclass tree) left at their defaults: none, for HOSTILE."""
    left = []
    for f in dataclasses.fields(value):
        v, key = getattr(value, f.name), f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(v):
            left += every_field_set(v, key)
        elif f.default is not dataclasses.MISSING and v == f.default:
            left.append(key)
    return left
