"""`applianctl verify`: the release manifest's signature, then every engine file against it.

Runs at boot (appliance-verify.service) and by hand. Writes paths.VERIFY_RESULT (a
records.VerifyResult); exit 0 when every file matches, 1 otherwise (one line on stderr naming the file).
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
from pathlib import Path
from typing import Any

from appliance import manifest, paths
from appliance.atomic import write_record
from appliance.hashing import sha256_file
from appliance.schema import dump_record
from applianctl.records import VerifyResult


def firmware_dir() -> Path:
    return Path(os.environ.get("APPLIANCE_FIRMWARE_DIR", manifest.FIRMWARE_UPDATES_DIR))


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check the manifest signature and every overlay, tuning table and firmware file",
        description="Check the signed release manifest against the trusted keys, then every overlay, "
        f"tuning table and firmware file on the device against it. Writes {paths.VERIFY_RESULT}.",
    )
    parser.add_argument("--json", action="store_true", help="print the result document (the one status reads) on stdout")
    parser.set_defaults(func=run)


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
    try:
        data = _read(paths.MANIFEST)
        sig = _read(paths.MANIFEST_SIG)
        release = manifest.verify(data, sig, paths.TRUSTED_KEYS_DIR)
    except manifest.ManifestError as e:
        return VerifyResult(False, _one_line(e.message))
    problem, count = _check_files(release)
    reason = problem or f"manifest {release.version} signed by {release.signer}: {count} files match"
    return VerifyResult(not problem, _one_line(reason), release.version, release.signer)


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(manifest.MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise manifest.ManifestError(f"{path}: missing", hint="the image is damaged") from None
    except OSError as e:
        raise manifest.ManifestError(f"{path}: cannot read ({e.strerror})", hint="the image is damaged") from None
    return data


def _check_files(release: manifest.Manifest) -> tuple[str, int]:
    expected: dict[Path, str] = {}
    for entry in release.files:
        where = manifest.device_path(entry, paths.ENGINE_FILES_DIR, firmware_dir())
        if where is None:
            continue
        expected[where] = entry.sha256
        problem = _check_file(where, entry.sha256)
        if problem:
            return problem, 0
    for kind_dir in sorted({paths.ENGINE_FILES_DIR / d for d in manifest.DEVICE_SUBDIRS.values()}):
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
