# SPDX-License-Identifier: MIT
"""The proxy's metrics site on the real Caddy: scrapers in metrics.allowed_cidrs
(and the appliance itself) get node_exporter's /metrics and the engine's /engine/metrics; clients,
who are not scrapers, get 403; exactly those two targets by GET; with metrics.client_ca, a scraper
without a certificate signed by it gets no TLS session at all."""

from __future__ import annotations

import dataclasses
import datetime
import http.client
import http.server
import os
import shutil
import socket
import ssl
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from requests.adapters import HTTPAdapter

import appliance.config
from appliance.caddyfile import render_caddyfile
from applianctl import tls
from testkit import caddy
from testkit.standin import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not os.access(caddy.CADDY, os.X_OK), reason="needs Debian's caddy (apt install caddy)")

NODE_TEXT = "# TYPE node_load1 gauge\nnode_load1 0.25\n"
ENGINE_TEXT = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
SCRAPER, CLIENT = "127.0.0.3", "127.0.0.4"


def _serve(text: str, seen: list[str]) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            body = text.encode() if self.path == "/metrics" else b"not here"
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _serve_attest(seen: list[tuple[str, str, bytes]]) -> tuple[http.server.ThreadingHTTPServer, int]:
    """A stand-in for appliance-attest.service: every request it gets, answered 200 with JSON."""
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _any(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            seen.append((self.command, self.path, self.rfile.read(length)))
            body = b'{"attested": true}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = do_DELETE = _any

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def _ca(name: str, tmp: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    return key, cert


def _client(ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, out: Path) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prometheus")]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=30))
            .sign(ca_key, hashes.SHA256()))
    crt, pem = out / "scraper.crt", out / "scraper.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(crt), str(pem)


@dataclasses.dataclass(frozen=True)
class Site:
    port: int
    ca: Path
    node_seen: list[str]
    engine_seen: list[str]
    scraper_cert: tuple[str, str] | None = None
    stranger_cert: tuple[str, str] | None = None
    attest_seen: list[tuple[str, str, bytes]] = dataclasses.field(default_factory=list)


class _From(HTTPAdapter):
    def __init__(self, source: str) -> None:
        self._source = source
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["source_address"] = (self._source, 0)
        kwargs["server_hostname"] = "appliance.local"
        super().init_poolmanager(*args, **kwargs)


def _get(site: Site, path: str, source: str = SCRAPER, method: str = "GET", cert: tuple[str, str] | None = None,
         data: bytes | None = None) -> requests.Response:
    s = requests.Session()
    s.trust_env = False
    s.verify = str(site.ca)
    s.mount("https://", _From(source))
    return s.request(method, f"https://127.0.0.1:{site.port}{path}", timeout=10, cert=cert, data=data,
                     headers={"Host": f"appliance.local:{site.port}"})


def _status_as_sent(site: Site, path: str, source: str = SCRAPER) -> int:
    """The status for a request line carrying `path` byte for byte: HTTP clients normalise some
    paths (urllib3 2 turns `//metrics` into `/metrics`), the site must see them as written."""
    ctx = ssl.create_default_context(cafile=str(site.ca))
    conn = http.client.HTTPSConnection("127.0.0.1", site.port, timeout=10)
    # connected by hand: from the scraper's address, and checked against the site's name
    conn.sock = ctx.wrap_socket(socket.create_connection(("127.0.0.1", site.port), 10, (source, 0)),
                                server_hostname="appliance.local")
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        conn.putheader("Host", f"appliance.local:{site.port}")
        conn.endheaders()
        return conn.getresponse().status
    finally:
        conn.close()


def _site(tmp: Path, client_ca: str = "") -> Iterator[Site]:
    node_seen: list[str] = []
    engine_seen: list[str] = []
    node, node_port = _serve(NODE_TEXT, node_seen)
    engine, engine_port = _serve(ENGINE_TEXT, engine_seen)
    attest_seen: list[tuple[str, str, bytes]] = []
    attest, attest_port = _serve_attest(attest_seen)
    https_port, http_port, metrics_port = (free_port() for _ in range(3))
    config = appliance.config.load(ROOT / "appliance.toml", "demo")
    config = dataclasses.replace(
        config,
        proxy=dataclasses.replace(config.proxy, https_port=https_port, allowed_cidrs=("127.0.0.0/8",)),
        engine=dataclasses.replace(config.engine, port=engine_port),
        metrics=dataclasses.replace(config.metrics, port=metrics_port, allowed_cidrs=(f"{SCRAPER}/32",), client_ca=client_ca),
    )
    tls_dir = tmp / "tls"
    tls.generate(tls_dir, config.proxy.hostname, [], group="appliance-no-such-group")
    (tmp / "client-ca.pem").write_text(client_ca)
    sock_dir = Path(tempfile.mkdtemp(prefix="mx-"))  # a unix socket path stays short
    caddyfile = tmp / "Caddyfile"
    caddyfile.write_text(render_caddyfile(config, tls_dir=tls_dir, http_port=http_port, admin=f"unix/{sock_dir}/admin.sock",
                                          metrics_client_ca=tmp / "client-ca.pem", node_exporter=f"127.0.0.1:{node_port}",
                                          attest=f"127.0.0.1:{attest_port}"))
    try:
        with caddy.running(caddyfile, tmp, metrics_port, tmp / "caddy.log"):
            yield Site(metrics_port, tls_dir / "ca.crt", node_seen, engine_seen, attest_seen=attest_seen)
    finally:
        node.shutdown()
        engine.shutdown()
        attest.shutdown()
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    yield from _site(tmp_path_factory.mktemp("metrics-site"))


@pytest.mark.programs
def test_a_scraper_gets_node_exporters_metrics_and_the_engines(site: Site) -> None:
    node = _get(site, "/metrics")
    assert node.status_code == 200 and node.text == NODE_TEXT
    engine = _get(site, "/engine/metrics")
    assert engine.status_code == 200 and engine.text == ENGINE_TEXT
    assert site.engine_seen[-1] == "/metrics"  # the engine's own path, nothing else


@pytest.mark.programs
def test_each_replica_has_its_own_path_and_one_not_up_fails_alone(site: Site) -> None:
    """/engine/I/metrics is replica I's own /metrics (a scraper labels it replica="I": docs/fleet.md);
    /engine/metrics stays replica 0's. Replica 1 does not listen here: its target fails, as a JSON
    error (the scraper's up is 0 for it alone), and replica 0's still answers."""
    before = len(site.engine_seen)
    zero = _get(site, "/engine/0/metrics")
    assert zero.status_code == 200 and zero.text == ENGINE_TEXT and site.engine_seen[before:] == ["/metrics"]
    one = _get(site, "/engine/1/metrics")
    assert one.status_code == 502 and one.json()["error"]["type"] == "proxy_error"
    assert _get(site, "/engine/2/metrics").status_code == 404  # the demo has two replicas


@pytest.mark.programs
def test_the_appliance_itself_may_scrape(site: Site) -> None:
    assert _get(site, "/metrics", source="127.0.0.1").status_code == 200


@pytest.mark.programs
def test_a_client_that_is_not_a_scraper_gets_403_and_reaches_nothing(site: Site) -> None:
    before = len(site.node_seen), len(site.engine_seen)
    for path in ("/metrics", "/engine/metrics"):
        r = _get(site, path, source=CLIENT)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert (len(site.node_seen), len(site.engine_seen)) == before


@pytest.mark.programs
@pytest.mark.parametrize("path", ["/", "/metrics/", "/Metrics", "/metrics?collect[]=cpu", "/engine/metrics/..",
                                  "/engine/v1/models", "/v1/models", "//metrics"])
def test_only_the_two_targets_exactly(site: Site, path: str) -> None:
    before = len(site.node_seen), len(site.engine_seen)
    assert _status_as_sent(site, path) in (400, 404)
    assert (len(site.node_seen), len(site.engine_seen)) == before


@pytest.mark.programs
def test_only_get(site: Site) -> None:
    assert _get(site, "/metrics", method="POST").status_code == 404


@pytest.fixture(scope="module")
def mtls_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("metrics-mtls")
    ca_key, ca = _ca("scrapers' CA", tmp)
    stranger_key, stranger = _ca("another CA", tmp)
    (tmp / "mine").mkdir()
    (tmp / "other").mkdir()
    for s in _site(tmp, ca.public_bytes(serialization.Encoding.PEM).decode()):
        yield dataclasses.replace(s, scraper_cert=_client(ca_key, ca, tmp / "mine"),
                                  stranger_cert=_client(stranger_key, stranger, tmp / "other"))


@pytest.mark.programs
def test_with_a_client_ca_a_scraper_needs_a_certificate_it_signed(mtls_site: Site) -> None:
    assert _get(mtls_site, "/metrics", cert=mtls_site.scraper_cert).status_code == 200
    for cert in (None, mtls_site.stranger_cert):
        with pytest.raises(requests.exceptions.SSLError):
            _get(mtls_site, "/metrics", cert=cert)


# ------------------------------------------------------------------ remote attestation on the metrics site


@pytest.mark.programs
def test_a_scraper_reaches_the_attestation_service_on_its_three_routes(site: Site) -> None:
    before = len(site.attest_seen)
    assert _get(site, "/attest/identity").json() == {"attested": True}
    nonce = b'{"nonce": "' + b"ab" * 32 + b'"}'
    assert _get(site, "/attest/quote", method="POST", data=nonce).status_code == 200
    assert _get(site, "/attest/activate", method="POST", data=b'{"credential": "AAAA"}').status_code == 200
    assert site.attest_seen[before:] == [("GET", "/attest/identity", b""), ("POST", "/attest/quote", nonce),
                                         ("POST", "/attest/activate", b'{"credential": "AAAA"}')]


@pytest.mark.programs
@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/attest/identity"), ("GET", "/attest/quote"), ("GET", "/attest/activate"), ("PUT", "/attest/quote"),
    ("DELETE", "/attest/identity"), ("GET", "/attest/"), ("GET", "/attest/identity/"), ("GET", "/attest/identity?x=1"),
    ("POST", "/attest/quote/"), ("POST", "/attest/seal"), ("GET", "/Attest/identity"), ("POST", "/attest/Quote"),
])
def test_other_methods_and_paths_under_attest_reach_nothing(site: Site, method: str, path: str) -> None:
    before = len(site.attest_seen)
    r = _get(site, path, method=method, data=b"{}" if method in ("POST", "PUT") else None)
    assert r.status_code in (400, 404) and r.json()["error"]["type"] == "invalid_request_error"
    assert "POST /attest/quote" in r.json()["error"]["message"] or r.status_code == 400
    assert len(site.attest_seen) == before


@pytest.mark.programs
def test_an_attestation_body_over_the_bound_is_refused_before_the_service(site: Site) -> None:
    from appliance.caddyfile import ATTEST_MAX_BODY

    before = len(site.attest_seen)
    r = _get(site, "/attest/quote", method="POST", data=b"x" * (ATTEST_MAX_BODY + 1))
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    for parts in ([b"y" * 8192] * 3, [b'{"credential": "AAAA"}']):  # chunked: no Content-Length, whatever its size
        chunked = _get(site, "/attest/activate", method="POST", data=iter(parts))  # type: ignore[arg-type]
        assert chunked.status_code == 411 and chunked.json()["error"]["code"] == 411
    assert len(site.attest_seen) == before
    assert _get(site, "/attest/quote", method="POST", data=b"z" * ATTEST_MAX_BODY).status_code == 200


@pytest.mark.programs
def test_a_client_outside_the_allowlist_gets_403_for_attestation(site: Site) -> None:
    before = len(site.attest_seen)
    for method, path in (("GET", "/attest/identity"), ("POST", "/attest/quote"), ("POST", "/attest/activate")):
        r = _get(site, path, source=CLIENT, method=method, data=b"{}" if method == "POST" else None)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert len(site.attest_seen) == before


@pytest.mark.programs
def test_with_a_client_ca_attestation_needs_the_scrapers_certificate(mtls_site: Site) -> None:
    assert _get(mtls_site, "/attest/identity", cert=mtls_site.scraper_cert).status_code == 200
    for cert in (None, mtls_site.stranger_cert):
        with pytest.raises(requests.exceptions.SSLError):
            _get(mtls_site, "/attest/identity", cert=cert)
