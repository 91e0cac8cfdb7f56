# SPDX-License-Identifier: MIT
"""The one validation mechanism: frozen dataclasses describe a document, one loader walks them.

`Loader.load` checks parsed data against the tree: unknown keys refused, missing ones named, types
exact (a bool is not a number, floats finite), each field's metadata check ("check", "each",
"keys") and lower bound ("min": `at_least`). A fault is one line naming document, key and value,
with a hint, worded per document by overriding `invalid`, `unknown`, `missing`.

The device's records are read `lenient`ly (unknown keys skipped, known ones type-checked) because
after a rollback one release reads what another wrote; outside input is strict. Records on /var
carry "format" (the class's FORMAT); a file without it, from older releases, loads as format 0.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from appliance.errors import UserError
from appliance.safe_read import MAX_RECORD_BYTES, loads_bounded, read_capped

# Each check returns None when the value is good, else what a good value is ("a DNS name ...").
Check = Callable[[Any], str | None]

MAX_INT = 2**31 - 1
# C0, DEL and C1: refused in every string of a `printable` document (Loader.printable)
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def check(fn: Check) -> dict[str, Any]:
    """Field metadata: check the value."""
    return {"check": fn}


def each(fn: Check) -> dict[str, Any]:
    """Field metadata for a list or table: check every element (value)."""
    return {"each": fn}


def multiline(fn: Check) -> dict[str, Any]:
    """Field metadata: check the value, which may span lines (a printable document allows it "\\n")."""
    return {"check": fn, "multiline": True}


def at_least(bound: int | float) -> dict[str, Any]:
    """Field metadata: a number, or each number of a list or table, is BOUND or more (a count read
    back as -1000 would switch off whatever it counts)."""
    return {"min": bound}


def optional(**kw: Any) -> Any:
    """A field that is None unless set, and then not written at all (the key is absent)."""
    return dataclasses.field(default=None, metadata={"omit": True, **kw})


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return "a list of " + type_name(typing.get_args(tp)[0]).removeprefix("a ").removeprefix("an ") + "s"
    if origin in (types.UnionType, typing.Union):
        return " or ".join(type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if dataclasses.is_dataclass(tp):
        return "a table"
    if origin is Mapping:
        return "a table of " + type_name(typing.get_args(tp)[1]).removeprefix("a ").removeprefix("an ") + "s"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(tp, str(tp))


def join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def shown(value: Any, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, dict | list) else ("{...}" if isinstance(value, dict) else "[...]")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def known_keys(key: str, known: list[str]) -> str:
    """What to write instead of the unknown KEY (dotted, as `join` makes it): the known key closest
    to it, if one is close, and every known key of its table."""
    table, _, name = key.rpartition(".")
    listed = "known keys here: " + (", ".join(known) or "none")
    close = difflib.get_close_matches(name, known, n=1)
    return f"did you mean {join(table, close[0])}? {listed}" if close else listed


class _Incomplete(Exception):
    """A table had faults (already collected): it cannot be built, and its parent notes no more."""


class Loader:
    """Walk a dataclass tree over parsed data. Subclasses word the faults for their document.

    By default the first fault is raised. With `collect` (a list), every fault is appended to it
    and `load` returns None when there was any: `validate` reports them all in one run.
    A `printable` document (the install plan) has no control character in any string."""

    printable: ClassVar[bool] = False

    def __init__(self, where: str, collect: list[UserError] | None = None, lenient: bool = False) -> None:
        self.where = where
        self.collect = collect
        self.lenient = lenient  # unknown keys skipped (the device's own records), not refused

    def _fault(self, error: UserError) -> None:
        if self.collect is None:
            raise error
        self.collect.append(error)

    # --- how faults read (override per document)

    def invalid(self, key: str, value: Any, expected: str) -> UserError:
        return UserError(f"{self.where}: {key} = {shown(value)}: invalid", hint=f"expected {expected}")

    def unknown(self, key: str, value: Any, known: list[str]) -> UserError:
        return UserError(f"{self.where}: unknown key {key!r} = {shown(value, 60)}", hint=known_keys(key, known))

    def missing(self, key: str, tp: Any) -> UserError:
        return UserError(f"{self.where}: missing key {key!r}", hint=f"add {key} ({type_name(tp)})")

    # --- the walk

    def load(self, cls: type, table: Any, prefix: str = "", **given: Any) -> Any:
        """TABLE as CLS; GIVEN fields are set by the caller (never read from TABLE)."""
        try:
            return self._load(cls, table, prefix, **given)
        except _Incomplete:
            return None

    def _load(self, cls: type, table: Any, prefix: str = "", **given: Any) -> Any:
        if not isinstance(table, dict):
            self._fault(self.invalid(prefix, table, "a table"))
            raise _Incomplete
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        faults = len(self.collect or ())
        incomplete = False
        for key in table:
            if (key not in fields and not self.lenient) or key in given:
                self._fault(self.unknown(join(prefix, key), table[key], [n for n in fields if n not in given]))
        kwargs = dict(given)
        for name, f in fields.items():
            if name in given:
                continue
            key = join(prefix, name)
            if name in table:
                try:
                    kwargs[name] = self.value(hints[name], table[name], key, f.metadata)
                except _Incomplete:
                    incomplete = True
                except UserError as e:
                    self._fault(e)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                self._fault(self.missing(key, hints[name]))
        if incomplete or len(self.collect or ()) > faults:
            raise _Incomplete
        return cls(**kwargs)

    def value(self, tp: Any, value: Any, key: str, meta: Mapping[str, Any]) -> Any:
        origin = typing.get_origin(tp)
        if tp is Any:  # a table only shown, never acted on (a plan's effective settings)
            return value
        if origin in (types.UnionType, typing.Union):
            if value is None:
                if type(None) in typing.get_args(tp):
                    return None
                raise self.invalid(key, value, type_name(tp))
            inner = [a for a in typing.get_args(tp) if a is not type(None)]
            for one in inner[:-1]:  # the first member the value is (bool | str: True stays True)
                try:
                    return self.value(one, value, key, meta)
                except (UserError, _Incomplete):
                    pass
            return self.value(inner[-1], value, key, meta)
        if dataclasses.is_dataclass(tp):
            return self._load(typing.cast(type, tp), value, key)
        element = {"check": meta["each"]} if "each" in meta else {}
        if "min" in meta:
            element["min"] = meta["min"]
        if origin is tuple:
            if not isinstance(value, list):
                raise self.invalid(key, value, type_name(tp))
            inner = typing.get_args(tp)[0]
            return tuple(self.value(inner, v, f"{key}[{i}]", element) for i, v in enumerate(value))
        if origin is Mapping:
            if not isinstance(value, dict):
                raise self.invalid(key, value, type_name(tp))
            inner = typing.get_args(tp)[1]
            out = {}
            for k, v in value.items():
                keys = meta.get("keys")
                if keys is not None and (hint := keys(k)) is not None:
                    raise self.invalid(join(key, k), v, hint)
                out[k] = self.value(inner, v, join(key, k), element)
            return types.MappingProxyType(out)
        # bool is not a number, and a number is not a bool; numbers are finite and bounded
        ok = type(value) is tp or (tp is float and type(value) is int)
        if ok and tp is float:
            ok = math.isfinite(value) and abs(value) <= 1e15
            value = float(value) if ok else value
        if ok and tp is int:
            ok = -MAX_INT <= value <= 10**15
        if not ok:
            raise self.invalid(key, value, type_name(tp) + (" (finite, at most 15 digits)" if tp in (int, float) else ""))
        if tp in (int, float) and "min" in meta and value < meta["min"]:
            raise self.invalid(key, value, f"{type_name(tp)} of at least {meta['min']}")
        # a `multiline` field (PEM certificates) may hold line feeds, and no other control character
        if self.printable and tp is str and CONTROL.search(value.replace("\n", "") if meta.get("multiline") else value):
            raise self.invalid(key, value, "text without control characters (C0, DEL, C1)")
        fn = meta.get("check")
        if fn is not None and (hint := fn(value)) is not None:
            raise self.invalid(key, value, hint)
        return value


def plain(value: Any) -> Any:
    """A dataclass tree as JSON-ready dicts and lists (an `optional` field that is None: no key)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.metadata.get("omit") and getattr(value, f.name) is None)}
    if isinstance(value, tuple):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


# ----------------------------------------------------------------------------------- records

R = TypeVar("R")


class Record:
    """Base of the device's records: FORMAT is written as "format" (None: the record lives on /run,
    which a reboot empties, so no other release ever reads it and it carries none)."""

    FORMAT: ClassVar[int | None] = None


class RecordLoader(Loader):
    def invalid(self, key: str, value: Any, expected: str) -> UserError:
        return UserError(f"{self.where}: {key or 'the record'} = {shown(value)}: invalid",
                         hint=f"expected {expected}; the file is damaged: remove it, the command that writes it writes it again")


def from_json(cls: type[R], data: Any, where: str, *, lenient: bool) -> R:
    """DATA (parsed JSON) as record CLS; UserError (one line) when it is not one."""
    loader = RecordLoader(where, lenient=lenient)
    if isinstance(data, dict) and "format" in data:
        data = dict(data)
        number = data.pop("format")
        newest = getattr(cls, "FORMAT", None)
        if type(number) is not int or number < 0:
            raise loader.invalid("format", number, "a format number")
        if newest is not None and number > newest and not lenient:
            raise UserError(f"{where}: format {number} is newer than this release reads ({newest})",
                            hint="update the appliance first, or make it with this release's tools")
    record: R = loader.load(cls, data)
    return record


def load_record(cls: type[R], path: Path, *, lenient: bool) -> R | None:
    """The record at PATH, None when there is no file; UserError (one line) when it cannot be read
    or is not a CLS."""
    damaged = "the file is damaged: remove it, the command that writes it writes it again"
    raw = read_capped(path, MAX_RECORD_BYTES, what="a record", hint=damaged)
    if raw is None:
        return None
    try:
        data = loads_bounded(raw.decode("utf-8"))
    except ValueError as e:
        raise UserError(f"{path}: not JSON ({e})".splitlines()[0], hint=damaged) from None
    return from_json(cls, data, str(path), lenient=lenient)


def dump_record(record: Any) -> dict[str, Any]:
    """RECORD as its JSON object, with its "format" when its class has one."""
    doc: dict[str, Any] = plain(record)
    number = getattr(record, "FORMAT", None)
    if number is not None:
        doc["format"] = number
    return doc
