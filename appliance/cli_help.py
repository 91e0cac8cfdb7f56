# SPDX-License-Identifier: MIT
"""Every command's --help in one form: a one-line summary, examples, and its exit statuses.

`verb_parser()` adds a command whose description is the summary and whose epilog holds an optional
paragraph, then an "Examples:" and an "Exit status:" section; `read_help()` reads them back from
any parser, so that the tests and whatever generates man pages or completion read the parsers
themselves, never a copy.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

EXAMPLES = "Examples:"
EXIT_STATUS = "Exit status:"
_INDENT = "  "
_WIDTH = 100

# The statuses most commands share (appliance.errors.run_reporting).
OK = (0, "success")
BAD_INPUT = (2, "bad input: a usage error or a fault you can fix (one line on stderr, then a hint)")
FAILED_STEP = (2, "bad input, or a fault you can fix, a failed step included (one line on stderr, then a hint)")

ExitCodes = Sequence[tuple[int, str]]


@dataclass(frozen=True)
class VerbHelp:
    summary: str
    details: str
    examples: tuple[str, ...]
    exit_codes: tuple[tuple[int, str], ...]


def epilog(examples: Sequence[str], exit_codes: ExitCodes, details: str = "") -> str:
    """The epilog of a command's --help: DETAILS as a paragraph, then the two sections."""
    if not examples or not exit_codes:
        raise ValueError("a command's help needs an example and its exit statuses")
    codes = sorted(exit_codes)
    if len({code for code, _ in codes}) != len(codes):
        raise ValueError(f"an exit status is described twice: {codes}")
    parts = [textwrap.fill(" ".join(details.split()), _WIDTH)] if details.strip() else []
    parts.append("\n".join([EXAMPLES, *(_INDENT + line for line in examples)]))
    width = max(len(str(code)) for code, _ in codes)
    lines = [
        textwrap.fill(what, _WIDTH, initial_indent=f"{_INDENT}{code:<{width}}  ",
                      subsequent_indent=" " * (len(_INDENT) + width + 2))
        for code, what in codes
    ]
    parts.append("\n".join([EXIT_STATUS, *lines]))
    return "\n\n".join(parts)


def describe(
    parser: argparse.ArgumentParser, summary: str, *, examples: Sequence[str], exit_codes: ExitCodes, details: str = ""
) -> argparse.ArgumentParser:
    """Give PARSER (a program's own, or a command's) the summary, examples and exit statuses."""
    if not summary.strip() or "\n" in summary:
        raise ValueError(f"a command's summary is one line: {summary!r}")
    parser.description = summary
    parser.epilog = epilog(examples, exit_codes, details)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def verb_parser(
    subparsers: argparse._SubParsersAction[Any],
    name: str,
    summary: str,
    *,
    examples: Sequence[str],
    exit_codes: ExitCodes,
    details: str = "",
    hidden: bool = False,
    **kwargs: Any,
) -> argparse.ArgumentParser:
    """Add the command NAME. HIDDEN: not listed in the program's help (a unit's step), yet with a
    --help of its own."""
    if not hidden:
        kwargs["help"] = summary
    parser: argparse.ArgumentParser = subparsers.add_parser(name, **kwargs)
    return describe(parser, summary, examples=examples, exit_codes=exit_codes, details=details)


def read_help(parser: argparse.ArgumentParser) -> VerbHelp:
    """PARSER's summary, paragraph, examples and exit statuses as `describe` wrote them (empty
    where a parser has none)."""
    summary = parser.description or ""
    text = parser.epilog or ""
    details, examples, codes = [], [], []
    section = ""
    for line in text.splitlines():
        if line in (EXAMPLES, EXIT_STATUS):
            section = line
        elif not line.strip():
            continue
        elif section == EXAMPLES:
            examples.append(line.strip())
        elif section == EXIT_STATUS:
            head, _, what = line.strip().partition("  ")
            if head.isdigit():
                codes.append((int(head), what.strip()))
            elif codes:  # a wrapped description
                codes[-1] = (codes[-1][0], f"{codes[-1][1]} {line.strip()}")
        else:
            details.append(line.strip())
    return VerbHelp(summary, " ".join(details), tuple(examples), tuple(codes))


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """PARSER and every command under it, each with the words that reach it (hidden ones too)."""
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:  # an alias names the same parser
                    seen.add(id(sub))
                    out += walk(sub, (*path, name))
    return out
