# SPDX-License-Identifier: MIT
"""Secrets out of text before it leaves the appliance in a support bundle, by family rather than by
the names we happen to know: a value named by anything ending in PASSWORD, SECRET, TOKEN, KEY...
(`DB_PASSWORD=`, `"aws_secret_access_key": "..."`, `Cookie:`, `Authorization:`), credentials in a
URL, the value after `--password` and its kin, PEM private keys whole or cut by a size limit,
/var's recovery key and the token formats that are recognisable on their own.

It errs on the side of hiding: an unquoted value runs to the end of its line, a private key whose
END is missing hides the rest of the text, one whose BEGIN is missing hides everything before it.
A JSON document is redacted by its structure (its keys name the secrets, and it stays JSON), then
as text like everything else; private keys are taken out of its raw text before it is parsed, so
a key whose lines are several strings is still one key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from appliance.safe_read import loads_bounded

REDACTED = "[redacted]"

# what a name that holds a secret ends with (any prefix, any case)
_SUFFIX = r"(?:password|passwd|passphrase|secret|token|key|credentials?|cookie|authorization)"
_SECRET_NAME = re.compile(r"(?is).*" + _SUFFIX)
_FLAG_NAME = r"--?(?:[A-Za-z0-9][\w-]*?)?" + _SUFFIX
_SECRET_FLAG = re.compile(_FLAG_NAME, re.I)
_QUOTE = r"\\*[\"']"  # a quote, perhaps escaped (JSON inside a JSON string)

_PEM_BEGIN = r"-----BEGIN[A-Z0-9 ]* PRIVATE KEY[A-Z ]*-----"
_PEM_END = r"-----END[A-Z0-9 ]* PRIVATE KEY[A-Z ]*-----"
_PEM: tuple[re.Pattern[str], ...] = (
    re.compile(_PEM_BEGIN + r".*?" + _PEM_END, re.S),
    re.compile(_PEM_BEGIN + r".*\Z", re.S),  # cut by a head limit: the rest of the text is the key
    re.compile(r"\A.*" + _PEM_END, re.S),  # cut by a tail limit: everything before an END is the key
)

_TOKENS: tuple[tuple[re.Pattern[str], str], ...] = (
    # /var's recovery key (systemd-cryptenroll's modhex form, appliance/luks.py)
    (re.compile(r"\b[cbdefghijklnrtuv]{8}(?:-[cbdefghijklnrtuv]{8}){7}\b"), REDACTED),
    (re.compile(r"(?i)\bbearer\s+(?!\[redacted\])[A-Za-z0-9._~+/=-]{8,}"), f"Bearer {REDACTED}"),
    # Hugging Face, OpenAI-style, GitHub and AWS access keys, JWTs: recognisable wherever they are
    (re.compile(r"\bhf_[A-Za-z0-9]{20,}\b"), REDACTED),
    (re.compile(r"\bsk-[A-Za-z0-9_-]{16,}\b"), REDACTED),
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,})\b"), REDACTED),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\beyJ[\w-]{8,}\.eyJ[\w-]{8,}\.[\w-]*"), REDACTED),
    # scheme://user:password@host (the password may hold an unescaped @: up to the last one)
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)([^\s/?#@:\"'<>]*):([^\s/?#\"'<>]+)@"), rf"\1\2:{REDACTED}@"),
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)(?!\[redacted\]@)[^\s/?#@:\"'<>]+@"), rf"\1{REDACTED}@"),
)

# a value in quotes runs to its closing quote (spaces and all), or to the end of the line
_QUOTED = r"(?P<vq>" + _QUOTE + r")(?P<inner>.*?)(?:(?<!\\)(?P=vq)|$)"
_FLAG = re.compile(
    r"(?<![\w-])(?P<flag>" + _FLAG_NAME + r")(?![\w-])"
    r"(?P<q1>" + _QUOTE + r")?(?P<sep>[ \t]*=[ \t]*|[ \t]*,[ \t]*|[ \t]+)(?:" + _QUOTED + r"|(?P<bare>[^\s]+))",
    re.I | re.M)
_KEY_VALUE = re.compile(
    r"(?P<open>" + _QUOTE + r")?(?<![\w.-])(?P<name>(?:[A-Za-z0-9_][\w.-]*?)?" + _SUFFIX + r")(?!\w)"
    r"(?P<close>" + _QUOTE + r")?[ \t]*[=:][ \t]*(?:" + _QUOTED + r"|(?P<bare>[^\r\n]*))",
    re.I | re.M)
_LITERAL = re.compile(r"(?:true|false|null)[ \t]*(?:[,}\]]|$)")  # a JSON flag such as "var_recovery_key": true
_SCHEME = re.compile(r"(?i)(?:bearer|basic|digest|negotiate|token)[ \t]+")


def _closing(text: str, quote: str) -> int:
    """Where QUOTE closes in TEXT (an occurrence not escaped by one more backslash), else its end."""
    found = re.search(r"(?<!\\)" + re.escape(quote), text)
    return found.start() if found else len(text)


def _hide(text: str, m: re.Match[str], start: int, end: int) -> tuple[str, int]:
    """M's text from its start to END with START..END (positions in TEXT) replaced; where to go on."""
    if start >= end:
        return text[m.start():end], end
    return text[m.start():start] + REDACTED, end


def _quoted(text: str, m: re.Match[str]) -> tuple[str, int]:
    return _hide(text, m, m.start("inner"), m.end("inner"))


def _key_value(text: str, m: re.Match[str]) -> tuple[str, int]:
    if m["vq"] is not None:
        return _quoted(text, m)
    start, value = m.start("bare"), m["bare"]
    scheme = _SCHEME.match(value) if m["name"].lower().endswith("authorization") else None
    if not value.strip() or value[scheme.end() if scheme else 0:].startswith(REDACTED) or _LITERAL.match(value):
        return text[m.start():m.end("name")], m.end("name")
    if m["open"] and not m["close"]:  # 'Authorization: Bearer x' -- the value ends at the name's quote
        end = start + _closing(value, m["open"])
    elif m["close"] and not value.startswith(("{", "[")):  # "pin": 1234, ... -- a bare JSON value
        found = re.search(r"[,}\]]", value)
        end = start + found.start() if found else m.end()
    else:
        end = m.end()  # a bare value may hold spaces: the rest of the line
    return _hide(text, m, start + (scheme.end() if scheme else 0), end)


def _flag(text: str, m: re.Match[str]) -> tuple[str, int]:
    if m["vq"] is not None:
        return _quoted(text, m)
    value = m["bare"]
    if value.startswith(("-", REDACTED)):  # the next option, not a value
        return text[m.start():m.end("flag")], m.end("flag")
    end = m.end()
    if m["q1"]:  # '--password', x' -- a quoted argv's item ends at its quote
        end = m.start("bare") + _closing(value, m["q1"])
    return _hide(text, m, m.start("bare"), end)


def _sub(pattern: re.Pattern[str], hide: Callable[[str, re.Match[str]], tuple[str, int]], text: str) -> str:
    """re.sub, except that the search goes on right after what was hidden (the rest of a line
    may hold the next secret)."""
    out: list[str] = []
    pos = 0
    while (m := pattern.search(text, pos)) is not None:
        replacement, end = hide(text, m)
        out += [text[pos:m.start()], replacement]
        pos = end  # past the name at least: every hide() moves on
    out.append(text[pos:])
    return "".join(out)


def redact(text: str) -> str:
    """TEXT with every secret this module knows the shape of replaced by REDACTED."""
    for pem in _PEM:
        text = pem.sub(REDACTED, text)
    for pattern, replacement in _TOKENS:
        text = pattern.sub(replacement, text)
    text = _sub(_FLAG, _flag, text)
    return _sub(_KEY_VALUE, _key_value, text)


def _walk(node: Any) -> Any:
    if isinstance(node, str):
        return redact(node)
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            hidden = _SECRET_NAME.fullmatch(key) and value is not None and not isinstance(value, bool)
            out[redact(key)] = REDACTED if hidden else _walk(value)
        return out
    if isinstance(node, list):
        items: list[Any] = []
        hide_next = False
        for item in node:
            # ["--password", "x"]: an argument vector's value is the next item
            items.append(REDACTED if hide_next and not isinstance(item, (bool, list, dict)) and item is not None else _walk(item))
            hide_next = isinstance(item, str) and bool(_SECRET_FLAG.fullmatch(item))
        return items
    return node


def redact_member(name: str, data: bytes) -> bytes:
    """DATA, the bundle's member NAME, redacted: private keys first, then a JSON document (one
    that is still JSON) by its keys and then as text, anything else as text."""
    text = data.decode("utf-8", "replace")
    for pem in _PEM:  # first, on the raw text: a key split into several JSON strings is still one key
        text = pem.sub(REDACTED, text)
    if name.endswith(".json"):
        try:
            doc = loads_bounded(text)
        except ValueError:
            pass  # cut or not JSON after all: as text
        else:
            text = json.dumps(_walk(doc), indent=2, ensure_ascii=False) + "\n"
    return redact(text).encode("utf-8")
