# SPDX-License-Identifier: MIT
"""The configuration's reference, generated from the model: each setting's description (its
field's `doc`), its default or example, and the values its check takes (the hint the check gives
for a bad value: what the loader says is expected).

`markdown()` is the reference part of docs/configuration.md (between its markers); `example_toml()`
is docs/appliance.example.toml, every setting with its description as comments. `--write` writes
both; `--markdown` and `--toml` print one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import textwrap
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import host_settings, schema
from appliance.atomic import atomic_write
from appliance.config import checks
from appliance.config.model import Config

ROOT = Path(__file__).resolve().parents[2]
DOC = Path("docs/configuration.md")
EXAMPLE = Path("docs/appliance.example.toml")
BEGIN = "<!-- generated from appliance/config/model.py by python3 -m appliance.config.reference --write: edit the model, not this -->"
END = "<!-- end of the generated reference -->"
GIVEN = ("profile",)  # set by the loader, never read from the file
# What a host's signed install plan may set in place of the image's value: the overlay's keys, and
# the host name and SSH keys (the plan's own hostname and [ssh]).
PER_HOST = frozenset({f"{section}.{key}" for section, keys in host_settings.OVERLAY.items() for key in keys}
                     | {"os.hostname", "os.ssh_authorized_keys"})
PER_HOST_NOTE = "A host's install plan may set it (docs/install.md)."
WIDTH = 100


@dataclass(frozen=True)
class Setting:
    """One key of a table: a value, a list of tables, or a table of strings (a Mapping)."""

    key: str  # dotted from the top: engine.health.path
    field: dataclasses.Field[Any]
    tp: Any

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def doc(self) -> str:
        text = str(self.field.metadata.get("doc", ""))
        return f"{text} {PER_HOST_NOTE}" if self.key in PER_HOST else text

    @property
    def required(self) -> bool:
        return self.field.default is dataclasses.MISSING and self.field.default_factory is dataclasses.MISSING

    @property
    def default(self) -> Any:
        if self.field.default_factory is not dataclasses.MISSING:
            return self.field.default_factory()
        return self.field.default

    @property
    def example(self) -> Any:
        """The value the example file shows: the field's example, else its default."""
        return self.field.metadata.get("example", self.default)

    @property
    def element(self) -> type | None:
        """The table class of a list of tables."""
        if typing.get_origin(self.tp) is tuple and dataclasses.is_dataclass(inner := typing.get_args(self.tp)[0]):
            return typing.cast(type, inner)
        return None

    @property
    def is_mapping(self) -> bool:
        return typing.get_origin(self.tp) is Mapping

    def values(self) -> str:
        """The values the setting takes, as its check words them."""
        meta = self.field.metadata
        if self.element is not None:
            return f"a list of tables, [[{self.key}]] below"
        if self.is_mapping:
            return f"names: {_allowed(meta['keys'], str)}; values: {_allowed(meta['each'], str)}"
        inner = [a for a in typing.get_args(self.tp) if a is not type(None)] if typing.get_origin(self.tp) is not tuple else []
        scalar = inner[0] if inner else self.tp
        if "check" in meta:
            return _allowed(meta["check"], scalar)
        if "each" in meta:
            return "a list, each " + _allowed(meta["each"], typing.get_args(self.tp)[0])
        return schema.type_name(self.tp)


@dataclass(frozen=True)
class Table:
    """A table of the file: [engine.health], or the element of a list of tables ([[engine.overlays]])."""

    key: str
    doc: str
    cls: type
    array: bool = False

    def settings(self) -> list[Setting]:
        """Its keys (values, lists of tables and tables of strings), in the model's order."""
        hints = typing.get_type_hints(self.cls)
        return [Setting(f"{self.key}.{f.name}", f, hints[f.name]) for f in dataclasses.fields(self.cls)
                if f.name not in GIVEN and not dataclasses.is_dataclass(hints[f.name])]

    def tables(self) -> list[Table]:
        """The tables under it: [engine.health] under [engine], then the lists of tables."""
        hints = typing.get_type_hints(self.cls)
        nested = [Table(f"{self.key}.{f.name}", str(f.metadata.get("doc", "")), typing.cast(type, hints[f.name]))
                  for f in dataclasses.fields(self.cls) if f.name not in GIVEN and dataclasses.is_dataclass(hints[f.name])]
        arrays = [Table(s.key, f"One entry of {s.key}.", s.element, array=True) for s in self.settings() if s.element is not None]
        return nested + arrays


def tables() -> Iterator[Table]:
    """Every table of the configuration, each before the tables under it."""

    def walk(table: Table) -> Iterator[Table]:
        yield table
        for sub in table.tables():
            yield from walk(sub)

    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        if f.name not in GIVEN:
            yield from walk(Table(f.name, str(f.metadata.get("doc", "")), typing.cast(type, hints[f.name])))


def settings() -> Iterator[Setting]:
    for table in tables():
        yield from table.settings()


# A value no check takes: a string with a NUL, a number that is not one.
_BAD: dict[Any, Any] = {str: "\x00", int: math.nan, float: math.nan}


def _allowed(check: schema.Check, tp: Any) -> str:
    """What CHECK says a good value is, asked with a value it refuses."""
    if check is checks.is_ssh_key:  # its hint also says what was wrong with the bad value
        return checks.SSH_KEY_HINT
    hint = check(_BAD[tp])
    if hint is None:
        raise ValueError(f"{check!r} takes {_BAD[tp]!r}: the reference cannot say what it takes")
    return hint


def toml_value(value: Any) -> str:
    """VALUE written as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string without control characters is a TOML basic string
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return toml_value(schema.plain(value))
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


# ------------------------------------------------------------------------------------ Markdown


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default_cell(setting: Setting) -> str:
    if setting.required:
        return "required"
    if setting.default is None:
        return "unset"
    if setting.element is not None or (setting.is_mapping and not setting.default):
        return "none"
    return f"`{_cell(toml_value(setting.default))}`"


def markdown() -> str:
    """The reference: one section per table, a row per key."""
    out = ["## Reference", "",
           "Every setting of appliance.toml: its default (\"required\": it has none), the values its check takes, and "
           "what it is. docs/appliance.example.toml holds the same as a file, each setting with its description as "
           "comments.", ""]
    for table in tables():
        out += [f"### `{'[[' + table.key + ']]' if table.array else '[' + table.key + ']'}`", "", table.doc, ""]
        rows = table.settings()
        if rows:
            out += ["| key | default | values | what it is |", "|---|---|---|---|"]
            out += [f"| `{s.name}` | {_default_cell(s)} | {_cell(s.values())} | {_cell(s.doc)} |" for s in rows]
            out.append("")
    return "\n".join(out)


def document(current: str) -> str:
    """CURRENT (docs/configuration.md) with the part between its markers generated anew."""
    head, begin, rest = current.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{DOC}: the markers of the generated reference are missing")
    return f"{head}{BEGIN}\n\n{markdown()}\n{END}{tail}"


# ---------------------------------------------------------------------------------- the example


def _comment(text: str, first: str = "# ", rest: str = "# ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False, break_on_hyphens=False)


def _setting_lines(setting: Setting) -> list[str]:
    out = _comment(setting.doc)
    if setting.element is not None:
        out += ["# Each a table of:"]
        for field in Table(setting.key, "", setting.element).settings():
            default = "required" if field.required else f"default {toml_value(field.default)}"
            out += _comment(f"{field.name} ({default}; {field.values()}): {field.doc}", "#   ", "#     ")
    else:
        out += _comment(f"Values: {setting.values()}.")
    line = f"{setting.name} = {toml_value(setting.example)}"
    if setting.required:
        return [*out, line]
    if "example" in setting.field.metadata:
        out.append("# Unset by default; for example:" if setting.default is None else
                   f"# Default: {toml_value(setting.default)}; for example:")
    return [*out, "#" + line]


def example_toml() -> str:
    """An appliance.toml with every setting: the required ones set to an example, every other one
    commented out (#key = value) at its default, or at an example where the default shows nothing."""
    out = [
        "# appliance.toml with every setting: what it is, the values it takes and its default.",
        "# Generated from the configuration model (appliance/config/model.py) by",
        "# python3 -m appliance.config.reference --write; docs/configuration.md says the same in tables.",
        "#",
        "# The required settings are set to an example value; every other one is commented out at its",
        "# default (#key = value). The top level is the production profile; in the repository's",
        "# appliance.toml, [profiles.demo] overrides it table by table, key by key, for the demo.",
    ]
    for table in tables():
        if table.array:  # described with its list, in the table that holds it
            continue
        out += ["", *_comment(table.doc), f"[{table.key}]"]
        keys = table.settings()
        for setting in (s for s in keys if not s.is_mapping):
            out += ["", *_setting_lines(setting)]
        for setting in (s for s in keys if s.is_mapping):  # after the keys: a table header ends them
            out += ["", *_comment(setting.doc), *_comment(f"Values: {setting.values()}."), f"[{setting.key}]"]
            out += ["#" + f"{k} = {toml_value(v)}" for k, v in setting.example.items()]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------- the command


def expected_files(root: Path = ROOT) -> dict[Path, str]:
    """What each generated file under ROOT should hold."""
    return {root / DOC: document((root / DOC).read_text()), root / EXAMPLE: example_toml()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m appliance.config.reference",
                                     description="The configuration's reference, generated from appliance/config/model.py.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--markdown", action="store_true", help="print the reference of docs/configuration.md")
    what.add_argument("--toml", action="store_true", help="print docs/appliance.example.toml")
    what.add_argument("--write", action="store_true", help="write both into this repository")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
    elif args.toml:
        sys.stdout.write(example_toml())
    else:
        for path, text in expected_files().items():
            if not path.exists() or path.read_text() != text:
                atomic_write(path, text.encode())
                print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
