# SPDX-License-Identifier: MIT
"""`applianctl verify`: the release manifest's signature, then every engine file against it, then
what in /etc or /run changes behaviour outside the signed image (appliance.factory_etc); and the
hidden `applianctl etc-reset --root DIR`, which puts /etc back to the factory's (in the initrd).

Runs at boot (appliance-verify.service) and by hand. Writes paths.VERIFY_RESULT (a
records.VerifyResult); exit 0 when every file matches and nothing overrides the image, 1 otherwise
(one line on stderr naming the file). The manifest module (cryptography) is imported by `verify`
only: etc-reset runs in the initrd.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance import cli_help, factory_etc, paths
from appliance.atomic import write_record
from appliance.errors import UserError
from appliance.hashing import sha256_file
from appliance.schema import dump_record
from applianctl.records import VerifyResult

if TYPE_CHECKING:
    from appliance.signed import release_manifest

OVERRIDES_SHOWN = 50  # in the result; the reason names the first REASON_SHOWN
REASON_SHOWN = 3


def firmware_dir() -> Path:
    from appliance.signed import release_manifest

    return Path(os.environ.get("APPLIANCE_FIRMWARE_DIR", release_manifest.FIRMWARE_UPDATES_DIR))


def add_parser(subparsers: Any) -> None:
    parser = cli_help.verb_parser(
        subparsers, "verify",
        "check the manifest signature, every overlay, tuning table and firmware file, and /etc against the factory's",
        examples=["applianctl verify", "applianctl verify --json"],
        exit_codes=[(0, "every file matches and nothing in /etc or /run overrides the image"),
                    (1, "a file does not match, the manifest is not as signed, or /etc overrides the image (one line naming it)"),
                    cli_help.BAD_INPUT],
        details="Check the signed release manifest against the trusted keys, then every overlay, "
        "tuning table and firmware file on the device against it, then that nothing in /etc or /run changes "
        f"behaviour outside the signed image (against {paths.FACTORY_ETC_RECORD}). Writes {paths.VERIFY_RESULT}.",
    )
    parser.add_argument("--json", action="store_true", help="print the result document (the one status reads) on stdout")
    parser.set_defaults(func=run)
    # Hidden (no help=, so not listed): the initrd runs it on /sysroot before systemd reads /etc.
    reset = cli_help.verb_parser(
        subparsers, "etc-reset", "put DIR/etc back to the factory /etc of the image in DIR (the initrd's step)",
        examples=["applianctl etc-reset --root /sysroot"],
        exit_codes=[(0, "/etc is as the factory's where it matters (or the image has no factory /etc record)"),
                    (1, "something could not be put back (each named)"), cli_help.BAD_INPUT],
        details="Where a difference changes behaviour: restore what changed or went from DIR/usr/share/factory/etc, "
        "delete what was added, keep per-host files.",
        hidden=True,
    )
    reset.add_argument("--root", required=True, type=Path, metavar="DIR", help="the root file system (/sysroot in the initrd)")
    reset.set_defaults(func=run_reset)


def run(args: argparse.Namespace) -> int:
    result = check()
    write_result(result)
    if getattr(args, "json", False):
        import json

        print(json.dumps(dump_record(result), indent=2))
        return 0 if result.ok else 1
    if not result.ok:
        print(f"applianctl verify: {result.reason}", file=sys.stderr)
        return 1
    print(result.reason)
    return 0


def check() -> VerifyResult:
    """The verification result (never raises for a bad manifest or file: that is a result)."""
    from appliance.signed import release_manifest

    try:
        data = _read(paths.MANIFEST)
        sig = _read(paths.MANIFEST_SIG)
        release = release_manifest.verify(data, sig, paths.TRUSTED_KEYS_DIR)
    except release_manifest.ManifestError as e:
        return VerifyResult(False, _one_line(e.message))
    problem, count = _check_files(release)
    etc_problem, overrides, note = _check_etc()
    reason = (problem or etc_problem or _overrides_reason(overrides)
              or f"manifest {release.version} signed by {release.signer}: {count} files match{note}")
    ok = not (problem or etc_problem or overrides)
    return VerifyResult(ok, _one_line(reason), release.version, release.signer, _capped(overrides))


def _check_etc() -> tuple[str, list[str] | None, str]:
    """(a fault, the overrides (None: not compared), a note for the reason when all is well)."""
    try:
        record = factory_etc.load(paths.FACTORY_ETC_RECORD)
    except UserError as e:
        return e.message, None, ""
    if record is None:
        return "", None, f"; /etc not compared: {paths.FACTORY_ETC_RECORD} absent (an image built before it)"
    try:
        findings = factory_etc.compare(paths.ETC_DIR, record)
    except OSError as e:
        return f"{paths.ETC_DIR}: cannot compare with the factory /etc ({e.strerror})", None, ""
    try:
        findings += factory_etc.runtime(paths.RUN_ROOT)
    except OSError as e:
        return f"{paths.RUN_ROOT}: cannot look for runtime units ({e.strerror})", None, ""
    lines = [_one_line(f.line()) for f in factory_etc.reported(findings)]
    return "", lines, "; /etc as the factory's"


def _overrides_reason(overrides: list[str] | None) -> str:
    if not overrides:
        return ""
    n = len(overrides)
    head = "1 file outside the signed image changes" if n == 1 else f"{n} files outside the signed image change"
    more = f" and {n - REASON_SHOWN} more (applianctl verify --json)" if n > REASON_SHOWN else ""
    return f"{head} behaviour: {', '.join(overrides[:REASON_SHOWN])}{more}"


def _capped(overrides: list[str] | None) -> tuple[str, ...] | None:
    if overrides is None:
        return None
    extra = len(overrides) - OVERRIDES_SHOWN
    return tuple(overrides[:OVERRIDES_SHOWN]) + ((f"... and {extra} more",) if extra > 0 else ())


def _read(path: Path) -> bytes:
    from appliance.signed import release_manifest

    try:
        with path.open("rb") as f:
            data = f.read(release_manifest.MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise release_manifest.ManifestError(f"{path}: missing", hint="the image is damaged") from None
    except OSError as e:
        raise release_manifest.ManifestError(f"{path}: cannot read ({e.strerror})", hint="the image is damaged") from None
    return data


def _check_files(release: release_manifest.Manifest) -> tuple[str, int]:
    from appliance.signed import release_manifest

    expected: dict[Path, str] = {}
    for entry in release.files:
        where = release_manifest.device_path(entry, paths.ENGINE_FILES_DIR, firmware_dir())
        if where is None:
            continue
        expected[where] = entry.sha256
        problem = _check_file(where, entry.sha256)
        if problem:
            return problem, 0
    for kind_dir in sorted({paths.ENGINE_FILES_DIR / d for d in release_manifest.DEVICE_SUBDIRS.values()}):
        try:
            present = sorted(kind_dir.iterdir())
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"{kind_dir}: cannot list ({e.strerror})", 0
        for path in present:
            if path not in expected:
                return f"{path}: not in the manifest", 0
    return "", len(expected)


def _check_file(path: Path, sha256: str) -> str:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return f"{path}: missing (manifest sha256 {sha256})"
    except OSError as e:
        return f"{path}: cannot read ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"{path}: is a symlink, expected a regular file"
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: not a regular file"
    try:
        actual = sha256_file(path)
    except OSError as e:
        return f"{path}: cannot read ({e.strerror})"
    if actual != sha256:
        return f"{path}: sha256 {actual}, manifest says {sha256}"
    return ""


def _one_line(reason: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in reason)


def write_result(result: VerifyResult) -> None:
    """Write paths.VERIFY_RESULT atomically."""
    write_record(paths.VERIFY_RESULT, result)


def run_reset(args: argparse.Namespace) -> int:
    """`applianctl etc-reset --root DIR`: one line per path reset; 1 when one could not be."""
    return factory_etc.reset(args.root)
