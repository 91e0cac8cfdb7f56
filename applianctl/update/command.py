# SPDX-License-Identifier: MIT
"""`applianctl update SOURCE` (a bundle directory or its https:// URL): install a signed release
bundle into the inactive slot. Nothing is trusted before its signature, nothing written before
every byte is proven:

0. the running version must be judged good (checks.check_judged), before any network;
1. bundle.json verified against the RUNNING version's keys, its timestamp against the running
   version's timestamp keys and the clock (fresh, not older than the last accepted, which is then
   recorded), then policy and fit: plan.make_plan; a version rolled back here is refused unless --force;
2. free space, every file downloaded and hashed (download), the content checked (checks.check_staged);
3. only then the new engine's slot, if any, and the inactive slot are written (install).

`--check` prints the plan and writes nothing; `--download-only` does 1-2 into the staged update;
`--apply` makes the plan again from it and re-checks every file before 3.
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

import applianctl.update.staged
from appliance import atomic, cli_help, paths, progress
from appliance.errors import Refused, UserError
from appliance.fetch import Deadline
from appliance.run import run
from appliance.safe_read import read_capped
from appliance.signed.bundle_index import BUNDLE_INDEX, MAX_INDEX_BYTES, BundleFile, engine_short, payload_names
from appliance.signed.release_manifest import Manifest
from applianctl.records import Freshness, LastUpdate, Staged
from applianctl.slots import engine, release, view
from applianctl.slots.entries import entries
from applianctl.slots.machine import Host
from applianctl.update import channel
from applianctl.update.checks import check_judged, check_kernel_trusted, check_staged
from applianctl.update.download import SPACE_MARGIN_BYTES, check_space, stage, staging_for
from applianctl.update.install import (
    boot_tries,
    engine_sysupdate_commands,
    link_engine_sources,
    link_sources,
    locked,
    pin_default_entry,
    prepare_engine_slot,
    prepare_slot,
    sysupdate_commands,
)
from applianctl.update.update_plan import UpdatePlan, accepted_sequences, make_plan

DEFAULT_DEADLINE_S = 4 * 3600.0  # the whole run; the unit's TimeoutStartSec= is a little longer


def _print(line: str) -> None:
    print(line, flush=True)  # progress, seen at once through a pipe


def _already_installed(p: UpdatePlan, say: Callable[[str], None]) -> int:
    _accepted(p)
    say(f"version {p.version} is already installed in slot {p.inactive.name}; reboot to start it")
    return 0


def _accepted(p: UpdatePlan) -> None:
    """Record P's timestamp as accepted, once an update or a --download-only has done what it
    plans (never --check): from now on a timestamp of its key with a lower sequence is refused.
    The record only ever goes up."""
    ts = p.timestamp
    if ts is None:
        return
    sequences = accepted_sequences()
    if sequences.get(ts.signer, 0) >= ts.sequence:
        return
    sequences[ts.signer] = ts.sequence
    atomic.write_record(paths.freshness_path(), Freshness(sequences=sequences, version=p.version,
                                                          accepted_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))


def _refuse_rolled_back(p: UpdatePlan) -> None:
    refused = p.refused_rolled_back
    if refused is not None:
        raise refused


def _download(p: UpdatePlan, staging: Path, space_margin: int, keys_dir: Path, host: Host) -> None:
    """Room first, then every file the plan names into STAGING, each proven, then their content."""
    check_space(p.index, staging, space_margin, p.engine_written)
    uki = payload_names(p.index.version, p.index.engine_digest, False)["uki"]

    def refuse_early(f: BundleFile) -> None:  # a kernel image the firmware would refuse: before /usr is fetched
        if f.name == uki:
            check_kernel_trusted(staging / uki, host.efivars)

    stage(p.index, p.source, staging, p.engine_written, proven=refuse_early)
    check_staged(p.index, staging, keys_dir, p.engine_written, p.running.engine_image, efivars_dir=host.efivars)


def check(
    spec: str,
    *,
    ca: str | None = None,
    allow_downgrade: bool = False,
    deadline_s: float = 300.0,
    host: Host | None = None,
    keys_dir: Path | None = None,
    running: Manifest | None = None,
    force: bool = False,
) -> UpdatePlan:
    """`update --check`: the plan; its .blocked says whether the update would be refused now. Its
    timestamp is checked, not recorded as accepted."""
    return make_plan(spec, ca=ca, deadline=Deadline(deadline_s), host=host or Host(), keys_dir=keys_dir or paths.TRUSTED_KEYS_DIR,
                     running=running or release.running_manifest(), allow_downgrade=allow_downgrade, force=force)


def update(
    spec: str,
    *,
    allow_downgrade: bool = False,
    reboot: bool = False,
    ca: str | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    space_margin: int = SPACE_MARGIN_BYTES,
    host: Host | None = None,
    keys_dir: Path | None = None,
    running: Manifest | None = None,
    confirm: Callable[[str], bool] | None = None,
    say: Callable[[str], None] = _print,
    force: bool = False,
) -> int:
    host = host or Host()
    keys_dir = keys_dir or paths.TRUSTED_KEYS_DIR
    running = running or release.running_manifest()
    deadline = Deadline(deadline_s)
    check_judged(view.read(host, running.version))  # no network, no lock file: never write while on trial
    with locked():
        p = make_plan(spec, ca=ca, deadline=deadline, host=host, keys_dir=keys_dir, running=running, allow_downgrade=allow_downgrade,
                      force=force)
        check_judged(p.view)  # read again under the lock
        _refuse_rolled_back(p)
        if p.already_installed:
            return _already_installed(p, say)
        if confirm is not None and not confirm(f"install {p.version} over {running.version} into slot {p.inactive.name}?"):
            raise UserError("not confirmed", hint="add --yes to install without asking")
        staging = staging_for(p.version)
        _download(p, staging, space_margin, keys_dir, host)
        say(f"bundle {p.version} verified ({len(p.index.files)} files, signed by {p.index.signer})")
        install(p, staging, host=host, deadline=deadline, source=spec, say=say)
        _accepted(p)
        shutil.rmtree(staging, ignore_errors=True)
    installed(p, reboot, say)
    return 0


def install(
    p: UpdatePlan,
    staging: Path,
    *,
    host: Host,
    deadline: Deadline,
    source: str,
    staged_at: str | None = None,
    say: Callable[[str], None],
) -> None:
    """For files in STAGING proven this run: the new engine into its engine slot when the plan
    writes one, then blank the inactive slot, let systemd-sysupdate write it, record the update
    in last-update.json (from SOURCE; STAGED_AT: downloaded then by --download-only). The caller
    holds the lock."""
    index, inactive, running, version = p.index, p.inactive, p.running, p.version
    if p.engine is not None and p.engine_written:
        slot = p.engine.slot
        short = engine_short(index.engine_digest)
        say(f"blanking engine slot {slot.name}")
        with progress.step(f"zeroing engine slot {slot.name}"):
            prepare_engine_slot(host, slot, leaving=inactive.version if inactive.version != running.version else None)
        link_engine_sources(index, staging)
        say(f"writing engine slot {slot.name}: {short}")
        with progress.step(f"systemd-sysupdate engine {short} into engine slot {slot.name}"):
            for command in engine_sysupdate_commands(index):
                hint = "see journalctl -t systemd-sysupdate; run the same command again to start over"
                run(command, "systemd-sysupdate (engine)", hint, timeout=deadline.left())
    if pin_default_entry(host):
        say("boot menu: the default pinned to the main entries (the factory reset entries are never a default)")
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
    if p.downgrade:
        run(["bootctl", "set-oneshot", f"appliance_{version}.efi"], "bootctl set-oneshot", "select the entry in the boot menu")
    installed_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    atomic.write_record(paths.last_update_path(), LastUpdate(version=version, from_version=running.version, slot=inactive.name,
                                                             downgrade=p.downgrade, installed_at=installed_at, source=source,
                                                             staged_at=staged_at))
    # which engine each version runs, from signed data, for choosing engine slots (slots.engine)
    engine.record({running.version: running.engine_image.digest, version: index.engine_digest},
                        keep={e.version for e in entries(host)} | {running.version, version})
    shutil.rmtree(paths.update_source_dir(), ignore_errors=True)
    # a staged download of this version or an older one would only overwrite what was just installed
    applianctl.update.staged.discard_if_not_newer(version)


def installed(p: UpdatePlan, reboot: bool, say: Callable[[str], None]) -> None:
    tries = boot_tries()
    say(f"installed {p.version} into slot {p.inactive.name}; it boots next, on trial ({tries if tries else 'counted'} tries)")
    if reboot:
        run(["systemctl", "reboot"], "systemctl reboot", "reboot by hand")


def _already_staged(p: UpdatePlan, previous: Staged | None) -> str | None:
    """When PREVIOUS (the usable staged record) holds this very bundle.json, its staged_at: nothing
    to fetch or hash."""
    if previous is None or previous.version != p.version:
        return None
    try:
        staged_index = applianctl.update.staged.directory(previous) / BUNDLE_INDEX
        same = read_capped(staged_index, MAX_INDEX_BYTES, what="a bundle index") == p.signed[0]
    except UserError:
        return None
    return previous.staged_at if same else None


def download_only(
    spec: str,
    *,
    allow_downgrade: bool = False,
    ca: str | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    space_margin: int = SPACE_MARGIN_BYTES,
    host: Host | None = None,
    keys_dir: Path | None = None,
    running: Manifest | None = None,
    say: Callable[[str], None] = _print,
    force: bool = False,
) -> int:
    """`update --download-only`: the plan's files into the staged update; no slot or boot entry is
    touched, so it is not refused while the running version is on trial (--apply is)."""
    host = host or Host()
    keys_dir = keys_dir or paths.TRUSTED_KEYS_DIR
    running = running or release.running_manifest()
    deadline = Deadline(deadline_s)
    with locked():
        p = make_plan(spec, ca=ca, deadline=deadline, host=host, keys_dir=keys_dir, running=running, allow_downgrade=allow_downgrade,
                      force=force)
        _refuse_rolled_back(p)
        if p.already_installed:
            return _already_installed(p, say)
        state = applianctl.update.staged.read()
        previous = state.usable if state is not None else None
        staged_at = _already_staged(p, previous)
        if staged_at is not None:  # the daily timer against an unchanged server
            _accepted(p)
            say(f"version {p.version} is already staged ({staged_at}); apply it with applianctl update --apply")
            return 0
        staging = staging_for(p.version)
        applianctl.update.staged.seed(previous, p.index, staging, p.engine_written)
        _download(p, staging, space_margin, keys_dir, host)
        record = applianctl.update.staged.publish(staging, p.index, p.signed, spec, p.engine_written, timestamp=p.signed_timestamp)
        _accepted(p)
    mib = record.bytes / (1 << 20)
    say(f"staged {p.version} ({record.files} files, {mib:.1f} MiB, signed by {p.index.signer}); "
        "install it with applianctl update --apply")
    return 0


def apply(
    *,
    allow_downgrade: bool = False,
    reboot: bool = False,
    deadline_s: float = DEFAULT_DEADLINE_S,
    host: Host | None = None,
    keys_dir: Path | None = None,
    running: Manifest | None = None,
    confirm: Callable[[str], bool] | None = None,
    say: Callable[[str], None] = _print,
    force: bool = False,
) -> int:
    """`update --apply`: install the staged update. The plan is made again from the staged
    directory and every file's SHA-256 and the content checked again before the slot is touched:
    the files waited on /var, where they could have changed. Not its timestamp: it was accepted
    fresh when it was staged, and applying it later does not depend on the expiry."""
    host = host or Host()
    keys_dir = keys_dir or paths.TRUSTED_KEYS_DIR
    running = running or release.running_manifest()
    deadline = Deadline(deadline_s)
    if applianctl.update.staged.read() is None:
        raise applianctl.update.staged.nothing_staged()
    check_judged(view.read(host, running.version))
    with locked():
        state = applianctl.update.staged.read()
        if state is None:
            raise applianctl.update.staged.nothing_staged()
        record = state.usable
        if record is None:
            raise UserError(f"the staged update cannot be used: {state.problem}", hint=applianctl.update.staged.DOWNLOAD_AGAIN)
        staged = applianctl.update.staged.directory(record)
        p = make_plan(str(staged), ca=None, deadline=deadline, host=host, keys_dir=keys_dir, running=running,
                      allow_downgrade=allow_downgrade, staged=record.version, force=force)
        check_judged(p.view)
        _refuse_rolled_back(p)
        if p.already_installed:
            applianctl.update.staged.discard()
            return _already_installed(p, say)
        if confirm is not None and not confirm(f"install the staged {p.version} over {running.version} into slot {p.inactive.name}?"):
            raise UserError("not confirmed", hint="add --yes to install without asking")
        with applianctl.update.staged.discarded_if_refused():
            applianctl.update.staged.verify_in_place(p.index, staged, p.engine_written)
            check_staged(p.index, staged, keys_dir, p.engine_written, p.running.engine_image, efivars_dir=host.efivars)
        say(f"staged bundle {p.version} verified again ({len(p.index.files)} files, signed by {p.index.signer})")
        install(p, staged, host=host, deadline=deadline, source=record.source, staged_at=record.staged_at, say=say)
    installed(p, reboot, say)
    return 0


def _print_plan(p: UpdatePlan) -> None:
    mib = p.download_bytes / (1 << 20)
    what = "downgrade" if p.downgrade else "upgrade"
    if p.rolled_back is not None and p.force:
        print(f"{p.rolled_back}; --force writes slot {p.inactive.name} again")
    if p.already_installed:
        print(f"{p.version} is already installed in slot {p.inactive.name}; reboot to start it")
    else:
        held = p.inactive.version or "nothing"
        print(f"would install {p.version} over {p.running.version} ({what}) into slot {p.inactive.name} (now: {held}), "
              f"downloading {mib:.1f} MiB, signed by {p.index.signer}")
    if p.blocked:
        print(p.blocked)


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
                     deadline_s=args.deadline or DEFAULT_DEADLINE_S, force=args.force)
    spec = args.source
    download = args.download_only
    if args.from_config:
        from appliance.host_settings import load_device

        settings = load_device().update
        spec = settings.url
        if not spec:
            print("update.url is empty: no automatic update check")
            return 0
        download = download or settings.timer_action == "download-only"
    if not spec:
        raise UserError("no SOURCE given", hint="applianctl update DIRECTORY-or-URL (or --from-config)")
    if channel.is_channel(spec):
        resolved = _resolve_channel(spec, args)
        if resolved is None:
            return 0
        spec = resolved
    if args.check:
        p = check(spec, ca=args.ca, allow_downgrade=args.allow_downgrade, deadline_s=args.deadline or 300.0, force=args.force)
        if args.json:
            print(json.dumps(p.to_json(), indent=2, sort_keys=True))
        else:
            _print_plan(p)
        return 2 if p.blocked else 0
    deadline_s = args.deadline or DEFAULT_DEADLINE_S
    try:
        if download:
            return download_only(spec, allow_downgrade=args.allow_downgrade, ca=args.ca, deadline_s=deadline_s, force=args.force)
        return update(spec, allow_downgrade=args.allow_downgrade, reboot=args.reboot, ca=args.ca, confirm=confirm, deadline_s=deadline_s,
                      force=args.force)
    except Refused as e:
        # the timer's service: an unchanged bundle on the server is not a failure
        if args.from_config and "is the running version" in e.message:
            print(f"up to date: {e.message}")
            return 0
        raise


def _resolve_channel(spec: str, args: argparse.Namespace) -> str | None:
    """SPEC names a channel index: say where this appliance stands in each rollout and when it
    installs; the bundle to go on with, or None when there is nothing to install now (for the timer,
    also outside a maintenance window). Every index accepted has its sequence recorded (by
    channel.resolve, --check included), so that an older one (which could undo a pause or a stop)
    is refused from then on."""
    now = channel.system_clock()
    running = release.running_manifest()
    res = channel.resolve(spec, ca=args.ca, deadline=Deadline(args.deadline or 300.0), keys_dir=paths.TRUSTED_KEYS_DIR,
                          running_version=running.version, machine=channel.machine_id(), now=now,
                          windows=channel.maintenance_windows())
    # with --json, stdout is the one JSON document
    print(res.describe(now), file=sys.stderr if getattr(args, "json", False) else sys.stdout, flush=True)
    if res.bundle is None:
        return None
    if args.from_config and not res.in_window:
        print("outside the maintenance window: nothing installed now", flush=True)
        return None
    return res.bundle


def add_parser(subparsers: Any) -> None:
    p = cli_help.verb_parser(
        subparsers, "update", "install a signed release bundle into the inactive slot (or stage it now and install it later)",
        examples=["applianctl update --check https://updates.example/appliance/ --json",
                  "applianctl update --download-only https://updates.example/appliance/",
                  "applianctl update --apply --reboot"],
        exit_codes=[(0, "installed, staged, up to date, or (--check) it would be installed"),
                    (1, "refused: the bundle is not authentic, not intact, or not allowed for this host"),
                    (2, "bad input or a fault you can fix (one line and a hint); with --check: it would be refused now")],
        details="Refused while the running version is on trial. "
        "--download-only fetches and verifies it into /var and writes no slot; --apply installs what was staged.",
    )
    p.add_argument("source", nargs="?", default="",
                   help="a bundle directory or an https:// URL of one, or of a channel index (.../channel.json: phased rollouts)")
    p.add_argument("--check", action="store_true",
                   help="say what would be installed and whether it would be refused now; write nothing "
                        "(but a channel index's sequence, recorded as accepted)")
    p.add_argument("--json", action="store_true", help="with --check: print the plan as JSON")
    p.add_argument("--download-only", action="store_true",
                   help="fetch and verify the bundle into /var (replacing what was staged before); write no slot or boot entry")
    p.add_argument("--apply", action="store_true",
                   help="install what --download-only staged, after checking its signature and every file again")
    p.add_argument("--reboot", action="store_true", help="reboot into the new version when it is installed")
    p.add_argument("--allow-downgrade", action="store_true", help="accept a signed bundle older than the running version")
    p.add_argument("--force", action="store_true",
                   help="install a version that was rolled back on this appliance again (its slot is written again, with fresh boot tries)")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--ca", help="CA certificate to trust for an https:// SOURCE, and only it (default: the system's)")
    p.add_argument("--deadline", type=float, help=f"seconds the whole update may take (default {DEFAULT_DEADLINE_S:g}; --check: 300)")
    p.add_argument("--from-config", action="store_true",
                   help="use update.url of the configuration, and update.timer_action: install or download-only (the update timer)")
    p.set_defaults(func=cmd_update)
