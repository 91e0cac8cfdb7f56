# SPDX-License-Identifier: MIT
"""`applianctl status`: every part of the appliance, each ok, degraded, down or not configured.

All probes run side by side under one deadline (probes.DEADLINE_S), so the command answers
within 2 seconds even when the engine hangs. The overall state is the worst part's; the exit
status is 0 when healthy, 1 when degraded, 2 when down and 3 when status could not run (the
monitoring-plugin convention). `--json` prints the stable document of docs/status-schema.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from appliance import cli_help, paths, terminal
from appliance.config import Config
from appliance.errors import UserError
from appliance.host_settings import load_device
from applianctl import records
from applianctl.status import disk, engine, files, gpu, host, os_slots, probes, proxy, remediation, sealed, shm, systemd, tls, weights
from applianctl.status.document import EngineDetails, StartupDetails, StatusDocument
from applianctl.status.probes import DEGRADED, DOWN, NOT_CONFIGURED, OK, Part, Sources

SCHEMA = 1
EXIT_STATUS = {OK: 0, NOT_CONFIGURED: 0, DEGRADED: 1, DOWN: 2}

# The parts, in the order they are shown.
PARTS = (
    "os", "slots", "sealed", "units", "engine", "proxy", "startup", "verify", "preflight", "shm-check", "gpu", "shm", "disk", "tls",
    "weights", "host", "remediation",
)


def probe_table(config: Config, src: Sources) -> dict[str, Callable[[], Part]]:
    read_slots = os_slots.slots_reader(config, src)
    table: dict[str, Callable[[], Part]] = {
        "os": lambda: os_slots.probe_os(config, src, read_slots),
        "slots": lambda: os_slots.probe_slots(config, read_slots),
        "sealed": lambda: sealed.probe_sealed(_efivars(src)),
        "units": lambda: systemd.probe(paths.units(config.replicas), src.bus),
        "engine": lambda: engine.probe_engine(config, src),
        "proxy": lambda: proxy.probe_proxy(config, src),
        "startup": lambda: engine.probe_startup(config, paths.STARTUP_REPORT),
        "verify": lambda: files.probe_check(paths.VERIFY_RESULT, "image verification", records.VerifyResult),
        "preflight": lambda: files.probe_check(paths.PREFLIGHT_RESULT, "the preflight check", records.PreflightResult),
        "shm-check": lambda: files.probe_check(paths.SHM_CHECK, "the /dev/shm check", records.ShmCheck),
        "gpu": lambda: gpu.probe(config, src.run, paths.GPU_SELFTEST),
        "shm": lambda: shm.probe_shm(config, src, paths.SHM_DIR),
        "disk": lambda: disk.probe_disk(config, paths.STATE_DIR),
        "tls": lambda: tls.probe_tls(config, paths.TLS_DIR),
        "weights": lambda: weights.probe_weights(config),
        "host": lambda: host.probe_host(config, src, paths.RUN_DIR / "host.json"),
        "remediation": lambda: remediation.probe_remediation(config),
    }
    assert tuple(table) == PARTS
    return table


def _efivars(src: Sources) -> Path:
    from applianctl.slots.machine import Host

    return Path((src.slots_host or Host()).efivars)


def _cross_check(parts: dict[str, Part]) -> None:
    """Readings that only make sense together."""
    engine, startup = parts["engine"], parts["startup"]
    # While weights load and graphs are captured, vLLM's port refuses connections: that is a
    # start in progress, not a dead engine.
    refused = isinstance(engine.details, EngineDetails) and engine.details.refused
    loading = isinstance(startup.details, StartupDetails) and startup.details.report_state == "loading"
    if engine.state == DOWN and refused and loading:
        parts["engine"] = Part(DEGRADED, "starting: the port opens once the model is loaded", engine.details)


def collect(config: Config, src: Sources | None = None, deadline_s: float = probes.DEADLINE_S) -> StatusDocument:
    """The status document (docs/status-schema.md)."""
    src = src or Sources()
    started = time.monotonic()
    parts = probes.run_probes(probe_table(config, src), deadline_s)
    _cross_check(parts)
    ordered = [(name, parts[name]) for name in PARTS]
    return StatusDocument(
        schema=SCHEMA,
        state=probes.worst([p.state for _, p in ordered]),
        reason=probes.first_reason(ordered),
        appliance=config.appliance.name,
        version=config.appliance.version,
        profile=config.profile,
        generated_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        elapsed_s=round(time.monotonic() - started, 3),
        parts=dict(ordered),
    )


# ----------------------------------------------------------------------------------- output

_COLOURS = {OK: "32", DEGRADED: "33", DOWN: "31", NOT_CONFIGURED: "2"}


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}%"


def summary(name: str, part: Mapping[str, Any]) -> str:
    """One line of the most useful details of a part."""
    d = part
    if name == "os":
        usr = d.get("usr") or {}
        bc = d.get("boot_counting") or {}
        boot = bc.get("state")
        if bc.get("state") == "on trial":
            boot = f"on trial, {bc['tries_left']} tries left"
        return (
            f"version {_fmt(d.get('version'))} (image {_fmt(d.get('image_version'))}), "
            f"slot {_fmt(usr.get('slot'))}, boot counting: {boot}"
        )
    if name == "units":
        units = d.get("units") or {}
        return ", ".join(
            f"{n.removeprefix('appliance-').removesuffix('.service')} {u['active_state']}" for n, u in units.items()
        )
    if name == "engine":
        replicas = d.get("replicas") or []
        serving = f"replicas {sum(r.get('state') == OK for r in replicas)}/{len(replicas)} serving; " if replicas else ""
        judge = d.get("judge") or {}  # the progress judge: its canary's load, or why it is not judging
        judged = f"; {judge.get('note') or 'canary ' + _fmt(judge.get('canary_requests_last_hour')) + '/h'}" if judge else ""
        if d.get("models") is None and d.get("metrics") is None:
            return serving.removesuffix("; ") + judged
        m = d.get("metrics") or {}
        models = ", ".join(d.get("models") or []) or "-"
        return serving + (
            f"models {models}; running {_fmt(m.get('requests_running'))}, waiting {_fmt(m.get('requests_waiting'))}, "
            f"KV {_pct(m.get('kv_cache_usage'))}, prefix hits {_pct(m.get('prefix_cache_hit_rate'))}, "
            f"spec accept {_pct(m.get('spec_decode_acceptance_rate'))}, TTFT {_fmt(m.get('mean_ttft_s'), 3)} s"
        ) + judged
    if name == "startup":
        figs = d.get("figures") or {}
        shown = [f"{k} {_fmt(v.get('value'))}/{_fmt(v.get('expected'))}" for k, v in figs.items()]
        if not shown:
            return ""
        return "; ".join(shown) + f"; graphs {_fmt(d.get('cuda_graphs'))}, ready {_fmt(d.get('ready'))}"
    if name == "gpu":
        out = []
        for g in d.get("gpus") or []:
            used, total = g.get("vram_used_mib"), g.get("vram_total_mib")
            vram = f"{used / 1024:.1f}/{total / 1024:.1f} GiB" if used is not None and total is not None else "-"
            out.append(
                f"GPU {g['gpu']}: VRAM {vram}, {_fmt(g.get('temperature_c'), 0)} °C, {_fmt(g.get('power_w'), 0)} W, "
                f"ECC {_fmt(g.get('ecc_correctable'))}/{_fmt(g.get('ecc_uncorrectable'))}"
            )
        return "; ".join(out)
    if name == "shm" and "total_bytes" in d:
        gib = 1024**3
        return (
            f"{d['used_bytes'] / gib:.1f}/{d['total_bytes'] / gib:.1f} GiB used, "
            f"{len(d.get('offload_files') or [])} offload file(s), {len(d.get('stale_offload_files') or [])} stale"
        )
    if name == "disk":
        gib = 1024**3
        out = []
        for key in ("var", "model_cache"):
            fs = d.get(key) or {}
            if "total_bytes" in fs:
                out.append(f"{fs['path']} {fs['free_bytes'] / gib:.0f} GiB free of {fs['total_bytes'] / gib:.0f}")
        return "; ".join(out)
    if name == "proxy" and "certificate" in d:
        cert, req = d["certificate"], d.get("request") or {}
        text = f"certificate for {', '.join(cert['names']) or '-'}, expires {cert['not_after'][:10]}"
        return text + (f"; GET {req['path']} HTTP {req['status']} in {req['elapsed_s']:.2f} s" if req else "")
    if name == "tls" and "ca_sha256" in d:
        return f"CA {d['ca_sha256'][:23]}..., expires {d['ca_not_after'][:10]}"
    if name == "verify":
        text = " ".join(f"{k} {d[k]}" for k in ("version", "signer") if k in d)
        # overrides absent: this image has no factory /etc record (the reason names the overrides)
        return text + ("; /etc not compared" if not isinstance(d.get("overrides"), list) else "")
    if name == "weights" and d.get("files") is not None:
        verified = ", verified" if d.get("verified") else ""
        return f"revision {d['revision'][:12]}, {d['files']} files, {d['bytes'] / 1024**3:.1f} GiB{verified}"
    if name == "host" and "hostname" in d:
        return f"{d['hostname']} {', '.join(d['addresses'] or [])} (settings from the {d['source'] or 'image defaults'})"
    return ""


def render(doc: StatusDocument, out: TextIO, colour: bool) -> None:
    def paint(state: str, text: str) -> str:
        return f"\033[{_COLOURS[state]}m{text}\033[0m" if colour else text

    width = max(len(state) for state in _COLOURS)
    head = f"{doc.appliance} {doc.version}: "
    out.write(head + paint(doc.state, doc.state) + (f" ({doc.reason})" if doc.reason else "") + "\n")
    for name, part in doc.parts.items():
        line = f"  {name:<10} {paint(part.state, part.state.ljust(width))}  "
        shown = part.to_json()
        text = part.reason or summary(name, shown)
        if part.reason and (extra := summary(name, shown)):
            text += f" [{extra}]"
        out.write(line + text + "\n")


UNKNOWN_EXIT = 3  # the monitoring-plugin convention: status could not be determined


def run(args: argparse.Namespace, src: Sources | None = None) -> int:
    if getattr(args, "output", None) and not getattr(args, "prometheus", False):
        raise UserError("--output writes the Prometheus text only", hint="applianctl status --prometheus --output FILE")
    try:
        config = load_device()
        if getattr(args, "timeout_scale", 1.0) != 1:
            probes.scale_timeouts(args.timeout_scale)
        doc = collect(config, src, probes.DEADLINE_S)
    except UserError as e:
        # Could not run: "unknown" (3), never "down" (2), which a monitor would page on as an outage.
        print(f"applianctl status: unknown: {e.message}", file=sys.stderr)
        print(f"hint: {e.hint or 'see `applianctl status --help`'}", file=sys.stderr)
        return UNKNOWN_EXIT
    if args.json:
        json.dump(doc.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif getattr(args, "prometheus", False):
        from applianctl.status import exposition, gpu_metrics

        # the GPUs' own series (device-metrics-exporter's names) after the status document's
        text = exposition.render(doc, config.metrics.refresh_s) + gpu_metrics.exposition(probes.run_command, probes.COMMAND_TIMEOUT_S * 5)
        if getattr(args, "output", None):
            # whole or not at all: node_exporter's textfile collector may read it at any moment
            from appliance.atomic import atomic_write

            atomic_write(Path(args.output), text.encode(), 0o644)
        else:
            sys.stdout.write(text)
    else:
        render(doc, sys.stdout, colour=terminal.escapes(sys.stdout))
    sys.stdout.flush()
    return EXIT_STATUS[doc.state]


def add_parser(subparsers: Any) -> None:
    p = cli_help.verb_parser(
        subparsers, "status", "show the state of every part of the appliance",
        examples=["applianctl status", "applianctl status --json", "applianctl status --prometheus --output /run/metrics/appliance.prom"],
        exit_codes=[(0, "ok (or not configured)"), (1, "degraded"), (2, "down"),
                    (3, "unknown: status could not run, a usage error included (stderr: what, then a hint)")],
        details="The exit statuses follow the monitoring-plugin convention (docs/status-schema.md).",
    )
    output = p.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the JSON document of docs/status-schema.md")
    output.add_argument("--prometheus", action="store_true",
                        help="print the same as Prometheus metrics (text format; monitoring/ holds alert rules and a dashboard)")
    p.add_argument("--output", metavar="FILE", help="with --prometheus: write FILE (atomically) instead of standard output "
                   "(appliance-metrics.service, for node_exporter's textfile collector)")
    p.add_argument("--timeout-scale", type=float, default=1.0, metavar="N",
                   help="multiply every probe's timeout by N (slow hosts, e.g. emulated test VMs)")
    p.set_defaults(func=run)
