# SPDX-License-Identifier: MIT
"""`applianctl model fetch [SOURCE]` and `applianctl model verify`: the command line of the weights.

fetch: applianctl/model/fetch.py; verify (run by appliance-model-verify.service, which the engine
requires): applianctl/model/verify.py. Both read the image's signed weights manifest
(applianctl/model/store.py); an image without one has nothing to fetch or check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import applianctl.model.store
from appliance import cli_help, paths
from appliance.atomic import write_record
from appliance.config import Config
from appliance.config.checks import is_weights_source
from appliance.errors import UserError
from appliance.host_settings import load_device
from appliance.safe_read import read_capped
from appliance.schema import dump_record
from applianctl.model.fsverity_seal import Kernel, Verity
from applianctl.records import ModelVerifyResult, WeightsFetch


def _store() -> tuple[applianctl.model.store.Store | None, Config]:
    """The weights' store (None when the image pins no weights) and the device's configuration.
    The configuration is read first: where there is none, no appliance is installed (that fault,
    naming where it looked), which is not the same as an image without weights."""
    config = load_device()
    manifest = applianctl.model.store.load_manifest()
    if manifest is None:
        return None, config
    return applianctl.model.store.open_store(config, manifest), config


# A source handed over with the boot (a systemd credential), for --at-boot: demo images import it
# (a drop-in only demo images have), `make demo` and the QEMU tests give their
# build host's mirror this way; a production unit imports no credential.
SOURCE_CREDENTIAL = paths.MODEL_SOURCE_CREDENTIAL
CA_CREDENTIAL = paths.MODEL_SOURCE_CA_CREDENTIAL


def _credential(name: str) -> Path | None:
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    path = Path(directory) / name if directory else None
    return path if path is not None and path.is_file() else None


def _boot_source(given: str) -> str:
    """GIVEN (the command line), else the credential's one line; checked as model.source is."""
    path = _credential(SOURCE_CREDENTIAL)
    if given or path is None:
        return given
    data = read_capped(path, applianctl.model.store.MAX_HOST_SOURCE_BYTES, what="the model source credential") or b""
    line = data.decode("utf-8", "replace").strip()
    problem = is_weights_source(line) if line else None
    if problem is not None:
        raise UserError(f"credential {SOURCE_CREDENTIAL}: {line[:80]!r} is not {problem}", hint="give an https:// mirror or a directory")
    return line


def cmd_fetch(args: argparse.Namespace, verity: Verity | None = None) -> int:
    from applianctl.model import fetch, verify

    store, config = _store()
    if store is None:
        raise UserError(f"{applianctl.model.store.weights_manifest()}: this image pins no weights", hint="nothing to fetch")
    ca = args.ca
    if args.at_boot:  # appliance-model-fetch.service: once a boot, before the start check
        present = verify.check(store, verity or Kernel())
        if present.ok:
            print(f"weights {store.manifest.model}@{store.manifest.revision[:12]}: in place, as signed; nothing to fetch")
            return 0
        spec = _boot_source(args.source) or store.default_source(config)
        if not spec:
            # not a failure of this unit: the start check names the missing file, status says it
            print(f"{present.reason}; no source to fetch them from (applianctl model fetch SOURCE, "
                  f"{store.host_dir / applianctl.model.store.HOST_SOURCE}, or model.source)")
            return 0
        ca = ca or (str(_credential(CA_CREDENTIAL)) if _credential(CA_CREDENTIAL) else None)
    else:
        spec = args.source or store.default_source(config)
    source = fetch.open_source(spec, ca, args.layout, store.manifest.model, store.manifest.revision)
    summary = fetch.fetch(store, source, verity or Kernel(), workers=args.jobs)
    applianctl.model.store.write_host_record(store.host_dir, applianctl.model.store.FETCH_STATE,
                                  WeightsFetch(spec, store.manifest.revision, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    if args.json:
        print(json.dumps({"source": spec, **summary}, sort_keys=True))
    else:
        print(f"weights {store.manifest.model}@{store.manifest.revision[:12]}: {summary['files']} files, {summary['bytes']} bytes "
              f"in place and sealed ({summary['fetched_files']} fetched, {summary['fetched_bytes']} bytes, {summary['elapsed_s']} s)")
    return 0


def cmd_verify(args: argparse.Namespace, verity: Verity | None = None) -> int:
    from applianctl.model import verify

    store, _ = _store()
    if store is None:
        result = ModelVerifyResult(True, "", checked=False)
        message = "model verify: this image pins no weights; nothing to check"
    else:
        result = verify.check(store, verity or Kernel(), deep=args.deep)
        message = f"model verify: {result.files} files, {result.bytes} bytes, every fs-verity digest as signed"
        message += ", every byte read back" if args.deep else ""
    write_record(applianctl.model.store.verify_result(), result)
    if args.json:
        print(json.dumps(dump_record(result), sort_keys=True))
    if not result.ok:
        print(f"{result.reason}", file=sys.stderr)
        print("hint: applianctl model fetch puts the signed files back; the engine stays stopped until then", file=sys.stderr)
        return 1
    if not args.json:
        print(message)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fetch_codes = [(0, "every file is in place, as signed, and sealed (--at-boot: also when there is no source)"),
                   (1, "refused: a file is not as the signed manifest says"),
                   (2, "bad input, or the source cannot be read (one line and a hint)")]
    verify_codes = [(0, "every file is as signed (or the image pins no weights)"),
                    (1, "a file is missing or not as signed (named on stderr)"), cli_help.BAD_INPUT]
    p = cli_help.verb_parser(
        sub, "model", "the model's weights: fetch them, verify them",
        examples=["applianctl model fetch https://mirror.example/models/", "applianctl model verify --deep"],
        exit_codes=[(0, "success"), (1, "a file is not as signed"), cli_help.BAD_INPUT],
        details="Each ACTION's --help names its own exit statuses.",
    )
    verbs = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    f = cli_help.verb_parser(
        verbs, "fetch", "fetch the signed weights onto /var, check and seal every file (resumable)",
        examples=["applianctl model fetch", "applianctl model fetch https://mirror.example/models/ --ca mirror-ca.pem --json"],
        exit_codes=fetch_codes,
    )
    f.add_argument("source", nargs="?", default="",
                   help="an https:// mirror (Hub layout BASE/resolve/REVISION/PATH or BASE/PATH) or a directory "
                        "(default: /var/lib/appliance/host/model-source, else model.source)")
    f.add_argument("--ca", help="the PEM CA that signed the mirror's certificate (default: the system's)")
    f.add_argument("--layout", choices=["auto", "hub", "plain"], default="auto",
                   help="the mirror's layout (auto: hub when the URL ends with the model id)")
    f.add_argument("--jobs", type=int, default=4, help="files fetched at once (default: 4)")
    f.add_argument("--json", action="store_true", help="print the summary as JSON")
    f.add_argument("--at-boot", action="store_true",
                   help="(appliance-model-fetch.service) only when a file is missing or not as signed; the source may also "
                        f"come as the credential {SOURCE_CREDENTIAL} (its CA as {CA_CREDENTIAL}); none: say so, exit 0")
    v = cli_help.verb_parser(
        verbs, "verify", "check every weight file's fs-verity digest against the signed manifest",
        examples=["applianctl model verify", "applianctl model verify --deep --json"],
        exit_codes=verify_codes,
    )
    v.add_argument("--json", action="store_true", help="print the result as JSON")
    v.add_argument("--deep", action="store_true",
                   help="also read every byte through fs-verity (minutes; finds blocks changed on the disk behind the file system)")
    v.set_defaults(func=cmd_verify)
    for verb in (f, v):  # as applianctl's global options: before or after the verb
        verb.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    f.set_defaults(func=cmd_fetch)
