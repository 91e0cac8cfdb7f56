# SPDX-License-Identifier: MIT
"""The repository says what the software does, not how it was made: no file names a work session
("the nineteenth session", "twice in ten sessions"), a stop of a plan ("stop 3"), an issue of the
project's own tracker ("issue 22", "#22") or a commit of its own history ("at 9d8cfa3"). That is
what git history is for. A workaround names the upstream bug instead ("systemd/systemd#12345",
"vllm-project/vllm issue 39863": an issue number after its owner/repo is upstream's, and so is a
commit hash given as "owner/repo @ hash").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from repository import repository_files

ROOT = Path(__file__).resolve().parents[1]
# The changelog tells the project's history; this file holds the matcher's own samples.
EXEMPT = {"CHANGELOG.md", "tests/test_no_history.py"}

# Hash-shaped words that are not commits of this repository, each with what it is.
NOT_COMMITS = {
    "ed25519": "the signature algorithm",
    "0036024b": "a GPU firmware version as rocm-smi prints it (applianctl/selftest/checks.py)",
    "e68d18b2ba50": "an engine digest's first 12 hex digits, as engine slots are labelled (test data)",
    "7872f01b": "a model revision cut short, which the configuration check refuses (test data)",
    "0fc63daf": "the first group of the GPT type linux-generic (test data)",
    "4d21b016": "the first group of the GPT type of /var (test data)",
}

_ORDINAL = (
    r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth"
    r"|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth"
    r"|twenty-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)|\d+(?:st|nd|rd|th))"
)
_COUNT = r"(?:\d+|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|several|many)"
_OWNER_REPO = re.compile(r"[\w.-]+/[\w.-]+\s*$")  # what comes right before an upstream reference
_UPSTREAM_COMMIT = re.compile(r"[\w.-]+/[\w.-]+\s*@\s*([0-9a-f]{7,40})\b")

PATTERNS: dict[str, re.Pattern[str]] = {
    # "the nineteenth session", "the seventeenth and eighteenth sessions", "22nd session"
    "ordinal session": re.compile(rf"\b{_ORDINAL}(?:(?:,\s*|\s+(?:and|or|to)\s+)(?:the\s+)?{_ORDINAL})*\s+sessions?\b",
                                  re.IGNORECASE),
    # "session 19", "session #19"
    "numbered session": re.compile(r"\bsessions?\s+#?\d+\b", re.IGNORECASE),
    # "in the sixteenth": ordinals past ten count sessions here, nothing in the product counts that far
    "session ordinal": re.compile(
        r"\b(?:eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth"
        r"|twentieth|thirtieth|twenty-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth))\b",
        re.IGNORECASE),
    # "twice in ten sessions", "in the last 5 sessions"
    "session count": re.compile(
        rf"\b(?:once|twice|thrice|\w+\s+times)\s+in\s+(?:\w+\s+)?sessions\b"
        rf"|\b(?:in|of|over|across)\s+(?:the\s+)?(?:last\s+|past\s+)?{_COUNT}\s+sessions\b",
        re.IGNORECASE),
    # a stop of a plan: "stop 3"
    "plan stop": re.compile(r"\bstops?\s+#?\d+\b", re.IGNORECASE),
    # "issue 22", "Issue #14", "issues 20 and 22" (not after an owner/repo: checked in scan)
    "issue number": re.compile(r"\bissues?\s*#?\s*\d+", re.IGNORECASE),
    # "(#22)": a bare reference to the project's tracker (owner/repo#N has a word character before #)
    "issue reference": re.compile(r"(?<![\w/&#])#\d+\b"),
    # "at 9d8cfa3": 7 to 12 lower-case hex digits standing alone, with a digit and a letter among
    # them; not part of a UUID, a path, a label or a longer digest
    "commit hash": re.compile(r"(?<![\w./:@#=+-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}(?![\w-])"),
}


def scan(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, the words found) of each piece of development history in TEXT."""
    upstream = set(_UPSTREAM_COMMIT.findall(text))
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        spans: list[tuple[int, int]] = []  # what is reported already: each piece once, by the first kind
        for kind, pattern in PATTERNS.items():
            for m in pattern.finditer(line):
                if kind == "issue number" and _OWNER_REPO.search(line[:m.start()]):
                    continue  # upstream's issue: "vllm-project/vllm issue 39863"
                if kind == "commit hash" and (m.group() in NOT_COMMITS
                                              or any(full.startswith(m.group()) for full in upstream)):
                    continue  # not a commit, or upstream's commit named as owner/repo @ hash in this file
                if any(m.start() < end and start < m.end() for start, end in spans):
                    continue
                spans.append(m.span())
                found.append((number, kind, m.group()))
    return found




def text_of(path: Path) -> str | None:
    """PATH's text; None for a binary file, a link, or a file no longer there."""
    if path.is_symlink() or not path.is_file():
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def history_in(root: Path, names: list[str]) -> list[str]:
    """"file:line: kind: words" for each piece of development history in the files NAMES under ROOT."""
    lines = []
    for name in names:
        text = text_of(root / name)
        if text is not None:
            lines += [f"{name}:{number}: {kind}: {words!r}" for number, kind, words in scan(text)]
    return lines


@pytest.mark.programs
def test_no_file_tells_how_it_was_made() -> None:
    found = history_in(ROOT, repository_files(EXEMPT))
    assert not found, ("development history belongs in git, not in the files (say why, not when; "
                       "name an upstream bug as owner/repo#N):\n" + "\n".join(found))


@pytest.mark.parametrize("text", [
    "measured in the nineteenth session",
    "the twenty-second session: 52 passed",
    "in the seventeenth and eighteenth sessions",
    "Fixed in the 18th session",
    "see session 19",
    "54 min 30 s in the sixteenth and 65 min in the seventeenth",
    "oopsed twice in ten sessions",
    "flaky in the last 5 sessions",
    "done at stop 3",
    "the journal off the box (issue 22, item 2)",
    "Issue #14: seals the weights",
    "as images before issue 15 wrote it",
    "issues 20 and 22",
    "added in (#22)",
    "CI: 61.4 min at ea5a82b",
    "as they were (0c8769f: slots/records.py read_json)",
])
def test_history_is_found(text: str) -> None:
    assert scan(text), text


@pytest.mark.parametrize("text", [
    "build the demo image once per session",
    '@pytest.fixture(scope="session")',
    "a TLS session, an SSH session, the login session",
    "an HTTP header name such as X-Session-Id",
    "to a tenth of a GiB",
    "the first boot; the second NIC; the third serial port",
    "systemd/systemd#12345 and vllm-project/vllm#39863",
    "caddyserver/caddy#5431: bodies buffered",
    "github.com/ROCm/ROCm/issues/4021",
    "vllm-project/vllm issue 39863",
    "dmesg-ras-mi300x-rocm-issue-4021.txt",
    "PKCS#7 SignedData, PKCS#1 v1.5",
    "the issuer's name",
    "GUID 8be4df61-93ca-11d2-aa0d-00e098032b8c",
    "label engine_e68d18b2ba50-verity, sha256:0123456789abcdef0123456789abcdef",
    "ssh-ed25519 AAAA... user@host",
    "engine A e68d18b2ba50 running (1.0.0), B abababababab",
    "the date 20240101 and the port 8000",
    "a list of 12 items, stop, 3 more",
])
def test_what_is_not_history_passes(text: str) -> None:
    assert not scan(text), scan(text)


def test_each_piece_is_named_once() -> None:
    assert scan("x\nin the seventeenth and eighteenth sessions, then the nineteenth") == [
        (2, "ordinal session", "seventeenth and eighteenth sessions"), (2, "session ordinal", "nineteenth")]


def test_an_upstream_commit_may_be_named_again_shortened() -> None:
    text = "amd-smi: github.com/ROCm/amdsmi @ 0ceca28f4139 (2024-10-23)\n`static_gpu` (0ceca28): lower-case keys\n"
    assert not scan(text)
    assert scan("`static_gpu` (0ceca28): lower-case keys\n")  # without the upstream line it is a bare hash


def test_a_planted_hit_in_a_copy_fails_naming_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "setup-host").write_text("#!/bin/sh\n# the collector (issue 22)\napt-get install -y x\n")
    (tmp_path / "clean.py").write_text('"""Build the demo image once per session."""\n')
    (tmp_path / "blob.bin").write_bytes(b"\0issue 22 at 9d8cfa3\0")
    assert history_in(tmp_path, ["tools/setup-host", "clean.py", "blob.bin", "gone.txt"]) == [
        "tools/setup-host:2: issue number: 'issue 22'"]
