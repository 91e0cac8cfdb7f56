"""Errors a user sees: one line that says what is wrong, one that says what to do."""

from __future__ import annotations


class UserError(Exception):
    """A fault in the user's input or environment; reported without a traceback (exit status 2)."""

    exit_status = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class ConfigError(UserError):
    """appliance.toml says something the model does not allow."""
