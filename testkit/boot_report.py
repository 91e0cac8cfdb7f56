# SPDX-License-Identifier: MIT
"""The boot check's report: what the guest writes between marker lines to its second serial port
once per boot, and what the test host reads back, as frozen dataclasses loaded through the core's
schema loader (appliance/schema.py). The keys are the JSON keys.

Tools' own JSON (the status document, sfdisk's partition table, findmnt's file systems) and the
plan's step outcomes, whose shape each step chooses, are carried as they came.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.errors import UserError
from appliance.schema import Loader, optional, plain, shown

BEGIN, END = "APPLIANCE-REPORT-BEGIN", "APPLIANCE-REPORT-END"


@dataclass(frozen=True)
class ReplicaStart:
    """When a replica's unit was started, its container's main process started and the unit became
    active (µs since boot; absent when systemd had no such time), and its stagger step's last lines."""

    stagger: tuple[str, ...]
    started: int | None = optional()
    main_started: int | None = optional()
    active: int | None = optional()


@dataclass(frozen=True)
class BootEntry:
    """One boot menu entry as `bootctl list --json=short` shows it (bootctl's own key names)."""

    id: str | None
    title: str | None
    isDefault: bool | None
    isSelected: bool | None


@dataclass(frozen=True)
class LoaderVars:
    """What systemd-boot and systemd-stub say of this boot (their EFI variables' names)."""

    LoaderEntrySelected: str | None
    LoaderBootCountPath: str | None
    StubProfile: str | None


@dataclass(frozen=True)
class Sealed:
    secure_boot: bool | None
    setup_mode: bool | None
    tpm: bool
    pcr_signature: bool


@dataclass(frozen=True)
class EtcState:
    """What the initrd's /etc reset did, and whether the engine runs with a drop-in from /etc."""

    etc_dropin_present: bool
    engine_drop_in_paths: str
    engine_environment: str
    reset_log: str


@dataclass(frozen=True)
class EngineEnvironment:
    """The engine process's command line and environment (the exact bytes it got) and its image's
    own variables; only `error` when there was no engine to read."""

    error: str | None = optional()
    pid: str | None = optional()
    init_pid: str | None = optional()
    cmdline: str | None = optional()
    environ: tuple[str, ...] | None = optional()
    image_env: tuple[str, ...] | None = optional()


@dataclass(frozen=True)
class UsrSignature:
    """Whether the initrd handed /usr's root hash signature to dm-verity, and what its unit said."""

    file: bool
    log: str


@dataclass(frozen=True)
class SmokeAnswer:
    """The smoke completion straight to the engine: its text, which answers the stand-in gave."""

    answer: str
    answers_variant: str | None = None
    error: str | None = optional()


@dataclass(frozen=True)
class BootReport:
    """One boot's report. `status` is `applianctl status --json` (or its state "unknown" and the
    output when that was not JSON); `steps` the plan's step outcomes on this and earlier boots,
    oldest first; `scenarios` the last engine fault scenarios' outcome among them."""

    replica_starts: Mapping[str, ReplicaStart]
    boot_entries: tuple[BootEntry, ...]
    loader: LoaderVars
    sealed: Sealed
    etc: EtcState
    engine_env: EngineEnvironment
    applianctl_version: str
    bootcheck_version: str
    failed_units: tuple[str, ...]
    usr_mount: tuple[str, ...]
    usr_verity: str
    usr_signature: UsrSignature
    partitions: Any  # sfdisk -J of the boot disk, None when it was not found
    filesystems: Mapping[str, Any]  # findmnt -J of /, /var and /usr: {"filesystems": [...]}
    cmdline: str
    journal: Mapping[str, str]  # the last lines of each appliance unit's journal, for whoever reads a failure
    smoke_engine: SmokeAnswer
    smoke_proxy: str
    status: Mapping[str, Any]
    status_text: str
    engine_became_healthy: bool = False
    scenarios: Mapping[str, Any] | None = None
    steps: tuple[Mapping[str, Any], ...] = ()

    @property
    def os_version(self) -> str:
        """The running version as the status document names it ("" when it does not)."""
        parts = self.status.get("parts")
        os_part = parts.get("os") if isinstance(parts, Mapping) else None
        version = os_part.get("version") if isinstance(os_part, Mapping) else None
        return version if isinstance(version, str) else ""


class BootReportLoader(Loader):
    def invalid(self, key: str, value: Any, expected: str) -> UserError:
        return UserError(f"{self.where}: {key or 'the report'} = {shown(value)}: invalid",
                         hint=f"expected {expected}; the guest's testkit and the host's differ: build the image again")


def load_report(data: Any, where: str = "the boot report") -> BootReport:
    """DATA (parsed JSON) as a BootReport; UserError (one line) when it is not one."""
    report: BootReport = BootReportLoader(where).load(BootReport, data)
    return report


def report_block(report: BootReport) -> str:
    """REPORT as the guest writes it: its JSON on one line between the marker lines."""
    return f"\n{BEGIN}\n{json.dumps(plain(report))}\n{END}\n"


def parse_blocks(text: str) -> list[Any]:
    """The JSON of every complete block between the marker lines, in order; a block cut short (a
    power cut while it was written) is skipped."""
    blocks = []
    for block in text.split(BEGIN)[1:]:
        body, end, _ = block.partition(END)
        if not end:
            continue
        try:
            blocks.append(json.loads(body))
        except json.JSONDecodeError:
            continue
    return blocks


def is_boot_report(block: Any) -> bool:
    """Whether a block is the boot check's (a test's own guest script may write others between the
    same markers: tests/integration/weights_guest.py)."""
    return isinstance(block, dict) and "bootcheck_version" in block


def parse_reports(text: str, where: str = "the boot report") -> list[BootReport]:
    """Every boot check report in TEXT (the second serial port's log), oldest first."""
    return [load_report(b, f"{where} {i}") for i, b in enumerate(parse_blocks(text)) if is_boot_report(b)]
