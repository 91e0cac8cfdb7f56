# SPDX-License-Identifier: MIT
"""Status part `tls`: the appliance CA (applianctl tls writes it; the proxy's certificate is the
`proxy` part's)."""

from __future__ import annotations

import datetime
from pathlib import Path

from appliance import paths
from appliance.config import Config
from applianctl.status.document import TlsDetails
from applianctl.status.probes import DEGRADED, DOWN, NOT_CONFIGURED, OK, Part

TLS_WARN_DAYS = 30


def probe_tls(config: Config, tls_dir: Path | None = None, now: datetime.datetime | None = None) -> Part:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    path = (tls_dir or paths.TLS_DIR) / "ca.crt"
    mode = config.proxy.tls
    try:
        pem = path.read_bytes()
    except FileNotFoundError:
        why = "the proxy uses ACME certificates" if mode == "acme" else "no appliance CA yet"
        return Part(NOT_CONFIGURED, f"{path} absent: {why}", TlsDetails(mode=mode))
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        return Part(DOWN, f"{path}: not a PEM certificate ({e})".splitlines()[0], TlsDetails(mode=mode))
    fingerprint = cert.fingerprint(hashes.SHA256()).hex(":").upper()
    after = getattr(cert, "not_valid_after_utc", None) or cert.not_valid_after.replace(tzinfo=datetime.UTC)
    now = now or datetime.datetime.now(datetime.UTC)
    days = (after - now).total_seconds() / 86400
    details = TlsDetails(mode=mode, ca_sha256=fingerprint, ca_subject=cert.subject.rfc4514_string(),
                         ca_not_after=after.isoformat(), ca_days_left=int(days))
    if days < 0:
        return Part(DOWN, f"the appliance CA expired on {after:%Y-%m-%d}", details)
    if days < TLS_WARN_DAYS:
        return Part(DEGRADED, f"the appliance CA expires on {after:%Y-%m-%d} ({int(days)} days)", details)
    return Part(OK, "", details)
