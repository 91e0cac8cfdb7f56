"""`make bench`: `applianctl status`, median of 20 runs against the stand-in engine, healthy and hung."""

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
from testkit.standin import StandinProcess


def bench_status(demo: config.Config) -> None:
    env_base = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for label, faults in (("healthy engine", {}), ("hung engine", {"STANDIN_HANG_AFTER_S": "0"})):
        engine = StandinProcess(env=faults).wait_ready()
        with tempfile.TemporaryDirectory() as tmp:
            cfg = demo.to_json()
            cfg["engine"]["port"] = engine.port
            args = cfg["engine"]["args"]
            args[args.index("--port") + 1] = str(engine.port)  # the device's config model refuses a mismatch
            path = Path(tmp) / "appliance.json"
            path.write_text(json.dumps(cfg))
            env = {**env_base, "APPLIANCE_CONFIG": str(path), "APPLIANCE_RUN_DIR": tmp}
            times = []
            for _ in range(20):
                start = time.monotonic()
                r = subprocess.run([sys.executable, "-m", "applianctl", "status", "--json"], env=env, capture_output=True)
                if r.returncode == 3:  # status could not run: its time says nothing
                    raise RuntimeError(f"applianctl status: {r.stderr.decode(errors='replace').strip()}")
                times.append(time.monotonic() - start)
            print(f"{'applianctl status, median of 20, ' + label:<44} {statistics.median(times):8.2f} s")
        engine.stop()
