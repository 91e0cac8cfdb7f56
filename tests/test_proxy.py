# SPDX-License-Identifier: MIT
"""The proxy: the Caddyfile rendered from appliance.toml, checked by the real Caddy 2.6.2 and run
on loopback in front of the real stand-in engine.

Caddy runs unprivileged on free high ports; the stand-in is `python3 -m standin serve`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import socket
import socketserver
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from cryptography import x509
from requests.adapters import HTTPAdapter

import appliance.caddyfile
import appliance.config
from appliance import engine_limits, paths
from appliance.caddyfile import render_caddyfile
from appliance.config import Config
from appliance.errors import ConfigError
from applianctl import tls
from testkit import caddy

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)

ROOT = Path(__file__).resolve().parents[1]
TOML = ROOT / "appliance.toml"
CADDY = caddy.CADDY
MODEL = "standin/tiny-demo"
SMOKE = "Calculate 17 * 23. Answer with the number only."

needs_caddy = pytest.mark.skipif(not os.access(CADDY, os.X_OK), reason="needs Debian's caddy (apt install caddy)")


def _env(home: Path) -> dict[str, str]:
    return caddy.caddy_env(home)


def _demo() -> Config:
    """The demo profile with one engine: the live tests run one stand-in behind the proxy (the
    demo's two replicas are rendered by test_rendered_text and run by tests/test_replicas.py)."""
    demo = appliance.config.load(TOML, "demo")
    return dataclasses.replace(demo, topology=dataclasses.replace(demo.topology, gpus=1, layout="1x1"))


def _variant(config: Config, **proxy: Any) -> Config:
    return dataclasses.replace(config, proxy=dataclasses.replace(config.proxy, **proxy))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real appliance certificates from applianctl.tls (the device's code), for mode internal."""
    tls_dir = tmp_path_factory.mktemp("tls")
    tls.generate(tls_dir, "appliance.local", tls.host_addresses(), group="appliance-no-such-group")
    return tls_dir


# ------------------------------------------------------------------------------ rendering

VARIANTS = [
    pytest.param(profile, mode, http, metrics, id=f"{profile}-{mode}-{http}-{'metrics' if metrics else 'nometrics'}")
    for profile in ("production", "demo")
    for mode in ("acme", "internal")
    for http in ("redirect", "close")
    for metrics in ((), ("10.9.0.0/16", "fd00:9::/32"))
]


def _render(profile: str, mode: str, http: str, metrics: tuple[str, ...], certs: Path) -> tuple[Config, str]:
    config = appliance.config.load(TOML, profile)
    email = config.proxy.acme_email or "ops@example.net"
    config = _variant(config, tls=mode, http=http, metrics_cidrs=metrics, acme_email=email)
    return config, render_caddyfile(config, tls_dir=certs)


def _adapt(text: str, tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "Caddyfile"
    path.write_text(text)
    out = subprocess.run(
        [CADDY, "adapt", "--adapter", "caddyfile", "--config", str(path)],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


@needs_caddy
@pytest.mark.parametrize(("profile", "mode", "http", "metrics"), VARIANTS)
def test_every_variant_is_valid_for_caddy(
    profile: str, mode: str, http: str, metrics: tuple[str, ...], certs: Path, tmp_path: Path
) -> None:
    config, text = _render(profile, mode, http, metrics, certs)
    path = tmp_path / "Caddyfile"
    path.write_text(text)
    out = subprocess.run(
        [CADDY, "validate", "--adapter", "caddyfile", "--config", str(path)],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=60,
    )
    assert out.returncode == 0 and "Valid configuration" in out.stdout + out.stderr, out.stderr[-2000:]

    servers = _adapt(text, tmp_path)["apps"]["http"]["servers"]
    listens = sorted(addr for s in servers.values() for addr in s["listen"])
    # the metrics site (scrapers) on a port of its own, in every variant
    if http == "redirect":
        assert listens == [":443", ":80", ":9443"]
    else:
        assert listens == [":443", ":9443"], "http = close: port 80 must not be opened"
    assert all(s.get("automatic_https", {}).get("disable_redirects") for s in servers.values())
    https = next(s for s in servers.values() if s["listen"] == [":443"])
    routes = json.dumps(https["routes"])
    # no explicit flush_interval -1 (caddyserver/caddy#4952: the engine's request would outlive its client)
    assert '"flush_interval"' not in routes and '"buffer_requests": true' in routes
    if config.replicas > 1:  # the balancer checks each replica; Caddy sends to it
        assert '"health_checks"' not in routes and f'"dial": "127.0.0.1:{config.balancer_port}"' in routes
    else:
        assert '"uri": "/health"' in routes and "expect_body" not in routes and '"dial": "127.0.0.1:8000"' in routes
    for cidr in config.proxy.allowed_cidrs:
        assert f'"{cidr}"' in routes
    assert ('"/metrics"]' in routes and '"not"' in routes) == bool(metrics)
    # Inside the site (acme: behind a host matcher), the last route has no matcher and answers 403.
    site_routes = https["routes"]
    if mode == "acme":
        (site,) = site_routes
        assert site["match"] == [{"host": [config.proxy.hostname]}]
        site_routes = site["handle"][0]["routes"]
    assert "match" not in site_routes[-1]
    assert json.dumps(site_routes[-1]["handle"]).count('"status_code": 403') == 1
    # Before anything else: a request target not in canonical form gets 400.
    assert site_routes[0]["match"] == [
        {"not": [{"vars_regexp": {"{http.request.orig_uri}": {"pattern": appliance.caddyfile.CANONICAL_RE}}}]}
    ]
    assert '"status_code": 400' in json.dumps(site_routes[0]["handle"])
    # the engine's health path is the judge's verdict, from the same sources as the engine's paths
    health = next(r for r in site_routes if f'"{paths.JUDGE_HEALTH}"' in json.dumps(r["handle"]))
    assert health["match"][0]["vars_regexp"] == {
        "{http.request.orig_uri}": {"pattern": appliance.caddyfile.allowed_re([config.engine.health.path])}
    }
    assert health["match"][0]["remote_ip"]["ranges"][-2:] == ["127.0.0.1/32", "::1/128"]
    engine = next(r for r in site_routes if '"buffer_requests": true' in json.dumps(r["handle"]))
    assert engine["match"][0]["vars_regexp"] == {
        "{http.request.orig_uri}": {"pattern": appliance.caddyfile.allowed_re(list(config.proxy.allowed_paths))}
    }
    assert engine["match"][0]["remote_ip"]["ranges"][-2:] == ["127.0.0.1/32", "::1/128"]


@pytest.mark.parametrize(("profile", "mode", "http", "metrics"), VARIANTS)
def test_rendered_text(profile: str, mode: str, http: str, metrics: tuple[str, ...], certs: Path) -> None:
    config, text = _render(profile, mode, http, metrics, certs)
    assert "tls internal" not in text
    assert "admin unix//run/appliance-proxy/admin.sock" in text
    assert re.search(r"log \{\s*output stdout\s*format json\s*\}", text)
    # production's one engine; the demo's two replicas through the balancer after them
    upstream = f"127.0.0.1:{config.balancer_port if config.replicas > 1 else config.engine.port}"
    assert f"reverse_proxy {upstream} {{" in text and "\tflush_interval" not in text
    assert ("health_uri /health\n" in text) == (config.replicas == 1) and "lb_policy" not in text
    assert f"remote_ip {' '.join(config.proxy.allowed_cidrs)} 127.0.0.1/32 ::1/128\n" in text
    assert f"path {' '.join(config.proxy.allowed_paths)}\n" in text
    if mode == "acme":
        assert f"email {config.proxy.acme_email}\n" in text
        assert f"{config.proxy.hostname}:443 {{" in text
        assert ("disable_http_challenge" in text) == (http == "close")
    else:
        assert f"tls {certs}/server.crt {certs}/server.key\n" in text
        assert "https://:443 {" in text and f"default_sni {config.proxy.hostname}\n" in text
        assert "email" not in text
    assert ("http://:80 {" in text) == (http == "redirect")
    assert (f"not remote_ip {' '.join(metrics)}\n" in text) == bool(metrics)


def test_default_certificate_paths_are_the_devices() -> None:
    config = _variant(_demo(), http="close")
    text = render_caddyfile(config)
    assert f"tls {paths.TLS_DIR}/server.crt {paths.TLS_DIR}/server.key" in text
    assert str(paths.TLS_DIR) == "/var/lib/appliance/tls"


# ------------------------------------------------------------------------------ injection

# (key, value, a case that once slipped through the configuration checks)
INJECTIONS: list[tuple[str, str | list[str], bool]] = [
    ("hostname", "dsv4.example.net {", False),
    ("hostname", "dsv4.example.net:443 {\n\trespond 200\n}\nx.example.net", False),
    ("hostname", "{$HOME}", False),
    ("hostname", "dsv4.example.net #", False),
    ("hostname", '"dsv4.example.net"', False),
    ("hostname", "dsv4.example.net\n", True),
    ("acme_email", "ops@example.net {", False),
    ("acme_email", 'ops"@example.net', False),
    ("acme_email", "ops@example.net\n}\n:9999 {\n\trespond 200\n", False),
    ("acme_email", "{$HOME}@example.net", True),
    ("acme_email", "#ops@example.net", True),
    ("acme_email", "ops@example.net\n", True),
    ("allowed_cidrs", ["10.0.0.0/8 0.0.0.0/0"], False),
    ("allowed_cidrs", ["10.0.0.0/8\n}\nhandle {"], False),
    ("allowed_cidrs", ["{$TRUSTED}"], False),
    ("allowed_cidrs", ["fe80::%}\n\trespond 200\n{/128"], True),
    ("allowed_cidrs", ["fe80::%{$HOME}/128"], True),
    ("allowed_paths", ["/v1/models {"], False),
    ("allowed_paths", ["/v1/*"], False),
    ("allowed_paths", ["/v1/models /admin"], False),
    ("allowed_paths", ['/v1/models"'], False),
    ("allowed_paths", ["/{$HOME}"], False),
    ("allowed_paths", ["/health\n"], True),
    ("metrics_cidrs", ["0.0.0.0/0 #"], False),
    ("metrics_cidrs", ["10.0.0.0/8}"], False),
    ("metrics_cidrs", ["fe80::%x y/128"], True),
]


def _id(key: str, value: str | list[str]) -> str:
    return f"{key}-{json.dumps(value)}"


LOAD_CASES = [
    pytest.param(key, value, id=_id(key, value)) for key, value, _ in INJECTIONS
]
RENDER_CASES = [pytest.param(key, value, id=_id(key, value)) for key, value, _ in INJECTIONS]


def _toml_with(tmp_path: Path, key: str, value: str | list[str]) -> Path:
    """The repo's appliance.toml with one [proxy] key replaced (JSON strings are TOML strings)."""
    text = TOML.read_text()
    start = text.index("\n[proxy]\n")
    end = text.index("\n[", start + 1)
    section = text[start:end]
    line = re.compile(rf"^{key} = .*$", re.M)
    assert line.search(section), key
    section = line.sub(lambda _: f"{key} = {json.dumps(value)}", section, count=1)
    path = tmp_path / "appliance.toml"
    path.write_text(text[:start] + section + text[end:])
    return path


def test_toml_helper_changes_the_value(tmp_path: Path) -> None:
    path = _toml_with(tmp_path, "allowed_cidrs", ["10.1.0.0/16", "fd00::/8"])
    assert appliance.config.load(path).proxy.allowed_cidrs == ("10.1.0.0/16", "fd00::/8")


@pytest.mark.parametrize(("key", "value"), LOAD_CASES)
def test_config_load_refuses_injection(tmp_path: Path, key: str, value: str | list[str]) -> None:
    path = _toml_with(tmp_path, key, value)
    with pytest.raises(ConfigError) as e:
        appliance.config.load(path)
    assert f"proxy.{key}" in e.value.message


@pytest.mark.parametrize(("key", "value"), RENDER_CASES)
def test_render_refuses_injection_whatever_config_lets_through(key: str, value: str | list[str]) -> None:
    config = appliance.config.load(TOML)  # production: acme, so acme_email is rendered too
    config = _variant(config, **{key: tuple(value) if isinstance(value, list) else value})
    with pytest.raises(ConfigError) as e:
        render_caddyfile(config)
    assert key in e.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [("tls_dir", Path("/var/lib/app liance/tls")), ("admin", "unix//run/x {"), ("http_port", 0)],
)
def test_render_refuses_bad_parameters(field: str, value: Any) -> None:
    with pytest.raises(ConfigError):
        render_caddyfile(_variant(_demo(), http="redirect"), **{field: value})


# ------------------------------------------------------------------------------ live


def _plain_get(url: str) -> requests.Response:
    with requests.Session() as s:
        s.trust_env = False
        return s.get(url, allow_redirects=False, timeout=5)


def _connects(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


def _san(conn: ssl.SSLSocket) -> list[tuple[str, str]]:
    cert = conn.getpeercert()
    assert cert is not None
    entries: Any = cert.get("subjectAltName", ())
    return [(str(k), str(v)) for k, v in entries]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait(what: str, ready: Any, proc: subprocess.Popen[bytes], log: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail(f"{what} not ready after {timeout} s:\n{log.read_text()[-3000:]}")


@dataclasses.dataclass(frozen=True)
class Live:
    https_port: int
    http_port: int
    engine_port: int
    hostname: str
    ca: Path
    tls_dir: Path
    caddyfile: Path
    home: Path
    engine_log: Path
    caddy_log: Path


@contextlib.contextmanager
def _caddy(caddyfile: Path, home: Path, https_port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The real Caddy on CADDYFILE, running until the block ends; ready once HTTPS_PORT connects."""
    with caddy.running(caddyfile, home, https_port, log) as proc:
        yield proc


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    if not os.access(CADDY, os.X_OK):
        pytest.skip("needs Debian's caddy (apt install caddy)")
    base = tmp_path_factory.mktemp("live")
    engine_port, https_port, http_port = _free_port(), _free_port(), _free_port()

    engine_log = base / "engine.log"
    env = {**os.environ, "STANDIN_LOAD_SECONDS": "0", "STANDIN_SHM_DIR": str(base), "STANDIN_TOKEN_SECONDS": "0.15"}
    with engine_log.open("wb") as out:
        engine = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "standin",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(engine_port),
                "--served-model-name",
                MODEL,
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait("stand-in", lambda: _plain_get(f"http://127.0.0.1:{engine_port}/health").ok, engine, engine_log)

        config = _demo()
        config = dataclasses.replace(
            _variant(
                config,
                https_port=https_port,
                http="redirect",
                allowed_cidrs=("127.0.0.1/32", "127.0.0.3/32"),
                metrics_cidrs=("127.0.0.3/32",),
            ),
            engine=dataclasses.replace(config.engine, port=engine_port),
        )
        tls_dir = base / "tls"
        tls.generate(tls_dir, config.proxy.hostname, tls.host_addresses(), group="appliance-no-such-group")
        # A unix socket path must stay short (108 bytes).
        sock_dir = Path(tempfile.mkdtemp(prefix="px-"))
        caddyfile = base / "Caddyfile"
        caddyfile.write_text(
            render_caddyfile(config, tls_dir=tls_dir, http_port=http_port, admin=f"unix/{sock_dir}/admin.sock",
                             judge_health=f"127.0.0.1:{_free_port()}")  # where no judge listens
        )
        caddy_log = base / "caddy.log"
        try:
            with _caddy(caddyfile, base, https_port, caddy_log):
                yield Live(
                    https_port,
                    http_port,
                    engine_port,
                    config.proxy.hostname,
                    tls_dir / "ca.crt",
                    tls_dir,
                    caddyfile,
                    base,
                    engine_log,
                    caddy_log,
                )
        finally:
            shutil.rmtree(sock_dir, ignore_errors=True)
    finally:
        caddy.stop(engine)


class _Via(HTTPAdapter):
    """Connect with SNI/verification name SERVER_HOSTNAME and/or from SOURCE (an address on lo)."""

    def __init__(self, server_hostname: str | None = None, source: str | None = None) -> None:
        self._server_hostname = server_hostname
        self._source = source
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        if self._server_hostname:
            kwargs["server_hostname"] = self._server_hostname
        if self._source:
            kwargs["source_address"] = (self._source, 0)
        super().init_poolmanager(*args, **kwargs)


def _session(live: Live, *, source: str | None = None, sni: bool = True) -> requests.Session:
    s = requests.Session()
    # Not trust_env: REQUESTS_CA_BUNDLE would replace verify, and *_PROXY must not apply to loopback.
    s.trust_env = False
    s.verify = str(live.ca)
    s.mount("https://", _Via(live.hostname if sni else None, source))
    s.mount("http://", _Via(None, source))
    if sni:
        s.headers["Host"] = f"{live.hostname}:{live.https_port}"
    return s


def _url(live: Live, path: str) -> str:
    return f"https://127.0.0.1:{live.https_port}{path}"


def test_client_trusting_only_the_appliance_ca_completes_the_handshake(live: Live, tmp_path: Path) -> None:
    ctx = ssl.create_default_context(cafile=str(live.ca))  # with a cafile: no system CAs
    assert len(ctx.get_ca_certs()) == 1
    with (
        socket.create_connection(("127.0.0.1", live.https_port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=live.hostname) as conn,
    ):
        names = [v for k, v in _san(conn) if k == "DNS"]
        assert names == [live.hostname]
    # By IP address (no SNI): the same certificate, valid for 127.0.0.1.
    with (
        socket.create_connection(("127.0.0.1", live.https_port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as conn,
    ):
        assert ("IP Address", "127.0.0.1") in _san(conn)
    # A client that trusts another CA does not.
    tls.generate(tmp_path, live.hostname, [], group="appliance-no-such-group")
    other = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    with (
        socket.create_connection(("127.0.0.1", live.https_port), timeout=5) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        other.wrap_socket(raw, server_hostname=live.hostname)


def test_requests_by_hostname_reaches_the_engine(live: Live) -> None:
    r = _session(live).get(_url(live, "/v1/models"), timeout=10)
    assert r.status_code == 200, r.text
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    # the proxy's /health is the judge's, and no judge runs here: 503 with the reason (tests/test_proxy_cancel.py
    # has a judge that answers)
    health = _session(live).get(_url(live, "/health"), timeout=10)
    assert health.status_code == 503 and "judge is not running" in health.json()["error"]["message"]


def test_openai_client_smoke_completion_and_streamed_chat(live: Live) -> None:
    import openai

    # openai's own httpx client class, trusting the appliance CA only; no proxies from the environment.
    http_client = openai.DefaultHttpxClient(
        verify=ssl.create_default_context(cafile=str(live.ca)), trust_env=False, timeout=30
    )
    client = openai.OpenAI(base_url=_url(live, "/v1"), api_key="unused", http_client=http_client, max_retries=0)
    done = client.completions.create(model=MODEL, prompt=SMOKE, temperature=0, max_tokens=32)
    assert done.choices[0].text.strip() == "391"

    arrivals: list[float] = []
    pieces: list[str] = []
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            arrivals.append(time.monotonic())
    assert "".join(pieces) == "Hello! I am the stand-in engine."
    # The engine takes 0.15 s per token: unbuffered, the pieces arrive spread out, not at once.
    assert len(arrivals) >= 5 and arrivals[-1] - arrivals[0] > 0.4


def _engine_saw(live: Live, marker: str) -> bool:
    time.sleep(0.2)
    return marker in live.engine_log.read_text()


def test_source_outside_the_allowlist_gets_403_and_never_reaches_the_engine(live: Live) -> None:
    allowed, denied = uuid.uuid4().hex, uuid.uuid4().hex
    assert _session(live, source="127.0.0.1").get(_url(live, f"/v1/models?{allowed}"), timeout=10).status_code == 200
    r = _session(live, source="127.0.0.2").get(_url(live, f"/v1/models?{denied}"), timeout=10)
    assert r.status_code == 403
    assert _engine_saw(live, allowed), "control: the stand-in logs the requests it gets"
    assert not _engine_saw(live, denied)
    access = [json.loads(line) for line in live.caddy_log.read_text().splitlines() if denied in line]
    assert any(e.get("logger", "").startswith("http.log.access") and e["status"] == 403 for e in access)


@pytest.mark.parametrize("path", ["/version", "/v1/models/", "/v1", "/load", "/"])
def test_path_outside_allowed_paths_gets_403(live: Live, path: str) -> None:
    assert _plain_get(f"http://127.0.0.1:{live.engine_port}/version").status_code == 200  # control
    r = _session(live).get(_url(live, path), timeout=10)
    assert r.status_code == 403


def test_metrics_only_for_metrics_cidrs(live: Live) -> None:
    assert _session(live, source="127.0.0.1").get(_url(live, "/metrics"), timeout=10).status_code == 403
    r = _session(live, source="127.0.0.3").get(_url(live, "/metrics"), timeout=10)
    assert r.status_code == 200 and "vllm:" in r.text
    assert _session(live, source="127.0.0.3").get(_url(live, "/v1/models"), timeout=10).status_code == 200


def test_plain_http_redirects_to_https(live: Live) -> None:
    r = _plain_get(f"http://127.0.0.1:{live.http_port}/v1/models?x=1")
    assert r.status_code == 308
    assert r.headers["Location"] == f"https://127.0.0.1:{live.https_port}/v1/models?x=1"


def test_reload_picks_up_a_renewed_certificate(live: Live) -> None:
    """The unit's ExecReload (`caddy reload ... --force`) serves the certificate renewed on disk."""

    def served_serial() -> int:
        ctx = ssl.create_default_context(cafile=str(live.ca))
        with (
            socket.create_connection(("127.0.0.1", live.https_port), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname=live.hostname) as conn,
        ):
            der = conn.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der).serial_number

    before = served_serial()
    result = tls.generate(
        live.tls_dir,
        live.hostname,
        # Inside the CA's name constraints (loopback), so the renewed certificate names it.
        [*tls.host_addresses(), ipaddress.IPv4Address("127.0.0.77")],
        group="appliance-no-such-group",
    )
    assert result.renewed
    renewed = x509.load_pem_x509_certificate((live.tls_dir / "server.crt").read_bytes()).serial_number
    assert renewed != before
    unit = (ROOT / "units/appliance-proxy.service").read_text()
    reload_cmd = re.search(r"^ExecReload=(.*)$", unit, re.M)
    assert reload_cmd is not None
    argv = reload_cmd.group(1).split()
    argv[argv.index("--config") + 1] = str(live.caddyfile)
    argv[0] = CADDY
    out = subprocess.run(argv, capture_output=True, text=True, env=_env(live.home), timeout=30)
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 10
    while served_serial() != renewed and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served_serial() == renewed


# ------------------------------------------------------------------------------ canonical paths
#
# Caddy's path matchers judge a cleaned, case-folded, decoded path; reverse_proxy forwards the path
# as sent. Each request target below goes over TLS byte for byte (no client library normalizes
# it) to the real Caddy in front of a backend that records the raw request line it receives. Each
# must either be refused at the proxy (400/403, never reaching the backend) or reach the backend
# with exactly an allowed path.

ALLOWED = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/generate")

# (request target as bytes, what must happen: "pass" = forwarded exactly, "refuse" = 400/403)
TARGETS: list[tuple[bytes, str]] = [
    # controls: canonical and allowed
    (b"/v1/models", "pass"),
    (b"/health", "pass"),
    (b"/v1/chat/completions", "pass"),
    (b"/v1/models?a=1&b=%2F..%2F&c=x;y", "pass"),
    # dot segments and doubled slashes
    (b"/v1/../v1/models", "refuse"),
    (b"/x/../v1/models", "refuse"),
    (b"/v1/./models", "refuse"),
    (b"/./v1/models", "refuse"),
    (b"/v1/models/.", "refuse"),
    (b"/v1/models/..", "refuse"),
    (b"/v1/models/../../admin", "refuse"),
    (b"/..", "refuse"),
    (b"//v1/models", "refuse"),
    (b"/v1//models", "refuse"),
    (b"/v1/models//", "refuse"),
    (b"///health", "refuse"),
    (b"/v1/models/", "refuse"),
    (b"/health/", "refuse"),
    # percent-encodings of separators, dots, NUL, letters, and double or overlong encodings
    (b"/v1%2fmodels", "refuse"),
    (b"/v1%2Fmodels", "refuse"),
    (b"/v1%252fmodels", "refuse"),
    (b"/%2e%2e/v1/models", "refuse"),
    (b"/v1/%2e%2e/v1/models", "refuse"),
    (b"/v1/%2E/models", "refuse"),
    (b"/v1/.%2e/v1/models", "refuse"),
    (b"/v1/models%00", "refuse"),
    (b"/v1/models%2500", "refuse"),
    (b"/v1%5cmodels", "refuse"),
    (b"/v1%5Cmodels", "refuse"),
    (b"/v1/model%73", "refuse"),
    (b"/%76%31/%6d%6f%64%65%6c%73", "refuse"),
    (b"/%c0%ae%c0%ae/v1/models", "refuse"),
    (b"/v1%c0%afmodels", "refuse"),
    (b"/v1%e0%80%afmodels", "refuse"),
    (b"/v1/%u002e%u002e/models", "refuse"),
    (b"/v1/models%", "refuse"),
    (b"/v1/models%2", "refuse"),
    (b"/v1/models%20", "refuse"),
    (b"/v1/models%09", "refuse"),
    (b"/v1/models%0d%0a", "refuse"),
    # backslashes
    (b"/v1\\models", "refuse"),
    (b"\\v1\\models", "refuse"),
    (b"/v1/models\\", "refuse"),
    (b"/v1/..\\..\\v1/models", "refuse"),
    # letter case other than the allowlist's
    (b"/V1/models", "refuse"),
    (b"/v1/Models", "refuse"),
    (b"/HEALTH", "refuse"),
    (b"/Health", "refuse"),
    (b"/v1/model\xc5\xbf", "refuse"),  # U+017F LATIN SMALL LETTER LONG S, raw UTF-8
    (b"/v1/\xef\xbd\x8dodels", "refuse"),  # fullwidth m
    # path parameters and other trailing junk
    (b"/v1/models;x=1", "refuse"),
    (b"/v1/models;", "refuse"),
    (b"/health;/../v1/models", "refuse"),
    (b"/v1/models#frag", "refuse"),
    (b"/v1/models?x#frag", "refuse"),
    (b"/v1/models?a=%zz", "refuse"),
    (b"/v1/models?a=\x7f", "refuse"),
    (b"/v1/models%3fa=1", "refuse"),
    # absolute-form and other request-target forms
    (b"http://appliance.local/v1/models", "refuse"),
    (b"https://appliance.local/v1/models", "refuse"),
    (b"HTTPS://appliance.local/v1/models", "refuse"),
    (b"https://appliance.local/v1/../v1/models", "refuse"),
    (b"//appliance.local/v1/models", "refuse"),
    (b"*", "refuse"),
    (b"v1/models", "refuse"),
    # paths outside the allowlist (canonical, but not allowed)
    (b"/version", "refuse"),
    (b"/v1", "refuse"),
    (b"/", "refuse"),
    (b"/v1/models.json", "refuse"),
    (b"/.well-known/../v1/models", "refuse"),
    # trailing dots and near misses that some normalizers strip
    (b"/v1/models.", "refuse"),
    (b"/health..", "refuse"),
    (b"/v1/models%2e", "refuse"),
    (b"/v1/models~", "refuse"),
    (b"/v1/models/~", "refuse"),
    (b"/v1/./../v1/models", "refuse"),
]


@dataclasses.dataclass
class Recorded:
    lines: list[tuple[bytes, bytes]]  # (raw request line, X-Probe header)


class _Recorder(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.recorded = Recorded([])
        super().__init__(("127.0.0.1", 0), _RecordingHandler)


class _RecordingHandler(socketserver.StreamRequestHandler):
    server: _Recorder

    def handle(self) -> None:
        while True:
            line = self.rfile.readline(65536)
            if not line:
                return
            probe = b""
            length = 0
            chunked = False
            while (header := self.rfile.readline(65536)) not in (b"\r\n", b"\n", b""):
                name, _, value = header.partition(b":")
                if name.strip().lower() == b"x-probe":
                    probe = value.strip()
                elif name.strip().lower() == b"content-length":
                    length = int(value.strip())
                elif name.strip().lower() == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
            if length:
                self.rfile.read(length)
            if chunked and not self._read_chunked():
                return  # a body cut off on the way: no request arrived
            self.server.recorded.lines.append((line.rstrip(b"\r\n"), probe))
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 8\r\n\r\nbackend\n")
            self.wfile.flush()

    def _read_chunked(self) -> bool:
        """Read a chunked body to its end; False if the connection ended before it."""
        while True:
            size_line = self.rfile.readline(1024)
            if not size_line.endswith(b"\n"):
                return False
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return self.rfile.readline(1024).endswith(b"\n")
            if len(self.rfile.read(size + 2)) != size + 2:
                return False


@dataclasses.dataclass(frozen=True)
class RawLive:
    https_port: int
    hostname: str
    ca: Path
    recorded: Recorded
    caddy_log: Path


@pytest.fixture(scope="module")
def raw_live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RawLive]:
    """Caddy with the production path allowlist in front of the recording backend; allowed_cidrs
    holds only 127.0.0.3, so 127.0.0.1 and ::1 get in only as the appliance's own loopback."""
    if not os.access(CADDY, os.X_OK):
        pytest.skip("needs Debian's caddy (apt install caddy)")
    base = tmp_path_factory.mktemp("raw")
    backend = _Recorder()
    thread = threading.Thread(target=backend.serve_forever, daemon=True)
    thread.start()
    try:
        config = _demo()
        assert set(config.proxy.allowed_paths) == set(ALLOWED), "the test's allowlist is the configured one"
        https_port = _free_port()
        config = dataclasses.replace(
            _variant(config, https_port=https_port, http="close", allowed_cidrs=("127.0.0.3/32",), metrics_cidrs=()),
            engine=dataclasses.replace(config.engine, port=backend.server_address[1]),
        )
        tls_dir = base / "tls"
        tls.generate(tls_dir, config.proxy.hostname, tls.host_addresses(), group="appliance-no-such-group")
        caddyfile = base / "Caddyfile"
        # the proxy's /health goes to the judge: here the recording backend too, so that it is
        # seen getting exactly the allowed path like the engine's
        caddyfile.write_text(render_caddyfile(config, tls_dir=tls_dir, http_port=_free_port(), admin="off",
                                              judge_health=f"127.0.0.1:{backend.server_address[1]}"))
        caddy_log = base / "caddy.log"
        with _caddy(caddyfile, base, https_port, caddy_log):
            yield RawLive(https_port, config.proxy.hostname, tls_dir / "ca.crt", backend.recorded, caddy_log)
    finally:
        backend.shutdown()
        backend.server_close()


def _raw_request(
    live: RawLive,
    target: bytes,
    *,
    source: str = "127.0.0.1",
    extra: bytes = b"",
    method: bytes = b"GET",
    body: bytes = b"",
) -> tuple[int, str]:
    """Send one request line byte for byte over TLS; return (status, probe id sent in X-Probe)."""
    probe = uuid.uuid4().hex
    request = (
        method + b" " + target + b" HTTP/1.1\r\n"
        + f"Host: {live.hostname}\r\nX-Probe: {probe}\r\nConnection: close\r\n".encode()
        + extra
        + b"\r\n"
        + body
    )
    family = socket.AF_INET6 if ":" in source else socket.AF_INET
    ctx = ssl.create_default_context(cafile=str(live.ca))
    with socket.socket(family) as raw:
        raw.settimeout(10)
        raw.bind((source, 0))
        raw.connect((source if family == socket.AF_INET6 else "127.0.0.1", live.https_port))
        with ctx.wrap_socket(raw, server_hostname=live.hostname) as conn:
            conn.sendall(request)
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
    status_line = data.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 "), data[:200]
    return int(status_line.split()[1]), probe


def _seen(live: RawLive, probe: str) -> list[bytes]:
    time.sleep(0.05)
    return [line for line, p in live.recorded.lines if p == probe.encode()]


@needs_caddy
@pytest.mark.parametrize(("target", "expect"), [pytest.param(t, e, id=repr(t)[2:-1]) for t, e in TARGETS])
def test_engine_gets_exactly_an_allowed_path_or_nothing(raw_live: RawLive, target: bytes, expect: str) -> None:
    status, probe = _raw_request(raw_live, target, source="127.0.0.3")  # from allowed_cidrs
    seen = _seen(raw_live, probe)
    if status in (400, 403):
        assert seen == [], f"refused with {status} but the backend got {seen}"
    else:
        # Anything that got through arrived with exactly an allowed path (and the query as sent).
        assert status == 200 and len(seen) == 1, (status, seen)
        method, forwarded, version = seen[0].split(b" ")
        assert (method, version) == (b"GET", b"HTTP/1.1")
        assert forwarded == target
        assert forwarded.split(b"?", 1)[0].decode() in ALLOWED
    assert ("pass" if status == 200 else "refuse") == expect, f"{target!r}: got {status}"


@needs_caddy
@pytest.mark.parametrize(
    "target", [b"/v1/../v1/models", b"//v1/models", b"/v1%2fmodels", b"/v1\\models", b"/v1/models;x", b"/V1/models"]
)
def test_noncanonical_forms_get_400(raw_live: RawLive, target: bytes) -> None:
    assert _raw_request(raw_live, target, source="127.0.0.3")[0] == 400


@needs_caddy
@needs_caddy
@pytest.mark.parametrize(
    ("method", "target"),
    [(b"CONNECT", b"appliance.local:443"), (b"CONNECT", b"127.0.0.1:8000"), (b"OPTIONS", b"*"),
     (b"GET", b"127.0.0.1:8000/v1/models")],
)
def test_other_request_target_forms_never_reach_the_engine(raw_live: RawLive, method: bytes, target: bytes) -> None:
    status, probe = _raw_request(raw_live, target, source="127.0.0.3", method=method)
    assert _seen(raw_live, probe) == []
    # Go's HTTP server answers "OPTIONS *" itself (200, empty) before any handler of Caddy's runs.
    assert status in (400, 403, 405) or (method, target, status) == (b"OPTIONS", b"*", 200)


@needs_caddy
def test_post_with_a_body_passes_exactly(raw_live: RawLive) -> None:
    body = b'{"model": "m", "prompt": "x"}'
    status, probe = _raw_request(
        raw_live,
        b"/v1/completions",
        method=b"POST",
        extra=b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body),
        body=body,
    )
    assert status == 200
    assert _seen(raw_live, probe) == [b"POST /v1/completions HTTP/1.1"]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@needs_caddy
def test_loopback_is_admitted_besides_allowed_cidrs(raw_live: RawLive) -> None:
    status, probe = _raw_request(raw_live, b"/v1/models", source="127.0.0.1")
    assert status == 200 and _seen(raw_live, probe) == [b"GET /v1/models HTTP/1.1"]
    assert _raw_request(raw_live, b"/v1/models", source="127.0.0.3")[0] == 200  # allowed_cidrs
    # Only the loopback address itself, not 127.0.0.0/8.
    status, probe = _raw_request(raw_live, b"/v1/models", source="127.0.0.2")
    assert status == 403 and _seen(raw_live, probe) == []
    if _has_ipv6_loopback():
        status, probe = _raw_request(raw_live, b"/v1/models", source="::1")
        assert status == 200 and len(_seen(raw_live, probe)) == 1


@needs_caddy
@pytest.mark.parametrize(
    "header",
    [
        b"X-Forwarded-For: 127.0.0.1\r\n",
        b"X-Forwarded-For: 127.0.0.3\r\n",
        b"X-Real-IP: 127.0.0.1\r\n",
        b"Forwarded: for=127.0.0.1\r\n",
        b"X-Forwarded-For: 127.0.0.3, 127.0.0.1\r\n",
    ],
)
def test_spoofed_forwarding_headers_do_not_pass(raw_live: RawLive, header: bytes) -> None:
    status, probe = _raw_request(raw_live, b"/v1/models", source="127.0.0.2", extra=header)
    assert status == 403 and _seen(raw_live, probe) == []


@pytest.mark.parametrize(("target", "expect"), [pytest.param(t, e, id=repr(t)[2:-1]) for t, e in TARGETS])
def test_canonical_regexp_without_caddy(target: bytes, expect: str) -> None:
    """The same table against the rendered regexps in Python's re (RE2 agrees on these constructs)."""
    config = _demo()
    text = target.decode("latin-1")
    canonical = re.fullmatch(appliance.caddyfile.CANONICAL_RE, text) is not None
    allowed = re.fullmatch(appliance.caddyfile.allowed_re(list(config.proxy.allowed_paths)), text) is not None
    assert allowed == (expect == "pass")
    if allowed:
        assert canonical


def test_allowed_paths_must_be_canonical() -> None:
    config = _demo()
    for bad in ("/v1//models", "/v1/./models", "/v1/..", "/v1/models/."):
        with pytest.raises(ConfigError):
            render_caddyfile(_variant(config, allowed_paths=(bad,)))


CURL = shutil.which("curl")
H2_TARGETS = [(t, e) for t, e in TARGETS if all(0x21 <= b <= 0x7E for b in t)]


@needs_caddy
@pytest.mark.skipif(CURL is None, reason="needs curl")
@pytest.mark.parametrize(("target", "expect"), [pytest.param(t, e, id=repr(t)[2:-1]) for t, e in H2_TARGETS])
def test_http2_engine_gets_exactly_an_allowed_path_or_nothing(raw_live: RawLive, target: bytes, expect: str) -> None:
    """The same table over HTTP/2 (the request target in :path), sent as is by curl --request-target."""
    assert CURL is not None
    probe = uuid.uuid4().hex
    out = subprocess.run(
        [
            CURL, "-sS", "--http2", "--path-as-is", "--request-target", target.decode(),
            "--cacert", str(raw_live.ca), "--interface", "127.0.0.3",
            "--resolve", f"{raw_live.hostname}:{raw_live.https_port}:127.0.0.1",
            "-H", f"X-Probe: {probe}", "-o", "/dev/null", "-w", "%{http_version} %{http_code}",
            f"https://{raw_live.hostname}:{raw_live.https_port}/",
        ],
        capture_output=True, text=True, timeout=30, env={"PATH": os.environ.get("PATH", "/usr/bin")},
    )
    seen = _seen(raw_live, probe)
    version, _, code = out.stdout.partition(" ")
    if out.returncode == 0:
        assert version == "2", out.stdout  # really HTTP/2
    status = int(code) if out.returncode == 0 else 0
    if status == 200:
        assert len(seen) == 1 and seen[0].split(b" ")[1] == target, seen
        assert target.split(b"?", 1)[0].decode() in ALLOWED
    else:
        assert seen == [], f"refused ({out.stdout or out.stderr}) but the backend got {seen}"
    assert ("pass" if status == 200 else "refuse") == expect, f"{target!r}: {out.stdout} {out.stderr}"


# ------------------------------------------------------------------------------ methods, body limit, JSON refusals


def _raw_response(live: RawLive, target: bytes, *, method: bytes = b"GET", extra: bytes = b"", body: bytes = b"",
                  source: str = "127.0.0.3") -> tuple[int, dict[str, str], bytes, str]:
    """Like _raw_request, with the response's headers and body."""
    probe = uuid.uuid4().hex
    request = (method + b" " + target + b" HTTP/1.1\r\n"
               + f"Host: {live.hostname}\r\nX-Probe: {probe}\r\nConnection: close\r\n".encode() + extra + b"\r\n")
    ctx = ssl.create_default_context(cafile=str(live.ca))
    with socket.socket() as raw:
        raw.settimeout(20)
        raw.bind((source, 0))
        raw.connect(("127.0.0.1", live.https_port))
        with ctx.wrap_socket(raw, server_hostname=live.hostname) as conn:
            conn.sendall(request)
            with contextlib.suppress(OSError):  # the proxy may answer (and close) before the body is sent
                conn.sendall(body)
            data = b""
            with contextlib.suppress(OSError):
                while chunk := conn.recv(65536):
                    data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", payload
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest = out + rest[:size], rest[size + 2:]
        payload = out
    return int(lines[0].split()[1]), headers, payload, probe


def _openai_error(status: int, headers: dict[str, str], payload: bytes, code: int) -> None:
    assert status == code, (status, payload[:300])
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(payload)["error"]
    assert error["code"] == code and error["message"] and error["type"], error


@needs_caddy
@pytest.mark.parametrize("method", [b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"TRACE", b"HEAD"])
@pytest.mark.parametrize("target", [b"/v1/models", b"/v1/chat/completions", b"/health"])
def test_other_methods_on_allowed_paths_get_405_json_and_never_reach_the_engine(
    raw_live: RawLive, method: bytes, target: bytes
) -> None:
    status, headers, payload, probe = _raw_response(raw_live, target, method=method)
    assert _seen(raw_live, probe) == []
    assert status == 405 and headers["allow"] == "GET, POST"
    if method != b"HEAD":
        _openai_error(status, headers, payload, 405)


@needs_caddy
@pytest.mark.parametrize("method", [b"GET", b"POST"])
def test_get_and_post_still_reach_the_engine(raw_live: RawLive, method: bytes) -> None:
    status, _, _, probe = _raw_response(raw_live, b"/v1/models", method=method, extra=b"Content-Length: 0\r\n")
    assert status == 200 and _seen(raw_live, probe) == [method + b" /v1/models HTTP/1.1"]


def test_body_limit_is_derived_from_the_context_length() -> None:
    config = appliance.config.load(TOML)
    assert engine_limits.max_model_len(config.engine.args) == 262144
    assert appliance.caddyfile.max_body_bytes(config) == 262144 * appliance.caddyfile.BYTES_PER_TOKEN == 8 << 20
    demo = _demo()
    assert appliance.caddyfile.max_body_bytes(demo) == appliance.caddyfile.MIN_BODY  # 4096 tokens: the 1 MiB floor
    assert engine_limits.max_model_len(["--max-model-len=32k"]) == 32000  # vLLM: k = 1000, K = 1024
    assert engine_limits.max_model_len(["--max-model-len=32K"]) == 32768
    assert engine_limits.max_model_len(["--max-model-len", "1M"]) == 1 << 20
    assert engine_limits.max_model_len([]) is None
    no_len = dataclasses.replace(config, engine=dataclasses.replace(config.engine, args=()))
    assert appliance.caddyfile.max_body_bytes(no_len) == engine_limits.FALLBACK_CONTEXT * appliance.caddyfile.BYTES_PER_TOKEN
    text = render_caddyfile(_variant(config, tls="internal", http="close"))
    assert f"max_size {8 << 20}\n" in text and f"max_buffer_size {(8 << 20) + 1}\n" in text


@pytest.mark.parametrize("limit", [1, 9, 10, 999, 1000, 1048576, 8388608, 4194305])
def test_greater_than_regexp(limit: int) -> None:
    pattern = re.compile(appliance.caddyfile.greater_than_re(limit))
    for n in {*range(max(0, limit - 120), limit + 120), 0, limit * 10, limit * 10 - 1, 10 ** len(str(limit))}:
        assert bool(pattern.match(str(n))) == (n > limit), n
        assert bool(pattern.match("000" + str(n))) == (n > limit), n
    assert not pattern.match("") and not pattern.match("-5") and not pattern.match(f"{limit + 1} ")


def test_proxy_buffers_request_bodies_and_outlives_no_engine_connection() -> None:
    """The guards against the empty/cut 200s (tests/test_proxy_soak.py is the live proof): the request
    body is read whole before it goes upstream, within max_size, and idle upstream connections close
    before the engine's 5 s keep-alive timeout."""
    text = render_caddyfile(_variant(_demo(), http="close"))
    engine = text[text.index("handle @engine {"):]
    engine = engine[:engine.index("\n\t}\n")]
    assert "\t\t\tbuffer_requests\n" in engine
    limit = int(re.search(r"max_size (\d+)", engine).group(1))  # type: ignore[union-attr]
    assert int(re.search(r"max_buffer_size (\d+)", engine).group(1)) > limit  # type: ignore[union-attr]
    idle = re.search(r"transport http \{[^}]*\n\t+keepalive (\d+)s\n", engine)
    assert idle and 0 < int(idle.group(1)) < 5
    # no explicit flush_interval -1: it keeps the engine's request going after its client left
    # (caddyserver/caddy#4952; tests/test_proxy_cancel.py is the live proof); a wait on the engine
    # lasts at most as long as one request can
    assert "\tflush_interval" not in engine
    assert f"\t\t\t\tread_timeout {engine_limits.request_bound_s(_demo())}s\n" in engine


@needs_caddy
def test_declared_body_over_the_limit_gets_413_json_and_never_reaches_the_engine(raw_live: RawLive) -> None:
    config = _demo()
    limit = appliance.caddyfile.max_body_bytes(config)
    body = b'{"prompt": "' + b"x" * (16 << 20) + b'"}'
    status, headers, payload, probe = _raw_response(
        raw_live, b"/v1/completions", method=b"POST", body=body,
        extra=b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body))
    _openai_error(status, headers, payload, 413)
    assert _seen(raw_live, probe) == []
    # Exactly at the limit passes, whole.
    body = b"y" * limit
    status, _, _, probe = _raw_response(raw_live, b"/v1/completions", method=b"POST", body=body,
                                        extra=b"Content-Length: %d\r\n" % len(body))
    assert status == 200 and _seen(raw_live, probe) == [b"POST /v1/completions HTTP/1.1"]


@needs_caddy
def test_chunked_body_over_the_limit_is_refused_with_json(raw_live: RawLive) -> None:
    limit = appliance.caddyfile.max_body_bytes(_demo())
    data = b"z" * (limit + 1)
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data)
    status, headers, payload, probe = _raw_response(
        raw_live, b"/v1/completions", method=b"POST", body=chunked, extra=b"Transfer-Encoding: chunked\r\n")
    _openai_error(status, headers, payload, 413)
    assert _seen(raw_live, probe) == []


@needs_caddy
@pytest.mark.parametrize(("target", "source", "code"), [
    (b"/version", "127.0.0.3", 403), (b"/v1/models", "127.0.0.2", 403), (b"/v1//models", "127.0.0.3", 400),
    (b"/V1/models", "127.0.0.3", 400),
])
def test_refusals_are_openai_shaped_json(raw_live: RawLive, target: bytes, source: str, code: int) -> None:
    status, headers, payload, probe = _raw_response(raw_live, target, source=source)
    _openai_error(status, headers, payload, code)
    assert _seen(raw_live, probe) == []


def test_openai_client_gets_the_refusals_message(live: Live) -> None:
    import openai

    http_client = openai.DefaultHttpxClient(
        verify=ssl.create_default_context(cafile=str(live.ca)), trust_env=False, timeout=30
    )
    client = openai.OpenAI(base_url=_url(live, "/v1beta"), api_key="unused", http_client=http_client, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as e:
        client.models.list()
    assert e.value.status_code == 403 and "not admitted" in e.value.message
    assert isinstance(e.value.body, dict) and e.value.body["type"] == "permission_error"
    assert e.value.body["code"] == 403 and "not admitted" in e.value.body["message"]
