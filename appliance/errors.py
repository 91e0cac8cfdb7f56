# SPDX-License-Identifier: MIT
"""Errors an operator sees: one line that says what is wrong, one that says what to do.

One error type for the builder and applianctl, so a fault raised by shared code (the manifest,
the configuration) reads the same on both sides.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    exit_status = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class ConfigError(UserError):
    """The configuration says something the model does not allow."""


class Refused(UserError):
    """A bundle is not acceptable for this host (authenticity, integrity, policy): exit 1."""

    exit_status = 1


def run_reporting(func: Callable[[], int], *, prefix: str, debug: bool) -> int:
    """Run FUNC; a UserError becomes two lines on stderr (what is wrong, what to do) and its
    exit status, with the traceback only under --debug. Shared by applianctl and the builder."""
    try:
        return int(func())
    except UserError as e:
        if debug:
            raise
        print(f"{prefix}{e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return e.exit_status
    except KeyboardInterrupt:
        return 130
