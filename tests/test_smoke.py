# SPDX-License-Identifier: MIT
"""`applianctl smoke`: against the real stand-in engine, and through a TLS endpoint that only
answers for the appliance's hostname with a certificate from a test CA (SNI, Host, CA trust)."""

from __future__ import annotations

import argparse
import datetime
import http.server
import io
import json
import os
import ssl
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from standin_engine import MODEL, free_port, start_standin, stop

import appliance.config
from appliance import paths
from applianctl.engine import smoke
from builder.https_server import HTTPSServer

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    port = free_port()
    proc = start_standin(port)
    yield f"http://127.0.0.1:{port}"
    stop(proc)


@pytest.fixture
def configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    data = appliance.config.load(ROOT / "appliance.toml", "demo").to_json()
    (tmp_path / "appliance.json").write_text(json.dumps(data))
    monkeypatch.setenv("APPLIANCE_CONFIG", str(tmp_path / "appliance.json"))
    monkeypatch.setattr(paths, "TLS_DIR", tmp_path / "tls")
    return data


def args(**kw: Any) -> argparse.Namespace:
    base: dict[str, Any] = {"url": None, "ca": None, "insecure": False, "model": None, "timeout": 10.0}
    return argparse.Namespace(**{**base, **kw})


def run(monkeypatch: pytest.MonkeyPatch, a: argparse.Namespace) -> tuple[int, str]:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    code = smoke.run(a)
    return code, out.getvalue()


def test_passes_against_the_stand_in(configured: dict[str, Any], engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = run(monkeypatch, args(url=engine))
    assert code == 0, out
    assert "answer '391'" in out and "ok: smoke test passed" in out
    assert "/v1/completions:" in out and " s," in out  # the latency


def test_fails_when_the_model_is_not_served(
    configured: dict[str, Any], engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = run(monkeypatch, args(url=engine, model="other/model"))
    assert code == 1
    assert f"does not list other/model (it lists {MODEL})" in out


def test_fails_when_nothing_listens(configured: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, out = run(monkeypatch, args(url=url))
    assert code == 1
    assert out == f"FAILED: could not reach {url} (GET /v1/models): Connection refused\n"
    assert capsys.readouterr().err == f"hint: is anything serving at {url}? `applianctl status` shows the engine and the proxy\n"


def test_the_proxy_not_listening_is_one_line_and_a_hint(configured: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # the default target: the local proxy's HTTPS port, here one nothing listens on
    port = free_port()
    config = dict(configured)
    config["proxy"] = {**configured["proxy"], "https_port": port}
    (Path(os.environ["APPLIANCE_CONFIG"])).write_text(json.dumps(config))
    code, out = run(monkeypatch, args())
    assert code == 1
    assert out == f"FAILED: could not reach https://127.0.0.1:{port} (GET /v1/models): Connection refused\n"
    assert capsys.readouterr().err == "hint: is the proxy running? `applianctl status`, `applianctl logs proxy`\n"
    assert "ConnectionError" not in out and "HTTPSConnectionPool" not in out


# ----------------------------------------------------------------------------------- TLS


def _ca_and_server_cert(tmp: Path, hostname: str) -> tuple[Path, Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths_ = (tmp / "ca.crt", tmp / "server.crt", tmp / "server.key")
    tmp.mkdir(parents=True, exist_ok=True)
    paths_[0].write_bytes(ca.public_bytes(pem))
    paths_[1].write_bytes(cert.public_bytes(pem))
    paths_[2].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths_


class _Proxy(http.server.BaseHTTPRequestHandler):
    """Like the appliance's proxy: serves only its hostname (SNI and Host), then a fixed answer."""

    answer = "391"
    seen: ClassVar[list[tuple[str | None, str | None]]] = []

    def log_message(self, *a: Any) -> None:
        pass

    def _send(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.seen.append((getattr(self.connection, "server_hostname", None), self.headers.get("Host")))
        self._send({"object": "list", "data": [{"id": MODEL}]})

    def do_POST(self) -> None:
        length = int(self.headers["Content-Length"])
        body = json.loads(self.rfile.read(length))
        assert body == {"model": MODEL, "prompt": smoke.PROMPT, "temperature": 0, "max_tokens": 32}
        self._send({"choices": [{"text": self.answer}]})


@pytest.fixture
def tls_proxy(configured: dict[str, Any], tmp_path: Path) -> Iterator[int]:
    hostname = configured["proxy"]["hostname"]
    _, crt, key = _ca_and_server_cert(paths.TLS_DIR, hostname)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, key)
    sni: list[str | None] = []
    ctx.sni_callback = lambda sock, name, _ctx: sni.append(name)
    server = HTTPSServer(("127.0.0.1", 0), _Proxy, ctx)
    configured["proxy"]["https_port"] = server.server_address[1]
    Path(os.environ["APPLIANCE_CONFIG"]).write_text(json.dumps(configured))
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    _Proxy.seen = []
    _Proxy.sni = sni  # type: ignore[attr-defined]
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def test_through_the_proxy_with_the_appliance_ca_and_hostname(
    configured: dict[str, Any], tls_proxy: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _Proxy.answer = "391"
    code, out = run(monkeypatch, args())
    assert code == 0, out
    assert f"https://127.0.0.1:{tls_proxy}/v1/models" in out
    assert set(_Proxy.sni) == {configured["proxy"]["hostname"]}  # type: ignore[attr-defined]
    assert _Proxy.seen[0][1] == configured["proxy"]["hostname"]


def test_wrong_answer_fails(configured: dict[str, Any], tls_proxy: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _Proxy.answer = "392"
    code, out = run(monkeypatch, args())
    assert code == 1
    assert "FAILED: the completion '392' does not contain 391" in out


def test_untrusted_certificate_fails_unless_insecure(
    configured: dict[str, Any], tls_proxy: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _Proxy.answer = "391"
    other_ca, _, _ = _ca_and_server_cert(tmp_path / "other", "x.example")
    code, out = run(monkeypatch, args(ca=str(other_ca)))
    assert code == 1 and "TLS failed" in out
    code, out = run(monkeypatch, args(ca=str(other_ca), insecure=True))
    assert code == 0, out
