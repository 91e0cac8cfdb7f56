# SPDX-License-Identifier: MIT
"""The records the device writes and reads back as JSON, each a frozen dataclass: read leniently
with appliance.schema.load_record (another release may have written it), written with
appliance.atomic.write_record. /var records carry FORMAT 1 (none: an older release's, loads the
same); /run ones none, as only this boot's release reads them. tests/fixtures/state/ holds one of
each as the release before these classes wrote it. Counts, sizes and durations are `at_least(0)`:
a guard reads its own records, and a negative count must read as damaged, not switch it off.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from appliance.hashing import SHA256
from appliance.schema import Record, at_least, each, optional


def _empty() -> Mapping[str, Any]:
    return types.MappingProxyType({})


def _sha256(value: str) -> str | None:
    return None if SHA256.match(value) else "a SHA-256 (64 lower-case hex digits)"


# ----------------------------------------------------------------------------------- results on /run


@dataclass(frozen=True)
class CheckResult(Record):
    """What a check before the engine starts found: status shows `reason` when not `ok`."""

    ok: bool
    reason: str


@dataclass(frozen=True)
class VerifyResult(CheckResult):
    """paths.VERIFY_RESULT (applianctl verify): the manifest's version and signer, null when unknown;
    `overrides`, what in /etc or /run changes behaviour outside the signed image ("added /etc/...",
    the first 50, then a count), absent when /etc was not compared."""

    version: str | None = None
    signer: str | None = None
    overrides: tuple[str, ...] | None = optional()


@dataclass(frozen=True)
class PreflightResult(CheckResult):
    """paths.PREFLIGHT_RESULT (applianctl preflight)."""

    gpu: str | None = optional()  # "not required"
    vram_total_bytes: int | None = optional(**at_least(0))


@dataclass(frozen=True)
class ShmRemoved:
    path: str
    bytes: int = field(metadata=at_least(0))
    allocated_bytes: int = field(metadata=at_least(0))


@dataclass(frozen=True)
class ShmCheck(CheckResult):
    """paths.SHM_CHECK (applianctl shm-clean). The figures are there whenever the command wrote it."""

    removed: tuple[ShmRemoved, ...] = ()
    shm_size_bytes: int | None = field(default=None, metadata=at_least(0))
    shm_used_bytes: int | None = field(default=None, metadata=at_least(0))
    required_bytes: int | None = field(default=None, metadata=at_least(0))
    mem_available_bytes: int | None = field(default=None, metadata=at_least(0))


@dataclass(frozen=True)
class StartupFigures:
    """What the engine's startup lines showed (absent: not seen); also the expected values."""

    model_memory_gib: float | None = optional(**at_least(0))
    draft_params: int | None = optional(**at_least(0))
    kv_cache_tokens: int | None = optional(**at_least(0))
    max_concurrency: float | None = optional(**at_least(0))
    offload_mmap_gb: float | None = optional(**at_least(0))
    cuda_graphs: bool | str | None = optional()
    ready: bool | None = optional()


@dataclass(frozen=True)
class StartupReport(Record):
    """paths.STARTUP_REPORT (applianctl startup-report): state is loading, ok or degraded."""

    state: str
    ok: bool = False
    reason: str = ""
    figures: StartupFigures = StartupFigures()
    reached_s: Mapping[str, float] = field(default_factory=_empty, metadata=at_least(0))
    expected: StartupFigures | None = field(default=None, metadata={"omit": True})  # as optional()


@dataclass(frozen=True)
class ModelVerifyResult(CheckResult):
    """applianctl.model.store.verify_result() (applianctl model verify); `checked` false: no weights pinned."""

    revision: str | None = optional()
    files: int | None = optional(**at_least(0))
    bytes: int | None = optional(**at_least(0))
    deep: bool | None = optional()
    file: str | None = optional()  # the first file at fault
    checked: bool | None = optional()


@dataclass(frozen=True)
class EngineSlotOpened(Record):
    """/run/appliance/engine-slot.json: the engine slot appliance-engine-store opened."""

    label: str
    partition: str
    verity_partition: str
    roothash: str


# ----------------------------------------------------------------------------------- per-host state on /var


@dataclass(frozen=True)
class WeightsFetch(Record):
    """host/weights-fetch.json: the last `applianctl model fetch`."""

    FORMAT = 1
    source: str
    revision: str
    finished: str


@dataclass(frozen=True)
class WeightsVerity(Record):
    """host/weights-verity.json: the fs-verity digests this device measured, by file."""

    FORMAT = 1
    model: str
    revision: str
    files: Mapping[str, str] = field(default_factory=_empty, metadata=each(_sha256))


@dataclass(frozen=True)
class CorruptFile:
    inode: int = field(metadata=at_least(0))
    reason: str


@dataclass(frozen=True)
class WeightsCorrupt(Record):
    """host/weights-corrupt.json: files whose blocks the kernel refused on a read (model verify --deep)."""

    FORMAT = 1
    revision: str
    files: Mapping[str, CorruptFile] = field(default_factory=_empty)


@dataclass(frozen=True)
class FetchJournal(Record):
    """PART.journal beside a partial weight file: LENGTH bytes are on disk, in chunks with these CRC-32s."""

    FORMAT = 1
    sha256: str
    size: int = field(metadata=at_least(0))
    length: int = field(metadata=at_least(0))
    chunks: tuple[int, ...] = field(metadata=at_least(0))  # CRC-32s


@dataclass(frozen=True)
class EngineVersions(Record):
    """update/engines.json: the engine digest each installed version runs (from signed data)."""

    FORMAT = 1
    versions: Mapping[str, str] = field(default_factory=_empty)


@dataclass(frozen=True)
class LastUpdate(Record):
    """update/last-update.json: the last install into the inactive slot."""

    FORMAT = 1
    version: str
    from_version: str | None = optional()
    slot: str | None = optional()
    downgrade: bool = False
    installed_at: str | None = optional()
    source: str | None = optional()
    staged_at: str | None = optional()  # installed from a staged download


@dataclass(frozen=True)
class LastAssessment(Record):
    """update/last-assessment.json: whether the booted version served its clients in time."""

    FORMAT = 1
    version: str
    ok: bool
    reason: str = ""
    entry: str | None = None  # null when boot counting names none
    tries_left: int | None = field(default=None, metadata=at_least(0))
    deadline_s: float | None = optional(**at_least(0))
    through: str | None = optional()
    at: str | None = optional()
    demoted: tuple[str, ...] | None = optional()  # entries marked out of tries after a downgrade


@dataclass(frozen=True)
class LastRollback(Record):
    """update/last-rollback.json: the operator's last `applianctl rollback`."""

    FORMAT = 1
    from_version: str
    to_version: str
    reason: str
    at: str


@dataclass(frozen=True)
class Staged(Record):
    """update/staged/staged.json: the staged bundle and the directory that holds it."""

    FORMAT = 1
    version: str
    directory: str
    bytes: int = field(metadata=at_least(0))
    files: int = field(metadata=at_least(0))
    signer: str
    source: str
    staged_at: str
    engine: bool = False


@dataclass(frozen=True)
class Freshness(Record):
    """update/freshness.json: per timestamp key (its id), the highest sequence an update or a
    download accepted; a timestamp of that key with a lower one is refused (an index replayed)."""

    FORMAT = 1
    sequences: Mapping[str, int] = field(default_factory=_empty, metadata=at_least(0))
    version: str | None = optional()  # of the bundle last accepted, and when
    accepted_at: str | None = optional()


@dataclass(frozen=True)
class EffectiveSettings:
    """The per-host settings in effect (appliance.host_settings HostSettings.effective), as shown."""

    hostname: str
    network: str  # one line
    ssh_authorized_keys: tuple[str, ...]
    proxy_hostname: str
    proxy_allowed_cidrs: tuple[str, ...]
    proxy_acme_email: str
    update_url: str
    weights_source: str
    metrics_allowed_cidrs: tuple[str, ...] | None = optional()  # absent in older releases' records
    logs_upload_url: str | None = optional()


@dataclass(frozen=True)
class HostResult(CheckResult):
    """/run/appliance/host.json (appliance-host.service): where the per-host settings came from."""

    source: str | None = None  # "plan" or "image defaults"
    settings: EffectiveSettings | None = field(default=None, metadata={"omit": True})  # as optional()
    network_files: tuple[str, ...] | None = optional()


@dataclass(frozen=True)
class FactoryResetRequest(Record):
    """factory-reset.json (applianctl factory-reset): what the next boot's reset keeps, and who asked."""

    FORMAT = 1
    keep_weights: bool
    keep_settings: bool
    requested_at: str
    by: str


@dataclass(frozen=True)
class LastFactoryReset(Record):
    """last-factory-reset.json (appliance-factory-reset.service): the reset that ran, what it kept and what it could not delete."""

    FORMAT = 1
    at: str
    by: str
    kept: tuple[str, ...]
    deleted: int = field(metadata=at_least(0))
    left: tuple[str, ...] = ()


@dataclass(frozen=True)
class BootRecord(Record):
    """update/boots.json (appliance-crashloop.service): this boot of a version, and how many boots
    of it in a row before this one ended uncleanly after it was judged good."""

    FORMAT = 1
    version: str
    boot_id: str
    unclean_in_a_row: int = field(metadata=at_least(0))
    started_at: str
    clean: bool = False  # an orderly shutdown or reboot ended it
    stable: bool = False  # it served for crashloop.STABLE_AFTER_S


def _pcr_value(value: str) -> str | None:
    return None if SHA256.match(value) else "a PCR 7 value (64 lower-case hex digits)"


@dataclass(frozen=True)
class VarSealState(Record):
    """var-seal.json on /var (applianctl var-seal): the PCR 7 /var was sealed to, and the factory
    reset (its record's `at`) the recovery key was last renewed for."""

    FORMAT = 1
    sealed_pcr7: str | None = optional(check=_pcr_value)
    recovery_renewed_for_reset: str | None = optional()


@dataclass(frozen=True)
class SelftestBaseline(Record):
    """The GPU self-test's baseline (paths.gpu_selftest_baseline_path()), or an earlier report
    `selftest --json` printed: the correctable ECC counts by GPU (checks.gpu_key)."""

    correctable_counts: Mapping[str, int] = field(metadata=at_least(0))


# ----------------------------------------------------------------------------------- the progress judge

REPLICA_STATES = ("starting", "alive", "stalled", "restarting", "held")


def _replica_state(value: str) -> str | None:
    return None if value in REPLICA_STATES else "one of " + ", ".join(REPLICA_STATES)


@dataclass(frozen=True)
class ReplicaJudgement:
    """One replica as the judge saw it last. `state`: starting (not yet ready on /health), alive
    (tokens advanced, or the canary answered, within engine.progress's bound), stalled (neither:
    taken out of the balancer and restarted), restarting, held (kept down by the hive ladder).
    `reason` says why in one line ("stalled: no tokens for 95 s with 12 requests waiting",
    "canary timed out after 30 s"), empty when alive."""

    replica: int = field(metadata=at_least(0))
    state: str = field(metadata={"check": _replica_state})
    reason: str
    since: str  # when it entered this state (UTC, ISO 8601)
    last_progress_at: str | None = None  # the last time its token counters moved or a canary answered
    waiting: int = field(default=0, metadata=at_least(0))  # requests waiting + running at the last scrape
    restarts: int = field(default=0, metadata=at_least(0))  # by the judge, this boot


@dataclass(frozen=True)
class JudgeState(Record):
    """paths.JUDGE_STATE (appliance-judge.service), rewritten every round: each replica's
    judgement, and the canary's load (requests sent in the last hour)."""

    checked_at: str
    replicas: tuple[ReplicaJudgement, ...]
    canaries_last_hour: int = field(metadata=at_least(0))
    alive: int = field(metadata=at_least(0))  # replicas alive now: the proxy's /health is 200 when > 0
    hive: str = ""  # the hive ladder's one-line verdict when it holds replicas down ("needs physical action: ...")


LADDER_STEPS = ("none", "restart", "reboot", "physical")


def _ladder_step(value: str) -> str | None:
    return None if value in LADDER_STEPS else "one of " + ", ".join(LADDER_STEPS)


@dataclass(frozen=True)
class RemediationState(Record):
    """paths.remediation_path() on /var: the hive-wide fault ladder (restart, then one reboot, then
    needs physical action), its counters kept across reboots and cleared after a quiet time."""

    FORMAT = 1
    step: str = field(metadata={"check": _ladder_step})
    faults: int = field(metadata=at_least(0))  # hive-wide faults since the ladder last reset
    last_fault_at: str | None = None
    evidence: tuple[str, ...] = ()  # the kernel log lines or the replicas that died together (first few)
    gpu: str | None = None  # the GPU the evidence names, when it names one
