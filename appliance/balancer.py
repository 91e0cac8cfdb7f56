# SPDX-License-Identifier: MIT
"""The balancer across the engine's replicas: Debian's HAProxy, on loopback, between the TLS proxy
and the replicas (units/haproxy.cfg.j2, rendered at build; topology and proxy.affinity_header are
image settings, never a host's). With one engine there is none: Caddy sends to the engine itself.

Why not Caddy's own load balancing: Caddy 2.6.2 (Debian 12 and 13) retries a request whose replica
refused the connection with a body buffer it has already handed back to its pool, so the retry
carries no body or another client's body (caddyserver/caddy#7547 fixed it in 2026), and the replica
that receives it is then marked failed too. Seen in the journey: replica 0 SIGKILLed, the retry sent
replica 1 a broken body, and with both marked down every request got 503 for 10 s. HAProxy retries
a refused connection on another replica from its own buffer (nothing was sent), the request intact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from appliance.config.checks import HEADER_NAME
from appliance.config.model import Config
from appliance.errors import ConfigError

TEMPLATE = "haproxy.cfg.j2"
_TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "units"  # rendered at build only
CONFIG_PATH = "/usr/lib/appliance/haproxy.cfg"

# A replica takes traffic only once it has answered a request: its check reads the engine's
# /metrics and passes when vLLM's count of finished requests is above zero, which the warm-up
# request its unit sends before it counts as started (the engine quadlet's HealthStartupCmd)
# makes it. A restarted replica counts from zero again.
WARMED_URI = "/metrics"
WARMED_RE = r"request_success_total[^ \n]* [1-9]"
# How often each replica is checked: a replica that died with nothing in flight is out after two
# checks, or at once when a request finds its port closed (and goes to another replica).
CHECK_INTERVAL_S = 2
# How long a check may take (a busy engine's /metrics under load).
CHECK_TIMEOUT_S = 5
# How long a connection to a replica may take before it counts as refused and goes to another.
CONNECT_TIMEOUT_S = 2
# A completion takes as long as the engine needs (its own limits apply); an idle client connection
# from Caddy stays open longer than Caddy keeps it (caddyfile.UPSTREAM_IDLE_S), so Caddy closes first.
REQUEST_TIMEOUT_S = 3600
KEEPALIVE_S = 10


def wanted(config: Config) -> bool:
    return config.replicas > 1


def template_values(config: Config) -> dict[str, Any]:
    header = config.proxy.affinity_header
    if header and not HEADER_NAME.fullmatch(header):
        raise ConfigError(f"proxy.affinity_header: {header!r} is not an HTTP header name",
                          hint="an HTTP header name such as X-Session-Id")
    return {
        "profile": config.profile,
        "port": config.balancer_port,
        "replicas": [(i, config.replica_port(i)) for i in range(config.replicas)],
        "affinity_header": header,
        "warmed_uri": WARMED_URI,
        # HAProxy's configuration language: a space inside a word is escaped
        "warmed_re": WARMED_RE.replace(" ", "\\ "),
        "check_interval_s": CHECK_INTERVAL_S,
        "check_timeout_s": CHECK_TIMEOUT_S,
        "connect_timeout_s": CONNECT_TIMEOUT_S,
        "request_timeout_s": REQUEST_TIMEOUT_S,
        "keepalive_s": KEEPALIVE_S,
    }


def render_balancer(config: Config) -> str:
    """HAProxy's configuration for CONFIG's replicas (the build installs it when wanted(config))."""
    import jinja2  # only at build

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATE_DIR)), autoescape=False,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    return env.get_template(TEMPLATE).render(**template_values(config))
