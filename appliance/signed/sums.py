# SPDX-License-Identifier: MIT
"""SHA256SUMS as GNU sha256sum reads and writes it: the pins of the project's files.

Parsed exactly as coreutils does (md5sum.c `split_3`: text and binary mode, the BSD tagged
form, backslash-escaped names), so the file checks the same with `sha256sum -c`.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.errors import UserError
from appliance.hashing import HEX64_ANY_CASE as _HEX

SUMS_FILE = "SHA256SUMS"


@dataclass(frozen=True)
class SumEntry:
    name: str
    sha256: str  # lower case
    binary: bool
    line: int



class _Malformed(Exception):
    pass


def _unescape(name: str) -> str:
    out = []
    i = 0
    while i < len(name):
        c = name[i]
        if c == "\\":
            if i + 1 >= len(name):
                raise _Malformed
            nxt = name[i + 1]
            if nxt == "n":
                out.append("\n")
            elif nxt == "r":
                out.append("\r")
            elif nxt == "\\":
                out.append("\\")
            else:
                raise _Malformed
            i += 2
            continue
        if c == "\0":
            raise _Malformed
        out.append(c)
        i += 1
    return "".join(out)


class _Reader:
    """coreutils md5sum.c `split_3`, line by line (with its one-space 'BSD reversed' state)."""

    def __init__(self) -> None:
        self.bsd_reversed: int | None = None

    def split(self, s: str) -> tuple[str, str, bool]:
        i = 0
        while i < len(s) and s[i] in " \t":
            i += 1
        escaped = False
        if s[i : i + 1] == "\\":
            i += 1
            escaped = True
        if s.startswith("SHA256", i):
            return self._tagged(s[i + 6 :], escaped)
        if len(s) - i < 64 + 2:
            raise _Malformed
        digest = s[i : i + 64]
        i += 64
        if s[i : i + 1] not in (" ", "\t"):
            raise _Malformed
        i += 1
        if not _HEX.match(digest):
            raise _Malformed
        binary = False
        if len(s) - i == 1 or s[i] not in (" ", "*"):
            if self.bsd_reversed == 0:
                raise _Malformed
            self.bsd_reversed = 1
        elif self.bsd_reversed != 1:
            self.bsd_reversed = 0
            binary = s[i] == "*"
            i += 1
        name = s[i:]
        if escaped:
            name = _unescape(name)
        return digest.lower(), name, binary

    @staticmethod
    def _tagged(s: str, escaped: bool) -> tuple[str, str, bool]:
        i = 0
        if s[i : i + 1] == " ":
            i += 1
        if s[i : i + 1] != "(":
            raise _Malformed
        s = s[i + 1 :]
        end = s.rfind(")")
        if end < 0:
            raise _Malformed
        name = _unescape(s[:end]) if escaped else s[:end]
        rest = s[end + 1 :].lstrip(" \t")
        if not rest.startswith("="):
            raise _Malformed
        digest = rest[1:].lstrip(" \t")
        if not _HEX.match(digest):
            raise _Malformed
        return digest.lower(), name, False


def parse_sums(data: bytes, source: str = SUMS_FILE) -> dict[str, SumEntry]:
    """The entries of a SHA256SUMS file, by name; UserError on the first bad line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{source}: not UTF-8 (byte {e.start})", hint="regenerate it with python3 -m builder pin"
        ) from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    reader = _Reader()
    entries: dict[str, SumEntry] = {}
    for number, line in enumerate(lines, start=1):
        if line.endswith("\r"):
            line = line[:-1]
        if line.startswith("#") or line.strip(" \t") == "":
            continue
        try:
            digest, name, binary = reader.split(line)
        except _Malformed:
            raise UserError(
                f"{source}:{number}: improperly formatted SHA256 checksum line",
                hint="each line is 'HASH  NAME' as sha256sum writes it; regenerate with python3 -m builder pin",
            ) from None
        if not is_safe_name(name):
            raise UserError(
                f"{source}:{number}: {name!r} is not a path inside the project",
                hint="names are relative to the project root, without '..', e.g. overlays/demo/file.py",
            )
        if name in entries:
            raise UserError(
                f"{source}:{number}: {name} is listed again (first on line {entries[name].line})",
                hint="list each file once",
            )
        entries[name] = SumEntry(name, digest, binary, number)
    return entries


def is_safe_name(name: str) -> bool:
    if not name or name.startswith("/") or "\0" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def format_line(name: str, sha256: str) -> str:
    """One line as GNU sha256sum writes it (text mode; names with \\, LF or CR escaped)."""
    if any(c in name for c in "\\\n\r"):
        escaped = name.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
        return f"\\{sha256}  {escaped}"
    return f"{sha256}  {name}"
