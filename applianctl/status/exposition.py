# SPDX-License-Identifier: MIT
"""`applianctl status --prometheus`: the status document (docs/status-schema.md) as Prometheus
metrics in the text exposition format, so that what a scraper alerts on is what `applianctl
status --json` says at the same moment. Every series is a gauge named appliance_*; one series per
part and state (1 for the part's state, 0 for the others), so an alert never depends on a reason
text. Label values come from the device's own records and are escaped as the format requires.
monitoring/ holds the alert rules and the dashboard written against these names.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TypeVar

from applianctl.records import LADDER_STEPS, REPLICA_STATES
from applianctl.status.document import (
    Details,
    DiskDetails,
    EngineDetails,
    RemediationDetails,
    SealedDetails,
    ShmDetails,
    SlotsDetails,
    StartupDetails,
    StatusDocument,
    TlsDetails,
    WeightsDetails,
)
from applianctl.status.engine import REASON_CLASSES

D = TypeVar("D", bound=Details)

OVERALL = ("ok", "degraded", "down")
PART_STATES = ("ok", "degraded", "down", "not configured")
# status part sealed: the facts whose loss weakens the appliance's seal, each 1 or 0
SEALED_FLAGS = ("secure_boot", "db_trusts_appliance", "tpm", "pcr_signature", "usr_signature", "var_encrypted", "var_sealed",
                "var_recovery_key")

HELP = {
    "appliance_info": "the appliance's name, version and profile (always 1)",
    "appliance_state": "the overall state: 1 for the current one, 0 for the others",
    "appliance_status_seconds": "how long collecting the status took",
    "appliance_part_state": "each part's state: 1 for the current one, 0 for the others",
    "appliance_replica_state": "each engine replica's state (label gpus: the GPUs it runs on): 1 for the current one, 0 for the "
                               "others; state ok, degraded or down as status says (the judge's verdict over /health), and "
                               "starting, alive, stalled, restarting or held as the progress judge says, with reason the "
                               "judge's reason in one word (none, no_tokens, canary_timeout, ...)",
    "appliance_replica_restarts": "restarts of each engine replica by the progress judge this boot",
    "appliance_canary_requests_last_hour": "one-token canary completions the progress judge sent in the last hour",
    "appliance_slot_info": "each /usr slot: its version, its state (good, on trial, bad, empty) and whether it is booted",
    "appliance_slot_tries_left": "boot tries left of the slot's version (absent when it is not counted)",
    "appliance_running_good": "1 when the running version is judged good",
    "appliance_rolled_back": "1 when the last update was rolled back",
    "appliance_sealed": "each fact of the seal (Secure Boot, TPM, signatures, /var): 1 or 0",
    "appliance_weights_verified": "1 when every weight file matched its signed digest before the engine started",
    "appliance_startup_figure": "the engine's startup report: each figure as logged",
    "appliance_startup_figure_expected": "the engine's startup report: each figure as the runbook expects it",
    "appliance_disk_free_bytes": "free bytes where the appliance keeps its state and the model cache",
    "appliance_disk_total_bytes": "size of the file systems of appliance_disk_free_bytes",
    "appliance_shm_free_bytes": "free bytes in /dev/shm (the engine's CPU KV offload lives there)",
    "appliance_shm_stale_offload_files": "offload files in /dev/shm that no process holds",
    "appliance_tls_ca_days_left": "days until the appliance CA expires",
    "appliance_metrics_refresh_seconds": "how often this text is rewritten (metrics.refresh_s): its staleness alert follows it",
    "appliance_remediation_step": "the hive-wide GPU fault ladder's step (none, restart, reboot, physical): 1 for the current one",
    "appliance_remediation_faults": "hive-wide GPU faults counted since the ladder last started again",
    "appliance_needs_physical_action": "1 when the hive-wide fault ladder holds the replicas down: someone must look at the machine",
}


def escape(value: object) -> str:
    """A label value as the text format needs it: backslash, double quote and newline escaped."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(name: str, labels: dict[str, object], value: float) -> str:
    inner = ",".join(f'{k}="{escape(v)}"' for k, v in labels.items())
    text = repr(float(value)) if not float(value).is_integer() else str(int(value))
    return f"{name}{{{inner}}} {text}" if inner else f"{name} {text}"


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _details(doc: StatusDocument, name: str, cls: type[D]) -> D | None:
    """Part NAME's details when its probe gave them (a probe that timed out gives none)."""
    part = doc.parts.get(name)
    return part.details if part is not None and isinstance(part.details, cls) else None


def _samples(doc: StatusDocument) -> Iterator[tuple[str, dict[str, object], float]]:
    yield "appliance_info", {"appliance": doc.appliance, "version": doc.version, "profile": doc.profile}, 1
    for state in OVERALL:
        yield "appliance_state", {"state": state}, int(doc.state == state)
    if (elapsed := _number(doc.elapsed_s)) is not None:
        yield "appliance_status_seconds", {}, elapsed
    for name, part in doc.parts.items():
        for state in PART_STATES:
            yield "appliance_part_state", {"part": name, "state": state}, int(part.state == state)
    if (engine := _details(doc, "engine", EngineDetails)) is not None:
        for replica in engine.replicas:
            gpus = ",".join(str(g) for g in replica.gpus)
            for state in PART_STATES[:3]:
                labels = {"replica": replica.replica, "gpus": gpus, "state": state}
                yield "appliance_replica_state", labels, int(replica.state == state)
            if (judged := replica.judgement) is not None:
                # the reason's class, never its text: a label value from a bounded set
                reason = judged.reason_class if judged.reason_class in REASON_CLASSES else "other"
                for state in REPLICA_STATES:
                    labels = {"replica": replica.replica, "gpus": gpus, "state": state, "reason": reason}
                    yield "appliance_replica_state", labels, int(judged.state == state)
                yield "appliance_replica_restarts", {"replica": replica.replica, "gpus": gpus}, judged.restarts
        if engine.judge is not None and (canaries := _number(engine.judge.canary_requests_last_hour)) is not None:
            yield "appliance_canary_requests_last_hour", {}, canaries
    if (slots := _details(doc, "slots", SlotsDetails)) is not None:
        for slot in slots.slots:
            labels = {"slot": slot.slot, "version": slot.version or "", "state": slot.state or "", "booted": str(slot.booted).lower()}
            yield "appliance_slot_info", labels, 1
            if (tries := _number(slot.tries_left)) is not None:
                yield "appliance_slot_tries_left", {"slot": slot.slot}, tries
        yield "appliance_running_good", {}, int(slots.running_state == "good")
        yield "appliance_rolled_back", {}, int(slots.rolled_back)
    if (sealed := _details(doc, "sealed", SealedDetails)) is not None:
        for flag in SEALED_FLAGS:
            if isinstance(fact := getattr(sealed, flag), bool):
                yield "appliance_sealed", {"fact": flag}, int(fact)
    if (weights := _details(doc, "weights", WeightsDetails)) is not None and weights.verified is not None:
        yield "appliance_weights_verified", {}, int(weights.verified)
    if (startup := _details(doc, "startup", StartupDetails)) is not None:
        for figure, values in startup.figures.items():
            for number, metric in ((values.value, "appliance_startup_figure"), (values.expected, "appliance_startup_figure_expected")):
                if (shown := _number(number)) is not None:
                    yield metric, {"figure": figure}, shown
    if (disk := _details(doc, "disk", DiskDetails)) is not None:
        for place in (disk.var, disk.model_cache):
            if place is None:
                continue
            for number, metric in ((place.free_bytes, "appliance_disk_free_bytes"), (place.total_bytes, "appliance_disk_total_bytes")):
                if (shown := _number(number)) is not None:
                    yield metric, {"path": place.path}, shown
    if (shm := _details(doc, "shm", ShmDetails)) is not None:
        yield "appliance_shm_free_bytes", {}, shm.free_bytes
        yield "appliance_shm_stale_offload_files", {}, len(shm.stale_offload_files)
    if (tls := _details(doc, "tls", TlsDetails)) is not None and (days := _number(tls.ca_days_left)) is not None:
        yield "appliance_tls_ca_days_left", {}, days
    if (ladder := _details(doc, "remediation", RemediationDetails)) is not None:
        for step in LADDER_STEPS:
            yield "appliance_remediation_step", {"step": step}, int(ladder.step == step)
        yield "appliance_remediation_faults", {}, ladder.faults
        yield "appliance_needs_physical_action", {}, int(ladder.step == "physical")


def render(doc: StatusDocument, refresh_s: int | None = None) -> str:
    """The exposition text of DOC (a status document): HELP and TYPE once per metric, then its
    samples; with REFRESH_S (metrics.refresh_s), how often the textfile holding it is rewritten."""
    by_name: dict[str, list[str]] = {}
    found = list(_samples(doc))
    if refresh_s is not None:
        found.append(("appliance_metrics_refresh_seconds", {}, refresh_s))
    for name, labels, value in found:
        by_name.setdefault(name, []).append(_sample(name, labels, value))
    lines = []
    for name, samples in by_name.items():
        lines += [f"# HELP {name} {HELP[name]}", f"# TYPE {name} gauge", *samples]
    return "\n".join(lines) + "\n"
