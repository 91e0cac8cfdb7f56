# SPDX-License-Identifier: MIT
"""The real Caddy on the rendered demo Caddyfile in front of a backend on loopback, for the proxy
tests and `make bench` (one place for how it is started: certificates, an unprivileged home, ready
once its HTTPS port connects)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CADDY = shutil.which("caddy") or "/usr/bin/caddy"
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


class NotReady(RuntimeError):
    """A process this module started exited, or did not become ready in time; the message holds its log's tail."""


def caddy_env(home: Path) -> dict[str, str]:
    """Caddy's environment with its data and configuration under HOME, not the user's."""
    return {**os.environ, "HOME": str(home), "XDG_DATA_HOME": str(home / "data"), "XDG_CONFIG_HOME": str(home / "config")}


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, timeout: float = 20) -> None:
    """Return once READY() holds; raise NotReady when PROC exits first or TIMEOUT passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NotReady(f"{what} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise NotReady(f"{what} not ready after {timeout:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")


def connects(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def running(caddyfile: Path, home: Path, https_port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The real Caddy on CADDYFILE, running until the block ends; ready once HTTPS_PORT connects."""
    if not os.access(CADDY, os.X_OK):
        raise NotReady(f"{CADDY}: no caddy (apt install caddy)")
    with log.open("wb") as out:
        caddy = subprocess.Popen([CADDY, "run", "--config", str(caddyfile), "--adapter", "caddyfile"],
                                 env=caddy_env(home), stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready("caddy", lambda: connects(https_port), caddy, log)
        yield caddy
    finally:
        stop(caddy)


@contextlib.contextmanager
def balancer_running(cfg: Path, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The real HAProxy on CFG in the foreground, running until the block ends; ready once PORT connects."""
    if not os.access(HAPROXY, os.X_OK):
        raise NotReady(f"{HAPROXY}: no haproxy (apt install haproxy)")
    with log.open("wb") as out:
        proc = subprocess.Popen([HAPROXY, "-db", "-f", str(cfg)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready("haproxy", lambda: connects(port), proc, log)
        yield proc
    finally:
        stop(proc)


@dataclasses.dataclass(frozen=True)
class Front:
    """The proxy as a client sees it: HTTPS on 127.0.0.1:PORT, trusting CA."""

    port: int
    ca: Path
    log: Path

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


@contextlib.contextmanager
def demo_front(engine_port: int, work: Path, *, replicas: int = 1, affinity_header: str = "",
               judge_health: str | None = None, judge_agent: str | None = None) -> Iterator[Front]:
    """Caddy on the demo profile's rendered Caddyfile (its own certificates from applianctl.tls),
    forwarding to 127.0.0.1:ENGINE_PORT; loopback admitted, no plain HTTP, no admin API. With
    REPLICAS, the layout REPLICASx1: the replicas at ENGINE_PORT, +2, +4, ... (Config.replica_port)
    behind the real HAProxy on the rendered balancer configuration, at the port after them.
    JUDGE_HEALTH and JUDGE_AGENT: where the proxy's /health and the balancer's agent-check ask the
    judge (paths.JUDGE_HEALTH, paths.JUDGE_AGENT by default)."""
    import appliance.config
    from appliance import balancer, paths
    from appliance.caddyfile import render_caddyfile
    from applianctl import tls
    from testkit.standin import ROOT, free_port

    https_port = free_port()
    config = appliance.config.load(ROOT / "appliance.toml", "demo")
    config = dataclasses.replace(
        config,
        proxy=dataclasses.replace(config.proxy, https_port=https_port, http="close",
                                  allowed_cidrs=("127.0.0.1/32",), metrics_cidrs=()),
        engine=dataclasses.replace(config.engine, port=engine_port),
        topology=dataclasses.replace(config.topology, gpus=replicas, layout=f"{replicas}x1"),
    )
    if affinity_header:
        config = dataclasses.replace(config, proxy=dataclasses.replace(config.proxy, affinity_header=affinity_header))
    tls_dir = work / "tls"
    tls.generate(tls_dir, config.proxy.hostname, tls.host_addresses(), group="appliance-no-such-group")
    caddyfile = work / "Caddyfile"
    caddyfile.write_text(render_caddyfile(config, tls_dir=tls_dir, http_port=free_port(), admin="off",
                                          judge_health=judge_health or paths.JUDGE_HEALTH))
    log = work / "caddy.log"
    with contextlib.ExitStack() as stack:
        if balancer.wanted(config):
            cfg = work / "haproxy.cfg"
            cfg.write_text(balancer.render_balancer(config, judge_agent or paths.JUDGE_AGENT))
            stack.enter_context(balancer_running(cfg, config.balancer_port, work / "haproxy.log"))
        stack.enter_context(running(caddyfile, work / "home", https_port, log))
        yield Front(https_port, tls_dir / "ca.crt", log)
