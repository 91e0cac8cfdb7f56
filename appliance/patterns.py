# SPDX-License-Identifier: MIT
"""The forms of the names the configuration, the manifest and the bundle index share (defined once)."""

from __future__ import annotations

import re

# A release version: up to four numbers of up to 9 digits each joined by dots (a longer number is no
# version, and past 4300 digits Python's int() refuses it with a ValueError).
VERSION = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,9}){0,3}\Z")
VERSION_FORM = "up to four numbers of up to 9 digits joined by dots"  # what VERSION accepts, in words
REVISION = re.compile(r"^[0-9a-f]{40}\Z")  # a model revision: a full commit hash
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")  # org/name
