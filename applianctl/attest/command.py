# SPDX-License-Identifier: MIT
"""`applianctl attest --nonce HEX [--json]`: a quote of this appliance's TPM over a verifier's nonce
(PCRs 7 and 11, with the firmware's event log), as appliance-attest.service answers it on the
metrics site; `applianctl attest identity [--json]`: the TPM's EK and the appliance's AK (made and
persisted when missing: the installer enrolls both at install), what `builder attest enroll` reads."""

from __future__ import annotations

import argparse
import base64
import json
import re
from typing import TYPE_CHECKING

from appliance import cli_help
from appliance.errors import UserError

if TYPE_CHECKING:
    from appliance.attest.evidence import Evidence, Identity

_HEX64 = re.compile(r"^[0-9a-fA-F]{64}\Z")


def _print_json(model: Identity | Evidence) -> None:
    from appliance.attest.evidence import dump

    print(json.dumps(dump(model), indent=2, sort_keys=True))


def _certificate_line(certificate_b64: str) -> str:
    if not certificate_b64:
        return "none in the TPM (a verifier must accept this TPM by its EK alone)"
    from cryptography import x509

    try:
        cert = x509.load_der_x509_certificate(base64.b64decode(certificate_b64))
    except ValueError:
        return "present, but not a DER X.509 certificate"
    return f"issued by {cert.issuer.rfc4514_string()} to {cert.subject.rfc4514_string() or '(no subject)'}"


def cmd_identity(args: argparse.Namespace) -> int:
    from appliance import tpm_keys
    from applianctl.attest import tpm

    ident = tpm.identity()
    if args.json:
        _print_json(ident)
        return 0
    print(f"EK          sha256:{tpm_keys.ek_fingerprint(ident.ek_public)} (persistent at {tpm_keys.hex_handle(tpm_keys.EK_HANDLE)})")
    print(f"certificate {_certificate_line(ident.ek_certificate)}")
    print(f"AK          name {ident.ak_name} (persistent at {tpm_keys.hex_handle(tpm_keys.AK_HANDLE)})")
    return 0


def cmd_quote(args: argparse.Namespace) -> int:
    from applianctl.attest import tpm

    evidence = tpm.quote(bytes.fromhex(args.nonce))
    if args.json:
        _print_json(evidence)
        return 0
    print(f"nonce       {evidence.nonce}")
    for pcr in evidence.pcrs:
        print(f"PCR {pcr.index:<7} sha256:{pcr.sha256}")
    print(f"AK          name {evidence.ak_name}")
    print(f"quote       {len(base64.b64decode(evidence.quote))} bytes, signed ({len(base64.b64decode(evidence.signature))} bytes)")
    log = len(base64.b64decode(evidence.event_log))
    print(f"event log   {log} bytes" if log else "event log   none (this machine's firmware left none: PCR 7 cannot be replayed)")
    return 0


def main(args: argparse.Namespace) -> int:
    if args.what == "identity":
        if args.nonce is not None:
            raise UserError("`applianctl attest identity` takes no --nonce", hint="quote with `applianctl attest --nonce HEX`")
        return cmd_identity(args)
    if args.nonce is None:
        raise UserError("attest: a quote needs the verifier's nonce",
                        hint="applianctl attest --nonce HEX (64 hex digits: openssl rand -hex 32), or `applianctl attest identity`")
    if not _HEX64.match(args.nonce):
        raise UserError(f"--nonce {args.nonce[:80]!r}: not 64 hexadecimal digits",
                        hint="a nonce is 32 random bytes in hex: openssl rand -hex 32")
    return cmd_quote(args)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = cli_help.verb_parser(
        sub, "attest", "quote the TPM over a verifier's nonce, or show the TPM's identity (EK and AK)",
        examples=["applianctl attest --nonce 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
                  "applianctl attest --nonce 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 --json",
                  "applianctl attest identity", "applianctl attest identity --json"],
        exit_codes=[cli_help.OK, cli_help.BAD_INPUT],
        details="A quote is signed inside the TPM by the attestation key (AK) over PCRs 7 and 11 (sha256) and the "
                "nonce; it carries the firmware's event log, from which a verifier replays PCR 7. The fleet's "
                "verifier asks the same through the metrics site (appliance-attest.service): `builder attest`.",
    )
    p.add_argument("what", nargs="?", choices=("identity",), metavar="identity",
                   help="show the EK (fingerprint, certificate) and the AK (name) instead of quoting")
    p.add_argument("--nonce", metavar="HEX", help="the verifier's nonce: 32 bytes, 64 hex digits")
    p.add_argument("--json", action="store_true", help="print the evidence (or the identity) as the service answers it")
    p.set_defaults(func=main)
