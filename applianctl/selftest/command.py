# SPDX-License-Identifier: MIT
"""`applianctl selftest [--json] [--previous FILE]`: the GPU self-test on demand; `--at-boot`:
appliance-gpu-selftest.service, before every engine start.

Exit 0 when every GPU passed, 1 when a GPU failed (the report says which and why), 2 for bad input
(one line and a hint), 3 when it could not run (no tool listed the GPUs, or the test itself broke),
with a hint: no amdgpu/KFD device (no AMD GPU, a QEMU guest), or the tools that list GPUs.

--at-boot judges the GPUs the topology uses (0 .. topology.gpus - 1) against the correctable ECC
counts of the last run in which they passed (paths.gpu_selftest_baseline_path(), kept on /var),
writes this boot's report to paths.GPU_SELFTEST for status, and keeps the counts only when no GPU
the engines use failed (so a rise stays a failure until someone looks). GPUs beyond the topology's
are "not expected" in the report: idle, not fatal. A failed GPU takes out only the replicas that run
on it: each replica's unit runs `--replica I` before it starts, which fails when the boot's report
names one of replica I's GPUs. Exit 1 when every replica has a failed GPU (no engine can start);
a failed GPU the topology does not use is reported, not fatal. Could not run: exit 3 when the
profile requires a GPU, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from appliance import cli_help, paths
from appliance.atomic import atomic_write
from appliance.errors import UserError
from appliance.safe_read import MAX_RECORD_BYTES, loads_bounded, read_capped, set_aside
from appliance.schema import from_json
from applianctl.records import SelftestBaseline
from applianctl.selftest.checks import EXIT_COULD_NOT_RUN, FAILED, NOT_CHECKED, Expectations, Report, run
from applianctl.selftest.facts import kfd_sees_a_gpu
from applianctl.selftest.readings import DEADLINE_S, Readings, collect
from applianctl.status.probes import run_command

_HINT = "pass a report `applianctl selftest --json` printed, or leave --previous out"


def could_not_run_hint(readings: Readings | None) -> str:
    """What to do when the self-test could not run (exit 3): without a GPU the KFD sees, nothing
    to test (a machine without an AMD GPU, a QEMU guest); with one, the tools that list it."""
    if readings is None:
        return "the self-test broke: run `applianctl --debug selftest` for the traceback"
    if not kfd_sees_a_gpu(readings.kfd_nodes):
        return ("no amdgpu/KFD device: on a machine without an AMD GPU the self-test cannot run (in QEMU that is expected); "
                "on a GPU host, check that the amdgpu driver is loaded (journalctl -k | grep amdgpu)")
    return "the KFD sees a GPU but neither amd-smi nor rocm-smi listed it: check that amd-smi is installed and that amd-smi list works"


def previous_counts(path: Path) -> Mapping[str, Any] | None:
    """The correctable ECC counts of the report at PATH (None when there is no file yet); UserError
    (one line) when it is no regular file, not JSON, or its counts are not counts (a negative one
    would make every later count a rise)."""
    data = read_capped(path, MAX_RECORD_BYTES, what="an earlier self-test report", hint=_HINT)
    if data is None:
        return None
    try:
        doc = loads_bounded(data)
    except ValueError as e:
        raise UserError(f"{path}: not JSON ({e})".splitlines()[0], hint=_HINT) from None
    if not isinstance(doc, Mapping) or "correctable_counts" not in doc:
        raise UserError(f"{path}: not a self-test report (no correctable_counts)", hint=_HINT)
    try:
        return from_json(SelftestBaseline, doc, str(path), lenient=True).correctable_counts
    except UserError as e:
        raise UserError(e.message, hint=_HINT) from None


def render(report: Report) -> str:
    """The report for a person: a line per GPU, each failure's reason under it, what was not checked."""
    if report.could_not_run:
        return f"could not run: {report.could_not_run}"
    lines = []
    for g in report.gpus:
        where = f" ({g.bdf})" if g.bdf else ""
        lines.append(f"GPU {g.index}{where}: {g.state}")
        lines += [f"  {f.check}: {f.reason}" for f in g.findings if f.state == FAILED]
    lines += [f"host: {f.check}: {f.reason}" for f in report.host if f.state == FAILED]
    unchecked: dict[str, list[str]] = {}
    for f in [f for g in report.gpus for f in g.findings] + list(report.host):
        if f.state == NOT_CHECKED:
            unchecked.setdefault(f.check, []).append(f.reason)
    for check, reasons in unchecked.items():
        distinct = list(dict.fromkeys(reasons))
        more = f" (and {len(distinct) - 1} more)" if len(distinct) > 1 else ""
        lines.append(f"not checked: {check}: {distinct[0]}{more}")
    lines += [f"problem: {p}" for p in report.problems]
    failed = report.failed_gpus
    lines.append(f"failed GPUs: {', '.join(map(str, failed))}" if failed else "all GPUs passed")
    return "\n".join(lines)


def at_boot(debug: bool = False) -> int:
    from appliance.host_settings import load_device

    config = load_device()
    used = list(range(config.topology.gpus))
    baseline = paths.gpu_selftest_baseline_path()
    try:
        previous = previous_counts(baseline)
    except UserError as e:  # a damaged baseline is no reason to keep every GPU out: start afresh
        print(f"applianctl selftest: {e.message}; starting from this run's counts", file=sys.stderr)
        previous = None
    readings = None
    try:
        expected = Expectations(gpu_count=config.topology.gpus, render_node_per_gpu=config.replicas > 1)
        readings = collect(run_command, DEADLINE_S)
        report = run(readings, expected, previous)
        failure = ""
    except Exception as e:
        if debug:
            raise
        report, failure = None, f"{type(e).__name__}: {e}".splitlines()[0]
    doc: dict[str, Any] = report.to_json() if report is not None else {"ok": False, "could_not_run": failure, "failed_gpus": []}
    failed_used = sorted(set(doc.get("failed_gpus") or []) & set(used))
    doc.update({"used_gpus": used, "failed_used_gpus": failed_used, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    atomic_write(paths.GPU_SELFTEST, (json.dumps(doc, sort_keys=True) + "\n").encode(), 0o644)
    if report is not None and not report.could_not_run and not failed_used:
        _keep_baseline(baseline, report.correctable_counts)
    print(render(report) if report is not None else f"could not run: {failure}")
    if report is None or report.could_not_run:
        if not config.gpu.required:
            return 0
        print(f"hint: {could_not_run_hint(readings)}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    out = replicas_out(config.topology, failed_used)
    if out:
        print(f"GPU(s) {', '.join(map(str, failed_used))} failed: replica(s) {', '.join(map(str, out))} stay stopped", file=sys.stderr)
    return 1 if len(out) == config.topology.replicas else 0


def _keep_baseline(path: Path, counts: Mapping[str, int]) -> None:
    """COUNTS as the next boot's baseline; what is no regular file in its place is renamed aside (a
    directory there would fail every boot's self-test), and a baseline that cannot be written is
    one line: this boot's verdict stands."""
    try:
        if (kind := set_aside(path)) is not None:
            print(f"applianctl selftest: {path} was {kind}: moved to {path.name}.damaged", file=sys.stderr)
        atomic_write(path, (json.dumps({"correctable_counts": dict(counts)}, sort_keys=True) + "\n").encode(), 0o644)
    except OSError as e:
        print(f"applianctl selftest: {path}: cannot write ({e.strerror or e}); the next boot compares with the last kept counts",
              file=sys.stderr)


def replicas_out(topology: Any, failed_gpus: list[int]) -> list[int]:
    """The replicas that run on a failed GPU."""
    return [i for i in range(topology.replicas) if set(topology.replica_gpus(i)) & set(failed_gpus)]


def replica_gate(replica: int, report_path: Path | None = None) -> int:
    """Before replica REPLICA starts: exit 1 when this boot's self-test failed one of its GPUs. No
    report is no verdict (the self-test is skipped without /dev/kfd, and a self-test that failed to
    run already stops every engine through Requires=); a report that cannot be read fails closed."""
    from appliance.host_settings import load_device

    topology = load_device().topology
    if not 0 <= replica < topology.replicas:
        raise UserError(f"no replica {replica}: topology {topology.layout} has {topology.replicas}",
                        hint=f"pass a replica from 0 to {topology.replicas - 1}")
    path = report_path or paths.GPU_SELFTEST
    try:
        raw = read_capped(path, MAX_RECORD_BYTES, what="the self-test report")
    except UserError as e:
        print(f"{e.message}: replica {replica} stays stopped", file=sys.stderr)
        return 1
    if raw is None:
        return 0
    try:
        doc = loads_bounded(raw)
        failed = [int(g) for g in doc.get("failed_used_gpus") or []]
    except (ValueError, TypeError, AttributeError) as e:
        print(f"{path}: not a self-test report ({type(e).__name__}): replica {replica} stays stopped", file=sys.stderr)
        return 1
    if replica in replicas_out(topology, failed):
        gpus = sorted(set(topology.replica_gpus(replica)) & set(failed))
        print(f"replica {replica} runs on GPU(s) {', '.join(map(str, gpus))}, which failed this boot's self-test "
              "(applianctl status shows why): it stays stopped", file=sys.stderr)
        return 1
    return 0


def main(args: argparse.Namespace) -> int:
    if args.replica is not None:
        return replica_gate(args.replica)
    if args.at_boot:
        return at_boot(getattr(args, "debug", False))
    previous = previous_counts(args.previous) if args.previous is not None else None
    try:
        readings = collect(run_command, DEADLINE_S)
        report = run(readings, Expectations(), previous)
    except Exception as e:  # a self-test that breaks has not run: never a traceback read as "GPU failed"
        if args.debug:
            raise
        print(f"applianctl selftest: could not run: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        print(f"hint: {could_not_run_hint(None)}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    print(json.dumps(report.to_json(), indent=2) if args.json else render(report))
    if report.could_not_run:
        print(f"hint: {could_not_run_hint(readings)}", file=sys.stderr)
    return report.exit_status


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = cli_help.verb_parser(
        sub, "selftest", "check every GPU, read-only, before an engine starts",
        examples=["applianctl selftest", "applianctl selftest --json > now.json",
                  "applianctl selftest --previous now.json"],
        exit_codes=[(0, "every GPU passed"),
                    (1, "a GPU failed (--at-boot: every replica has a failed GPU; --replica I: a GPU of replica I failed)"),
                    cli_help.BAD_INPUT, (3, "the test could not run (no GPU tool or no GPU seen; a hint on stderr)")],
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON (it holds the correctable ECC counts to keep)")
    p.add_argument("--previous", type=Path, metavar="FILE",
                   help="an earlier --json report: correctable ECC errors must not have risen since")
    p.add_argument("--at-boot", action="store_true",
                   help="(appliance-gpu-selftest.service) the topology's GPUs against the last passing run; "
                        "the report for status; exit 1 when every replica has a failed GPU")
    p.add_argument("--replica", type=int, metavar="I",
                   help="(each engine replica's unit, before it starts) exit 1 when this boot's self-test failed a GPU of replica I")
    p.set_defaults(func=main)
