# SPDX-License-Identifier: MIT
"""What a command may write to a terminal beyond plain text.

Colour and cursor movement only on a terminal, never with NO_COLOR set to anything but the empty
string (https://no-color.org) and never on TERM=dumb, which understands no escape sequence.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TextIO


def plain_text_asked(environ: Mapping[str, str] | None = None) -> bool:
    """NO_COLOR (not empty) or TERM=dumb: no escape sequence at all."""
    env = os.environ if environ is None else environ
    return bool(env.get("NO_COLOR")) or env.get("TERM", "") == "dumb"


def escapes(out: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Whether OUT may carry escape sequences (colour, erasing a line)."""
    try:
        tty = out.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False
    return tty and not plain_text_asked(environ)
