# SPDX-License-Identifier: MIT
"""Status part `proxy`: what a client gets, not only the unit's state.

One TLS connection to the public port on loopback (the proxy admits the appliance's own loopback
besides allowed_cidrs): is anything listening, is its certificate trusted by the appliance CA
(ACME mode: the system's) for the configured host name, when does it expire, and does one request
through it (the engine's health path, else /v1/models) reach the engine. Standard library only
(ssl, http.client): this runs inside status's deadline.
"""

from __future__ import annotations

import dataclasses
import datetime
import http.client
import socket
import ssl
import time
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config import Config
from applianctl.status import probes
from applianctl.status.document import Certificate, ProxyDetails, ProxyRequest
from applianctl.status.probes import DEGRADED, DOWN, NOT_CONFIGURED, OK, Part, Sources

CERT_WARN_DAYS = 14  # the server certificate is renewed by appliance-tls.timer well before this


def request_path(config: Config) -> str | None:
    """The one path the probe asks for through the proxy: one the allowlist forwards."""
    for path in (config.engine.health.path, "/v1/models"):
        if path in config.proxy.allowed_paths:
            return path
    return None


def _context(config: Config, tls_dir: Path) -> tuple[ssl.SSLContext, str]:
    if config.proxy.tls == "internal":
        # Only the appliance CA: loading the system's store as well costs ~80 ms of status's time.
        ca = tls_dir / "ca.crt"
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the chain and the host name
        ctx.load_verify_locations(cafile=str(ca))
        return ctx, str(ca)
    return ssl.create_default_context(), "the system's CAs"


def _names(cert: dict[str, Any]) -> list[str]:
    return [value for kind, value in cert.get("subjectAltName", ()) if kind in ("DNS", "IP Address")]


def probe_proxy(config: Config, src: Sources, tls_dir: Path | None = None, now: datetime.datetime | None = None) -> Part:
    tls_dir = tls_dir or paths.TLS_DIR
    port = config.proxy.https_port
    host = config.proxy.hostname
    url = f"https://{host}:{port}"
    timeout = probes.HTTP_TIMEOUT_S
    details = ProxyDetails(url=url, address=f"{src.proxy_address}:{port}", listening=False)
    try:
        ctx, trust = _context(config, tls_dir)
    except (OSError, ssl.SSLError) as e:
        if config.proxy.tls == "internal" and not (tls_dir / "ca.crt").exists():
            return Part(NOT_CONFIGURED, f"{tls_dir / 'ca.crt'} absent: no appliance CA yet", details)
        return Part(DOWN, f"cannot load the appliance CA: {e}".splitlines()[0], details)
    details = dataclasses.replace(details, trust=trust)
    # Connect to loopback but verify and send SNI for the configured name, as a client would.
    conn = http.client.HTTPSConnection(src.proxy_address, port, timeout=timeout, context=ctx)
    started = time.monotonic()
    try:
        sock = socket.create_connection((src.proxy_address, port), timeout=timeout)
    except ConnectionRefusedError:
        return Part(DOWN, f"nothing listens on port {port}", details)
    except OSError as e:
        return Part(DOWN, f"port {port}: {e.strerror or type(e).__name__}", details)
    details = dataclasses.replace(details, listening=True)
    try:
        conn.sock = ctx.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as e:
        sock.close()
        return Part(DOWN, f"port {port}: certificate not trusted for {host}: {e.verify_message}", details)
    except (OSError, ssl.SSLError) as e:
        sock.close()
        return Part(DOWN, f"port {port}: TLS handshake failed: {e}".splitlines()[0], details)
    path = request_path(config)
    try:
        cert = conn.sock.getpeercert() or {}
        after = datetime.datetime.fromtimestamp(ssl.cert_time_to_seconds(str(cert["notAfter"])), datetime.UTC)
        days = (after - (now or datetime.datetime.now(datetime.UTC))).total_seconds() / 86400
        details = dataclasses.replace(details, certificate=Certificate(names=tuple(_names(cert)), not_after=after.isoformat(),
                                                                       days_left=int(days)))
        if path is None:
            return Part(OK, "", details)
        conn.request("GET", path, headers={"Host": host if port == 443 else f"{host}:{port}", "Connection": "close"})
        response = conn.getresponse()
        response.read(65536)
        asked = ProxyRequest(path=path, status=response.status, elapsed_s=round(time.monotonic() - started, 3))
        details = dataclasses.replace(details, request=asked)
    except TimeoutError:
        return Part(DOWN, f"GET {path} through the proxy: no answer within {timeout:g} s", details)
    except (OSError, http.client.HTTPException, KeyError, ValueError) as e:
        return Part(DOWN, f"GET {path} through the proxy: {type(e).__name__}", details)
    finally:
        conn.close()
    problems = []
    if response.status in (400, 403, 404):
        refused = f"GET {path} through the proxy: HTTP {response.status} (the proxy refused the appliance's own request)"
        return Part(DOWN, refused, details)
    if response.status != 200:
        # 502/503/504: the proxy answers but cannot reach the engine (the engine part says why).
        problems.append(f"GET {path} through the proxy: HTTP {response.status}")
    if days < CERT_WARN_DAYS:
        problems.append(f"the proxy's certificate expires on {after:%Y-%m-%d} ({int(days)} days)")
    return Part(DEGRADED if problems else OK, "; ".join(problems), details)
