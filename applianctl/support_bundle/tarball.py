# SPDX-License-Identifier: MIT
"""`applianctl support-bundle`: what a vendor or a colleague needs to see why an appliance misbehaves,
in one tarball, without secrets: the journal since a given time, status, slots, verify, the
startup report, unit states, a hardware inventory (amd-smi, lsblk, ip) and the signed manifest's
versions. Each source is gathered on its own, bounded in time and size; one that fails is named in
the bundle's index.json with why, and the rest is still gathered. Every text is redacted before it
is written (applianctl/support_bundle/redact.py), the index too. A file is read only if it is a regular file,
no link followed (a link to /etc/shadow is not copied, a FIFO does not hang the bundle). The tarball
is its owner's alone from its first byte, written under a temporary name and renamed into place
once whole; its path is printed.
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import os
import re
import secrets
import socket
import stat
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import cli_help, paths
from appliance.atomic import fsync_dir
from appliance.errors import UserError
from appliance.run import CompletedProcess, TimeoutExpired, call
from appliance.safe_read import file_kind
from applianctl.support_bundle.redact import REDACTED, redact, redact_member

__all__ = ["REDACTED", "add_parser", "gather", "redact", "run", "write"]

DEFAULT_OUTPUT = Path("/var/tmp")
MAX_SOURCE_BYTES = 64 << 20  # the journal of a busy day fits; a runaway source is cut, and says so
COMMAND_TIMEOUT_S = 120.0

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

@dataclass
class Gathered:
    files: dict[str, bytes]
    index: dict[str, Any]


def _tail(data: str, limit: int) -> tuple[str, bool]:
    """The last LIMIT bytes of DATA, from the first whole line on (a line cut at its start could be
    a secret without its name); whether it was cut."""
    raw = data.encode("utf-8", "replace")
    if len(raw) <= limit:
        return data, False
    kept = raw[-limit:]
    return kept[kept.find(b"\n") + 1:].decode("utf-8", "replace"), True  # the newest part of a log matters most


def _read_file(path: Path) -> tuple[bytes | None, str]:
    """The first MAX_SOURCE_BYTES of the regular file PATH up to its last whole line, and "" or
    "cut"; or None and why it was not read."""
    try:
        # no link followed; O_NONBLOCK: opening a FIFO or a device must not wait for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None, "a symbolic link, not followed: skipped"
        return None, e.strerror or type(e).__name__
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return None, f"{file_kind(mode)}, not a regular file: skipped"
        chunks: list[bytes] = []
        have = 0
        while have <= MAX_SOURCE_BYTES and (chunk := os.read(fd, MAX_SOURCE_BYTES + 1 - have)):
            chunks.append(chunk)
            have += len(chunk)
    except OSError as e:
        return None, e.strerror or type(e).__name__
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) <= MAX_SOURCE_BYTES:
        return data, ""
    data = data[:MAX_SOURCE_BYTES]
    return data[:data.rfind(b"\n") + 1], "cut"  # a line cut at its end could be a secret without its end


def gather(since: str, commands: tuple[tuple[str, tuple[str, ...]], ...] = COMMANDS,
           files: tuple[tuple[str, Path], ...] = FILES) -> Gathered:
    """Every source as it is (write() redacts), and the index that says how each went."""
    out: dict[str, bytes] = {}
    index: dict[str, Any] = {"since": since, "host": socket.gethostname(),
                             "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sources": {}}
    journal = ("journal.txt", ("journalctl", "--since", since, "-o", "short-iso-precise", "--no-pager"))
    for name, argv in (journal, *commands):
        try:
            proc: CompletedProcess[str] = call(argv, timeout=COMMAND_TIMEOUT_S)
        except FileNotFoundError:
            index["sources"][name] = {"command": list(argv), "collected": False, "why": f"{argv[0]} is not installed"}
            continue
        except TimeoutExpired:
            index["sources"][name] = {"command": list(argv), "collected": False, "why": f"no answer within {COMMAND_TIMEOUT_S:g} s"}
            continue
        text, cut = _tail(proc.stdout, MAX_SOURCE_BYTES)
        # status and verify say what is wrong through their exit status: their output is what matters
        out[name] = text.encode()
        entry: dict[str, Any] = {"command": list(argv), "collected": True, "exit": proc.returncode}
        if cut:
            entry["cut_to_last_bytes"] = MAX_SOURCE_BYTES
        if proc.returncode != 0 and proc.stderr:
            entry["stderr"] = _tail(proc.stderr, 2000)[0]
        index["sources"][name] = entry
    for name, path in files:
        data, why = _read_file(path)
        if data is None:
            index["sources"][name] = {"file": str(path), "collected": False, "why": why}
            continue
        out[name] = data
        index["sources"][name] = {"file": str(path), "collected": True, **({"cut_to_first_bytes": MAX_SOURCE_BYTES} if why else {})}
    return Gathered(out, index)


def write(gathered: Gathered, output: Path) -> Path:
    """The tarball of every member redacted, the index too: created 0600 under a temporary name
    in OUTPUT, renamed into place once whole; nothing is left behind when it cannot be."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    name = f"support-{re.sub(r'[^A-Za-z0-9.-]', '_', gathered.index['host'])}-{stamp}"
    final = output / f"{name}.tar.gz"
    tmp = output / f".{name}.tar.gz.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    created = False
    try:
        # 0600 from the start (a bundle names the host's addresses and disks); O_EXCL and
        # O_NOFOLLOW: a name planted in a shared /var/tmp is neither followed nor reused
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        created = True
        with os.fdopen(fd, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w:gz") as tar:
                members = {**gathered.files, "index.json": (json.dumps(gathered.index, indent=2, sort_keys=True) + "\n").encode()}
                for member, data in sorted(members.items()):
                    data = redact_member(member, data)
                    info = tarfile.TarInfo(f"{name}/{member}")
                    info.size, info.mode, info.mtime = len(data), 0o600, int(time.time())
                    tar.addfile(info, io.BytesIO(data))
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, final)
        created = False
        fsync_dir(output)
    except OSError as e:
        raise UserError(f"{final}: cannot be written ({e.strerror})", hint="free some space there or pass --output DIR") from None
    finally:
        if created:
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
    p = cli_help.verb_parser(
        subparsers, "support-bundle",
        "gather the journal, status, slots, unit states and a hardware inventory into one tarball, secrets redacted",
        examples=['applianctl support-bundle --since "2 hours ago"'],
        exit_codes=[(0, "written: its path on stdout"), cli_help.BAD_INPUT],
    )
    p.add_argument("--since", default="1 day ago", help='the journal from this time on (journalctl --since; default "1 day ago")')
    p.add_argument("--output", default=str(DEFAULT_OUTPUT), help="the directory for the tarball (default /var/tmp)")
    p.set_defaults(func=run)
