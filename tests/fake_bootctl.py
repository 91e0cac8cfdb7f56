#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""A stand-in for systemd 257's `bootctl list --json=short` over a temporary ESP (the host has
systemd 252), in the format of src/shared/bootspec.c boot_entry_to_json(): one object per entry
with type ("type2" for a UKI), source, id (the file name without the boot counter), path, root,
title, showTitle, sortKey, version, linux, isReported, triesLeft/triesDone (only when the name
carries a counter), isDefault, isSelected. Entries sort as systemd-boot sorts them: out of tries
last, then newest version first; the default is the first that is not out of tries. Any other
verb does nothing (the fakeprog.fake_program wrapper that execs this records every call).
Environment: FAKE_EFIVARS (LoaderEntrySelected)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"
COUNTER = re.compile(r"^(?P<stem>.+?)(?:\+(?P<left>[0-9]+)(?:-(?P<done>[0-9]+))?)?\.efi$")


def _efi(name: str) -> str | None:
    base = os.environ.get("FAKE_EFIVARS")
    if not base:
        return None
    try:
        return (Path(base) / f"{name}-{GUID}").read_bytes()[4:].decode("utf-16-le").split("\0", 1)[0]
    except OSError:
        return None


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"[0-9]+", version))


def listing(esp: Path) -> list[dict[str, object]]:
    found = []
    for path in sorted((esp / "EFI" / "Linux").glob("*.efi")):
        m = COUNTER.match(path.name)
        if not m:
            continue
        version = m.group("stem").split("_", 1)[-1]
        left = int(m.group("left")) if m.group("left") is not None else None
        done = int(m.group("done") or 0) if left is not None else None
        found.append((path, m.group("stem") + ".efi", version, left, done))
    found.sort(key=lambda e: (e[3] == 0, tuple(-x for x in _version_key(e[2]))))
    selected = _efi("LoaderEntrySelected")
    default = next((i for i, e in enumerate(found) if e[3] != 0), 0 if found else -1)
    out: list[dict[str, object]] = []
    for i, (path, entry_id, version, left, done) in enumerate(found):
        item: dict[str, object] = {
            "type": "type2",
            "source": "esp",
            "id": entry_id,
            "path": str(path),
            "root": str(esp),
            "title": "Appliance",
            "showTitle": f"Appliance ({version})",
            "sortKey": "appliance",
            "version": version,
            "linux": f"EFI/Linux/{path.name}",
            "isReported": selected is not None,
        }
        if left is not None:
            item["triesLeft"] = left
            item["triesDone"] = done
        if default >= 0:
            item["isDefault"] = i == default
        if selected is not None:
            item["isSelected"] = entry_id == selected or path.name == selected
        out.append(item)
    return out


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--no-pager"]
    esp = next((Path(a.split("=", 1)[1]) for a in args if a.startswith("--esp-path=")), None)
    if args[:1] == ["list"]:
        if esp is None:
            print("Couldn't find EFI system partition. It is recommended to mount it to /boot or /efi.", file=sys.stderr)
            return 1
        print(json.dumps(listing(esp), separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
