# SPDX-License-Identifier: MIT
"""`make bench`, remote attestation: one round trip as the fleet's verifier makes it (a fresh nonce,
HTTPS POST /attest/quote on the proxy's metrics site: the real Caddy on the rendered demo Caddyfile,
the real appliance-attest.service (`applianctl attest-serve`) behind it on a swtpm whose PCRs 7 and
11 hold a boot's measurements (testkit/attest_record.py's), the evidence loaded and checked by
appliance.attest.verify.check to a verdict) against a plain scrape of the same site (GET /metrics,
node_exporter), alternated on new connections. Goal: under 1 s on the software TPM (the ratio is
recorded). Also the verifier's own CPU time per host: time.process_time over many check() calls on
one evidence (goal: under 50 ms, so that one verifier checks a thousand appliances a minute),
against the one ECDSA verification of the quote's signature that no check can skip.

The service's token bucket (one request a second after a burst) is respected between round trips,
outside the timing: the figure is one verifier's round trip, not a flood the service refuses.
"""

from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from appliance import config
from appliance.attest import evidence, tpm_wire, verify
from appliance.caddyfile import render_caddyfile
from applianctl import tls
from applianctl.attest import service
from bench.common import Figure, measured
from bench.metrics import NODE_EXPORTER
from testkit import attest_record, caddy
from testkit.standin import free_port
from testkit.swtpm import running_swtpm

RUNS = 10
CHECKS = 500
ROUND_TRIP_GOAL_S = 1.0
CHECK_CPU_GOAL_S = 0.050


@dataclasses.dataclass(frozen=True)
class _Boot:
    """What the swtpm was made to hold, and what a verifier trusts for it."""

    log: Path
    releases: tuple[verify.ReleasePolicy, ...]
    trust: verify.SecureBootTrust


def _boot(tcti: str, work: Path) -> _Boot:
    """A boot's measurements into the TPM: the firmware's PCR 7 events (Secure Boot on, the fleet's
    db certificate) as the event log says, and a UKI's PCR 11; the release whose policy matches it."""
    tpm = attest_record.Tpm(tcti, work)
    banks = tpm.banks()
    db_cert, third_party = attest_record.certificate("Appliance Secure Boot"), attest_record.certificate("Third-Party CA")
    events = attest_record.firmware_events(secure_boot=True, db_cert=db_cert, third_party=third_party)
    for e in events:
        tpm.extend(e.pcr, e.measured, banks)
    pcr11 = bytes(32)
    for data in attest_record.uki_measurements(dict(attest_record.UKI_FILES)):
        tpm.extend(11, data, banks)
        pcr11 = attest_record.digest("sha256", pcr11 + attest_record.digest("sha256", data))
    log = work / "binary_bios_measurements"
    log.write_bytes(attest_record.write_log(events, banks))
    release = verify.ReleasePolicy("1.0", frozenset({tpm_wire.pcr_policy_digest(11, pcr11)}))
    return _Boot(log, (release,), verify.SecureBootTrust((db_cert, third_party)))


def _https(port: int, ctx: ssl.SSLContext, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    """One request on a new connection (TLS handshake included)."""
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Host": f"appliance.local:{port}", "Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _scrape(port: int, ctx: ssl.SSLContext) -> float:
    start = time.monotonic()
    status, body = _https(port, ctx, "GET", "/metrics")
    seconds = time.monotonic() - start
    if status != 200 or b"node_" not in body:
        raise RuntimeError(f"a scrape answered {status}: {body[:300]!r}")
    return seconds


def _round_trip(port: int, ctx: ssl.SSLContext, ak_public: bytes, boot: _Boot) -> tuple[float, verify.Verdict, evidence.Evidence]:
    """Nonce to verdict: seconds, the verdict, the evidence."""
    start = time.monotonic()
    nonce = os.urandom(evidence.NONCE_BYTES)
    status, body = _https(port, ctx, "POST", "/attest/quote", json.dumps({"nonce": nonce.hex()}).encode())
    if status != 200:
        raise RuntimeError(f"POST /attest/quote answered {status}: {body[:300]!r}")
    ev = evidence.load_evidence(json.loads(body))
    verdict = verify.check(ev, nonce=nonce, ak_public=ak_public, releases=boot.releases, secure_boot=boot.trust)
    return time.monotonic() - start, verdict, ev


def _signature_only(ev: evidence.Evidence, ak_public: bytes) -> None:
    """The quote's ECDSA signature checked by the AK, nothing else: the floor of any check."""
    key = tpm_wire.parse_public(ak_public).key
    sig = tpm_wire.parse_signature(base64.b64decode(ev.signature))
    assert isinstance(key, ec.EllipticCurvePublicKey)
    key.verify(encode_dss_signature(sig.r, sig.s), base64.b64decode(ev.quote), ec.ECDSA(hashes.SHA256()))


def _cpu_per_call(fn: object, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()  # type: ignore[operator]
    return (time.process_time() - start) / calls


def bench_attest(demo: config.Config, runs: int = RUNS, checks: int = CHECKS) -> list[Figure]:
    if not os.access(NODE_EXPORTER, os.X_OK):
        raise RuntimeError(f"{NODE_EXPORTER}: missing (make setup installs prometheus-node-exporter)")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with running_swtpm(tmp) as tcti:
            boot = _boot(tcti, tmp)
            attest_port, node_port, https_port, http_port, metrics_port = (free_port() for _ in range(5))
            env = {**os.environ, "TPM2TOOLS_TCTI": tcti, "APPLIANCE_TPM_EVENT_LOG": str(boot.log), "PYTHONWARNINGS": "ignore"}
            attest_log, node_log = tmp / "attest.log", tmp / "node_exporter.log"
            with attest_log.open("wb") as out:
                attestd = subprocess.Popen([sys.executable, "-m", "applianctl", "attest-serve", "--listen", f"127.0.0.1:{attest_port}"],
                                           env=env, stdout=out, stderr=subprocess.STDOUT)
            with node_log.open("wb") as out:
                node = subprocess.Popen([NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{node_port}"],
                                        stdout=out, stderr=subprocess.STDOUT)
            try:
                caddy.wait_ready("appliance-attest", lambda: caddy.connects(attest_port), attestd, attest_log)
                caddy.wait_ready("node_exporter", lambda: caddy.connects(node_port), node, node_log)
                device = dataclasses.replace(
                    demo, proxy=dataclasses.replace(demo.proxy, https_port=https_port),
                    metrics=dataclasses.replace(demo.metrics, port=metrics_port))
                tls.generate(tmp / "tls", device.proxy.hostname, [], group="appliance-no-such-group")
                sock = Path(tempfile.mkdtemp(prefix="ba-"))
                caddyfile = tmp / "Caddyfile"
                caddyfile.write_text(render_caddyfile(device, tls_dir=tmp / "tls", http_port=http_port, admin=f"unix/{sock}/a.sock",
                                                      node_exporter=f"127.0.0.1:{node_port}", attest=f"127.0.0.1:{attest_port}"))
                ctx = ssl.create_default_context(cafile=str(tmp / "tls/ca.crt"))
                ctx.check_hostname = False  # the certificate names appliance.local; the address is loopback
                with caddy.running(caddyfile, tmp, metrics_port, tmp / "caddy.log"):
                    status, body = _https(metrics_port, ctx, "GET", "/attest/identity")  # the enrollment's read
                    if status != 200:
                        raise RuntimeError(f"GET /attest/identity answered {status}: {body[:300]!r}")
                    ak_public = base64.b64decode(evidence.load_identity(json.loads(body)).ak_public)
                    _scrape(metrics_port, ctx)  # warm: node_exporter's collectors
                    trips, scrapes = [], []
                    verdict, ev = None, None
                    for _ in range(runs):  # alternated, so that the host's drift weighs on both
                        time.sleep(1 / service.REFILL_PER_S)  # the service's rate, outside the timing
                        seconds, verdict, ev = _round_trip(metrics_port, ctx, ak_public, boot)
                        trips.append(seconds)
                        scrapes.append(_scrape(metrics_port, ctx))
            finally:
                caddy.stop(attestd)
                caddy.stop(node)
    assert verdict is not None and ev is not None
    if not verdict.proven:
        raise RuntimeError(f"the round trip's verdict is not proven: {verdict.code}: {verdict.reason}")
    trip, scrape = statistics.median(trips), statistics.median(scrapes)
    round_trip = measured(f"attestation round trip through the metrics site, median of {runs} (vs a plain scrape)",
                          trip * 1000, scrape * 1000, "ms", under=ROUND_TRIP_GOAL_S * 1000,
                          note=f"nonce to verdict ({verdict.code}: release {verdict.release}, Secure Boot {verdict.secure_boot}) "
                               f"on swtpm; evidence {len(json.dumps(evidence.dump(ev))) / 1024:.1f} KiB")

    def one_check() -> None:
        verify.check(ev, nonce=bytes.fromhex(ev.nonce), ak_public=ak_public, releases=boot.releases, secure_boot=boot.trust)

    cpu = _cpu_per_call(one_check, checks)
    floor = _cpu_per_call(lambda: _signature_only(ev, ak_public), checks)
    per_host = measured(f"verifier CPU per host, check() x {checks} (vs the signature alone)", cpu * 1000, floor * 1000, "ms",
                        under=CHECK_CPU_GOAL_S * 1000,
                        note=f"{60 / cpu:.0f} hosts a minute on one core" if cpu > 0 else "")
    return [round_trip, per_host]
