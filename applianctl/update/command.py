"""`applianctl update SOURCE`: install a signed release bundle into the inactive slot.

SOURCE is a bundle directory or an https:// URL of one on any static web server. Nothing in a
bundle is trusted before its one signature is checked, and nothing is written to a slot before
every byte is proven. The steps, each in its own module:

0. The running version must be judged good (its boot entry carries no boot counter): while it
   is on trial, the inactive slot may hold the only version known to be good, and writing it
   could leave nothing good to fall back to (slots.View.running_state). Refused in one line.
1. bundle.json and its signature are fetched with byte caps (appliance.fetch: HTTPS only, same-origin
   redirects, the given CA, one deadline) and checked against the keys the RUNNING version
   trusts (appliance.bundle.verify_index).
2. Policy and fit (update_verify): newer, min_version, profile, engine image, partition sizes.
3. Free space with a margin, then every file downloaded and hashed (update_stage); the content
   checked (update_verify.check_staged).
4. Only then the inactive slot is blanked and written by systemd-sysupdate (update_install).

`--check` does steps 0-2 and says what would be installed; it writes nothing.
`--download-only` does steps 1-3 and publishes the verified bundle as the staged update
(update_staged); `--apply` installs it later with steps 0-4, everything checked again first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance import atomic, paths, progress
from appliance.bundle import BUNDLE_INDEX, BUNDLE_SIG, MAX_INDEX_BYTES, MAX_SIG_BYTES, BundleIndex, engine_short, verify_index
from appliance.errors import Refused, UserError
from appliance.fetch import Deadline, open_source
from appliance.manifest import Manifest, version_tuple
from appliance.run import run
from applianctl.slots import engine as engine_slots
from applianctl.slots import view as slots
from applianctl.slots.engine import EngineChoice
from applianctl.update import staged as update_staged
from applianctl.update.checks import check_engine, check_fits, check_policy, check_staged, check_strict, writes_engine
from applianctl.update.download import SPACE_MARGIN_BYTES, check_space, stage, staging_for, to_fetch
from applianctl.update.install import (
    boot_tries,
    engine_sysupdate_commands,
    link_engine_sources,
    link_sources,
    locked,
    prepare_engine_slot,
    prepare_slot,
    sysupdate_commands,
)

DEFAULT_DEADLINE_S = 4 * 3600.0  # the whole run; the unit's TimeoutStartSec= is a little longer


def check_judged(view: slots.View) -> None:
    """The invariant: at every moment at least one boot entry is known good. Writing the inactive
    slot is safe only when the running version is that entry."""
    state, why = view.running_state()
    running = view.running_version
    other = view.other
    if state == slots.GOOD:
        return
    if state == slots.ON_TRIAL:
        raise UserError(
            f"refused: the running version {running} is on trial ({why}); slot {other.name if other else '?'} "
            "may hold the only version known to be good",
            hint="wait until this boot's assessment has passed (`applianctl slots` shows it judged good), then run the same command again",
        )
    if state == slots.BAD:
        raise UserError(
            f"refused: the running version {running} is marked bad ({why}); "
            f"slot {other.name if other else '?'} holds the version to fall back to",
            hint="reboot into the other slot first (it is the default now), then update from there",
        )
    raise UserError(f"refused: cannot tell whether the running version is judged good ({why})", hint="see applianctl slots")


def inactive_slot(view: slots.View) -> slots.Slot:
    booted = [s for s in view.slots if s.booted]
    if len(view.slots) != 2 or len(booted) != 1:
        errors = f" ({'; '.join(view.errors)})" if view.errors else ""
        raise UserError(
            f"expected two /usr slots, one of them booted; found {len(view.slots)} slot(s), {len(booted)} booted{errors}",
            hint="the second slot is made by systemd-repart on first boot; check `sfdisk -l` of the disk",
        )
    other = view.other
    assert other is not None
    return other


def plan(
    spec: str,
    *,
    ca: str | None,
    deadline: Deadline,
    host: slots.Host,
    keys_dir: Path,
    running: Manifest,
    allow_downgrade: bool,
) -> dict[str, Any]:
    """Steps 1 and 2: what installing SPEC would do. Reads the source; writes nothing."""
    source = open_source(spec, ca, deadline)
    data = source.read_small(BUNDLE_INDEX, MAX_INDEX_BYTES)
    sig = source.read_small(BUNDLE_SIG, MAX_SIG_BYTES)
    index = verify_index(data, sig, keys_dir)
    check_strict(index)
    downgrade = check_policy(index, running, allow_downgrade)
    view = slots.read(host, running.version, running_engine=running.engine_image.digest)
    engine = check_engine(index, running, view)
    inactive = inactive_slot(view)
    check_fits(index, inactive)
    version = index.version
    new_engine = writes_engine(engine)
    return {
        "source": spec,
        "version": version,
        "running_version": running.version,
        "slot": inactive.name,
        "slot_holds": inactive.version,
        "downgrade": downgrade,
        "signer": index.signer,
        "engine": engine_short(index.engine_digest),
        "engine_slot": engine.slot.name if engine is not None else None,
        "engine_written": new_engine,
        "download_bytes": sum(f.size for f in to_fetch(index, new_engine)),
        "files": [f.name for f in to_fetch(index, new_engine)],
        "already_installed": inactive.version == version and view.entry(version) is not None,
        "_index": index,
        "_signed": (data, sig),
        "_source": source,
        "_inactive": inactive,
        "_view": view,
        "_engine": engine,
    }


def _public(p: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in p.items() if not k.startswith("_")}


def check(
    spec: str,
    *,
    ca: str | None = None,
    allow_downgrade: bool = False,
    deadline_s: float = 300.0,
    host: slots.Host | None = None,
    keys_dir: Path | None = None,
    running: Manifest | None = None,
) -> dict[str, Any]:
    """`update --check`: the plan, and whether the update would be refused now (blocked)."""
    host = host or slots.Host()
    running = running or slots.running_manifest()
    p = plan(spec, ca=ca, deadline=Deadline(deadline_s), host=host, keys_dir=keys_dir or paths.TRUSTED_KEYS_DIR,
             running=running, allow_downgrade=allow_downgrade)
    out = _public(p)
    try:
        check_judged(p["_view"])
        out["blocked"] = None
    except UserError as e:
        out["blocked"] = e.message
    return out


def update(
    spec: str,
    *,
    allow_downgrade: bool = False,
    reboot: bool = False,
    ca: str | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    space_margin: int = SPACE_MARGIN_BYTES,
    host: slots.Host | None = None,
    keys_dir: Path | None = None,
    running: Manifest | None = None,
    confirm: Callable[[str], bool] | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),  # progress, seen at once through a pipe
) -> int:
    host = host or slots.Host()
    keys_dir = keys_dir or paths.TRUSTED_KEYS_DIR
    running = running or slots.running_manifest()
    deadline = Deadline(deadline_s)
    # 0. before anything else (no network, no lock file): never write while on trial
    check_judged(slots.read(host, running.version))
    with locked():
        # 1-2. the signature, before anything in the bundle is looked at; then policy and fit
        p = plan(spec, ca=ca, deadline=deadline, host=host, keys_dir=keys_dir, running=running, allow_downgrade=allow_downgrade)
        check_judged(p["_view"])  # read again under the lock
        index, source, inactive = p["_index"], p["_source"], p["_inactive"]
        version = index.version
        if p["already_installed"]:
            say(f"version {version} is already installed in slot {inactive.name}; reboot to start it")
            return 0
        if confirm is not None and not confirm(f"install {version} over {running.version} into slot {inactive.name}?"):
            raise UserError("not confirmed", hint="add --yes to install without asking")
        # 3. room first, then every byte, proven
        engine, new_engine = p["_engine"], p["engine_written"]
        staging = staging_for(version)
        check_space(index, staging, space_margin, new_engine)
        stage(index, source, staging, new_engine)
        check_staged(index, staging, keys_dir)
        say(f"bundle {version} verified ({len(index.files)} files, signed by {index.signer})")
        # 4. only now: the engine slot (when the engine is new), then the inactive /usr slot
        install(index, staging, host=host, inactive=inactive, running=running, downgrade=p["downgrade"], deadline=deadline,
                record={"source": spec}, say=say, engine=engine)
        shutil.rmtree(staging, ignore_errors=True)
    installed(version, inactive, reboot, say)
    return 0


def install(
    index: BundleIndex,
    staging: Path,
    *,
    host: slots.Host,
    inactive: slots.Slot,
    running: Manifest,
    downgrade: bool,
    deadline: Deadline,
    record: dict[str, Any],
    say: Callable[[str], None],
    engine: EngineChoice | None = None,
) -> None:
    """Step 4, for files in STAGING that were proven this run: the new engine into its engine slot
    when ENGINE says so, then blank the inactive slot, let systemd-sysupdate write it, record the
    update. The caller holds the lock."""
    version = index.version
    if writes_engine(engine):
        assert engine is not None
        short = engine_short(index.engine_digest)
        say(f"blanking engine slot {engine.slot.name}")
        with progress.step(f"zeroing engine slot {engine.slot.name}"):
            prepare_engine_slot(host, engine.slot, leaving=inactive.version if inactive.version != running.version else None)
        link_engine_sources(index, staging)
        say(f"writing engine slot {engine.slot.name}: {short}")
        with progress.step(f"systemd-sysupdate engine {short} into engine slot {engine.slot.name}"):
            for command in engine_sysupdate_commands(index):
                hint = "see journalctl -t systemd-sysupdate; run the same command again to start over"
                run(command, "systemd-sysupdate (engine)", hint, timeout=deadline.left())
    say(f"blanking slot {inactive.name}")
    with progress.step(f"zeroing slot {inactive.name}"):  # blkdiscard --zeroout: no count to show
        prepare_slot(host, inactive, running.version)
    link_sources(index, staging)
    say(f"writing slot {inactive.name}: {version}")
    with progress.step(f"systemd-sysupdate {version} into slot {inactive.name}"):
        for command in sysupdate_commands(index):
            hint = "see journalctl -t systemd-sysupdate; run the same command again to start over"
            run(command, "systemd-sysupdate", hint, timeout=deadline.left())
    os.sync()
    if downgrade:
        run(["bootctl", "set-oneshot", f"appliance_{version}.efi"], "bootctl set-oneshot", "select the entry in the boot menu")
    atomic.write_json_atomic(
        slots.last_update_path(),
        {
            "version": version,
            "from_version": running.version,
            "slot": inactive.name,
            "downgrade": downgrade,
            "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **record,
        },
    )
    # which engine each version runs, from signed data, for choosing engine slots (engine_slots.py)
    engine_slots.record({running.version: running.engine_image.digest, version: index.engine_digest},
                        keep={e.version for e in slots.entries(host)} | {running.version, version})
    shutil.rmtree(slots.source_dir(), ignore_errors=True)
    # a staged download of this version or an older one would only overwrite what was just installed
    update_staged.discard_if_not_newer(version)


def installed(version: str, inactive: slots.Slot, reboot: bool, say: Callable[[str], None]) -> None:
    tries = boot_tries()
    say(f"installed {version} into slot {inactive.name}; it boots next, on trial ({tries if tries else 'counted'} tries)")
    if reboot:
        run(["systemctl", "reboot"], "systemctl reboot", "reboot by hand")


def download_only(
    spec: str,
    *,
    allow_downgrade: bool = False,
    ca: str | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    space_margin: int = SPACE_MARGIN_BYTES,
    host: slots.Host | None = None,
    keys_dir: Path | None = None,
    running: Manifest | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> int:
    """`update --download-only`: steps 1-3 into the staged update; no slot or boot entry is
    touched, so it is not refused while the running version is on trial (--apply is)."""
    host = host or slots.Host()
    keys_dir = keys_dir or paths.TRUSTED_KEYS_DIR
    running = running or slots.running_manifest()
    deadline = Deadline(deadline_s)
    with locked():
        p = plan(spec, ca=ca, deadline=deadline, host=host, keys_dir=keys_dir, running=running, allow_downgrade=allow_downgrade)
        index, source, inactive = p["_index"], p["_source"], p["_inactive"]
        version = index.version
        if p["already_installed"]:
            say(f"version {version} is already installed in slot {inactive.name}; reboot to start it")
            return 0
        previous = update_staged.read()
        if previous and "error" not in previous and previous["version"] == version:
            try:
                same = (update_staged.directory(previous) / BUNDLE_INDEX).read_bytes() == p["_signed"][0]
            except OSError:
                same = False
            if same:  # the daily timer against an unchanged server: nothing to fetch or hash
                say(f"version {version} is already staged ({previous['staged_at']}); apply it with applianctl update --apply")
                return 0
        new_engine = p["engine_written"]
        staging = staging_for(version)
        update_staged.seed(previous, index, staging, new_engine)
        check_space(index, staging, space_margin, new_engine)
        stage(index, source, staging, new_engine)
        check_staged(index, staging, keys_dir)
        record = update_staged.publish(staging, index, p["_signed"], spec, new_engine)
    mib = record["bytes"] / (1 << 20)
    say(f"staged {version} ({record['files']} files, {mib:.1f} MiB, signed by {index.signer}); "
        "install it with applianctl update --apply")
    return 0


def apply(
    *,
    allow_downgrade: bool = False,
    reboot: bool = False,
    deadline_s: float = DEFAULT_DEADLINE_S,
    host: slots.Host | None = None,
    keys_dir: Path | None = None,
    running: Manifest | None = None,
    confirm: Callable[[str], bool] | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> int:
    """`update --apply`: install the staged update. Everything is checked again as if it had just
    been downloaded (signature, policy, fit, every file's SHA-256, the content) before the slot is
    touched: the files waited on /var, where they could have changed."""
    host = host or slots.Host()
    keys_dir = keys_dir or paths.TRUSTED_KEYS_DIR
    running = running or slots.running_manifest()
    deadline = Deadline(deadline_s)
    if update_staged.read() is None:
        raise update_staged.nothing_staged()
    check_judged(slots.read(host, running.version))
    with locked():
        record = update_staged.read()
        if record is None:
            raise update_staged.nothing_staged()
        if "error" in record:
            raise UserError(f"the staged update cannot be used: {record['error']}", hint=update_staged.DOWNLOAD_AGAIN)
        staged = update_staged.directory(record)
        with update_staged.discarded_if_refused():
            source = open_source(str(staged), None, deadline)
            index = verify_index(source.read_small(BUNDLE_INDEX, MAX_INDEX_BYTES), source.read_small(BUNDLE_SIG, MAX_SIG_BYTES), keys_dir)
            check_strict(index)
            if index.version != record["version"]:
                raise Refused(f"the staged bundle.json is version {index.version}, its record says {record['version']}")
        version = index.version
        new, cur = version_tuple(version), version_tuple(running.version)
        if new == cur or (new < cur and not allow_downgrade):
            raise UserError(
                f"the staged bundle {version} is not newer than the running version {running.version}",
                hint="stage a newer one: `applianctl update --download-only SOURCE` (an older one only with --allow-downgrade)",
            )
        downgrade = check_policy(index, running, allow_downgrade)
        view = slots.read(host, running.version, running_engine=running.engine_image.digest)
        engine = check_engine(index, running, view)
        check_judged(view)
        inactive = inactive_slot(view)
        check_fits(index, inactive)
        if inactive.version == version and view.entry(version) is not None:
            update_staged.discard()
            say(f"version {version} is already installed in slot {inactive.name}; reboot to start it")
            return 0
        if confirm is not None and not confirm(f"install the staged {version} over {running.version} into slot {inactive.name}?"):
            raise UserError("not confirmed", hint="add --yes to install without asking")
        with update_staged.discarded_if_refused():
            update_staged.verify_in_place(index, staged, writes_engine(engine))
            check_staged(index, staged, keys_dir)
        say(f"staged bundle {version} verified again ({len(index.files)} files, signed by {index.signer})")
        install(index, staged, host=host, inactive=inactive, running=running, downgrade=downgrade, deadline=deadline,
                record={"source": record.get("source"), "staged_at": record.get("staged_at")}, say=say, engine=engine)
    installed(version, inactive, reboot, say)
    return 0


def _print_plan(p: dict[str, Any]) -> None:
    mib = p["download_bytes"] / (1 << 20)
    what = "downgrade" if p["downgrade"] else "upgrade"
    if p["already_installed"]:
        print(f"{p['version']} is already installed in slot {p['slot']}; reboot to start it")
    else:
        held = p["slot_holds"] or "nothing"
        print(f"would install {p['version']} over {p['running_version']} ({what}) into slot {p['slot']} (now: {held}), "
              f"downloading {mib:.1f} MiB, signed by {p['signer']}")
    if p["blocked"]:
        print(p["blocked"])


def _options(args: argparse.Namespace) -> None:
    """Combinations that mean nothing, refused in one line before anything is read."""
    if args.download_only and args.apply:
        raise UserError("--download-only and --apply are two steps, not one run",
                        hint="download now: `applianctl update --download-only SOURCE`; install later: `applianctl update --apply`")
    if args.apply and (args.source or args.from_config):
        raise UserError("--apply installs what was staged and takes no SOURCE", hint="`applianctl update --apply`")
    if args.apply and args.check:
        raise UserError("--check goes with a SOURCE, not --apply", hint="`applianctl status` shows what is staged")
    if args.apply and args.ca:
        raise UserError("--apply downloads nothing: --ca does not go with it", hint="`applianctl update --apply`")
    if args.download_only and (args.reboot or args.check):
        which = "--reboot" if args.reboot else "--check"
        raise UserError(f"--download-only writes no slot: {which} does not go with it",
                        hint="`applianctl update --download-only SOURCE`, then `applianctl update --apply --reboot`")
    if args.json and not args.check:
        raise UserError("--json goes with --check", hint="applianctl update --check SOURCE --json")
    if args.deadline is not None and not (0 < args.deadline < 7 * 86400):
        raise UserError(f"--deadline {args.deadline:g}: expected seconds between 0 and a week", hint="e.g. --deadline 14400")


def cmd_update(args: argparse.Namespace) -> int:
    _options(args)
    confirm = None
    if not args.yes and sys.stdin.isatty():

        def confirm(question: str) -> bool:
            return input(question + " [y/N] ").strip().lower() in ("y", "yes")

    if args.apply:
        return apply(allow_downgrade=args.allow_downgrade, reboot=args.reboot, confirm=confirm,
                     deadline_s=args.deadline or DEFAULT_DEADLINE_S)
    spec = args.source
    download = args.download_only
    if args.from_config:
        from appliance.config import load_device

        settings = load_device().update
        spec = settings.url
        if not spec:
            print("update.url is empty: no automatic update check")
            return 0
        download = download or settings.timer_action == "download-only"
    if not spec:
        raise UserError("no SOURCE given", hint="applianctl update DIRECTORY-or-URL (or --from-config)")
    if args.check:
        p = check(spec, ca=args.ca, allow_downgrade=args.allow_downgrade, deadline_s=args.deadline or 300.0)
        if args.json:
            print(json.dumps(p, indent=2, sort_keys=True))
        else:
            _print_plan(p)
        return 2 if p["blocked"] else 0
    deadline_s = args.deadline or DEFAULT_DEADLINE_S
    try:
        if download:
            return download_only(spec, allow_downgrade=args.allow_downgrade, ca=args.ca, deadline_s=deadline_s)
        return update(spec, allow_downgrade=args.allow_downgrade, reboot=args.reboot, ca=args.ca, confirm=confirm, deadline_s=deadline_s)
    except Refused as e:
        # the timer's service: an unchanged bundle on the server is not a failure
        if args.from_config and "is the running version" in e.message:
            print(f"up to date: {e.message}")
            return 0
        raise


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "update",
        help="install a signed release bundle into the inactive slot (or stage it now and install it later)",
        description="Install a signed release bundle into the inactive slot; refused while the running version is on trial. "
        "--download-only fetches and verifies it into /var and writes no slot; --apply installs what was staged.",
    )
    p.add_argument("source", nargs="?", default="", help="a bundle directory or an https:// URL of one")
    p.add_argument("--check", action="store_true", help="say what would be installed and whether it would be refused now; write nothing")
    p.add_argument("--json", action="store_true", help="with --check: print the plan as JSON")
    p.add_argument("--download-only", action="store_true",
                   help="fetch and verify the bundle into /var (replacing what was staged before); write no slot or boot entry")
    p.add_argument("--apply", action="store_true",
                   help="install what --download-only staged, after checking its signature and every file again")
    p.add_argument("--reboot", action="store_true", help="reboot into the new version when it is installed")
    p.add_argument("--allow-downgrade", action="store_true", help="accept a signed bundle older than the running version")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--ca", help="CA certificate to trust for an https:// SOURCE, and only it (default: the system's)")
    p.add_argument("--deadline", type=float, help=f"seconds the whole update may take (default {DEFAULT_DEADLINE_S:g}; --check: 300)")
    p.add_argument("--from-config", action="store_true",
                   help="use update.url of the configuration, and update.timer_action: install or download-only (the update timer)")
    p.set_defaults(func=cmd_update)
