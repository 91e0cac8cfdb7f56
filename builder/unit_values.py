# SPDX-License-Identifier: MIT
"""Jinja filters that write configuration values into systemd (and quadlet) units so that they arrive exactly.

systemd expands `%` specifiers (a core pattern `gpucore.%p` would reach the engine as
`gpucore.appliance-engine`) and splits Environment= and command lines on white space. Quadlet splits
the same way (podman's pkg/systemd/parser/split.go) and copies `%` untouched, so `%%` still reaches
systemd. The configuration model refuses what cannot be written (control characters, quotes, `\\`, `$`).
"""

from __future__ import annotations

import re

_PLAIN = re.compile(r"^[^\s\"'\\]+\Z")


def systemd_escape(value: object) -> str:
    """VALUE with `%` doubled: systemd reads `%%` as one literal `%`."""
    return str(value).replace("%", "%%")


def systemd_quote(value: object) -> str:
    """VALUE as one word of an Environment= or Exec= line: `%` doubled, double-quoted (`\\` and `"`
    escaped) when empty or holding white space or quotes."""
    text = str(value)
    if not _PLAIN.match(text):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return systemd_escape(text)


FILTERS = {"systemd_escape": systemd_escape, "systemd_quote": systemd_quote}
