# SPDX-License-Identifier: MIT
"""`make bench`, the metrics: one scrape as Prometheus makes it (HTTPS GET /metrics on
the proxy's metrics site: the real Caddy on the rendered demo Caddyfile, Debian's real
node_exporter behind it serving the textfile that `applianctl status --prometheus --output`
wrote, as appliance-metrics.service writes it) against `applianctl status --json` alone, both
against the same stand-in engine in the same run, alternated. Goal: at most 1.5x, and under
250 ms. Also the exporters' CPU time per scrape (node_exporter and Caddy, from /proc) and per
refresh of the textfile (the status run, from its rusage).

The host has no systemd as PID 1 here, so node_exporter's systemd collector is left out; on the
appliance it adds one D-Bus call per scrape.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import resource
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from appliance import config
from appliance.caddyfile import render_caddyfile
from applianctl import tls
from bench.common import Figure, measured
from testkit import caddy
from testkit.standin import StandinProcess, free_port

NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
RUNS = 20
RATIO_GOAL = 1.5
ABSOLUTE_GOAL_S = 0.250


def _cpu_seconds(pid: int) -> float:
    """utime + stime of PID so far (/proc/PID/stat fields 14 and 15, in clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _scrape(port: int, ctx: ssl.SSLContext) -> tuple[float, int]:
    """One scrape on a new connection (TLS handshake included): seconds and bytes."""
    start = time.monotonic()
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
    try:
        conn.request("GET", "/metrics", headers={"Host": f"appliance.local:{port}"})
        r = conn.getresponse()
        body = r.read()
    finally:
        conn.close()
    seconds = time.monotonic() - start
    if r.status != 200 or b"appliance_part_state" not in body or b"node_memory_MemAvailable_bytes" not in body:
        raise RuntimeError(f"a scrape answered {r.status} without the appliance's and the host's series: {body[:300]!r}")
    return seconds, len(body)


def _timed_status(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, of the child) of one status run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    r = subprocess.run(argv, env=env, capture_output=True)
    seconds = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode == 3:
        raise RuntimeError(f"status could not run: {r.stderr.decode(errors='replace')[-400:]}")
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def bench_metrics_scrape(demo: config.Config, runs: int = RUNS) -> list[Figure]:
    if not os.access(NODE_EXPORTER, os.X_OK):
        raise RuntimeError(f"{NODE_EXPORTER}: missing (make setup installs prometheus-node-exporter)")
    engine = StandinProcess().wait_ready()
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            cfg = demo.to_json()
            cfg["engine"]["port"] = engine.port
            args = cfg["engine"]["args"]
            args[args.index("--port") + 1] = str(engine.port)
            (tmp / "appliance.json").write_text(json.dumps(cfg))
            env = {**os.environ, "PYTHONWARNINGS": "ignore", "APPLIANCE_CONFIG": str(tmp / "appliance.json"),
                   "APPLIANCE_RUN_DIR": str(tmp)}
            textfiles = tmp / "metrics"
            textfiles.mkdir()
            refresh = [sys.executable, "-m", "applianctl", "status", "--prometheus", "--output", str(textfiles / "appliance.prom")]
            _, refresh_cpu = _timed_status(refresh, env)

            node_port, https_port, http_port, metrics_port = (free_port() for _ in range(4))
            node_log = tmp / "node_exporter.log"
            with node_log.open("wb") as out:
                node = subprocess.Popen([NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{node_port}",
                                         f"--collector.textfile.directory={textfiles}"], stdout=out, stderr=subprocess.STDOUT)
            try:
                caddy.wait_ready("node_exporter", lambda: caddy.connects(node_port), node, node_log)
                device = config.device.from_json(cfg, tmp / "appliance.json")
                device = dataclasses.replace(
                    device, proxy=dataclasses.replace(device.proxy, https_port=https_port),
                    metrics=dataclasses.replace(device.metrics, port=metrics_port))
                tls.generate(tmp / "tls", device.proxy.hostname, [], group="appliance-no-such-group")
                sock = Path(tempfile.mkdtemp(prefix="bm-"))
                caddyfile = tmp / "Caddyfile"
                caddyfile.write_text(render_caddyfile(device, tls_dir=tmp / "tls", http_port=http_port, admin=f"unix/{sock}/a.sock",
                                                      node_exporter=f"127.0.0.1:{node_port}"))
                ctx = ssl.create_default_context(cafile=str(tmp / "tls/ca.crt"))
                ctx.check_hostname = False  # the certificate names appliance.local; the address is loopback
                with caddy.running(caddyfile, tmp, metrics_port, tmp / "caddy.log") as proxy:
                    _scrape(metrics_port, ctx)  # warm: the first scrape loads node_exporter's collectors
                    status = [sys.executable, "-m", "applianctl", "status", "--json"]
                    scrapes, statuses, sizes = [], [], []
                    node_cpu0, proxy_cpu0 = _cpu_seconds(node.pid), _cpu_seconds(proxy.pid)
                    for _ in range(runs):  # alternated, so that the host's drift weighs on both
                        seconds, size = _scrape(metrics_port, ctx)
                        scrapes.append(seconds)
                        sizes.append(size)
                        statuses.append(_timed_status(status, env)[0])
                    node_cpu = (_cpu_seconds(node.pid) - node_cpu0) / runs
                    proxy_cpu = (_cpu_seconds(proxy.pid) - proxy_cpu0) / runs
            finally:
                caddy.stop(node)
    finally:
        engine.stop()
    scrape, alone = statistics.median(scrapes), statistics.median(statuses)
    figure = measured(f"metrics scrape through the proxy, median of {runs} (vs status --json)", scrape * 1000, alone * 1000, "ms",
                      at_most=RATIO_GOAL, under=ABSOLUTE_GOAL_S * 1000,
                      note=f"{statistics.median(sizes) / 1024:.1f} KiB; CPU per scrape: node_exporter {node_cpu * 1000:.1f} ms, "
                           f"Caddy {proxy_cpu * 1000:.1f} ms; per refresh of the status textfile {refresh_cpu * 1000:.1f} ms")
    return [figure]
