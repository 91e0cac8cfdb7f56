# SPDX-License-Identifier: MIT
"""SHA-256 of files and the forms a digest is written in: defined once for host and device."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from pathlib import Path

CHUNK = 1 << 20

SHA256 = re.compile(r"^[0-9a-f]{64}\Z")  # a hex SHA-256 as this project writes it
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}\Z")  # an OCI content digest
HEX64_ANY_CASE = re.compile(r"^[0-9A-Fa-f]{64}\Z")  # as sha256sum accepts it on reading


def sha256_file(path: Path, advance: Callable[[int], None] | None = None) -> str:
    """The hex SHA-256 of the file at PATH, read in 1 MiB chunks; ADVANCE (such as
    appliance.progress.Progress.advance) is told the size of each chunk read."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            if advance is not None:
                advance(len(chunk))
    return digest.hexdigest()
