# SPDX-License-Identifier: MIT
"""Reading a small file that someone else could have written (the install plan and its signature,
the device's records, staged bundle files on /var): a regular file, opened without following a
symbolic link and without blocking (a FIFO, /dev/zero or a directory is refused at once), its size
capped before one byte is read; and JSON parsed with its nesting depth and its numbers bounded
(Python's json has neither limit: 10 000 brackets are a RecursionError, 5 000 digits a slow int).
`set_aside` moves what is no regular file out of a record's place, so its writer can write again.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.errors import UserError

MAX_RECORD_BYTES = 1 << 20
MAX_DEPTH = 32  # the deepest document the appliance writes is a handful of levels
MAX_INT_DIGITS = 20  # 2**64 has 20 digits
MAX_FLOAT_CHARS = 40  # repr() of any float is at most 24 characters

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def file_kind(mode: int) -> str:
    """What a stat mode is, for a message: "a regular file", "a directory", "a symbolic link"..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a symbolic link" if stat.S_ISLNK(mode) else _kind(mode)


def read_capped(path: Path, max_bytes: int, *, what: str, hint: str = "") -> bytes | None:
    """The bytes of the regular file PATH (WHAT it is, for the hint), None when there is none.
    UserError (one line) when PATH is a symbolic link, not a regular file, larger than MAX_BYTES
    (known from its size before reading, or from reading at most MAX_BYTES + 1 when it grows), or
    cannot be read."""
    hint = hint or f"{what} is a regular file of at most {max_bytes} bytes: remove {path}, or put the right file there"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{path}: is a symbolic link (not followed)", hint=hint) from None
        denied = e.errno in (errno.EACCES, errno.EPERM)
        raise UserError(f"{path}: cannot read ({e.strerror})", hint="check the file's permissions" if denied else hint) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{path}: is {_kind(st.st_mode)}, not a regular file", hint=hint)
        if st.st_size > max_bytes:
            raise UserError(f"{path}: {st.st_size} bytes, more than {max_bytes}", hint=hint)
        chunks: list[bytes] = []
        have = 0
        while have <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - have)
            if not chunk:
                break
            chunks.append(chunk)
            have += len(chunk)
        if have > max_bytes:
            raise UserError(f"{path}: grew past {max_bytes} bytes while read", hint=hint)
        return b"".join(chunks)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})", hint=hint) from None
    finally:
        os.close(fd)


def set_aside(path: Path) -> str | None:
    """When PATH is there and is no regular file (a directory, a FIFO, a symbolic link...), rename it
    to PATH.damaged (removing what an earlier call left there), so that a file can be renamed into
    its place again: a rename never follows a link, and the rename onto PATH fails on a directory.
    Returns what PATH was ("a directory"), or None when it was a regular file or absent. OSError
    when it cannot be moved."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return None
    aside = path.with_name(path.name + ".damaged")
    try:
        old = os.lstat(aside).st_mode
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISDIR(old):
            shutil.rmtree(aside)  # never follows a link inside it
        else:
            aside.unlink()
    os.rename(path, aside)
    return file_kind(mode)


class JSONBoundError(ValueError):
    """JSON beyond the bounds loads_bounded sets (a ValueError, as json's own faults are)."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JSONBoundError(f"a number of {len(text.lstrip('-'))} digits, more than {MAX_INT_DIGITS}")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_FLOAT_CHARS:
        raise JSONBoundError(f"a number of {len(text)} characters, more than {MAX_FLOAT_CHARS}")
    return float(text)


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """JSONBoundError when VALUE (parsed JSON) nests lists and objects deeper than MAX_DEPTH."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > max_depth:
            raise JSONBoundError(f"nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children)


def loads_bounded(data: bytes | str, *, max_depth: int = MAX_DEPTH, parse_float: Callable[[str], Any] | None = None,
                  **kwargs: Any) -> Any:
    """json.loads(DATA, **KWARGS) with integers of at most MAX_INT_DIGITS digits, floats of at most
    MAX_FLOAT_CHARS characters (then PARSE_FLOAT, float by default) and lists and objects nested at
    most MAX_DEPTH deep; any other JSON reads exactly as json.loads reads it. Raises ValueError
    (JSONBoundError, json.JSONDecodeError, UnicodeDecodeError) on a fault."""
    def bounded_float(text: str) -> Any:
        _float(text)
        return parse_float(text) if parse_float is not None else float(text)

    try:
        value = json.loads(data, parse_int=_int, parse_float=bounded_float, **kwargs)
    except RecursionError:
        raise JSONBoundError(f"nested deeper than {max_depth} levels") from None
    check_depth(value, max_depth)
    return value
