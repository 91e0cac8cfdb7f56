"""What installing a bundle would do, decided once (make_plan) and acted on by every verb:
`--check` prints it, plain `update` and `--download-only` fetch what it names, `--apply` makes
it again from the staged directory. Making it reads bundle.json, its signature and the slots;
it writes nothing."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.bundle import BUNDLE_INDEX, BUNDLE_SIG, MAX_INDEX_BYTES, MAX_SIG_BYTES, BundleFile, BundleIndex, engine_short, verify_index
from appliance.errors import Refused, UserError
from appliance.fetch import Deadline, Source, open_source
from appliance.manifest import Manifest
from applianctl.slots import view as slots
from applianctl.slots.engine import EngineChoice
from applianctl.slots.machine import Host
from applianctl.slots.partitions import Slot
from applianctl.update import staged as update_staged
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
    view: slots.View  # read after the signature was checked
    inactive: Slot
    engine: EngineChoice | None  # None: the new version runs the running engine
    downgrade: bool
    files: tuple[BundleFile, ...]  # what this appliance downloads (download.to_fetch)

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
        """The inactive slot holds this version and it has a boot entry. A slot labelled with it but
        without an entry was interrupted and is written again."""
        return self.inactive.version == self.version and self.view.entry(self.version) is not None

    @property
    def blocked(self) -> str | None:
        """Why writing the slot is refused now (check_judged), None when it is not."""
        try:
            check_judged(self.view)
        except UserError as e:
            return e.message
        return None

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
        }


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
) -> UpdatePlan:
    """The signature first, before anything in the bundle is looked at; then policy and fit.
    STAGED: SPEC is the staged directory and this the version its record names; a staged bundle
    that fails its signature is discarded (update.staged.discarded_if_refused)."""
    guard: AbstractContextManager[None] = update_staged.discarded_if_refused() if staged is not None else nullcontext()
    with guard:
        source = open_source(spec, ca, deadline)
        signed = source.read_small(BUNDLE_INDEX, MAX_INDEX_BYTES), source.read_small(BUNDLE_SIG, MAX_SIG_BYTES)
        index = verify_index(*signed, keys_dir)
        check_strict(index)
        if staged is not None and index.version != staged:
            raise Refused(f"the staged bundle.json is version {index.version}, its record says {staged}")
    if staged is not None:
        check_staged_newer(index, running, allow_downgrade)
    downgrade = check_policy(index, running, allow_downgrade)
    view = slots.read(host, running.version, running_engine=running.engine_image.digest)
    engine = check_engine(index, running, view)
    inactive = inactive_slot(view)
    check_fits(index, inactive)
    return UpdatePlan(
        spec=spec, source=source, index=index, signed=signed, running=running, view=view, inactive=inactive, engine=engine,
        downgrade=downgrade, files=tuple(to_fetch(index, writes_engine(engine))),
    )
