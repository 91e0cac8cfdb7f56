"""The forms of the names the configuration, the manifest and the bundle index share (defined once)."""

from __future__ import annotations

import re

VERSION = re.compile(r"^[0-9]+(\.[0-9]+){0,3}\Z")  # a release version: up to four numbers joined by dots
REVISION = re.compile(r"^[0-9a-f]{40}\Z")  # a model revision: a full commit hash
MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*\Z")  # org/name
