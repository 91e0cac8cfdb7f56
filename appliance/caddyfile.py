# SPDX-License-Identifier: MIT
"""The Caddyfile: the [proxy] settings through the template Caddyfile.j2, at build
(builder/render.py) and on the device with a plan's per-host settings (appliance-host.service).

Every value is checked again here, whatever the schema let through: a Caddyfile has no quoting we
could rely on, so a value is plainly safe (a DNS name, a network as ipaddress prints it, an e-mail
address, a URL path, a port) or rendering stops with a ConfigError naming the key.
"""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Any

from appliance import balancer, paths
from appliance.config.checks import EMAIL, is_dns_name
from appliance.config.model import Config
from appliance.engine_limits import context_tokens, request_bound_s
from appliance.errors import ConfigError

TEMPLATE = "Caddyfile.j2"
_SOURCE_TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "units"

# The image's Caddyfile (rendered at build) and where the proxy's admin socket lives
# (RuntimeDirectory=appliance-proxy in units/appliance-proxy.service).
CADDYFILE_PATH = "/usr/lib/appliance/Caddyfile"
ADMIN_SOCKET = "/run/appliance-proxy/admin.sock"


def template_dir() -> Path:
    """units/ in the source tree (the build, tests); on the device, where the image installs it."""
    return _SOURCE_TEMPLATE_DIR if (_SOURCE_TEMPLATE_DIR / TEMPLATE).is_file() else paths.LIB_DIR


# Anything a Caddyfile tokenizer treats specially: whitespace and control characters split or end
# tokens, braces open blocks and placeholders ({$ENV}, {env.X}), quotes and backticks quote, '#'
# starts a comment, '\' escapes, '%' and '$' are refused too (scoped IPv6, env expansion).
_CADDY_SYNTAX = re.compile(r"[\s\x00-\x1f\x7f{}\"'`#\\$%;<>|*]")
_URL_PATH = re.compile(r"/[A-Za-z0-9._~/-]*")
_ABS_PATH = re.compile(r"(/[A-Za-z0-9._-]+)+")
_ADMIN = re.compile(r"off|unix/" + _ABS_PATH.pattern + r"|localhost:[0-9]{1,5}")


# The request target as sent, in canonical form: "/", or segments of RFC 3986 unreserved characters
# that are neither "." nor ".." (RE2 has no lookahead, hence three alternatives), an optional
# trailing "/", and an optional query of RFC 3986 query characters with well-formed escapes.
# No "%" in the path at all: allowed paths never need escaping, so an escape only hides something.
_SEGMENT = r"(?:[A-Za-z0-9_~-][A-Za-z0-9._~-]*|\.[A-Za-z0-9_~-][A-Za-z0-9._~-]*|\.\.[A-Za-z0-9._~-]+)"
_QUERY = r"(?:\?(?:[A-Za-z0-9._~!$&'()*+,;=:@/?-]|%[0-9A-Fa-f][0-9A-Fa-f])*)?"
CANONICAL_RE = rf"^/(?:{_SEGMENT}(?:/{_SEGMENT})*/?)?{_QUERY}$"
# The proxy's own host: always admitted besides allowed_cidrs, so local checks take the clients'
# path. Exactly these two addresses, not 127.0.0.0/8.
LOOPBACK = ("127.0.0.1/32", "::1/128")


# Idle connections from Caddy to the engine close after this long: under the engine's own keep-alive
# timeout (uvicorn's timeout_keep_alive, 5 s in vLLM), so the proxy always closes first and never
# sends a request on a connection the engine is closing at that moment.
UPSTREAM_IDLE_S = 2
# remote attestation's request bodies on the metrics site (applianctl/attest/service.py takes as much)
ATTEST_MAX_BODY = 16 * 1024
# The request body limit: the engine's context (--max-model-len) times BYTES_PER_TOKEN, at least
# MIN_BODY. A token of prompt is ~4 bytes of JSON text, ~6-12 for escaped non-ASCII or token ids
# ("prompt": [123, ...]); 32 leaves margin for chat structure. Without --max-model-len (the model's
# own context applies), engine_limits.FALLBACK_CONTEXT tokens are assumed.
BYTES_PER_TOKEN = 32
MIN_BODY = 1 << 20


def max_body_bytes(config: Config) -> int:
    """The largest request body the proxy forwards to the engine."""
    return max(MIN_BODY, context_tokens(config) * BYTES_PER_TOKEN)


def greater_than_re(limit: int) -> str:
    """An RE2 regexp for the decimal numbers (leading zeros allowed) greater than LIMIT."""
    digits = str(limit)
    n = len(digits)
    alternatives = [f"[1-9][0-9]{{{n},}}"]
    for i, d in enumerate(digits):
        if d != "9":
            rest = f"[0-9]{{{n - i - 1}}}" if n - i - 1 else ""
            alternatives.append(f"{digits[:i]}[{int(d) + 1}-9]{rest}")
    return "^0*(?:" + "|".join(alternatives) + ")$"


def _error_json(message: str, kind: str, code: int | str) -> str:
    """The OpenAI error shape. CODE may be a Caddy placeholder (rendered unquoted)."""
    text = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": 0}})
    return text.replace('"code": 0', f'"code": {code}')


REFUSALS = {
    "noncanonical": _error_json("The request target is not in canonical form.", "invalid_request_error", 400),
    "forbidden": _error_json("Not allowed here: the source address or the path is not admitted.",
                             "permission_error", 403),
    "method": _error_json("Method not allowed: the engine's API takes GET and POST.", "invalid_request_error", 405),
    "too_large": _error_json("The request body is larger than the proxy admits.", "invalid_request_error", 413),
    "not_found": _error_json("Not here: the metrics site serves GET /metrics, GET /engine/metrics, GET /engine/N/metrics "
                             "(replica N), GET /attest/identity, POST /attest/quote and POST /attest/activate.",
                             "invalid_request_error", 404),
    "length_required": _error_json("A request body here needs a Content-Length (no chunked encoding).",
                                   "invalid_request_error", 411),
    "error": _error_json("{http.error.status_text}", "proxy_error", "{http.error.status_code}"),
    # the proxy's own /health when the judge (appliance-judge.service) gives no answer: no verdict, no 200
    "judge_down": _error_json("The appliance's judge is not running: no replica is known to be serving.",
                              "service_unavailable_error", 503),
}


def allowed_re(allowed_paths: list[str]) -> str:
    """The request targets (exact path, optional query) that may reach the engine, as an RE2 regexp."""
    # _url_path admitted only [A-Za-z0-9._~/-]: "." is the one regexp character among them.
    return "^(?:" + "|".join(p.replace(".", r"\.") for p in allowed_paths) + ")" + _QUERY + "$"


def _refuse(key: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"proxy: {key} = {value!r}: refused for the Caddyfile", hint=f"expected {expected}")


def _plain(key: str, value: str) -> str:
    if not value or _CADDY_SYNTAX.search(value):
        raise _refuse(key, value, "a value without spaces, quotes, braces, '#', '$', '%' or control characters")
    return value


def _hostname(key: str, value: str) -> str:
    _plain(key, value)
    if is_dns_name(value) is not None or value != value.strip():
        raise _refuse(key, value, "a DNS name such as appliance.example.net")
    return value


def _email(key: str, value: str) -> str:
    _plain(key, value)
    if not EMAIL.fullmatch(value):  # the configuration's and the plan's check too
        raise _refuse(key, value, "an e-mail address such as ops@example.net (letters, digits, '.', '_', '+', '-')")
    return value


def _cidrs(key: str, values: tuple[str, ...], *, allow_empty: bool) -> list[str]:
    if not values and not allow_empty:
        raise _refuse(key, values, "at least one network in CIDR notation")
    out = []
    for i, value in enumerate(values):
        _plain(f"{key}[{i}]", value)
        try:
            network = ipaddress.ip_network(value, strict=True)
        except ValueError:
            raise _refuse(f"{key}[{i}]", value, "a network in CIDR notation, e.g. 10.0.0.0/8") from None
        # Rendered as ipaddress prints it (never the raw string); scoped IPv6 ("%eth0") refused.
        text = str(network)
        if "%" in text or "/" not in value:
            raise _refuse(f"{key}[{i}]", value, "a network with a prefix length and no IPv6 scope, e.g. fd00::/8")
        out.append(_plain(f"{key}[{i}]", text))
    return out


def _url_path(key: str, value: str) -> str:
    _plain(key, value)
    # Canonical itself, or the proxy would refuse every request for it with 400.
    if not _URL_PATH.fullmatch(value) or not re.fullmatch(CANONICAL_RE, value):
        raise _refuse(key, value, "a URL path such as /v1/models")
    return value


def _port(key: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise _refuse(key, value, "a TCP port between 1 and 65535")
    return value


def _upstream(key: str, value: str) -> str:
    host, _, port = value.rpartition(":")
    if host != "127.0.0.1" or not port.isdigit():
        raise _refuse(key, value, "127.0.0.1:PORT")
    return f"127.0.0.1:{_port(key, int(port))}"


def _file(key: str, value: Path) -> str:
    text = str(value)
    if not _ABS_PATH.fullmatch(text) or "/../" in text + "/":
        raise _refuse(key, text, "an absolute path of letters, digits, '.', '_' and '-'")
    return text


def template_values(
    config: Config,
    *,
    tls_dir: Path | None = None,
    http_port: int = 80,
    admin: str = f"unix/{ADMIN_SOCKET}",
    metrics_client_ca: Path = paths.METRICS_CLIENT_CA,
    node_exporter: str = paths.NODE_EXPORTER,
    judge_health: str = paths.JUDGE_HEALTH,
    attest: str = paths.ATTEST,
) -> dict[str, Any]:
    """Every value the template takes, each checked; ConfigError naming the first bad one.
    Without jinja2: host_settings.overlay checks a host's settings with it before any reader sees them."""
    proxy = config.proxy
    if proxy.tls not in ("acme", "internal"):
        raise _refuse("tls", proxy.tls, "'acme' or 'internal'")
    if proxy.http not in ("redirect", "close"):
        raise _refuse("http", proxy.http, "'redirect' or 'close'")
    if not _ADMIN.fullmatch(admin):
        raise _refuse("admin", admin, "off, unix//ABSOLUTE/PATH or localhost:PORT")
    acme = proxy.tls == "acme"
    if acme and not proxy.acme_email:
        raise _refuse("acme_email", proxy.acme_email, "an e-mail address for ACME (tls = 'acme')")
    tls_dir = paths.TLS_DIR if tls_dir is None else tls_dir
    paths_ = [_url_path(f"allowed_paths[{i}]", p) for i, p in enumerate(proxy.allowed_paths)]
    if not paths_:
        raise _refuse("allowed_paths", proxy.allowed_paths, "at least one URL path")
    # The engine's health path, when the allowlist forwards it, is answered by the judge instead.
    health = _url_path("engine.health.path", config.engine.health.path)
    health_path = health if health in paths_ else ""
    values: dict[str, Any] = {
        "profile": _plain("profile", config.profile),
        "acme": acme,
        "acme_email": _email("acme_email", proxy.acme_email) if acme else "",
        "redirect": proxy.http == "redirect",
        "hostname": _hostname("hostname", proxy.hostname),
        "https_port": _port("https_port", proxy.https_port),
        "http_port": _port("http_port", http_port),
        # the engine, or with several replicas the balancer in front of them (appliance/balancer.py),
        # which checks each replica itself
        "upstream": (f"127.0.0.1:{_port('engine.port', config.balancer_port)}" if balancer.wanted(config)
                     else f"127.0.0.1:{_port('engine.port', config.engine.port)}"),
        # each replica's own loopback address, for its metrics on the metrics site
        # (replica I's at /engine/I/metrics in every layout, one replica's too: one scrape configuration for a fleet)
        "replica_upstreams": [f"127.0.0.1:{_port('engine.port', config.replica_port(i))}" for i in range(config.replicas)],
        "health_uri": "" if balancer.wanted(config) else health,
        # the proxy's own /health: the judge's verdict on every replica (empty: not an allowed path)
        "health_path": health_path,
        "health_re": allowed_re([health_path]) if health_path else "",
        "judge_health": _upstream("judge_health", judge_health),
        # how long Caddy waits on the engine for one request's next bytes (appliance/engine_limits.py)
        "request_bound_s": request_bound_s(config),
        "allowed_cidrs": _cidrs("allowed_cidrs", proxy.allowed_cidrs, allow_empty=False),
        "allowed_paths": paths_,
        "allowed_re": allowed_re(paths_),
        "canonical_re": CANONICAL_RE,
        "loopback": LOOPBACK,
        # Restricting /metrics only matters when /metrics can be reached at all.
        "metrics_cidrs": _cidrs("metrics_cidrs", proxy.metrics_cidrs, allow_empty=True),
        # the metrics site (docs/fleet.md): scrapers, who are not clients
        "metrics_port": _port("metrics.port", config.metrics.port),
        "scraper_cidrs": _cidrs("metrics.allowed_cidrs", config.metrics.allowed_cidrs, allow_empty=True),
        "metrics_client_ca": _file("metrics.client_ca", metrics_client_ca) if config.metrics.client_ca else "",
        "node_exporter": _upstream("node_exporter", node_exporter),
        # remote attestation on the metrics site (appliance-attest.service) and its bodies' bound
        "attest": _upstream("attest", attest),
        "attest_max_body": ATTEST_MAX_BODY,
        "attest_too_large_re": greater_than_re(ATTEST_MAX_BODY),
        "cert_file": _file("tls_dir", tls_dir / "server.crt"),
        "key_file": _file("tls_dir", tls_dir / "server.key"),
        "admin": admin,
        "max_body": max_body_bytes(config),
        "too_large_re": greater_than_re(max_body_bytes(config)),
        "upstream_idle_s": UPSTREAM_IDLE_S,
        "refusals": REFUSALS,
    }
    if values["metrics_port"] in (values["https_port"], values["http_port"]):
        raise _refuse("metrics.port", values["metrics_port"], "a port of its own (not the proxy's HTTPS or HTTP port)")
    if proxy.https_port == http_port and values["redirect"]:
        raise _refuse("https_port", proxy.https_port, "a port other than the plain HTTP port")
    return values


def render_caddyfile(
    config: Config,
    *,
    tls_dir: Path | None = None,
    http_port: int = 80,
    admin: str = f"unix/{ADMIN_SOCKET}",
    metrics_client_ca: Path = paths.METRICS_CLIENT_CA,
    node_exporter: str = paths.NODE_EXPORTER,
    judge_health: str = paths.JUDGE_HEALTH,
    attest: str = paths.ATTEST,
) -> str:
    """The Caddyfile for CONFIG; TLS_DIR holds server.crt/.key in mode "internal". HTTP_PORT and
    ADMIN are for tests, which run Caddy unprivileged on loopback, as are NODE_EXPORTER,
    JUDGE_HEALTH and ATTEST (their loopback addresses)."""
    import jinja2  # only where a Caddyfile is written (the build, appliance-host.service)

    values = template_values(config, tls_dir=tls_dir, http_port=http_port, admin=admin, metrics_client_ca=metrics_client_ca,
                             node_exporter=node_exporter, judge_health=judge_health, attest=attest)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        autoescape=False,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    return env.get_template(TEMPLATE).render(**values)
