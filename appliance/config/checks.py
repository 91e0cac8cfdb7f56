# SPDX-License-Identifier: MIT
"""The checks on single values of the configuration and the install plan (the schema's field checks).

Each check returns None when the value is good, else a hint saying what a good value is.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re

from appliance import schema
from appliance.schema import Check

_DNS_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)\Z")
IMAGE_NAME = re.compile(r"^[a-z0-9]+([._-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*\Z")
# The domain in lower case, as is_dns_name: the form the Caddyfile takes (caddyfile.py checks with this).
EMAIL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*@[a-z0-9-]+(\.[a-z0-9-]+)+")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
CAPABILITY = re.compile(r"^[A-Z_]+\Z")
SIZE = re.compile(r"^[0-9]+[kmg]\Z")
URL_PATH = re.compile(r"^/[A-Za-z0-9._~/-]*\Z")
# an HTTP header name: letters, digits and '-' (RFC 9110's token, narrowed: it goes into a Caddyfile)
HEADER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,63}\Z")
# Characters that would let a value break out of a line in a generated unit, Caddyfile or
# sources file.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029{}\"'`$\\;]")  # C0, C1 and Unicode line breaks too


def is_dns_name(value: str) -> str | None:
    labels = value.split(".")
    if len(value) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        return "a DNS name: lower-case letters, digits and '-', labels joined by '.', e.g. appliance.example.net"
    return None


# The kernel's HOST_NAME_MAX: sethostname() refuses a longer name (appliance-host sets the plan's).
HOST_NAME_MAX = 64


def is_host_name(value: str) -> str | None:
    """A name the host itself can take: a DNS name of at most HOST_NAME_MAX characters."""
    if is_dns_name(value) is not None or len(value) > HOST_NAME_MAX:
        return f"a DNS name of at most {HOST_NAME_MAX} characters (the kernel's limit for a host name), e.g. gpu-07.example.net"
    return None


def is_email(value: str) -> str | None:
    return None if EMAIL.fullmatch(value) else "an e-mail address such as ops@example.net (its domain in lower case)"


def pattern(regex: re.Pattern[str], hint: str) -> Check:
    return lambda value: None if regex.fullmatch(value) else hint


# ------------------------------------------------------------------------------ SSH public keys

# The key types a plan or appliance.toml may carry, and what each blob holds after its type name.
SSH_KEY_TYPES = ("ssh-ed25519", "sk-ssh-ed25519@openssh.com", "ssh-rsa",
                 "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521")
SSH_KEY_HINT = "an OpenSSH public key line as ssh-keygen writes it, e.g. ssh-ed25519 AAAA... user@host"
_SSH_LINE = re.compile(r" *([^ ]+) +([^ ]+)(?: +(.*))?\Z", re.S)  # as sshd and ssh-keygen split it
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}\Z", re.ASCII)
CONTROL = schema.CONTROL
# OpenSSH's bounds (sshkey.c, sshbuf-getput-crypto.c): RSA moduli of 1024 to 16384 bits, bignums of
# at most 2048 bytes (one more for a leading zero); for ECDSA (coordinate bytes, bits of the order).
_RSA_BITS = (1024, 16384)
_MAX_BIGNUM = 16384 // 8
_CURVES = {"nistp256": (32, 256), "nistp384": (48, 384), "nistp521": (66, 521)}


class _Blob:
    """A key blob read as RFC 4251 strings (a 4-byte big-endian length, then that many bytes)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def string(self, what: str) -> bytes:
        if len(self.data) - self.at < 4:
            raise ValueError(f"the key ends before its {what}")
        size = int.from_bytes(self.data[self.at:self.at + 4], "big")
        if size > len(self.data) - self.at - 4:
            raise ValueError(f"the key's {what} runs past its end")
        self.at += 4 + size
        return self.data[self.at - size:self.at]

    def mpint(self, what: str) -> int:
        raw = self.string(what)
        if raw and raw[0] & 0x80:
            raise ValueError(f"the key's {what} is negative")
        if len(raw) > _MAX_BIGNUM + 1 or (len(raw) == _MAX_BIGNUM + 1 and raw[0]):
            raise ValueError(f"the key's {what} is too large")
        return int.from_bytes(raw, "big")

    def end(self) -> None:
        if self.at != len(self.data):
            raise ValueError("the key has bytes after its end")


def _ecdsa_point(curve: str, point: bytes) -> None:
    """What OpenSSH checks of an ECDSA public key: uncompressed, on the curve, as sshkey_ec_validate_public."""
    size, order_bits = _CURVES[curve]
    if len(point) != 1 + 2 * size or point[0] != 4:
        raise ValueError(f"the key's point is not an uncompressed {curve} point")
    x, y = int.from_bytes(point[1:1 + size], "big"), int.from_bytes(point[1 + size:], "big")
    if x.bit_length() <= order_bits // 2 or y.bit_length() <= order_bits // 2:
        raise ValueError("the key's point is not a valid public key")
    from cryptography.hazmat.primitives.asymmetric import ec  # imported only for an ECDSA key

    named: ec.EllipticCurve = {"nistp256": ec.SECP256R1(), "nistp384": ec.SECP384R1(), "nistp521": ec.SECP521R1()}[curve]
    try:
        ec.EllipticCurvePublicKey.from_encoded_point(named, point)
    except ValueError:
        raise ValueError(f"the key's point is not on {curve}") from None


def _mpint_bytes(value: int) -> bytes:
    return value.to_bytes((value.bit_length() + 8) // 8, "big") if value else b""


def ssh_key_blob(line: str) -> tuple[str, bytes, str]:
    """(type, blob, comment) of an authorized key line, read as OpenSSH reads one (sshkey_read: the
    type, the base64 of a blob that begins with the same type, the rest a comment); ValueError
    saying what is wrong when OpenSSH would refuse it, or when the comment holds control characters.
    The blob is the key as OpenSSH writes it again, the one its fingerprint is of."""
    m = _SSH_LINE.fullmatch(line)
    if not m:
        raise ValueError("not a key type, a space and the key in base64")
    kind, text, comment = m.group(1), m.group(2), m.group(3) or ""
    if kind not in SSH_KEY_TYPES:
        raise ValueError(f"{schema.shown(kind, 40)} is not a key type this appliance takes: {', '.join(SSH_KEY_TYPES)}")
    try:
        # strict: the alphabet, the padding and zero bits past the last byte, as OpenSSH's b64_pton
        blob = base64.b64decode(text, validate=True) if _BASE64.fullmatch(text) else None
    except binascii.Error:
        blob = None
    if blob is None or base64.b64encode(blob).decode() != text:
        raise ValueError("the key is not valid base64")
    b = _Blob(blob)
    inner = b.string("type")
    if inner != kind.encode():
        raise ValueError(f"the key is a {inner.decode(errors='replace')!r} key, not {kind!r}")
    if kind in ("ssh-ed25519", "sk-ssh-ed25519@openssh.com"):
        if len(b.string("public key")) != 32:
            raise ValueError("an Ed25519 public key is 32 bytes")
        if kind.startswith("sk-") and b"\0" in b.string("application"):
            raise ValueError("the key's application holds a NUL")
    elif kind == "ssh-rsa":
        e, n = b.mpint("exponent"), b.mpint("modulus")
        if not _RSA_BITS[0] <= n.bit_length() <= _RSA_BITS[1]:
            raise ValueError(f"an RSA key of {n.bit_length()} bits (OpenSSH takes {_RSA_BITS[0]} to {_RSA_BITS[1]})")
        # the numbers as OpenSSH writes them again (no leading zeros): what its fingerprint is of
        blob = b"".join(len(x).to_bytes(4, "big") + x for x in (kind.encode(), *(_mpint_bytes(v) for v in (e, n))))
    else:
        curve = kind.removeprefix("ecdsa-sha2-")
        if b.string("curve") != curve.encode():
            raise ValueError(f"the key's curve is not {curve}")
        _ecdsa_point(curve, b.string("point"))
    b.end()
    if CONTROL.search(comment):
        raise ValueError("the comment holds control characters")
    return kind, blob, comment


def is_ssh_key(value: str) -> str | None:
    try:
        ssh_key_blob(value)
    except ValueError as e:
        return f"{SSH_KEY_HINT} ({e})"
    return None


def is_header_name(value: str) -> str | None:
    """"" (none) or an HTTP header name."""
    return None if value == "" or HEADER_NAME.fullmatch(value) else "an HTTP header name such as X-Session-Id"


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


def is_https_url(value: str) -> str | None:
    if value == "" or (value.startswith("https://") and is_url(value) is None):
        return None
    return "an https:// URL such as https://logs.example.net:19532, or \"\""


# One or more PEM certificates; a CA bundle of a thousand certificates is far beyond any real one.
MAX_PEM_BYTES = 256 * 1024
_PEM_BLOCK = re.compile(r"-----BEGIN CERTIFICATE-----\n[A-Za-z0-9+/=\n]+-----END CERTIFICATE-----\n?")


def is_pem_certificates(value: str) -> str | None:
    """"" or one or more X.509 certificates in PEM, nothing else (the text lands in a file the proxy
    or systemd-journal-upload reads as a CA bundle)."""
    if value == "":
        return None
    hint = "one or more PEM certificates (-----BEGIN CERTIFICATE----- ...), nothing else, or \"\""
    text = value if value.endswith("\n") else value + "\n"
    if len(text) > MAX_PEM_BYTES or _PEM_BLOCK.sub("", text).strip():
        return hint
    from cryptography import x509  # only where a certificate is given

    try:
        for block in _PEM_BLOCK.finditer(text):
            x509.load_pem_x509_certificate(block.group(0).encode())
    except ValueError:
        return hint
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


def number_text(value: float) -> str:
    """VALUE as a hint writes it: a whole number in full (1048576, not 1.04858e+06)."""
    return str(int(value)) if value == int(value) else f"{value:g}"


def between(low: float, high: float) -> Check:
    return lambda value: None if low <= value <= high else f"a number from {number_text(low)} to {number_text(high)}"


positive = between(1, schema.MAX_INT)


def parse_decimal(text: str) -> float | None:
    """TEXT as a plain decimal number (ASCII digits, an optional fraction), else None."""
    return float(text) if _DECIMAL.fullmatch(text) else None


def is_slot_size(value: float) -> str | None:
    # whole MiB: the partitions systemd-repart makes and the hash tree sized for them stay aligned
    if not 1 / 64 <= value <= MAX_GIB or value * 1024 != int(value * 1024):
        return f"a size in GiB that is a whole number of MiB, from 0.015625 (16 MiB) to {number_text(MAX_GIB)}, e.g. 40 or 0.0625"
    return None


# An engine layout: REPLICASxTP, e.g. 8x1 (eight single-GPU engines) or 1x8 (one engine, tensor
# parallel 8). Tensor parallel sizes are the ones an MI300X platform's XGMI mesh splits evenly.
LAYOUT = re.compile(r"^([1-8])x(1|2|4|8)\Z")
LAYOUT_PRESETS = ("1x1", "2x1", "1x2", "8x1", "4x2", "2x4", "1x8")
MAX_GPUS = 8  # an MI300X platform (OAM baseboard) holds eight


def is_layout(value: str) -> str | None:
    if LAYOUT.fullmatch(value):
        return None
    return f"REPLICASxTP: replicas (1 to {MAX_GPUS}) x tensor parallel size (1, 2, 4 or 8), e.g. " + ", ".join(LAYOUT_PRESETS)


def is_port(value: int) -> str | None:
    return None if 0 < value < 65536 else "a TCP port between 1 and 65535"
