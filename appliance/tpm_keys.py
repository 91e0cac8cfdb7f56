# SPDX-License-Identifier: MIT
"""The TPM's endorsement key (EK) and the appliance's attestation key (AK), through tpm2-tools: the
installer enrolls them at install (installer/install.py), the device reads them, and makes them
again only when they are missing (applianctl/attest/tpm.py).

- The EK: RSA 2048 from the TCG default template (`tpm2_createek -G rsa`), persistent at
  EK_HANDLE; read when it is there (swtpm_setup and some firmware leave it there), made persistent
  when it is not. Its certificate, when the TPM's maker put one in NV (EK_CERT_NV), as DER.
- The AK: ECC P-256, ECDSA-SHA256, a restricted signing key under the EK (`tpm2_createak`),
  persistent at AK_HANDLE: made once, then read (its TPM2B_PUBLIC and its name are those
  `tpm2_createak -u -n` writes).

Each operation works in a directory of its own (0700, removed after) and flushes the transient
objects and sessions it loaded: between the tools and a swtpm there is no resource manager, and a
TPM has few object slots (on /dev/tpmrm0 the flush is harmless). The TCTI is the tools' own
choice: TPM2TOOLS_TCTI when set (a swtpm in the tests), else the device's /dev/tpmrm0.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from appliance import run
from appliance.errors import UserError

EK_HANDLE = 0x81010001
AK_HANDLE = 0x81010002
EK_CERT_NV = 0x01C00002  # TCG EK Credential Profile: the RSA 2048 EK certificate
TIMEOUT_S = 60.0  # an RSA primary takes seconds on a slow firmware TPM; nothing takes a minute
MAX_KEY_FILE_BYTES = 64 * 1024  # keys, names and a certificate are a few KiB; a TPM NV index at most a few
HINT = ("check that the TPM is on in the firmware setup and reachable (TPM2TOOLS_TCTI, else /dev/tpmrm0), "
        "then run `applianctl attest identity`")
MISSING_HINT = "tpm2-tools is part of the image; on another machine: apt install tpm2-tools"
_HANDLE = re.compile(r"^- (0x[0-9a-fA-F]{1,8})$", re.M)


def tool(argv: Sequence[str | Path], what: str, *, hint: str = HINT) -> run.CompletedProcess[str]:
    """Run one tpm2-tools command; a failure is a UserError naming WHAT with the tool's most telling
    line (the TPM's own error, not the closing "Unable to run ...")."""
    args = [str(a) for a in argv]
    try:
        proc = run.call(args, TIMEOUT_S)
    except FileNotFoundError:
        raise UserError(f"{what}: {args[0]} is not installed", hint=MISSING_HINT) from None
    except run.TimeoutExpired:
        raise UserError(f"{what}: {args[0]} did not finish within {TIMEOUT_S:g} s", hint=hint) from None
    if proc.returncode != 0:
        raise UserError(f"{what} failed: {reason(proc.stderr)}", hint=hint)
    return proc


def reason(stderr: str) -> str:
    """The line of a tool's stderr that says why: the TPM's error code when there is one."""
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("ERROR") and "Unable to run" not in line]
    tpm = [line for line in said if "tpm:" in line]
    best = (tpm or said or lines or ["no message"])[-1]
    return best.removeprefix("ERROR:").strip()[:300]


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    """A directory of this operation's own (0700), removed after; the transient objects and sessions
    loaded meanwhile flushed."""
    directory = Path(tempfile.mkdtemp(prefix="appliance-tpm-"))  # mkdtemp: 0700
    try:
        yield directory
    finally:
        flush()
        shutil.rmtree(directory, ignore_errors=True)


def flush() -> None:
    """Flush every transient object and session from the TPM (best effort: nothing to flush is fine)."""
    with contextlib.suppress(OSError, run.SubprocessError):
        run.call(["tpm2_flushcontext", "-t", "-l", "-s"], TIMEOUT_S)


def flush_session(session: Path, tcti: str | None = None) -> None:
    """Flush the session a tool saved to SESSION (best effort: it may be gone already), through
    TCTI when the session was made through one of its own."""
    if session.exists():
        with contextlib.suppress(OSError, run.SubprocessError):
            run.call(["tpm2_flushcontext", *(["-T", tcti] if tcti else []), session], TIMEOUT_S)


def _handles(kind: str) -> frozenset[int]:
    out = tool(["tpm2_getcap", kind], f"listing the TPM's {kind}").stdout
    return frozenset(int(h, 16) for h in _HANDLE.findall(out))


def persistent_handles() -> frozenset[int]:
    return _handles("handles-persistent")


def nv_indices() -> frozenset[int]:
    return _handles("handles-nv-index")


def _read(path: Path, what: str) -> bytes:
    from appliance.safe_read import read_capped

    data = read_capped(path, MAX_KEY_FILE_BYTES, what=what, hint=HINT)
    if not data:
        raise UserError(f"{what}: tpm2-tools wrote nothing to {path.name}", hint=HINT)
    return data


def der_length(data: bytes) -> bytes:
    """DATA cut after the DER SEQUENCE it starts with: a TPM's NV index is often larger than the
    certificate in it (padded with 0xff or zeros). DATA as it is when it starts with no SEQUENCE."""
    if len(data) < 2 or data[0] != 0x30:
        return data
    first = data[1]
    if first < 0x80:
        head, size = 2, first
    elif first in (0x81, 0x82, 0x83) and len(data) >= 2 + (first & 0x7F):
        count = first & 0x7F
        head, size = 2 + count, int.from_bytes(data[2:2 + count], "big")
    else:
        return data
    return data[:head + size] if head + size <= len(data) else data


def hex_handle(handle: int) -> str:
    return f"0x{handle:08x}"


@dataclass(frozen=True)
class Keys:
    """The EK and the AK as the TPM holds them; MADE: which of "EK", "AK" this call made."""

    ek_pem: str  # SubjectPublicKeyInfo, PEM
    ek_certificate: bytes  # DER, b"" when the TPM has none
    ak_public: bytes  # TPM2B_PUBLIC, as tpm2_createak -u writes it
    ak_name: bytes  # nameAlg || digest, as tpm2_createak -n writes it
    made: tuple[str, ...] = ()

    @property
    def ek_fingerprint(self) -> str:
        return ek_fingerprint(self.ek_pem)


def ek_fingerprint(ek_pem: str) -> str:
    """sha256 of the EK's DER SubjectPublicKeyInfo, hex: what the installer's summary shows and
    what `builder attest enroll` binds a host to."""
    try:
        key = serialization.load_pem_public_key(ek_pem.encode())
    except ValueError:
        raise UserError("the TPM's EK public key is not a PEM public key", hint=HINT) from None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def ak_name() -> bytes:
    """The persistent AK's name (nameAlg || digest); UserError when there is none."""
    with workdir() as d:
        tool(["tpm2_readpublic", "-c", hex_handle(AK_HANDLE), "-n", d / "ak.name", "-o", d / "ak.pub"],
             "reading the TPM's attestation key")
        return _read(d / "ak.name", "the AK's name")


def ensure_keys() -> Keys:
    """The EK (made persistent when absent) with its certificate, and the AK (made under the EK and
    persisted when absent)."""
    made: list[str] = []
    with workdir() as d:
        handles = persistent_handles()
        ek = hex_handle(EK_HANDLE)
        if EK_HANDLE in handles:
            tool(["tpm2_readpublic", "-c", ek, "-f", "pem", "-o", d / "ek.pem"], "reading the TPM's endorsement key")
        else:
            tool(["tpm2_createek", "-c", ek, "-G", "rsa", "-f", "pem", "-u", d / "ek.pem"],
                 "making the TPM's endorsement key persistent")
            made.append("EK")
        ek_pem = _read(d / "ek.pem", "the EK's public key").decode("ascii", "replace")
        certificate = b""
        if EK_CERT_NV in nv_indices():
            tool(["tpm2_nvread", hex_handle(EK_CERT_NV), "-o", d / "ek.crt"], "reading the TPM's EK certificate")
            certificate = der_length(_read(d / "ek.crt", "the EK certificate"))
        if AK_HANDLE in handles:
            tool(["tpm2_readpublic", "-c", hex_handle(AK_HANDLE), "-o", d / "ak.pub", "-n", d / "ak.name"],
                 "reading the TPM's attestation key")
        else:
            tool(["tpm2_createak", "-C", ek, "-c", d / "ak.ctx", "-G", "ecc", "-g", "sha256", "-s", "ecdsa",
                  "-u", d / "ak.pub", "-n", d / "ak.name"], "making the attestation key")
            tool(["tpm2_evictcontrol", "-C", "o", "-c", d / "ak.ctx", hex_handle(AK_HANDLE)],
                 "making the attestation key persistent")
            made.append("AK")
        return Keys(ek_pem, certificate, _read(d / "ak.pub", "the AK's public area"), _read(d / "ak.name", "the AK's name"),
                    tuple(made))
