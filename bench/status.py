# SPDX-License-Identifier: MIT
"""`make bench`: `applianctl status`, median of 20 runs against the stand-in engine, healthy and
hung, against the engine's own facts read by hand in the same runs: a plain Python script (the
same interpreter, started the same way) that GETs /health, /v1/models and /metrics on one
keep-alive connection within the same time limits the status probe has, and stops at the first
answer that does not come. The ratio is what every other part of status costs on top."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from appliance import config
from applianctl.status import probes
from bench.common import Figure, measured
from testkit.standin import StandinProcess

RUNS = 20

# the engine's facts with nothing around them: argv is PORT HTTP_TIMEOUT_S BUDGET_S
BY_HAND = """
import http.client, sys, time
port, timeout, budget = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + budget
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
seen = {}
try:
    for path in ("/health", "/v1/models", "/metrics"):
        conn.timeout = min(timeout, end - time.monotonic())
        if conn.sock is not None:
            conn.sock.settimeout(conn.timeout)
        conn.request("GET", path)
        r = conn.getresponse()
        seen[path] = (r.status, len(r.read(8 << 20)))
except OSError as e:
    seen["error"] = str(e)
print(seen)
"""


def _timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.monotonic()
    r = subprocess.run(argv, env=env, capture_output=True)
    seconds = time.monotonic() - start
    if r.returncode == 3 or (argv[1] == "-c" and r.returncode != 0):  # could not run: its time says nothing
        raise RuntimeError(f"{' '.join(argv[:3])[:60]}: {r.stderr.decode(errors='replace').strip()[-400:]}")
    return seconds


def bench_status(demo: config.Config, runs: int = RUNS) -> list[Figure]:
    env_base = {**os.environ, "PYTHONWARNINGS": "ignore"}
    figures = []
    for label, faults in (("healthy engine", {}), ("hung engine", {"STANDIN_HANG_AFTER_S": "0"})):
        engine = StandinProcess(env=faults).wait_ready()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                cfg = demo.to_json()
                cfg["engine"]["port"] = engine.port
                args = cfg["engine"]["args"]
                args[args.index("--port") + 1] = str(engine.port)  # the device's config model refuses a mismatch
                path = Path(tmp) / "appliance.json"
                path.write_text(json.dumps(cfg))
                env = {**env_base, "APPLIANCE_CONFIG": str(path), "APPLIANCE_RUN_DIR": tmp}
                status = [sys.executable, "-m", "applianctl", "status", "--json"]
                by_hand = [sys.executable, "-c", BY_HAND, str(engine.port), str(probes.HTTP_TIMEOUT_S), str(probes.ENGINE_BUDGET_S)]
                ours, base = [], []
                for _ in range(runs):  # alternated, so that the host's drift weighs on both
                    ours.append(_timed(status, env))
                    base.append(_timed(by_hand, env))
                mine, plain = statistics.median(ours), statistics.median(base)
                figures.append(measured(f"applianctl status, median of {runs}, {label} (vs by hand)", mine, plain, "s",
                                        note="the rest of status on top of the engine's answers"))
        finally:
            engine.stop()
    return figures
