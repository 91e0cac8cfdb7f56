"""Errors an operator sees: one line that says what is wrong, one that says what to do."""

from __future__ import annotations


class UserError(Exception):
    exit_status = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
