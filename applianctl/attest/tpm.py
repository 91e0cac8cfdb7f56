# SPDX-License-Identifier: MIT
"""The device's TPM operations for remote attestation, through tpm2-tools (appliance/tpm_keys.py
holds the EK and AK handling the installer shares):

- `identity()`: the EK (its PEM public key and certificate) and the AK (its TPM2B_PUBLIC and name),
  each made persistent when missing (the installer made both at install);
- `quote(nonce)`: a quote by the AK over PCRs 7 and 11 of the sha256 bank with the verifier's nonce
  as its extra data, the PCR values it covers, and the firmware's event log;
- `activate(credential)`: TPM2_ActivateCredential with the persistent AK and EK, so that a verifier
  that sealed a secret to this EK and this AK's name (`tpm2_makecredential`) learns that both live
  in one TPM.

Each operation in a directory of its own, removed after, its transient objects and sessions flushed.
The secret an activation recovers is returned, never printed or logged."""

from __future__ import annotations

import base64
import hashlib
import os
import re
from pathlib import Path

from appliance import paths, tpm_keys
from appliance.attest.evidence import FORMAT, MAX_EVENT_LOG_BYTES, NONCE_BYTES, PCRS, Evidence, Identity, Pcr
from appliance.errors import Refused, UserError
from appliance.safe_read import read_capped

MAX_CREDENTIAL_BYTES = 4096  # tpm2_makecredential's file for an RSA 2048 EK is about 340 bytes
MAX_SECRET_BYTES = 64  # TPM2B_DIGEST: the largest digest of the TPM's hashes
QUOTE_TRIES = 3  # the PCRs the tool reads beside the quote moved (an extend in between): quote again
_PCR_LINE = re.compile(r"^\s+([0-9]{1,2})\s*:\s*0x([0-9A-Fa-f]{64})\s*$", re.M)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def identity() -> Identity:
    """The TPM's EK and the appliance's AK; either made (and persisted) when missing."""
    keys = tpm_keys.ensure_keys()
    return Identity(format=FORMAT, ek_public=keys.ek_pem, ek_certificate=_b64(keys.ek_certificate),
                    ak_public=_b64(keys.ak_public), ak_name=keys.ak_name.hex())


def _ensure_ak() -> None:
    if tpm_keys.AK_HANDLE not in tpm_keys.persistent_handles():
        tpm_keys.ensure_keys()


def pcr_values(stdout: str) -> tuple[Pcr, ...]:
    """The sha256 PCR values tpm2_quote printed (its `pcrs:` section), in index order."""
    _, found, section = stdout.partition("\npcrs:")
    if not found:
        raise UserError("tpm2_quote printed no PCR values", hint=tpm_keys.HINT)
    section = section.split("\n", 1)[1] if "\n" in section else ""
    # the section's lines are indented; the next top-level key ends it
    body = []
    for line in section.splitlines():
        if line and not line[0].isspace():
            break
        body.append(line)
    values = {int(i): v.lower() for i, v in _PCR_LINE.findall("\n".join(body))}
    if tuple(sorted(values)) != tuple(sorted(PCRS)):
        raise UserError(f"tpm2_quote printed PCRs {sorted(values)}, not {list(PCRS)}", hint=tpm_keys.HINT)
    return tuple(Pcr(index=i, sha256=values[i]) for i in sorted(values))


def read_event_log(path: Path | None = None) -> bytes:
    """The firmware's event log (b"" when this machine has none: the verifier then says so)."""
    data = read_capped(paths.TPM_EVENT_LOG if path is None else path, MAX_EVENT_LOG_BYTES,
                       what="the firmware's TPM event log")
    return data or b""


def quote(nonce: bytes, event_log: Path | None = None) -> Evidence:
    """A quote by the AK over PCRS (sha256) with NONCE as its extra data, the values, and the event log."""
    if len(nonce) != NONCE_BYTES:
        raise Refused(f"a nonce of {len(nonce)} bytes: a verifier's nonce is {NONCE_BYTES} random bytes",
                      hint=f"give {NONCE_BYTES * 2} hex digits")
    _ensure_ak()
    selection = "sha256:" + ",".join(str(i) for i in PCRS)
    for _ in range(QUOTE_TRIES):
        with tpm_keys.workdir() as d:
            out = tpm_keys.tool(["tpm2_quote", "-c", tpm_keys.hex_handle(tpm_keys.AK_HANDLE), "-l", selection,
                                 "-q", nonce.hex(), "-g", "sha256", "-m", d / "quote.msg", "-s", d / "quote.sig",
                                 # with -o the tool prints the values it read beside the quote
                                 "-o", d / "quote.pcrs"],
                                "quoting the PCRs").stdout
            message = read_capped(d / "quote.msg", tpm_keys.MAX_KEY_FILE_BYTES, what="the quote") or b""
            signature = read_capped(d / "quote.sig", tpm_keys.MAX_KEY_FILE_BYTES, what="the quote's signature") or b""
        pcrs = pcr_values(out)
        # TPMS_ATTEST of a quote ends with the digest of the quoted PCRs: the values read beside it
        # are those it covers only when it ends with their digest
        if message.endswith(hashlib.sha256(b"".join(bytes.fromhex(p.sha256) for p in pcrs)).digest()):
            break
    else:
        raise UserError(f"the PCRs moved during each of {QUOTE_TRIES} quotes", hint="try again in a moment")
    if not message or not signature:
        raise UserError("tpm2_quote wrote no quote or no signature", hint=tpm_keys.HINT)
    return Evidence(format=FORMAT, nonce=nonce.hex(), pcrs=pcrs, quote=_b64(message), signature=_b64(signature),
                    ak_name=tpm_keys.ak_name().hex(), event_log=_b64(read_event_log(event_log)))


def session_tcti(configured: str | None) -> str | None:
    """The TCTI for activation's policy session, which spans three tools: the kernel's resource
    manager (/dev/tpmrm0) flushes a client's sessions when its process exits (the session tests of
    tpm2-tools run with tpm2-abrmd only: tpm2-software/tpm2-tools#2700), so these tools talk to the
    TPM itself (/dev/tpm0, where a saved session outlives its tool); None: the configured TCTI
    keeps sessions (a swtpm, the tests)."""
    tcti = configured or "device:/dev/tpmrm0"
    found = re.fullmatch(r"device:/dev/tpmrm([0-9]+)", tcti)
    return f"device:/dev/tpm{found.group(1)}" if found else None


def activate(credential: bytes) -> bytes:
    """The secret sealed in CREDENTIAL (the file tpm2_makecredential -o writes) for this TPM's EK
    and the AK's name. Refused when it does not open with them (made for another AK or EK, or damaged)."""
    if not 0 < len(credential) <= MAX_CREDENTIAL_BYTES:
        raise Refused(f"a credential of {len(credential)} bytes (at most {MAX_CREDENTIAL_BYTES})",
                      hint="send the file tpm2_makecredential -o wrote, base64")
    _ensure_ak()
    tcti = session_tcti(os.environ.get("TPM2TOOLS_TCTI"))
    direct = ["-T", tcti] if tcti else []
    with tpm_keys.workdir() as d:
        (d / "credential").write_bytes(credential)
        session = d / "session.ctx"
        # the EK's policy: PolicySecret of the endorsement hierarchy (TCG's default EK template)
        tpm_keys.tool(["tpm2_startauthsession", *direct, "--policy-session", "-S", session],
                      "starting a policy session for the EK")
        try:
            tpm_keys.tool(["tpm2_policysecret", *direct, "-S", session, "-c", "e"], "satisfying the EK's policy")
            try:
                tpm_keys.tool(["tpm2_activatecredential", *direct, "-c", tpm_keys.hex_handle(tpm_keys.AK_HANDLE),
                               "-C", tpm_keys.hex_handle(tpm_keys.EK_HANDLE), "-i", d / "credential", "-o", d / "secret",
                               "-P", f"session:{session}"], "activating the credential")
            except UserError as e:
                raise Refused(f"the credential does not open with this TPM's EK and AK ({e.message})",
                              hint="make it with tpm2_makecredential for this TPM's EK and this AK's name "
                                   "(`applianctl attest identity`)") from None
        finally:
            tpm_keys.flush_session(session, tcti)
        secret = read_capped(d / "secret", MAX_SECRET_BYTES, what="the activated secret") or b""
    if not secret:
        raise UserError("tpm2_activatecredential wrote no secret", hint=tpm_keys.HINT)
    return secret
