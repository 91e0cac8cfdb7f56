# SPDX-License-Identifier: MIT
"""What the updater, the assessment and the rollback last recorded on /var (paths.last_*_path()),
and `write`, how the guards (assessment, rollback, crash-loop guard) write their records: a record
someone else could have damaged never keeps them from writing the next one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from appliance import atomic, paths
from appliance.errors import UserError
from appliance.safe_read import set_aside
from appliance.schema import dump_record, load_record
from applianctl.records import Freshness, LastAssessment, LastRollback, LastUpdate


@dataclass(frozen=True)
class History:
    """The three records, each None when absent or damaged (nothing to judge by; the file's next
    write replaces it)."""

    update: LastUpdate | None
    assessment: LastAssessment | None
    rollback: LastRollback | None

    def to_json(self) -> dict[str, Any]:
        """Status's last_update, last_assessment and last_rollback: each record as written, or null."""
        return {
            "last_update": dump_record(self.update) if self.update is not None else None,
            "last_assessment": dump_record(self.assessment) if self.assessment is not None else None,
            "last_rollback": dump_record(self.rollback) if self.rollback is not None else None,
        }


R = TypeVar("R")


def _read(cls: type[R], path: Path) -> R | None:
    try:
        return load_record(cls, path, lenient=True)
    except UserError as e:
        print(f"{e.message}; taken as no record", file=sys.stderr)
        return None


def write(path: Path, record: Any) -> None:
    """PATH holds RECORD (written atomically); what stands in its place and is no regular file
    (a directory, a FIFO, a link) is first renamed to PATH.damaged, one line on stderr says so.
    UserError (one line) when it cannot be written."""
    hint = f"check that {path.parent} is writable and has room; remove {path} if it is in the way"
    try:
        kind = set_aside(path)
        if kind is not None:
            print(f"{path}: was {kind}, not a record: moved to {path.name}.damaged", file=sys.stderr)
        atomic.write_record(path, record)
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror or e})", hint=hint) from None


def last_update() -> LastUpdate | None:
    return _read(LastUpdate, paths.last_update_path())


def freshness() -> Freshness | None:
    """The highest timestamp sequences the updater accepted (update/freshness.json)."""
    return _read(Freshness, paths.freshness_path())


def read() -> History:
    return History(last_update(), _read(LastAssessment, paths.last_assessment_path()), _read(LastRollback, paths.last_rollback_path()))
