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

from appliance import paths
from appliance.config.checks import HEADER_NAME
from appliance.config.model import Config
from appliance.engine_limits import request_bound_s
from appliance.errors import ConfigError

TEMPLATE = "haproxy.cfg.j2"
_TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "units"  # rendered at build only
CONFIG_PATH = "/usr/lib/appliance/haproxy.cfg"

# A replica takes traffic only once it has answered a request: its check reads the engine's
# /metrics and passes when vLLM's count of finished requests is above zero, which the warm-up
# request its unit sends before it counts as started (the engine quadlet's HealthStartupCmd)
# makes it. A restarted replica counts from zero again. The check stays beside the judge's agent
# (below): the agent says whether a replica makes progress, the check whether it is warmed up and
# answering at all, and it is what admits replicas when the judge is not running (HAProxy takes an
# agent that does not answer as no opinion).
WARMED_URI = "/metrics"
WARMED_RE = r"request_success_total[^ \n]* [1-9]"
# How often each replica is checked: a replica that died with nothing in flight is out after two
# checks, or at once when a request finds its port closed (and goes to another replica).
CHECK_INTERVAL_S = 2
# How long a check may take (a busy engine's /metrics under load).
CHECK_TIMEOUT_S = 5
# The progress judge's agent (appliance-judge.service on paths.JUDGE_AGENT), asked this often
# for each replica by name ("replica1\n"): its "down" takes a stalled replica out of the rotation
# at once, however well its /metrics and /health answer (vllm-project/vllm#39863).
AGENT_INTERVAL_MS = 500


def agent_reply(up: bool, reason: str = "") -> str:
    """The agent's answer for one replica as HAProxy 2.6 reads it: "up\n", or "down #REASON\n"
    (the reason shows in HAProxy's log and stats). The space before '#' is needed: HAProxy takes
    "down#REASON" as one unknown word and leaves the server up."""
    if up:
        return "up\n"
    reason = " ".join(reason.split())  # one line
    return f"down #{reason}\n" if reason else "down\n"
# How long a connection to a replica may take before it counts as refused and goes to another.
CONNECT_TIMEOUT_S = 2
# A request waits on its replica at most as long as one request can last (appliance/engine_limits.py);
# a client that goes away (Caddy closing its connection) ends it at the replica at once
# (option abortonclose). An idle client connection from Caddy stays open longer than Caddy keeps it
# (caddyfile.UPSTREAM_IDLE_S), so Caddy closes first.
KEEPALIVE_S = 10


def wanted(config: Config) -> bool:
    return config.replicas > 1


def _agent(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if host != "127.0.0.1" or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"balancer: judge agent {value!r} is not 127.0.0.1:PORT", hint="127.0.0.1:PORT")
    return host, int(port)


def template_values(config: Config, judge_agent: str = paths.JUDGE_AGENT) -> dict[str, Any]:
    header = config.proxy.affinity_header
    if header and not HEADER_NAME.fullmatch(header):
        raise ConfigError(f"proxy.affinity_header: {header!r} is not an HTTP header name",
                          hint="an HTTP header name such as X-Session-Id")
    agent_addr, agent_port = _agent(judge_agent)
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
        "request_timeout_s": request_bound_s(config),
        "agent_addr": agent_addr,
        "agent_port": agent_port,
        "agent_interval_ms": AGENT_INTERVAL_MS,
        "keepalive_s": KEEPALIVE_S,
    }


def render_balancer(config: Config, judge_agent: str = paths.JUDGE_AGENT) -> str:
    """HAProxy's configuration for CONFIG's replicas (the build installs it when wanted(config));
    JUDGE_AGENT is the judge's agent address (tests give their own)."""
    import jinja2  # only at build

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATE_DIR)), autoescape=False,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                             keep_trailing_newline=True)
    return env.get_template(TEMPLATE).render(**template_values(config, judge_agent))
