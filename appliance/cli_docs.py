# SPDX-License-Identifier: MIT
"""Man pages (roff) and bash completion generated from a program's own argparse parser.

applianctl's are written into the image at build (builder/render.py: man8 and
bash-completion/completions), the builder's into out/ by `make man`. Both walk the parser as
argparse holds it: each command's summary, paragraph, examples and exit statuses as
`appliance.cli_help` wrote them into its description and epilog, and its arguments. A command
registered without a help line is hidden (a unit's own step) and left out of both.

`python3 -m appliance.cli_docs MODULE:FUNCTION ...` builds the parser by calling FUNCTION of
MODULE, imported by name: the builder runs it for applianctl in a process of its own, since
builder/ never imports applianctl/.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import cli_help
from appliance.atomic import atomic_write
from appliance.errors import Refused, UserError, run_reporting

MAN_DIR = Path("usr/share/man")
COMPLETION_DIR = Path("usr/share/bash-completion/completions")

# What every command of both programs may exit with (appliance.errors.run_reporting), when the
# program's parser does not list its own statuses.
COMMON_EXIT_STATUS = (
    cli_help.OK,
    (Refused.exit_status, "refused, or what was checked is not as it should be (the command's own statuses below)"),
    (UserError.exit_status, "a usage error or a fault you can fix: one line on stderr, then a hint"),
    (130, "interrupted"),
)


@dataclass(frozen=True)
class Command:
    """A listed command: the words that reach it from the program (("model", "fetch")) and its parser."""

    words: tuple[str, ...]
    parser: argparse.ArgumentParser
    listed_help: str


def subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction[Any] | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def listed(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """PARSER's commands as its --help lists them (a hidden one has no help line), in order."""
    action = subcommands(parser)
    if action is None:
        return []
    shown = [(choice.dest, choice.help or "") for choice in action._choices_actions]
    return [(name, action.choices[name], help_line) for name, help_line in shown if name in action.choices]


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[Command]:
    """Every listed command under PARSER, depth first ("tls", then "tls show", ...)."""
    found = []
    for name, sub, help_line in listed(parser):
        found.append(Command((*words, name), sub, help_line))
        found += commands(sub, (*words, name))
    return found


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """PARSER's optional arguments that --help shows."""
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]


def positionals(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not a.option_strings and not isinstance(a, argparse._SubParsersAction) and a.help != argparse.SUPPRESS]


def takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(parser.prog, width=10_000)  # one line: roff fills it


def usage(parser: argparse.ArgumentParser) -> str:
    formatter = _formatter(parser)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return " ".join(formatter.format_help().split())


def invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return _formatter(parser)._format_action_invocation(action)


def help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return " ".join(_formatter(parser)._expand_help(action).split()) if action.help else ""


# --- man pages -----------------------------------------------------------------------------------


def roff(text: str) -> str:
    """TEXT as roff prints it: backslashes and hyphens escaped, no line taken for a request."""
    lines = []
    for line in text.replace("\\", "\\e").replace("-", "\\-").splitlines():
        lines.append("\\&" + line if line.startswith((".", "'")) else line)
    return "\n".join(lines)


def _quoted(text: str) -> str:
    """TEXT as one argument of a request."""
    return '"' + roff(text).replace('"', '\\(dq') + '"'


def _preformatted(lines: Iterable[str]) -> list[str]:
    return [".RS 4", ".nf", *(roff(line) for line in lines), ".fi", ".RE"]


def _paragraph(text: str) -> list[str]:
    return [".PP", roff(" ".join(text.split()))] if text.strip() else []


def _exit_statuses(codes: Sequence[tuple[int, str]]) -> list[str]:
    out = [".PD 0"]  # one line per status, no space between them
    for code, what in codes:
        out += [".TP", f".B {code}", roff(what)]
    return [*out, ".PD"]


def _arguments(parser: argparse.ArgumentParser, shared: set[str]) -> list[str]:
    """PARSER's arguments as a tagged list; the options every command shares (SHARED, -h) are in OPTIONS."""
    out = []
    for action in positionals(parser):
        out += [".TP", f"\\fI{roff(invocation(parser, action))}\\fR", roff(help_text(parser, action))]
    for action in options(parser):
        if isinstance(action, argparse._HelpAction) or set(action.option_strings) <= shared:
            continue
        out += [".TP", f"\\fB{roff(invocation(parser, action))}\\fR", roff(help_text(parser, action))]
    return out


def _summary(parser: argparse.ArgumentParser, listed_help: str) -> str:
    return cli_help.read_help(parser).summary or listed_help


def _examples(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    return cli_help.read_help(parser).examples


def man_page(parser: argparse.ArgumentParser, *, name: str, section: int, version: str, manual: str) -> str:
    """PARSER's man page: NAME, SYNOPSIS, DESCRIPTION, OPTIONS, COMMANDS (each with its arguments,
    examples and exit statuses), EXIT STATUS, EXAMPLES."""
    top = cli_help.read_help(parser)
    global_options = options(parser)
    shared = {s for a in global_options for s in a.option_strings}
    out = [
        '.\\" SPDX-License-Identifier: MIT',
        f'.\\" Generated from {name}\'s argument parser by appliance/cli_docs.py: do not edit.',
        f".TH {_quoted(name.upper())} {section} \"\" {_quoted(f'{name} {version}')} {_quoted(manual)}",
        ".nh",  # no hyphens inside option names and values
        ".ad l",
        ".SH NAME",
        f"{roff(name)} \\- {roff(top.summary.rstrip('.') or name)}",
        ".SH SYNOPSIS",
        f"\\fB{roff(parser.prog)}\\fR {roff(usage(parser).removeprefix(parser.prog).strip())}",
        ".SH DESCRIPTION",
        *_paragraph(top.summary),
        *_paragraph(top.details),
    ]
    every = commands(parser)
    if every:
        out += _paragraph("Each command takes -h or --help, which prints its summary, arguments, examples and exit "
                          "statuses; the options under OPTIONS work before or after it.")
    out += [".SH OPTIONS", *(x for a in global_options
                             for x in (".TP", f"\\fB{roff(invocation(parser, a))}\\fR", roff(help_text(parser, a))))]
    if every:
        out.append(".SH COMMANDS")
    for command in every:
        sub = command.parser
        verb = cli_help.read_help(sub)
        out += [
            f".SS {_quoted(' '.join(command.words))}",
            f"\\fB{roff(sub.prog)}\\fR {roff(usage(sub).removeprefix(sub.prog).strip())}",
            *_paragraph(_summary(sub, command.listed_help)),
            *_paragraph(verb.details),
            *_arguments(sub, shared),
        ]
        if verb.examples:
            out += [".PP", "Examples:", *_preformatted(verb.examples)]
        if verb.exit_codes:
            out += [".PP", "Exit status:", ".RS 4", *_exit_statuses(verb.exit_codes), ".RE"]
    out += [".SH \"EXIT STATUS\"", *_exit_statuses(top.exit_codes or COMMON_EXIT_STATUS)]
    if every:
        out += _paragraph("A command's own statuses are listed with it under COMMANDS.")
    examples = list(dict.fromkeys([*top.examples, *(e for c in every for e in _examples(c.parser)[:1])]))
    out += [".SH EXAMPLES", *(_preformatted(examples) if examples else _paragraph(f"{parser.prog} --help"))]
    return "\n".join(out) + "\n"


# --- bash completion -----------------------------------------------------------------------------


def _words(values: Iterable[object]) -> str:
    return shlex.quote(" ".join(str(v) for v in values))


def _case(entries: Sequence[tuple[str, str]], otherwise: str) -> list[str]:
    """A bash `case "$1"` whose patterns are quoted (matched literally, but a trailing * unquoted)."""
    out = ['    case "$1" in']
    for pattern, body in entries:
        literal, star = (pattern[:-1], "*") if pattern.endswith("*") else (pattern, "")
        out.append(f"        {shlex.quote(literal)}{star}) {body} ;;")
    out += [f"        *) {otherwise} ;;", "    esac"]
    return out


def bash_completion(parser: argparse.ArgumentParser, *, name: str) -> str:
    """A bash completion for NAME: its commands at each level, their options, the choices of an
    option's value or of a positional argument (a file name where any value goes)."""
    function = "_" + re.sub(r"[^A-Za-z0-9_]", "_", name)
    levels = [((), parser), *((c.words, c.parser) for c in commands(parser))]
    verbs, opts, values, arguments = [], [], [], []
    for words, level in levels:
        path = " ".join(words)
        below = [n for n, _, _ in listed(level)]
        if below:
            verbs.append((path, f"echo {_words(below)}"))
        opts.append((path, f"echo {_words(s for a in options(level) for s in a.option_strings)}"))
        for action in options(level):
            if takes_value(action):
                for option in action.option_strings:
                    values.append((f"{path}|{option}", f"echo {_words(action.choices or ())}"))
        for index, action in enumerate(positionals(level)):
            choices = f"echo {_words(action.choices)}" if action.choices else "echo -"
            many = action.nargs in ("*", "+", argparse.REMAINDER)
            arguments.append((f"{path}|{index}" + ("*" if many else ""), choices))
            if many:
                break
    lines = [
        "# SPDX-License-Identifier: MIT",
        f"# bash completion for {name}, generated from its argument parser by appliance/cli_docs.py: do not edit.",
        "",
        f"{function}_verbs() {{  # the commands under the words $1",
        *_case(verbs, "return 1"),
        "}",
        "",
        f"{function}_options() {{  # the options after the words $1",
        *_case(opts, "return 1"),
        "}",
        "",
        f"{function}_value() {{  # \"WORDS|OPTION\": the option's choices (none: any value); not one that takes a value: 1",
        *_case(values, "return 1"),
        "}",
        "",
        f"{function}_argument() {{  # \"WORDS|N\": the choices of positional argument N (-: any value)",
        *_case(arguments, "return 1"),
        "}",
        "",
        f"{function}() {{",
        "    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]}",
        "    local path='' word option='' given=0 i choices",
        "    COMPREPLY=()",
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        "        word=${COMP_WORDS[i]}",
        "        case $word in",
        "            =) i=$((i + 1)); continue ;;  # --option=value: bash splits it at the =",
        f'            -*) [[ ${{COMP_WORDS[i+1]}} != = ]] && {function}_value "$path|$word" >/dev/null && i=$((i + 1)); continue ;;',
        "        esac",
        f'        if [[ " $({function}_verbs "$path") " == *" $word "* ]]; then',
        '            path=${path:+$path }$word',
        "            given=0",
        "        else",
        "            given=$((given + 1))",
        "        fi",
        "    done",
        '    if [[ $cur == = ]]; then option=$prev cur=""',
        "    elif [[ $prev == = ]]; then option=${COMP_WORDS[COMP_CWORD-2]}",
        "    elif [[ $prev == -* ]]; then option=$prev",
        "    fi",
        f'    if [[ -n $option ]] && choices=$({function}_value "$path|$option"); then',
        '        if [[ -n $choices ]]; then COMPREPLY=($(compgen -W "$choices" -- "$cur")); else COMPREPLY=($(compgen -f -- "$cur")); fi',
        "        return 0",
        "    fi",
        "    if [[ $cur == -* ]]; then",
        f'        COMPREPLY=($(compgen -W "$({function}_options "$path")" -- "$cur"))',
        f'    elif choices=$({function}_verbs "$path"); then',
        '        COMPREPLY=($(compgen -W "$choices" -- "$cur"))',
        f'    elif choices=$({function}_argument "$path|$given"); then',
        '        if [[ $choices == - ]]; then COMPREPLY=($(compgen -f -- "$cur")); else COMPREPLY=($(compgen -W "$choices" -- "$cur")); fi',
        "    else",
        f'        COMPREPLY=($(compgen -W "$({function}_options "$path")" -- "$cur"))',
        "    fi",
        "}",
        "",
        f"complete -F {function} {shlex.quote(name)}",
    ]
    return "\n".join(lines) + "\n"


# --- writing them --------------------------------------------------------------------------------


def write(parser: argparse.ArgumentParser, *, name: str, section: int, version: str, manual: str,
          man_dir: Path, completion_dir: Path) -> list[Path]:
    """NAME's man page into MAN_DIR/manSECTION/NAME.SECTION and its completion into
    COMPLETION_DIR/NAME; the paths written."""
    page = man_dir / f"man{section}" / f"{name}.{section}"
    completion = completion_dir / name
    for path, text in ((page, man_page(parser, name=name, section=section, version=version, manual=manual)),
                       (completion, bash_completion(parser, name=name))):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text.encode())
    return [page, completion]


def load_parser(spec: str) -> argparse.ArgumentParser:
    """The parser FUNCTION of MODULE returns, SPEC being MODULE:FUNCTION."""
    module, sep, function = spec.partition(":")
    if not sep or not module or not function:
        raise UserError(f"not MODULE:FUNCTION: {spec!r}", hint="e.g. applianctl.__main__:build_parser")
    make: Callable[[], object] = getattr(importlib.import_module(module), function)
    parser = make()
    if not isinstance(parser, argparse.ArgumentParser):
        raise UserError(f"{spec} returned {type(parser).__name__}, not an argument parser", hint="name the function that builds it")
    return parser


def main(argv: list[str] | None = None) -> int:
    cli = argparse.ArgumentParser(prog="python3 -m appliance.cli_docs", description=__doc__.splitlines()[0] if __doc__ else None)
    cli.add_argument("parser", metavar="MODULE:FUNCTION", help="the function that builds the program's whole parser")
    cli.add_argument("--name", required=True, help="the program's name (the man page's and the completion's)")
    cli.add_argument("--section", type=int, default=1, help="the manual section (default 1; 8: system administration)")
    cli.add_argument("--version", required=True, help="the version the man page names")
    cli.add_argument("--manual", default="Appliance Manual", help="the manual's title")
    cli.add_argument("--man-dir", type=Path, required=True, help="where the manSECTION directory goes")
    cli.add_argument("--completion-dir", type=Path, required=True, help="where the bash completion goes")
    args = cli.parse_args(argv)

    def generate() -> int:
        for path in write(load_parser(args.parser), name=args.name, section=args.section, version=args.version,
                          manual=args.manual, man_dir=args.man_dir, completion_dir=args.completion_dir):
            print(path)
        return 0

    return run_reporting(generate, prefix="error: ", debug=False)


if __name__ == "__main__":
    sys.exit(main())

