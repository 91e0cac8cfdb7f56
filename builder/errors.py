"""Errors a user sees: one line that says what is wrong, one that says what to do.

The builder and applianctl share one error type (applianctl's, which ships in the image), so a
fault raised by shared code such as the manifest module reads the same on both sides.
"""

from __future__ import annotations

from applianctl.errors import UserError

__all__ = ["ConfigError", "UserError"]


class ConfigError(UserError):
    """appliance.toml says something the model does not allow."""
