"""`python -m bench`: every benchmark in turn against the demo profile (BENCH_ONLY=name,name: only those)."""

from __future__ import annotations

import os
import sys

from appliance import config
from bench.common import ROOT
from bench.engine import bench_engine_slot_write
from bench.image import bench_boot, bench_preload, bench_rebuild
from bench.install import bench_install
from bench.status import bench_status
from bench.upgrade import bench_bundle_bytes, bench_new_engine_bytes, bench_slot_write
from bench.weights import bench_weights_check, bench_weights_fetch

BENCHES = [bench_status, bench_preload, bench_bundle_bytes, bench_slot_write, bench_rebuild, bench_boot,
           bench_weights_fetch, bench_weights_check, bench_install, bench_engine_slot_write, bench_new_engine_bytes]


def main() -> int:
    demo = config.load(ROOT / "appliance.toml", "demo")
    only = os.environ.get("BENCH_ONLY")  # e.g. BENCH_ONLY=bench_boot make bench
    for bench in BENCHES:
        if only and bench.__name__ not in only.split(","):
            continue
        try:
            bench(demo)
        except Exception as e:  # a benchmark that cannot run says so and the others still run
            print(f"{bench.__name__}: not measured: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
