# SPDX-License-Identifier: MIT
"""Debian archive URLs taken from the build host's apt configuration.

No mirror host name is in the repository: the host knows its archive, and appliance.toml may override it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

APT_SOURCES_DIR = Path("/etc/apt/sources.list.d")
APT_SOURCES_LIST = Path("/etc/apt/sources.list")


@dataclass(frozen=True)
class Mirrors:
    archive: str  # serves SUITE, SUITE-updates
    security: str | None  # serves SUITE-security


def _deb822_entries(text: str) -> list[dict[str, str]]:
    entries: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for raw in [*text.splitlines(), ""]:
        line = raw.rstrip()
        if line.startswith("#"):
            continue
        if not line.strip():
            if current:
                entries.append(current)
            current = {}
            continue
        if ":" in line and not line[0].isspace():
            key, _, value = line.partition(":")
            current[key.strip().lower()] = value.strip()
    return entries


def _one_line_entries(text: str) -> list[dict[str, str]]:
    entries = []
    for line in text.splitlines():
        line = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()  # type: ignore[assignment]
        if len(line) >= 3 and line[0] == "deb":
            entries.append({"types": "deb", "uris": line[1], "suites": line[2]})
    return entries


def _host_entries(root: Path) -> list[dict[str, str]]:
    entries: list[dict[str, str]] = []
    sources_dir = root / APT_SOURCES_DIR.relative_to("/")
    if sources_dir.is_dir():
        for path in sorted(sources_dir.glob("*.sources")):
            entries += _deb822_entries(path.read_text(errors="replace"))
        for path in sorted(sources_dir.glob("*.list")):
            entries += _one_line_entries(path.read_text(errors="replace"))
    sources_list = root / APT_SOURCES_LIST.relative_to("/")
    if sources_list.is_file():
        entries += _one_line_entries(sources_list.read_text(errors="replace"))
    return entries


DEBIAN_SUITES = re.compile(r"^(bookworm|trixie|forky|sid|stable|testing|unstable|oldstable)(-updates|-backports)?\Z")
SECURITY_SUITES = re.compile(r"^[a-z]+-security(/updates)?\Z")


def host_mirrors(root: Path = Path("/")) -> Mirrors | None:
    """The Debian archive and security URLs the host's apt already uses, or None."""
    archive = security = None
    for entry in _host_entries(root):
        if "deb" not in entry.get("types", "deb").split() or entry.get("enabled", "yes") == "no":
            continue
        suites = entry.get("suites", "").split()
        for uri in entry.get("uris", "").split():
            uri = uri.rstrip("/")
            if archive is None and any(DEBIAN_SUITES.match(s) for s in suites):
                archive = uri
            if security is None and any(SECURITY_SUITES.match(s) for s in suites):
                security = uri
    return Mirrors(archive, security) if archive else None


def sources_deb822(mirrors: Mirrors, release: str, components: tuple[str, ...]) -> str:
    """An apt sources file for RELEASE, replacing mkosi's own (which adds the unreachable debug archive)."""
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    comps = " ".join(components)
    text = (
        f"Types: deb\nURIs: {mirrors.archive}\nSuites: {release} {release}-updates\n"
        f"Components: {comps}\nSigned-By: {keyring}\n"
    )
    if mirrors.security:
        text += (
            f"\nTypes: deb\nURIs: {mirrors.security}\nSuites: {release}-security\n"
            f"Components: {comps}\nSigned-By: {keyring}\n"
        )
    return text


def main() -> None:
    """`python3 -m builder.mirror RELEASE`: print a sources file for RELEASE (used by tools/setup-host)."""
    import sys

    mirrors = host_mirrors()
    if mirrors is None:
        print("error: no Debian archive found in the host's apt configuration", file=sys.stderr)
        print("hint: add a Debian source to /etc/apt/sources.list.d/ or set os.mirror in appliance.toml", file=sys.stderr)
        raise SystemExit(2)
    release = sys.argv[1] if len(sys.argv) > 1 else "trixie"
    sys.stdout.write(sources_deb822(mirrors, release, ("main", "non-free-firmware")))


if __name__ == "__main__":
    main()
