"""The checks on single values of the configuration and the install plan (the schema's field checks).

Each check returns None when the value is good, else a hint saying what a good value is.
"""

from __future__ import annotations

import ipaddress
import re

from appliance import schema
from appliance.schema import Check

_DNS_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)\Z")
IMAGE_NAME = re.compile(r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*\Z")
EMAIL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
CAPABILITY = re.compile(r"^[A-Z_]+\Z")
SIZE = re.compile(r"^[0-9]+[kmg]\Z")
URL_PATH = re.compile(r"^/[A-Za-z0-9._~/-]*\Z")
SSH_KEY = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\.com) [A-Za-z0-9+/=]+( [^\n\r]*)?\Z")
# Characters that would let a value break out of a line in a generated unit, Caddyfile or
# sources file.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029{}\"'`$\\;]")  # C0, C1 and Unicode line breaks too


def is_dns_name(value: str) -> str | None:
    labels = value.split(".")
    if len(value) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        return "a DNS name: lower-case letters, digits and '-', labels joined by '.', e.g. appliance.example.net"
    return None


def pattern(regex: re.Pattern[str], hint: str) -> Check:
    return lambda value: None if regex.fullmatch(value) else hint


def is_cidr(value: str) -> str | None:
    try:
        # Written back exactly as parsed: no scope ids (which may carry any text), no padding.
        if "%" in value or str(ipaddress.ip_network(value, strict=True)) != value:
            raise ValueError(value)
    except ValueError:
        return "a network in CIDR notation with no host bits set, e.g. 10.0.0.0/8 or 192.0.2.7/32"
    return None


def is_abs_path(value: str) -> str | None:
    parts = value.split("/")
    # ':' separates a mount's source, target and options (Volume=, AddDevice=)
    if not value.startswith("/") or ".." in parts or _UNSAFE.search(value) or " " in value or ":" in value:
        return "an absolute path without '..', ':', spaces or quotes, e.g. /opt/aiter-configs/table.csv"
    return None


def is_repo_file(value: str) -> str | None:
    parts = value.split("/")
    if value.startswith("/") or ".." in parts or _UNSAFE.search(value) or " " in value or ":" in value or not value:
        return "a path relative to the project root, without '..' or ':', e.g. overlays/demo/file.py"
    return None


def is_url(value: str) -> str | None:
    if value == "":
        return None
    if not re.fullmatch(r"https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._~/-]*)?", value):
        return "an http(s) URL such as https://updates.example.net/appliance/, or \"\""
    return None


def is_weights_source(value: str) -> str | None:
    if value == "" or (value.startswith("/") and is_abs_path(value) is None) or (value.startswith("https://") and is_url(value) is None):
        return None
    return "an https:// URL of a mirror, an absolute directory, or \"\""


def is_arg(value: str) -> str | None:
    if _UNSAFE.search(value.replace("%", "")) or not value:
        return "a non-empty argument without quotes, backslashes, '$', ';', braces or control characters"
    return None


def is_env_value(value: str) -> str | None:
    if _UNSAFE.search(value):
        return "a value without quotes, backslashes, '$', ';', braces or control characters"
    return None


def is_volume(value: str) -> str | None:
    parts = value.split(":")
    if len(parts) != 2 or any(is_abs_path(p) for p in parts):
        return "HOST:CONTAINER, two absolute paths, e.g. /usr:/usr"
    return None


def one_of(*choices: str) -> Check:
    return lambda value: None if value in choices else "one of " + ", ".join(repr(c) for c in choices)


# Numbers are bounded, so that every accepted value renders into a unit as a plain number that
# systemd and podman take as it is (no overflow, no exponent, no inf/NaN).
MAX_GIB = 1048576.0  # 1 PiB
_DECIMAL = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,6})?\Z")  # ASCII digits only: float() also takes '١٢', '1e3', 'inf'


def between(low: float, high: float) -> Check:
    return lambda value: None if low <= value <= high else f"a number from {low:g} to {high:g}"


positive = between(1, schema.MAX_INT)


def parse_decimal(text: str) -> float | None:
    """TEXT as a plain decimal number (ASCII digits, an optional fraction), else None."""
    return float(text) if _DECIMAL.fullmatch(text) else None


def is_slot_size(value: float) -> str | None:
    # whole MiB: the partitions systemd-repart makes and the hash tree sized for them stay aligned
    if not 1 / 64 <= value <= MAX_GIB or value * 1024 != int(value * 1024):
        return f"a size in GiB that is a whole number of MiB, from 0.015625 (16 MiB) to {MAX_GIB:g}, e.g. 40 or 0.0625"
    return None


def is_port(value: int) -> str | None:
    return None if 0 < value < 65536 else "a TCP port between 1 and 65535"
