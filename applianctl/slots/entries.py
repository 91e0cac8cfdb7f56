# SPDX-License-Identifier: MIT
"""The appliance's boot entries: unified kernel images `EFI/Linux/appliance_VERSION[+LEFT[-DONE]].efi`.

Read with `bootctl list --json=short` (id, path, triesLeft/triesDone, isDefault, isSelected); when
bootctl cannot say (not installed, no ESP found, older systemd), the ESP's EFI/Linux is read
instead, and read_entries() says which.

A version is judged by its entry's name: no counter = good (never counted, or blessed by
systemd-bless-boot after boot-complete.target); `+LEFT[-DONE]` with LEFT > 0 = on trial;
`+0[-DONE]` = bad (used up its tries, or marked so by a rollback).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from appliance.run import TimeoutExpired, call
from appliance.signed import release_manifest
from applianctl.slots.machine import Host
from applianctl.slots.partitions import VERSION

BOOTCTL_TIMEOUT_S = 10.0

_ENTRY = re.compile(rf"^appliance_({VERSION})(?:\+([0-9]{{1,4}})(?:-([0-9]{{1,4}}))?)?\.efi\Z")

GOOD, ON_TRIAL, BAD = "good", "on trial", "bad"


@dataclass(frozen=True)
class Entry:
    path: Path
    version: str
    tries_left: int | None  # None: not counting (judged good, or never counted)
    tries_done: int | None
    is_default: bool | None = None  # from bootctl; None when it could not tell
    is_selected: bool | None = None

    @property
    def id(self) -> str:
        """The boot loader's id of the entry: the file name without the boot counter."""
        return f"appliance_{self.version}.efi"

    @property
    def state(self) -> str:
        if self.tries_left is None:
            return GOOD
        return BAD if self.tries_left == 0 else ON_TRIAL

    def renamed(self, tries_left: int | None) -> Path:
        """This entry's path with the counter +TRIES_LEFT (None: no counter, judged good)."""
        suffix = "" if tries_left is None else f"+{tries_left}"
        return self.path.with_name(f"appliance_{self.version}{suffix}.efi")


def parse_entry(path: Path) -> Entry | None:
    m = _ENTRY.match(path.name)
    if not m:
        return None
    left = int(m.group(2)) if m.group(2) is not None else None
    done = int(m.group(3) or 0) if left is not None else None
    return Entry(path, m.group(1), left, done)


def _scan_entries(host: Host) -> list[Entry]:
    if host.esp is None:
        return []
    try:
        files = list((host.esp / "EFI" / "Linux").iterdir())
    except OSError:
        return []
    return [e for f in files if (e := parse_entry(f)) is not None]


def parse_bootctl_list(text: str) -> list[Entry]:
    """The appliance's entries in `bootctl list --json=short` (systemd 257: an array of objects
    with type, id, path, triesLeft/triesDone when counting, isDefault, isSelected). The file
    name in "path" is authoritative for version and counter; bootctl's id drops the counter."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("not a JSON array")
    out: list[Entry] = []
    by_path: dict[str, int] = {}
    for item in data:
        if not isinstance(item, dict) or item.get("type") != "type2" or not isinstance(item.get("path"), str):
            continue
        entry = parse_entry(Path(item["path"]))
        if entry is None:
            continue
        left, done = item.get("triesLeft"), item.get("triesDone")
        if (left is None) != (entry.tries_left is None) or (isinstance(left, int) and left != entry.tries_left):
            raise ValueError(f"{entry.path.name}: triesLeft {left!r} disagrees with the file name")
        found = Entry(
            entry.path,
            entry.version,
            entry.tries_left,
            done if isinstance(done, int) else entry.tries_done,
            is_default=item.get("isDefault") if isinstance(item.get("isDefault"), bool) else None,
            is_selected=item.get("isSelected") if isinstance(item.get("isSelected"), bool) else None,
        )
        # One version, one entry: bootctl lists a kernel image once per boot menu profile (the
        # factory reset entries), all with its path; default or booted if any of them is.
        if (at := by_path.get(item["path"])) is None:
            by_path[item["path"]] = len(out)
            out.append(found)
        else:
            first = out[at]
            out[at] = dataclasses.replace(first, is_default=_either(first.is_default, found.is_default),
                                          is_selected=_either(first.is_selected, found.is_selected))
    return out


def _either(a: bool | None, b: bool | None) -> bool | None:
    return None if a is None and b is None else bool(a or b)


def read_entries(host: Host) -> tuple[list[Entry], str]:
    """The appliance's boot entries, newest version first, and where they were read from."""
    argv = [host.bootctl, "--no-pager", "list", "--json=short"]
    if host.esp is not None:
        argv.append(f"--esp-path={host.esp}")
    source = "bootctl"
    try:
        proc = call(argv, BOOTCTL_TIMEOUT_S)
        if proc.returncode != 0:
            raise OSError((proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1])
        found = parse_bootctl_list(proc.stdout)
    except (OSError, ValueError, TimeoutExpired) as e:
        found, source = _scan_entries(host), f"ESP scan (bootctl: {str(e)[:160] or type(e).__name__})"
    return sorted(found, key=lambda e: release_manifest.version_tuple(e.version), reverse=True), source


def entries(host: Host) -> list[Entry]:
    return read_entries(host)[0]
