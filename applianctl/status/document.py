# SPDX-License-Identifier: MIT
"""The status document of `applianctl status --json` (docs/status-schema.md) as frozen dataclasses.

Each part's details are one class here; `field` metadata "doc" says what a key means, and
applianctl.status.schema_doc writes docs/status-schema.md from these classes. A part's JSON is its
state and reason followed by its details' keys. A key is absent when its value is `ABSENT`, or None
in an `optional` field; None elsewhere is written as null. `load` reads a document back through
appliance.schema's loader, strictly: a key no class here names is refused.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from appliance.errors import UserError
from appliance.schema import Loader, plain
from applianctl.records import BootRecord, EffectiveSettings, FactoryResetRequest, Freshness, LastFactoryReset


class Absent(enum.Enum):
    """A key not written at all (where None would be written as null)."""

    KEY = "absent"


ABSENT: Literal[Absent.KEY] = Absent.KEY


def doc(text: str) -> dict[str, Any]:
    """Field metadata: what the key means (docs/status-schema.md)."""
    return {"doc": text}


def omitted(text: str) -> dict[str, Any]:
    """Field metadata of a key left out when None (appliance.schema's `optional`), with what it means."""
    return {"omit": True, "doc": text}


@dataclass(frozen=True, kw_only=True)
class Details:
    """Base of every part's details. STATES: the states the part takes and why (the schema's
    States column); LEAD: words before its keys in the Details column."""

    STATES: ClassVar[str] = ""
    LEAD: ClassVar[str] = ""


# ----------------------------------------------------------------------------------- os


@dataclass(frozen=True, kw_only=True)
class BootedUsr:
    slot: str | None = field(metadata=doc('"A"/"B"/null'))
    partition: str | None = field(metadata=doc(""))
    label: str | None = field(metadata=doc(""))
    version: str | None = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class BootCounting:
    entry: str | None = field(metadata=doc(""))
    state: str = field(metadata=doc('"on trial"/"not counting"/"not configured"'))
    tries_left: int | None = field(default=None, metadata=omitted(""))
    tries_done: int | None = field(default=None, metadata=omitted(""))


@dataclass(frozen=True, kw_only=True)
class OsDetails(Details):
    STATES = "ok, degraded (IMAGE_VERSION differs from appliance.json; booted entry has 0 tries left)"
    version: str = field(metadata=doc(""))
    image_version: str | None = field(metadata=doc(""))
    usr: BootedUsr = field(metadata=doc("(the booted slot, from the slots model)"))
    boot_counting: BootCounting = field(metadata=doc(""))


# ----------------------------------------------------------------------------------- slots


@dataclass(frozen=True, kw_only=True)
class SlotsBootCounting:
    entry: str | None = field(metadata=doc(""))
    count_path: str | None = field(metadata=doc(""))
    tries_left: int | None = field(metadata=doc(""))
    tries_done: int | None = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class SlotInfo:
    slot: str = field(metadata=doc(""))
    partition: str | None = field(metadata=doc(""))
    label: str | None = field(metadata=doc(""))
    version: str | None = field(metadata=doc(""))
    booted: bool = field(metadata=doc(""))
    entry: str | None = field(metadata=doc(""))
    tries_left: int | None = field(metadata=doc(""))
    tries_done: int | None = field(metadata=doc(""))
    default: bool | None = field(metadata=doc(""))
    state: str = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class EntryInfo:
    path: str = field(metadata=doc(""))
    version: str | None = field(metadata=doc(""))
    state: str = field(metadata=doc(""))
    tries_left: int | None = field(metadata=doc(""))
    tries_done: int | None = field(metadata=doc(""))
    default: bool | None = field(metadata=doc(""))
    selected: bool | None = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class EngineSlotInfo:
    slot: str = field(metadata=doc('"A"/"B"'))
    partition: str | None = field(metadata=doc(""))
    label: str | None = field(metadata=doc(""))
    typed: bool = field(metadata=doc("(carries the appliance-engine type; false: recognised by its engine_ label, as older "
                                     "images wrote it, "
                      "and never opened by the engine-store unit)"))
    verity_partition: str | None = field(metadata=doc(""))
    digest: str | None = field(metadata=doc("(the first 12 hex digits, from the label; null: empty)"))
    full_digest: str | None = field(metadata=doc("(the whole digest, when signed data says which engine carries that label: the running "
                                  "manifest for the running slot, the one recorded digest with those 12 hex digits for "
                                  "another; null: not known, and an update does not count the slot as holding any engine)"))
    running: bool = field(metadata=doc("(the slot appliance-engine-store.service opened this boot, as it recorded in "
                        "/run/appliance/engine-slot.json; without that record, the first slot holding the running "
                        "manifest's engine)"))
    used_by: tuple[str, ...] = field(metadata=doc("[versions with a boot entry whose engine this is, as far as signed data says: the "
                                   "running manifest, the engine digests the updater recorded from bundle indexes]"))


AS_WRITTEN = ("(the state files as written, format number included; of a newer release's file, what this release reads "
              "of it; null when absent or damaged)")


@dataclass(frozen=True, kw_only=True)
class SlotsDetails(Details):
    STATES = ("ok, degraded (the appliance rolled the last upgrade back, or the crash-loop guard rolled a version back), "
              "not configured (no A/B slots found)")
    LEAD = "applianctl.slots.view' view, shared with update, assess and rollback:"
    running_version: str | None = field(metadata=doc(""))
    running_state: str = field(metadata=doc(""))
    running_state_reason: str = field(metadata=doc(""))
    booted_slot: str | None = field(metadata=doc(""))
    booted_entry: str | None = field(metadata=doc(""))
    boot_counting: SlotsBootCounting | None = field(metadata=doc("or null"))
    slots: tuple[SlotInfo, ...] = field(metadata=doc(""))
    entries: tuple[EntryInfo, ...] = field(metadata=doc(""))
    entries_source: str = field(metadata=doc(""))
    sysupdate: Any = field(metadata=doc(""))
    errors: tuple[str, ...] = field(metadata=doc("[lines]"))
    running_engine: str | None = field(metadata=doc("(the running version's engine digest, from its signed manifest, or null)"))
    engine_slots: tuple[EngineSlotInfo, ...] = field(metadata=doc(""))
    last_update: Any = field(metadata=doc(""))
    last_assessment: Any = field(metadata=doc(""))
    rolled_back: bool = field(metadata=doc(""))
    rollback_reason: str | None = field(metadata=doc(""))
    rolled_back_by: str | None = field(metadata=doc('("appliance": a failed assessment or tries used up, the part is degraded; "operator": '
                                     "the command applianctl rollback went back from the last update, the part stays ok "
                                     "and its line says so; null)"))
    last_rollback: Any = field(metadata=doc(AS_WRITTEN))
    staged: Any = field(metadata=doc("(what applianctl update --apply would install: the record staged.json as written, with version, "
                      "bytes, files, signer, source, staged_at and directory, plus error when it cannot be used; or null; "
                      'the one-line summary ends with "staged VERSION (MiB, when)")'))
    crash_loop: BootRecord | None = field(metadata=doc(
        "(the crash-loop guard's count for this boot, update/boots.json; `unclean_in_a_row`: boots of this version judged "
        'good that ended uncleanly right before this one; at 3 it is rolled back, `rolled_back_by` "appliance"; null '
        "before the guard ran or when the record is damaged: the guard then says so in one line, counts that boot as "
        "unclean and sets a non-file aside as boots.json.damaged)"))
    freshness: Freshness | None = field(metadata=doc("(the updater's replay protection, update/freshness.json as written: the highest "
                                      "timestamp sequence accepted per timestamp key, the version and time of the bundle "
                                      "it came with; null before any update or download)"))


# ----------------------------------------------------------------------------------- sealed


@dataclass(frozen=True, kw_only=True)
class SealedDetails(Details):
    STATES = ("ok (Secure Boot enforcing, the firmware's db holds the appliance's certificate, a TPM, the kernel image's "
              "signed PCR 11 policy present, /usr opened with its root hash signature, /var encrypted and sealed to PCR 7 "
              "+ signed PCR 11 with a recovery key), degraded (setup mode, Secure Boot off, db without the appliance's "
              "certificate, no TPM, no signed PCR policy, /usr opened without its signature, /var unencrypted, unsealed, "
              "without a recovery key or not checked this boot: the reason lists each), not configured (not booted "
              "through UEFI; then `efi` is the only key)")
    efi: bool = field(metadata=doc(""))
    secure_boot: Absent | bool | None = field(default=ABSENT, metadata=doc(""))
    setup_mode: Absent | bool | None = field(default=ABSENT, metadata=doc("(the firmware's variables; null when it has none)"))
    tpm: bool | None = field(default=None, metadata=omitted("(/sys/class/tpm/tpm0)"))
    pcr_signature: bool | None = field(default=None, metadata=omitted("(/run/systemd/tpm2-pcr-signature.json, left by systemd-stub)"))
    usr_signature: bool | None = field(default=None, metadata=omitted(
        "(/usr was opened with its root hash signature: the signed command line's systemd.verity_usr_options "
            "(root-hash-signature) names a file the initrd wrote, and dm-verity opens /usr only when the kernel verifies "
            "it against db)"))
    db_trusts_appliance: Absent | bool | None = field(default=ABSENT, metadata=doc(
        "(the certificate of /usr/lib/appliance/secureboot/enroll.json in db; null when unknown)"))
    db_error: str | None = field(default=None, metadata=omitted("(why it is unknown)"))
    var_encrypted: Absent | bool | None = field(default=ABSENT, metadata=doc("(/var is LUKS2; null when not checked this boot)"))
    var_sealed: Absent | bool | None = field(default=ABSENT, metadata=doc("(a TPM2 slot bound to PCR 7 and the signed PCR 11 policy)"))
    var_recovery_key: Absent | bool | None = field(default=ABSENT, metadata=doc("(a recovery key is enrolled)"))
    var_unlock: tuple[str, ...] | None = field(default=None, metadata=omitted(
        '(each unlock method of /var\'s header, e.g. "tpm2 PCR 7 + signed PCR 11 (slot 2)", "recovery (slot 1)"; '
            "from /run/appliance/var-seal.json, appliance-var-seal.service)"))


# ----------------------------------------------------------------------------------- units


@dataclass(frozen=True, kw_only=True)
class UnitStatus:
    load_state: str = field(metadata=doc(""))
    active_state: str = field(metadata=doc(""))
    sub_state: str = field(metadata=doc(""))
    result: str | None = field(metadata=doc(""))
    restarts: int | None = field(metadata=doc(""))
    active_since: str | None = field(metadata=doc(""))
    changed: str | None = field(metadata=doc(""))
    started: str | None = field(metadata=doc(""))
    condition_unmet: bool = field(metadata=doc("(its Condition...= was checked and not met: the unit is not configured here, e.g. the "
                                'journal upload without a collector; state "not configured", not counted as missing)'))
    state: str = field(metadata=doc(""))
    reason: str = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class UnitsDetails(Details):
    STATES = ("ok, degraded (activating, never started, restarted, a unit missing), down (failed; systemd unreachable), "
              "not configured (no appliance unit installed)")
    units: Mapping[str, UnitStatus] = field(metadata={
        "doc": "(ISO 8601 UTC); the units: verify, preflight, shm-clean, engine-store, gpu-selftest, model-fetch, "
               "engine@0 .. engine@R-1 (one per replica), startup-report, tls, proxy, node-exporter (the metrics scrapers "
               'reach), journal-upload (degraded "activating (auto-restart)" while the log collector is unreachable)',
        "names": "unit"})


# ----------------------------------------------------------------------------------- engine


@dataclass(frozen=True, kw_only=True)
class EngineMetrics:
    requests_running: int | None = field(metadata=doc(""))
    requests_waiting: int | None = field(metadata=doc(""))
    kv_cache_usage: float | None = field(metadata=doc("(0..1)"))
    prefix_cache_hit_rate: float | None = field(metadata=doc(""))
    spec_decode_acceptance_rate: float | None = field(metadata=doc(""))
    mean_ttft_s: float | None = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class ReplicaJudged:
    """One replica as the progress judge (appliance-judge.service) saw it in its last round."""

    state: str = field(metadata=doc('"starting"/"alive"/"stalled"/"restarting"/"held"'))
    reason: str = field(metadata=doc('(one line, e.g. "stalled: no tokens for 95 s with 12 requests waiting"; "" when alive)'))
    reason_class: str = field(metadata=doc(
        '(the reason in one word, as the metrics label it: "none", "no_tokens", "metrics_silent", "canary_timeout", '
        '"canary_failed", "engine_dead", "not_ready", "hive_fault", "needs_physical_action", "restart", "other")'))
    since: str = field(metadata=doc("(when it entered this state, ISO 8601 UTC)"))
    last_progress_at: str | None = field(metadata=doc(
        "(the last time its token counters moved or a canary answered; null: not yet this boot)"))
    waiting: int = field(metadata=doc("(requests waiting and running at the judge's last scrape)"))
    restarts: int = field(metadata=doc("(restarts by the judge this boot)"))


@dataclass(frozen=True, kw_only=True)
class ReplicaStatus:
    replica: int = field(metadata=doc(""))
    url: str = field(metadata=doc("(its loopback port)"))
    state: str = field(metadata=doc("(the judge's verdict wins: a replica judged stalled, restarting or held is down "
                                    "whatever its /health answers)"))
    reason: str = field(metadata=doc(""))
    gpus: tuple[int, ...] = field(metadata=doc("[the GPU indexes it runs on]"))
    judgement: ReplicaJudged | None = field(default=None, metadata=omitted("(absent when the judge has not judged it)"))


@dataclass(frozen=True, kw_only=True)
class JudgeSummary:
    """The progress judge's record (/run/appliance/judge.json) as status read it."""

    state: str = field(metadata=doc('"judging"/"not run" (no record yet)/"damaged"/"stale" (its last round is older '
                                    "than 5 minutes: its verdicts are not used)"))
    note: str = field(metadata=doc('(why it is not "judging", one line; "" when it is)'))
    checked_at: str | None = field(metadata=doc("(its last round, ISO 8601 UTC)"))
    alive: int | None = field(metadata=doc("(replicas alive by the judge: the proxy's /health answers 200 while above 0)"))
    canary_requests_last_hour: int | None = field(metadata=doc(
        "(the canary's load: one-token completions the judge sent in the last hour, only to replicas whose counters "
        "did not move)"))
    hive: str = field(metadata=doc('(the verdict of the hive-wide fault ladder when it holds replicas down, e.g. "needs '
                                   'physical action: ..."; "" otherwise)'))


@dataclass(frozen=True, kw_only=True)
class EngineDetails(Details):
    STATES = ("ok, degraded (/v1/models lacks the served model, /metrics unreadable, port refused while the startup "
              "report says loading; with several replicas: some do not serve, the reason names each; a replica the "
              "progress judge finds stalled, restarting or held; the judge's record damaged or stale), down (refused, no "
              "answer in 0.5 s, /health not 200, judged stalled, restarting or held although /health answers; with "
              "several replicas: none serves)")
    LEAD = "the first replica's"
    url: str = field(metadata=doc(""))
    refused: bool | None = field(default=None, metadata=omitted(""))
    health: int | None = field(default=None, metadata=omitted("(HTTP status)"))
    models: Absent | tuple[str, ...] | None = field(default=ABSENT, metadata=doc("[ids]"))
    metrics: Absent | EngineMetrics | None = field(default=ABSENT, metadata=doc(""))
    replicas: tuple[ReplicaStatus, ...] = field(metadata=doc("(every replica probed at once; the metrics' appliance_replica_state)"))
    judge: JudgeSummary | None = field(default=None, metadata=omitted("(the progress judge: /health and the rest are "
                                                                      "readiness, the judge says whether a replica makes "
                                                                      "progress)"))


# ----------------------------------------------------------------------------------- proxy


@dataclass(frozen=True, kw_only=True)
class Certificate:
    names: tuple[str, ...] = field(metadata=doc(""))
    not_after: str = field(metadata=doc(""))
    days_left: int = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class ProxyRequest:
    path: str = field(metadata=doc(""))
    status: int = field(metadata=doc(""))
    elapsed_s: float = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class ProxyDetails(Details):
    STATES = ("ok, degraded (the request through it is not answered 200, e.g. 502/503 while the engine is down; its "
              "certificate expires within 14 days), down (nothing listens on the public port; TLS handshake fails or the "
              "certificate is not trusted for the host name; the proxy refuses the appliance's own request; no answer in "
              "0.5 s), not configured (no appliance CA yet)")
    url: str = field(metadata=doc(""))
    address: str = field(metadata=doc("(where it connected)"))
    listening: bool = field(metadata=doc(""))
    trust: str | None = field(default=None, metadata=omitted("(the CA file, or \"the system's CAs\" for ACME)"))
    certificate: Certificate | None = field(default=None, metadata=omitted(""))
    request: ProxyRequest | None = field(default=None, metadata=omitted(""))


# ----------------------------------------------------------------------------------- startup


@dataclass(frozen=True, kw_only=True)
class Figure:
    value: float | None = field(metadata=doc(""))
    expected: float | None = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class StartupDetails(Details):
    STATES = "ok, degraded (loading, degraded start, unreadable), not configured (no report)"
    report_state: str = field(metadata=doc(""))
    figures: Mapping[str, Figure] = field(metadata={
        "doc": "(for model_memory_gib, draft_params, kv_cache_tokens, max_concurrency, offload_mmap_gb)", "names": "name"})
    cuda_graphs: bool | str | None = field(metadata=doc(""))
    ready: bool | None = field(metadata=doc(""))
    reached_s: Mapping[str, float] = field(metadata={"doc": "{*name*: seconds}"})


# ----------------------------------------------------------------------------------- result files


@dataclass(frozen=True, kw_only=True)
class CheckFileDetails(Details):
    """The result file's keys besides ok, reason and format, as written (also those a newer release adds)."""

    STATES = "ok, down (`\"ok\": false`; reason from the file), degraded (unreadable), not configured (file absent)"
    written: Mapping[str, Any] = field(metadata={
        "flatten": True,
        "doc": "every other key of the result file: `version`, `signer`, `overrides` (verify: each file in /etc or /run "
               "that differs from the signed image's factory /etc and would change behaviour, e.g. \"added "
               '/etc/systemd/system/x.service.d/y.conf"; absent when /etc was not compared)'})


# ----------------------------------------------------------------------------------- gpu


@dataclass(frozen=True, kw_only=True)
class GpuReading:
    gpu: int = field(metadata=doc(""))
    vram_total_mib: float | None = field(metadata=doc(""))
    vram_used_mib: float | None = field(metadata=doc(""))
    temperature_c: float | None = field(metadata=doc(""))
    power_w: float | None = field(metadata=doc(""))
    ecc_correctable: int | None = field(metadata=doc(""))
    ecc_uncorrectable: int | None = field(metadata=doc(""))
    vram_free_mib: float | None = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class GpuDetails(Details):
    STATES = ("ok, degraded (free VRAM < gpu.min_vram_headroom_mib; uncorrectable ECC errors; this boot's self-test "
              "could not run), down (not present and gpu.required; a GPU the engines use failed this boot's self-test: "
              "the reason names it and the check, and no engine starts), not configured (not present, not required)")
    present: bool = field(metadata=doc(""))
    required: bool = field(metadata=doc(""))
    tool: str | None = field(default=None, metadata=omitted('"amd-smi"/"rocm-smi"'))
    min_vram_headroom_mib: float | None = field(default=None, metadata=omitted(""))
    gpus: tuple[GpuReading, ...] | None = field(default=None, metadata=omitted(""))
    selftest: Any = field(metadata=doc("(this boot's self-test report as applianctl selftest --json prints it, with the GPUs the "
                        "topology uses, those of them that failed, and when it ran; null without one: no GPU device, as "
                        "in the demo)"))


# ----------------------------------------------------------------------------------- shm, disk, tls


@dataclass(frozen=True, kw_only=True)
class OffloadFile:
    name: str = field(metadata=doc(""))
    bytes: int = field(metadata=doc(""))
    in_use: bool = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class ShmDetails(Details):
    STATES = ("ok, degraded (an offload file nobody holds; smaller than offload + margin), down (absent while offload is "
              "configured), not configured (absent, no offload)")
    path: str = field(metadata=doc(""))
    total_bytes: int = field(metadata=doc(""))
    used_bytes: int = field(metadata=doc(""))
    free_bytes: int = field(metadata=doc(""))
    unreadable_maps: int | None = field(default=None, metadata=omitted("(processes whose /proc entries could not be read)"))
    offload_files: tuple[OffloadFile, ...] = field(metadata=doc(""))
    stale_offload_files: tuple[str, ...] = field(metadata=doc("[names]"))
    needed_bytes: int = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class FsUsage:
    path: str = field(metadata=doc(""))
    total_bytes: int | None = field(default=None, metadata=omitted(""))
    used_bytes: int | None = field(default=None, metadata=omitted(""))
    free_bytes: int | None = field(default=None, metadata=omitted(""))
    cache_bytes: int | None = field(default=None, metadata=omitted("(model_cache only)"))
    cache_bytes_complete: bool | None = field(default=None, metadata=omitted("(model_cache only)"))
    present: bool | None = field(default=None, metadata=omitted(
        "(model_cache: false when the directory is absent, the figures then absent)"))


@dataclass(frozen=True, kw_only=True)
class DiskDetails(Details):
    STATES = "ok, degraded (< 1 GiB or < 5 % free), down (state directory unreadable)"
    var: FsUsage | None = field(default=None, metadata=omitted(""))
    model_cache: FsUsage | None = field(default=None, metadata=omitted(""))


@dataclass(frozen=True, kw_only=True)
class TlsDetails(Details):
    STATES = "ok, degraded (CA expires within 30 days), down (expired, unreadable), not configured (no ca.crt)"
    mode: str = field(metadata=doc('"internal"/"acme"'))
    ca_sha256: str | None = field(default=None, metadata=omitted("(colon-separated, upper case)"))
    ca_subject: str | None = field(default=None, metadata=omitted(""))
    ca_not_after: str | None = field(default=None, metadata=omitted(""))
    ca_days_left: int | None = field(default=None, metadata=omitted(""))


# ----------------------------------------------------------------------------------- weights, host


@dataclass(frozen=True, kw_only=True)
class WeightsDetails(Details):
    STATES = ("ok (the last `applianctl model verify`, run before every engine start, found every file sealed with its "
              "signed fs-verity digest), degraded (not checked yet; the check was of another revision), down (a file "
              "missing, changed, unsealed or not in the manifest: the reason names it; the weights manifest is not the "
              "one the release pins), not configured (the image pins no weights)")
    revision: str | None = field(metadata=doc(""))
    files: int | None = field(metadata=doc("(count)"))
    bytes: int | None = field(metadata=doc(""))
    verified: bool | None = field(metadata=doc("(true/false, null before the first check)"))
    source: str | None = field(metadata=doc("(of the last fetch, else model.source)"))
    file: str | None = field(metadata=doc("(the file the check refused, else null)"))


@dataclass(frozen=True, kw_only=True)
class FactoryResetStatus:
    pending: FactoryResetRequest | None = field(metadata=doc("or null"))
    last: LastFactoryReset | None = field(metadata=doc("or null"))


@dataclass(frozen=True, kw_only=True)
class HostDetails(Details):
    STATES = ("ok (the signed install plan applied on this boot), degraded (a plan present but refused, e.g. unsigned or "
              "changed: the image's defaults apply; only its proxy, metrics, update or log settings refused (the "
              "Caddyfile's checks, a collector URL without its CA): the rest of the plan applies, the image's settings "
              "for those; the result unreadable; a factory reset pending: the next boot wipes /var), not configured "
              "(appliance-host has not run: the image's defaults apply)")
    source: str | None = field(metadata=doc('"plan"/"image defaults"/null'))
    hostname: str = field(metadata=doc("(now)"))
    addresses: tuple[str, ...] | None = field(metadata=doc("[global addresses with prefix length, null when unreadable]"))
    network_files: tuple[str, ...] = field(metadata=doc("[the systemd-networkd files rendered into /run/systemd/network]"))
    settings: EffectiveSettings = field(metadata=doc("(the plan's, the image's where it is silent)"))
    factory_reset: FactoryResetStatus = field(metadata=doc(""))


@dataclass(frozen=True, kw_only=True)
class RemediationDetails(Details):
    STATES = ("ok (no hive-wide GPU fault counted), degraded (a fault counted: the replicas were restarted, or the "
              "machine rebooted once; the ladder's record damaged, which counts as one fault), down (needs physical "
              "action: the replicas are held down; the reason names the GPU and the evidence)")
    step: str = field(metadata=doc('"none"/"restart"/"reboot"/"physical" (the ladder\'s step: applianctl/judge/hive.py)'))
    faults: int = field(metadata=doc("(hive-wide faults since the ladder last started again)"))
    last_fault_at: str | None = field(metadata=doc("(ISO 8601 UTC, null when none)"))
    gpu: str | None = field(metadata=doc("(the GPU the evidence names: a PCI address or a KFD node, null when none does)"))
    evidence: tuple[str, ...] = field(metadata=doc("[the kernel log lines or the replicas that died together, the first few]"))
    resets_at: str | None = field(metadata=doc("(when the ladder starts again without another fault: engine.remediation."
                                               "quiet_s after the last; null at none or physical)"))
    damaged: bool = field(metadata=doc("(the record was damaged)"))


# ----------------------------------------------------------------------------------- the document

# Each part's details, in the order the parts are shown.
PART_DETAILS: Mapping[str, type[Details]] = {
    "os": OsDetails, "slots": SlotsDetails, "sealed": SealedDetails, "units": UnitsDetails, "engine": EngineDetails,
    "proxy": ProxyDetails, "startup": StartupDetails, "verify": CheckFileDetails, "preflight": CheckFileDetails,
    "shm-check": CheckFileDetails, "gpu": GpuDetails, "shm": ShmDetails, "disk": DiskDetails, "tls": TlsDetails,
    "weights": WeightsDetails, "host": HostDetails, "remediation": RemediationDetails,
}


@dataclass(frozen=True)
class Part:
    """One part as the document holds it: state, reason, and its details (None: its probe gave none,
    e.g. it timed out)."""

    state: str
    reason: str = ""
    details: Details | None = None

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, **details_json(self.details)}


@dataclass(frozen=True, kw_only=True)
class StatusDocument:
    schema: int = field(metadata={"example": 1})
    state: str = field(metadata={"example": "ok | degraded | down"})
    reason: str = field(metadata={"example": "the first part in the worst state, as 'part: reason' (\"\" when ok)"})
    appliance: str = field(metadata={"example": "dsv4-flash"})
    version: str = field(metadata={"example": "1.0.0"})
    profile: str = field(metadata={"example": "production"})
    generated_at: str = field(metadata={"example": "2026-08-04T10:00:00Z"})
    elapsed_s: float = field(metadata={"example": 0.12})
    parts: Mapping[str, Part] = field(
        metadata={"example": {"<name>": {"state": "...", "reason": "...", "<detail>": "..."}}})

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "parts"}
        return {**out, "parts": {name: part.to_json() for name, part in self.parts.items()}}


def details_json(value: Any) -> dict[str, Any]:
    """DETAILS' keys as JSON: ABSENT and `optional` None left out, a "flatten" field's keys inline."""
    if value is None:
        return {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        if item is ABSENT or (f.metadata.get("omit") and item is None):
            continue
        if f.metadata.get("flatten"):
            out.update(plain(item))
        else:
            out[f.name] = _json(item)
    return out


def _json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and value.__module__ == __name__:
        return details_json(value)
    if isinstance(value, tuple):
        return [_json(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _json(v) for k, v in value.items()}
    return plain(value)


class DocumentLoader(Loader):
    def invalid(self, key: str, value: Any, expected: str) -> UserError:
        return UserError(f"{self.where}: {key or 'the document'} = {value!r:.80}: invalid",
                         hint=f"expected {expected} (docs/status-schema.md)")


def load_details(cls: type[Details], data: Mapping[str, Any], where: str = "status part") -> Details:
    """A part's details (its JSON without state and reason) as CLS, strictly."""
    loader = DocumentLoader(where)
    flat = next((f.name for f in dataclasses.fields(cls) if f.metadata.get("flatten")), None)
    details: Details = loader.load(cls, {flat: dict(data)} if flat else dict(data))
    return details


def load(data: Any, where: str = "status document") -> StatusDocument:
    """A document as `applianctl status --json` prints it, as a StatusDocument; UserError when a
    key is unknown, missing or of another type than docs/status-schema.md says."""
    if not isinstance(data, dict) or not isinstance(data.get("parts"), dict):
        raise UserError(f"{where}: not a status document", hint="give the output of applianctl status --json")
    parts = {}
    for name, part in data["parts"].items():
        if name not in PART_DETAILS or not isinstance(part, dict):
            raise UserError(f"{where}: unknown part {name!r}", hint="known parts: " + ", ".join(PART_DETAILS))
        rest = {k: v for k, v in part.items() if k not in ("state", "reason")}
        details = load_details(PART_DETAILS[name], rest, f"{where}: parts.{name}") if rest else None
        parts[name] = Part(str(part.get("state")), str(part.get("reason", "")), details)
    top = {k: v for k, v in data.items() if k != "parts"}
    document: StatusDocument = DocumentLoader(where).load(StatusDocument, top, parts=parts)
    return document
