"""`applianctl support-bundle`: what a vendor or a colleague needs to see why an appliance misbehaves,
in one tarball, without secrets: the journal since a given time, status, slots, verify, the
startup report, unit states, a hardware inventory (amd-smi, lsblk, ip) and the signed manifest's
versions. Each source is gathered on its own, bounded in time and size; one that fails is named in
the bundle's index.json with why, and the rest is still gathered. Every text is redacted before it
is written (private keys, tokens, passwords, /var's recovery key). The tarball is written under a
temporary name and renamed into place; its path is printed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import socket
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.errors import UserError
from appliance.run import call

DEFAULT_OUTPUT = Path("/var/tmp")
MAX_SOURCE_BYTES = 64 << 20  # the journal of a busy day fits; a runaway source is cut, and says so
COMMAND_TIMEOUT_S = 120.0
REDACTED = "[redacted]"

# (name in the bundle, command): each run on its own, its stdout kept (stderr in the index on failure)
COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("status.json", ("applianctl", "status", "--json")),
    ("slots.json", ("applianctl", "slots", "--json")),
    ("verify.json", ("applianctl", "verify", "--json")),
    ("units.txt", ("systemctl", "list-units", "--all", "--no-pager", "--plain")),
    ("failed-units.txt", ("systemctl", "--failed", "--no-pager", "--plain")),
    ("hardware/amd-smi-static.json", ("amd-smi", "static", "--json")),
    ("hardware/lsblk.json", ("lsblk", "--json", "-O", "-b")),
    ("hardware/ip-addr.json", ("ip", "-j", "addr")),
    ("hardware/ip-route.json", ("ip", "-j", "route")),
)
# files copied as they are (redacted like everything else)
FILES: tuple[tuple[str, Path], ...] = (
    ("startup-report.json", paths.RUN_DIR / "startup-report.json"),
    ("manifest.json", paths.MANIFEST),
)

_SECRETS: tuple[tuple[re.Pattern[str], str], ...] = (
    # PEM private keys of any kind, whole
    (re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----.*?-----END [A-Z0-9 ]*PRIVATE KEY-----", re.S), REDACTED),
    # /var's recovery key (systemd-cryptenroll's modhex form, appliance/luks.py)
    (re.compile(r"\b[cbdefghijklnrtuv]{8}(?:-[cbdefghijklnrtuv]{8}){7}\b"), REDACTED),
    # bearer tokens and HTTP authorization headers
    (re.compile(r"(?i)(authorization:\s*)(bearer|basic)\s+[^\s\"']+"), rf"\1\2 {REDACTED}"),
    (re.compile(r"(?i)\bbearer\s+[A-Za-z0-9._~+/=-]{8,}"), f"Bearer {REDACTED}"),
    # Hugging Face and OpenAI-style API tokens
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"), REDACTED),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{16,}\b"), REDACTED),
    # key=value and "key": "value" forms of passwords, tokens, secrets, API keys
    (re.compile(r"(?i)\b((?:pass(?:word|phrase)?|secret|token|api[_-]?key)[\w-]*\"?\s*[=:]\s*\"?)[^\s\",}]+"), rf"\1{REDACTED}"),
)


def redact(text: str) -> str:
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


@dataclass
class Gathered:
    files: dict[str, bytes]
    index: dict[str, Any]


def _bounded(data: str) -> tuple[str, bool]:
    raw = data.encode("utf-8", "replace")
    if len(raw) <= MAX_SOURCE_BYTES:
        return data, False
    return raw[-MAX_SOURCE_BYTES:].decode("utf-8", "replace"), True  # the newest part of a log matters most


def gather(since: str, commands: tuple[tuple[str, tuple[str, ...]], ...] = COMMANDS,
           files: tuple[tuple[str, Path], ...] = FILES) -> Gathered:
    out: dict[str, bytes] = {}
    index: dict[str, Any] = {"since": since, "host": socket.gethostname(),
                             "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sources": {}}
    journal = ("journal.txt", ("journalctl", "--since", since, "-o", "short-iso-precise", "--no-pager"))
    for name, argv in (journal, *commands):
        try:
            proc: subprocess.CompletedProcess[str] = call(argv, timeout=COMMAND_TIMEOUT_S)
        except FileNotFoundError:
            index["sources"][name] = {"command": list(argv), "collected": False, "why": f"{argv[0]} is not installed"}
            continue
        except subprocess.TimeoutExpired:
            index["sources"][name] = {"command": list(argv), "collected": False, "why": f"no answer within {COMMAND_TIMEOUT_S:g} s"}
            continue
        text, cut = _bounded(proc.stdout)
        # status and verify say what is wrong through their exit status: their output is what matters
        out[name] = redact(text).encode()
        entry: dict[str, Any] = {"command": list(argv), "collected": True, "exit": proc.returncode}
        if cut:
            entry["cut_to_last_bytes"] = MAX_SOURCE_BYTES
        if proc.returncode != 0 and proc.stderr:
            entry["stderr"] = redact(proc.stderr[-2000:])
        index["sources"][name] = entry
    for name, path in files:
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_SOURCE_BYTES + 1)
        except OSError as e:
            index["sources"][name] = {"file": str(path), "collected": False, "why": e.strerror or type(e).__name__}
            continue
        out[name] = redact(data[:MAX_SOURCE_BYTES].decode("utf-8", "replace")).encode()
        index["sources"][name] = {"file": str(path), "collected": True}
    return Gathered(out, index)


def write(gathered: Gathered, output: Path) -> Path:
    """The tarball, under a temporary name in OUTPUT, renamed into place once whole."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = f"support-{re.sub(r'[^A-Za-z0-9.-]', '_', gathered.index['host'])}-{stamp}"
    final = output / f"{name}.tar.gz"
    tmp = output / f".{name}.tar.gz.{os.getpid()}.tmp"
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            members = {**gathered.files, "index.json": (json.dumps(gathered.index, indent=2, sort_keys=True) + "\n").encode()}
            for member, data in sorted(members.items()):
                info = tarfile.TarInfo(f"{name}/{member}")
                info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
                tar.addfile(info, io.BytesIO(data))
        os.chmod(tmp, 0o600)  # a support bundle names the host's addresses and disks: for its owner only
        os.replace(tmp, final)
    except OSError as e:
        raise UserError(f"{final}: cannot be written ({e.strerror})", hint="free some space there or pass --output DIR") from None
    finally:
        tmp.unlink(missing_ok=True)
    return final


def run(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if not output.is_dir():
        raise UserError(f"--output {output}: no such directory", hint="give an existing directory (default /var/tmp)")
    if not args.since or any(c in args.since for c in "\n\0"):
        raise UserError("--since needs a time journalctl understands", hint='e.g. --since "2 hours ago" or --since 2026-12-01')
    path = write(gather(args.since), output)
    print(path)
    return 0


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "support-bundle", help="gather the journal, status, slots, unit states and a hardware inventory into one tarball, secrets redacted")
    p.add_argument("--since", default="1 day ago", help='the journal from this time on (journalctl --since; default "1 day ago")')
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help="the directory for the tarball (default /var/tmp)")
    p.set_defaults(func=run)
