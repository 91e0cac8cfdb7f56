# SPDX-License-Identifier: MIT
"""What installing a bundle would do, decided once (make_plan) and acted on by every verb:
`--check` prints it, plain `update` and `--download-only` fetch what it names, `--apply` makes
it again from the staged directory. Making it reads bundle.json, its signature, its timestamp
(freshness: not for a staged bundle, whose timestamp was accepted when it was staged) and the
slots; it writes nothing."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import appliance.signed.timestamp
import applianctl.slots.view
import applianctl.update.staged
from appliance import paths
from appliance.errors import Refused, UserError
from appliance.fetch import Deadline, Source, open_source
from appliance.schema import load_record
from appliance.signed.bundle_index import (
    BUNDLE_INDEX,
    BUNDLE_SIG,
    MAX_INDEX_BYTES,
    MAX_SIG_BYTES,
    BundleFile,
    BundleIndex,
    engine_short,
    verify_index,
)
from appliance.signed.release_manifest import Manifest
from applianctl.records import Freshness
from applianctl.slots import history
from applianctl.slots.engine import EngineChoice
from applianctl.slots.entries import BAD
from applianctl.slots.machine import Host
from applianctl.slots.partitions import Slot
from applianctl.update.checks import (
    check_engine,
    check_fits,
    check_judged,
    check_policy,
    check_staged_newer,
    check_strict,
    inactive_slot,
    writes_engine,
)
from applianctl.update.download import to_fetch


@dataclass(frozen=True)
class UpdatePlan:
    spec: str  # the SOURCE as given
    source: Source = field(repr=False, compare=False)  # opened, for fetching the files
    index: BundleIndex  # verified against the keys the running version trusts
    signed: tuple[bytes, bytes]  # bundle.json and its signature as read (a staged update keeps them)
    running: Manifest
    view: applianctl.slots.view.View  # read after the signature was checked
    inactive: Slot
    engine: EngineChoice | None  # None: the new version runs the running engine
    downgrade: bool
    files: tuple[BundleFile, ...]  # what this appliance downloads (download.to_fetch)
    # the timestamp checked fresh, and its bytes as read; None for a staged bundle (not checked again)
    timestamp: appliance.signed.timestamp.Timestamp | None = None
    signed_timestamp: tuple[bytes, bytes] | None = None
    rolled_back: str | None = None  # why this version counts as rolled back here (rolled_back_why)
    force: bool = False  # install a rolled-back version again

    @property
    def version(self) -> str:
        return self.index.version

    @property
    def engine_written(self) -> bool:
        return writes_engine(self.engine)

    @property
    def download_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def already_installed(self) -> bool:
        """The inactive slot holds this version and it has a boot entry, and it was not rolled back.
        A slot labelled with it but without an entry was interrupted and is written again; a
        rolled-back one is refused, or with --force written again (which gives it fresh tries)."""
        return self.inactive.version == self.version and self.view.entry(self.version) is not None and self.rolled_back is None

    @property
    def refused_rolled_back(self) -> Refused | None:
        """The refusal of a rolled-back version offered again without --force."""
        if self.rolled_back is None or self.force:
            return None
        return Refused(self.rolled_back, hint="to install it again anyway (its slot is written again, with fresh boot tries), add --force")

    @property
    def blocked(self) -> str | None:
        """Why writing the slot is refused now (check_judged), None when it is not."""
        try:
            check_judged(self.view)
        except UserError as e:
            return e.message
        refused = self.refused_rolled_back
        return refused.message if refused is not None else None

    def to_json(self) -> dict[str, Any]:
        """What `update --check --json` prints."""
        return {
            "source": self.spec,
            "version": self.version,
            "running_version": self.running.version,
            "slot": self.inactive.name,
            "slot_holds": self.inactive.version,
            "downgrade": self.downgrade,
            "signer": self.index.signer,
            "engine": engine_short(self.index.engine_digest),
            "engine_slot": self.engine.slot.name if self.engine is not None else None,
            "engine_written": self.engine_written,
            "download_bytes": self.download_bytes,
            "files": [f.name for f in self.files],
            "already_installed": self.already_installed,
            "blocked": self.blocked,
            "rolled_back": self.rolled_back,
            "sequence": self.timestamp.sequence if self.timestamp is not None else None,
            "expires": self.timestamp.expires if self.timestamp is not None else None,
        }


def rolled_back_why(version: str, view: applianctl.slots.view.View) -> str | None:
    """Why VERSION counts as rolled back on this appliance, None when it does not: the inactive
    slot holds it and its boot entry is out of tries (the boot loader fell back from it, or the
    operator rolled back from it), or the last rollback went from it to the running version."""
    last = history.read()
    rollback = last.rollback
    if rollback is not None and rollback.from_version == version and rollback.to_version == view.running_version:
        return f"version {version} was rolled back at {rollback.at} (applianctl rollback)"
    other, entry = view.other, view.entry(version)
    if other is None or other.version != version or entry is None or entry.state != BAD:
        return None
    judged = last.assessment
    at = f" at {judged.at}" if judged is not None and judged.version == version and not judged.ok and judged.at else ""
    return f"version {version} was rolled back{at}: its boot entry {entry.path.name} is out of tries"


def accepted_sequences() -> dict[str, int]:
    """The highest timestamp sequence accepted so far, per timestamp key (update/freshness.json,
    read capped and without following a link; a damaged file is refused, never taken as none)."""
    record = load_record(Freshness, paths.freshness_path(), lenient=True)
    return dict(record.sequences) if record is not None else {}


def check_fresh(source: Source, index_data: bytes, version: str, *, timestamp_keys_dir: Path, running: Manifest,
                now: float) -> tuple[appliance.signed.timestamp.Timestamp, tuple[bytes, bytes]]:
    """The bundle's timestamp, fetched through SOURCE with a cap: signed by a timestamp key of the
    running version, naming exactly INDEX_DATA, not expired by the system clock, not older than
    the last one accepted."""
    signed = (source.read_small(appliance.signed.timestamp.TIMESTAMP, appliance.signed.timestamp.MAX_TIMESTAMP_BYTES),
              source.read_small(appliance.signed.timestamp.TIMESTAMP_SIG, MAX_SIG_BYTES))
    ts = appliance.signed.timestamp.verify(*signed, timestamp_keys_dir)
    appliance.signed.timestamp.check_names(ts, index_data, version)
    appliance.signed.timestamp.check_clock(ts, now, running.build_time)
    appliance.signed.timestamp.check_sequence(ts, accepted_sequences().get(ts.signer))
    return ts, signed


def make_plan(
    spec: str,
    *,
    ca: str | None,
    deadline: Deadline,
    host: Host,
    keys_dir: Path,
    running: Manifest,
    allow_downgrade: bool,
    staged: str | None = None,
    timestamp_keys_dir: Path | None = None,
    now: float | None = None,
    force: bool = False,
) -> UpdatePlan:
    """The signature first, before anything in the bundle is looked at; then its freshness (the
    timestamp, by the system clock NOW), policy and fit. STAGED: SPEC is the staged directory and
    this the version its record names; a staged bundle that fails its signature is discarded
    (update.staged.discarded_if_refused), and its timestamp is not looked at again (install media
    and a staged bundle do not depend on the expiry). FORCE: a rolled-back version is not refused."""
    guard: AbstractContextManager[None] = applianctl.update.staged.discarded_if_refused() if staged is not None else nullcontext()
    with guard:
        source = open_source(spec, ca, deadline)
        signed = source.read_small(BUNDLE_INDEX, MAX_INDEX_BYTES), source.read_small(BUNDLE_SIG, MAX_SIG_BYTES)
        index = verify_index(*signed, keys_dir)
        check_strict(index)
        if staged is not None and index.version != staged:
            raise Refused(f"the staged bundle.json is version {index.version}, its record says {staged}")
    timestamp, signed_timestamp = None, None
    if staged is None:
        timestamp, signed_timestamp = check_fresh(
            source, signed[0], index.version, running=running, now=appliance.signed.timestamp.system_clock() if now is None else now,
            timestamp_keys_dir=timestamp_keys_dir or paths.timestamp_keys_dir(keys_dir))
    if staged is not None:
        check_staged_newer(index, running, allow_downgrade)
    downgrade = check_policy(index, running, allow_downgrade)
    view = applianctl.slots.view.read(host, running.version, running_engine=running.engine_image.digest)
    engine = check_engine(index, running, view)
    inactive = inactive_slot(view)
    check_fits(index, inactive)
    return UpdatePlan(
        spec=spec, source=source, index=index, signed=signed, running=running, view=view, inactive=inactive, engine=engine,
        downgrade=downgrade, files=tuple(to_fetch(index, writes_engine(engine))), timestamp=timestamp,
        signed_timestamp=signed_timestamp, rolled_back=rolled_back_why(index.version, view), force=force,
    )
