# SPDX-License-Identifier: MIT
"""What runs around an engine start: the checks before it, the startup report, the smoke test."""
