# SPDX-License-Identifier: MIT
"""`python -m bench`: every benchmark in turn against the demo profile (BENCH_ONLY=name,name: only those);
exit status 1 when any figure could not be measured, naming each. Every run writes out/bench.json and
out/bench.md (bench/report.py); a full run also the table in docs/benchmarks.md."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from appliance import config
from bench import report
from bench.attest import bench_attest
from bench.common import ROOT, measure
from bench.engine import bench_engine_slot_write
from bench.flash import bench_flash_fleet, bench_flash_vs_direct
from bench.image import bench_boot, bench_preload, bench_rebuild, bench_sealed_boot
from bench.install import bench_install
from bench.judge import bench_judge_canaries, bench_judge_removal, bench_judge_rps
from bench.metrics import bench_metrics_scrape
from bench.proxy import bench_proxy_rps, bench_proxy_stream
from bench.replicas import bench_replicas_rps
from bench.status import bench_status
from bench.upgrade import bench_bundle_bytes, bench_new_engine_bytes, bench_slot_write
from bench.weights import bench_weights_check, bench_weights_fetch

BENCHES: list[Callable[[config.Config], object]] = [
    bench_status, bench_preload, bench_bundle_bytes, bench_slot_write, bench_rebuild, bench_boot, bench_sealed_boot,
    bench_weights_fetch,
    bench_weights_check, bench_install, bench_engine_slot_write, bench_new_engine_bytes, bench_proxy_stream, bench_proxy_rps,
    bench_metrics_scrape, bench_replicas_rps, bench_judge_removal, bench_judge_rps, bench_judge_canaries,
    bench_flash_fleet, bench_flash_vs_direct, bench_attest,
]


def main(out: Path = ROOT / "out", docs: Path = report.DOCS) -> int:
    demo = config.load(ROOT / "appliance.toml", "demo")
    only = os.environ.get("BENCH_ONLY", "")
    load_start = report.load_average()
    # e.g. BENCH_ONLY=bench_boot make bench; any figure not measured makes the run fail
    outcome = measure(BENCHES, demo, only)
    if outcome.status == 2:
        return 2  # BENCH_ONLY named no benchmark: nothing ran, nothing to record
    full = len(outcome.ran) == len(BENCHES)
    report.write(outcome, report.machine(load_start), report.commit(), out, docs if full else None)
    print(f"bench: figures in {out / report.JSON_NAME} and {out / report.MARKDOWN_NAME}"
          + (f"; the table in {docs} replaced" if full else " (not a full run: docs/benchmarks.md left as it is)"))
    return outcome.status


if __name__ == "__main__":
    sys.exit(main())
