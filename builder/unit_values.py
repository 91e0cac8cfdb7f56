"""Configuration values written into systemd unit files (and quadlet's), so that they arrive exactly.

systemd expands `%` specifiers in most settings (`%p` is the unit's prefix, so a core pattern
`gpucore.%p` would reach the engine as `gpucore.appliance-engine`), and it splits Environment=
and command lines on white space. These filters turn a value into the text systemd reads back as
that value; the configuration model refuses what cannot be written this way (control characters,
quotes, backslashes, `$`).

Quadlet reads Environment= and Exec= with systemd's word splitting (podman's
pkg/systemd/parser/split.go follows extract_first_word) and writes the words back into the
generated ExecStart= quoted but with `%` untouched, so `%%` reaches systemd, which makes it `%`.
"""

from __future__ import annotations

import re

_PLAIN = re.compile(r"^[^\s\"'\\]+\Z")


def systemd_escape(value: object) -> str:
    """VALUE with `%` doubled: systemd reads `%%` as one literal `%`."""
    return str(value).replace("%", "%%")


def systemd_quote(value: object) -> str:
    """VALUE as one word of an Environment= or Exec= line: `%` doubled, and in double quotes (with
    `\\` and `"` escaped) when it is empty or holds white space or quotes."""
    text = str(value)
    if not _PLAIN.match(text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return systemd_escape(text)


FILTERS = {"systemd_escape": systemd_escape, "systemd_quote": systemd_quote}
