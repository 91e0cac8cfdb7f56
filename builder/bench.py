"""`make bench`: figures as ratios against baselines measured in the same run.

- rebuild with no change: the builder (checks, generation, mkosi) against plain mkosi given the
  same generated tree and options (target: at most 1.3x);
- preloading a generated engine image of 2 GiB (cold) against a plain copy of the same bytes
  (target: at most 1.3x), and again with the cache warm (target: under 5 s);
- `applianctl status`: median of 20 runs against the stand-in engine, healthy and hung.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from builder import build, config, engine_image
from builder.run import mkosi_command

ROOT = Path(__file__).resolve().parents[1]


def _time(fn: Callable[[], object]) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def _row(name: str, ours: float, base: float, target: str) -> None:
    print(f"{name:<44} {ours:8.2f} s  baseline {base:8.2f} s  ratio {ours / base:5.2f}x  ({target})")


def bench_rebuild(demo: config.Config) -> None:
    build.build(demo)  # warm caches so that both sides rebuild
    ours = _time(lambda: build.build(demo))
    key = build.signing_key_for(demo, None)
    generated, sandbox, repart = build.prepare(demo, None, key)
    out = Path(tempfile.mkdtemp(prefix="bench-mkosi-"))
    args = build.mkosi_arguments(demo, generated, sandbox, repart, out, key)
    cmd = [*mkosi_command(), *args, "build"]
    plain = _time(lambda: subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    shutil.rmtree(out, ignore_errors=True)
    _row("rebuild, no change (builder vs plain mkosi)", ours, plain, "target <= 1.3x")


def bench_preload(demo: config.Config, size: int = 2 * 1024**3) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-engine-", dir="/var/tmp"))
    try:
        layout = work / "layout"
        layer = work / "layer"
        with open(layer, "wb") as f:
            for _ in range(size // (64 * 1024**2)):
                f.write(os.urandom(64 * 1024**2))
        digest = engine_image.write_layout(layout, layer)
        pinned = dataclasses.replace(demo, engine=dataclasses.replace(demo.engine, digest=digest))
        cache = engine_image.CACHE / digest.replace(":", "-")
        shutil.rmtree(cache, ignore_errors=True)
        plain = _time(lambda: shutil.copytree(layout, work / "plain-copy"))
        cold = _time(lambda: engine_image.obtain(pinned, layout))
        warm = _time(lambda: engine_image.obtain(pinned, layout))
        _row("preload 2 GiB engine image, cold vs copy", cold, plain, "target <= 1.3x")
        print(f"{'preload 2 GiB engine image, warm (cache hit)':<44} {warm:8.2f} s  (target < 5 s)")
        shutil.rmtree(cache, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_status(demo: config.Config) -> None:
    from standin.testing import StandinProcess

    env_base = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for label, faults in (("healthy engine", {}), ("hung engine", {"STANDIN_HANG_AFTER_S": "0"})):
        engine = StandinProcess(env=faults).wait_ready()
        with tempfile.TemporaryDirectory() as tmp:
            cfg = demo.to_json()
            cfg["engine"]["port"] = engine.port
            path = Path(tmp) / "appliance.json"
            path.write_text(json.dumps(cfg))
            env = {**env_base, "APPLIANCE_CONFIG": str(path), "APPLIANCE_RUN_DIR": tmp}
            times = []
            for _ in range(20):
                start = time.monotonic()
                subprocess.run([sys.executable, "-m", "applianctl", "status", "--json"], env=env, capture_output=True)
                times.append(time.monotonic() - start)
            print(f"{'applianctl status, median of 20, ' + label:<44} {statistics.median(times):8.2f} s")
        engine.stop()


def main() -> int:
    demo = config.load(ROOT / "appliance.toml", "demo")
    for bench in (bench_status, bench_preload, bench_rebuild):
        try:
            bench(demo)
        except Exception as e:  # a benchmark that cannot run says so and the others still run
            print(f"{bench.__name__}: not measured: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
