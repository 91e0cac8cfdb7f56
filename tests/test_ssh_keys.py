# SPDX-License-Identifier: MIT
"""SSH public keys in an install plan (and appliance.toml) are read as OpenSSH reads them: keys made
by the real ssh-keygen and corrupted in every way a blob can be are judged by `ssh-keygen -l -f`
and by appliance.config.checks alike; the one difference is that a comment with control
characters, which OpenSSH takes, is refused (it would reach the installer's console)."""

from __future__ import annotations

import base64
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from appliance.config import checks
from appliance.errors import ConfigError
from appliance.signed import install_plan
from installer import install

pytestmark = pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs ssh-keygen (openssh-client: make setup)")

ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _s(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _mpint(n: int) -> bytes:
    return _s(n.to_bytes((n.bit_length() + 8) // 8, "big") if n else b"")


def _strings(blob: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(blob):
        size = struct.unpack(">I", blob[at:at + 4])[0]
        out.append(blob[at + 4:at + 4 + size])
        at += 4 + size
    return out


def _line(kind: str, blob: bytes, comment: str | None = "ops@example.net") -> str:
    return f"{kind} {base64.b64encode(blob).decode()}" + (f" {comment}" if comment is not None else "")


def _ssh_keygen(line: str, tmp: Path) -> tuple[bool, str]:
    """(accepted, fingerprint) of LINE as `ssh-keygen -l -f` sees it."""
    path = tmp / "key.pub"
    path.write_bytes(line.encode() + b"\n")
    proc = subprocess.run(["ssh-keygen", "-l", "-f", str(path)], capture_output=True, text=True, timeout=30, check=False)
    return proc.returncode == 0, proc.stdout.split()[1] if proc.returncode == 0 else ""


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, bytes]]:
    """ssh-keygen's own keys: name -> (type, blob)."""
    tmp = tmp_path_factory.mktemp("ssh-keys")
    out = {}
    for name, args in {"ed25519": ["-t", "ed25519"], "rsa": ["-t", "rsa", "-b", "1024"], "ecdsa256": ["-t", "ecdsa", "-b", "256"],
                       "ecdsa384": ["-t", "ecdsa", "-b", "384"], "ecdsa521": ["-t", "ecdsa", "-b", "521"]}.items():
        subprocess.run(["ssh-keygen", "-q", *args, "-N", "", "-C", "ops@example.net", "-f", str(tmp / name)], check=True, timeout=60)
        kind, text, _ = (tmp / f"{name}.pub").read_text().split(" ", 2)
        out[name] = (kind, base64.b64decode(text))
    pk = _strings(out["ed25519"][1])[1]
    sk = "sk-ssh-ed25519@openssh.com"
    out["sk-ed25519"] = (sk, _s(sk.encode()) + _s(pk) + _s(b"ssh:"))  # ssh-keygen makes these only with a FIDO token
    return out


Corrupt = Callable[[str, bytes], str]


def _b64(f: Callable[[str], str]) -> Corrupt:
    """A change to the base64 text of the key."""
    def corrupt(kind: str, blob: bytes) -> str:
        text = base64.b64encode(blob).decode()
        return f"{kind} {f(text)} ops@example.net"
    return corrupt


def _flip_last_bits(text: str) -> str:
    core = text.rstrip("=")
    return core[:-1] + ALPHABET[ALPHABET.index(core[-1]) ^ 1] + text[len(core):]


def _other_type(kind: str) -> str:
    return "ssh-rsa" if kind != "ssh-rsa" else "ssh-ed25519"


GENERIC: dict[str, Corrupt] = {
    "as made": lambda k, b: _line(k, b),
    "no comment": lambda k, b: _line(k, b, None),
    "a comment in Unicode": lambda k, b: _line(k, b, "jürgen 🚀 \u202e ünïcödé"),
    "two spaces between the fields": lambda k, b: _line(k, b).replace(" ", "  "),
    "a space before the type": lambda k, b: " " + _line(k, b),
    "base64 without its padding": _b64(lambda t: t.rstrip("=") if t.endswith("=") else t[:-1]),
    "base64 with a '=' too many": _b64(lambda t: t + "="),
    "base64 with set bits past the last byte": _b64(_flip_last_bits),
    "base64 with a '*'": _b64(lambda t: t[:8] + "*" + t[9:]),
    "base64 with a '=' inside": _b64(lambda t: t[:8] + "=" + t[8:]),
    "base64 cut short by 4 characters": _b64(lambda t: t[:-4] if not t.endswith("=") else t[:-8] + t[-4:]),
    "the line's type not the blob's": lambda k, b: _line(_other_type(k), b),
    "the blob's type not the line's": lambda k, b: _line(k, _s(_other_type(k).encode()) + b[4 + len(k):]),
    "a byte after the blob's end": lambda k, b: _line(k, b + b"\0"),
    "an empty string after the blob's end": lambda k, b: _line(k, b + _s(b"")),
    "the blob cut by a byte": lambda k, b: _line(k, b[:-1]),
    "the blob's first length too long": lambda k, b: _line(k, b"\xff\xff\xff\xff" + b[4:]),
    "only the blob's type": lambda k, b: _line(k, _s(k.encode())),
    "a type in capitals": lambda k, b: _line(k.upper(), b),
    "a type this appliance does not take": lambda k, b: _line("ssh-dss", b),
    "no base64": lambda k, b: k,
}


def _rsa(e: bytes, n: bytes) -> bytes:
    return _s(b"ssh-rsa") + e + n


def _ecdsa(kind: str, curve: bytes, point: bytes) -> bytes:
    return _s(kind.encode()) + _s(curve) + _s(point)


PRIMES = {b"nistp256": 2**256 - 2**224 + 2**192 + 2**96 - 1, b"nistp384": 2**384 - 2**128 - 2**96 + 2**32 - 1, b"nistp521": 2**521 - 1}


def _small_x(curve: bytes, point: bytes) -> bytes:
    """A point on the curve of POINT (y^2 = x^3 - 3x + b) with the smallest x there is: on the curve,
    yet refused by OpenSSH (sshkey_ec_validate_public wants x and y of more than half the order's bits)."""
    p, size = PRIMES[curve], (len(point) - 1) // 2
    x0, y0 = int.from_bytes(point[1:1 + size], "big"), int.from_bytes(point[1 + size:], "big")
    b = (y0 * y0 - x0**3 + 3 * x0) % p
    for x in range(1, 1000):
        rhs = (x**3 - 3 * x + b) % p
        y = pow(rhs, (p + 1) // 4, p)  # p = 3 (mod 4) for all three curves
        if y * y % p == rhs:
            return b"\4" + x.to_bytes(size, "big") + y.to_bytes(size, "big")
    raise AssertionError("no small x")


PER_TYPE: dict[str, dict[str, Callable[[str, list[bytes]], bytes]]] = {
    "ed25519": {
        "a 31-byte key": lambda k, p: _s(p[0]) + _s(p[1][:31]),
        "a 33-byte key": lambda k, p: _s(p[0]) + _s(p[1] + b"\0"),
    },
    "sk-ed25519": {
        "no application": lambda k, p: _s(p[0]) + _s(p[1]),
        "a 31-byte key": lambda k, p: _s(p[0]) + _s(p[1][:31]) + _s(p[2]),
        "an application with a NUL": lambda k, p: _s(p[0]) + _s(p[1]) + _s(b"ssh:\0x"),
        "an application in UTF-8": lambda k, p: _s(p[0]) + _s(p[1]) + _s("ssh:ünï".encode()),
    },
    "rsa": {
        "a negative exponent": lambda k, p: _rsa(_s(b"\x81"), _s(p[2])),
        "an exponent with a leading zero": lambda k, p: _rsa(_s(b"\0" + p[1]), _s(p[2])),
        "a negative modulus": lambda k, p: _rsa(_s(p[1]), _s(p[2].lstrip(b"\0"))),
        "a modulus of 1023 bits": lambda k, p: _rsa(_s(p[1]), _mpint(int.from_bytes(p[2], "big") >> 1)),
        "a modulus of 16384 bits": lambda k, p: _rsa(_s(p[1]), _mpint((1 << 16383) | int.from_bytes(p[2], "big"))),
        "a modulus of 16385 bits": lambda k, p: _rsa(_s(p[1]), _mpint((1 << 16384) | int.from_bytes(p[2], "big"))),
        "no modulus": lambda k, p: _rsa(_s(p[1]), b""),
        "an empty modulus": lambda k, p: _rsa(_s(p[1]), _s(b"")),
    },
    **{f"ecdsa{bits}": {
        "another curve's name": lambda k, p: _ecdsa(k, b"nistp256" if p[1] != b"nistp256" else b"nistp384", p[2]),
        "a compressed point": lambda k, p: _ecdsa(k, p[1], bytes([2 + (p[2][-1] & 1)]) + p[2][1:1 + (len(p[2]) - 1) // 2]),
        "a point in hybrid form": lambda k, p: _ecdsa(k, p[1], bytes([6 + (p[2][-1] & 1)]) + p[2][1:]),
        "a point off the curve": lambda k, p: _ecdsa(k, p[1], p[2][:-1] + bytes([p[2][-1] ^ 1])),
        "a point a byte short": lambda k, p: _ecdsa(k, p[1], p[2][:-1]),
        "the point at infinity": lambda k, p: _ecdsa(k, p[1], b"\0"),
        "a point with a small x": lambda k, p: _ecdsa(k, p[1], _small_x(p[1], p[2])),
        "no point": lambda k, p: _s(k.encode()) + _s(p[1]),
    } for bits in (256, 384, 521)},
}


def _cases(generated: dict[str, tuple[str, bytes]]) -> list[tuple[str, str]]:
    cases = []
    for name, (kind, blob) in generated.items():
        cases += [(f"{name}: {what}", f(kind, blob)) for what, f in GENERIC.items()]
        parts = _strings(blob)
        cases += [(f"{name}: {what}", _line(kind, f(kind, parts))) for what, f in PER_TYPE[name].items()]
    return cases


@pytest.mark.programs
def test_the_keys_ssh_keygen_takes_pass_and_the_keys_it_refuses_are_refused(generated: dict[str, tuple[str, bytes]],
                                                                              tmp_path: Path) -> None:
    verdicts = {"pass": 0, "refused": 0}
    for what, line in _cases(generated):
        theirs, fingerprint = _ssh_keygen(line, tmp_path)
        fault = checks.is_ssh_key(line)
        assert (fault is None) == theirs, (what, line[:120], fault)
        if theirs:
            assert install.ssh_fingerprint(line) == fingerprint, what  # the summary's fingerprint is ssh-keygen's
        verdicts["pass" if theirs else "refused"] += 1
    assert verdicts["pass"] >= 20 and verdicts["refused"] >= 80, verdicts


@pytest.mark.programs
@pytest.mark.parametrize("char", ["\x00", "\x0b", "\x1b", "\t", "\x7f", "\x85", "\x9b"])
def test_a_comment_with_a_control_character_is_refused_though_ssh_keygen_takes_it(
        generated: dict[str, tuple[str, bytes]], tmp_path: Path, char: str) -> None:
    kind, blob = generated["ed25519"]
    line = _line(kind, blob, f"ops{char}[2Jexample")
    assert _ssh_keygen(line, tmp_path)[0]
    hint = checks.is_ssh_key(line)
    assert hint is not None and "control characters" in hint


@pytest.mark.programs
def test_a_bad_key_in_a_plan_is_one_line_with_a_hint_before_anything_is_signed(generated: dict[str, tuple[str, bytes]],
                                                                               tmp_path: Path) -> None:
    kind, blob = generated["ed25519"]
    bad = [
        ("ssh-ed25519 AAA ops", "not valid base64"),  # passed `builder plan`, then crashed the installer's summary
        ("ssh-ed25519 AAAA ops", "ends before its type"),
        (_line(kind, _s(kind.encode()) + _s(_strings(blob)[1][:31])), "Ed25519 public key is 32 bytes"),
        (_line("ssh-rsa", blob), "not 'ssh-rsa'"),
    ]
    for line, reason in bad:
        path = tmp_path / "plan.toml"
        path.write_text(f'[ssh]\nauthorized_keys = ["{line}"]\n')
        with pytest.raises(ConfigError) as e:
            install_plan.load_toml(path)
        assert "ssh.authorized_keys[0]" in e.value.message and "\n" not in e.value.message
        assert reason in e.value.hint and e.value.exit_status == 2
    path.write_text(f'[ssh]\nauthorized_keys = ["{_line(kind, blob)}"]\n')
    assert install_plan.load_toml(path).ssh is not None
