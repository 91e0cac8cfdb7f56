# SPDX-License-Identifier: MIT
"""Man pages and bash completion generated from the argument parsers (appliance/cli_docs.py):
every listed command of applianctl and the builder with its options, hidden commands left out,
the page rendered by groff and man without a warning, the completion run by a real bash."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import applianctl.__main__
import builder.__main__
from appliance import cli_docs, cli_help
from appliance.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
applianctl_parser = applianctl.__main__.build_parser
builder_parser = builder.__main__.build_parser


def sample_parser() -> argparse.ArgumentParser:
    """A program with a global option, a described command, a nested one, a hidden one, choices
    and help text that roff would otherwise read as requests."""
    parser = argparse.ArgumentParser(prog="sample")
    cli_help.describe(parser, "Operate the sample.", examples=["sample run --fast"], exit_codes=[cli_help.OK, (4, "the sample is broken")])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = cli_help.verb_parser(sub, "run", "Run it once.", examples=["sample run --mode slow", "sample run FILE"],
                               exit_codes=[cli_help.OK, (1, "it ran and failed")], details="Runs at most once a boot.")
    run.add_argument("--mode", choices=["fast", "slow"], help="how fast")
    run.add_argument("--fast", action="store_true", help=".starts with a dot\\and has a backslash")
    run.add_argument("--out", help="write the result to OUT (default: %(default)s)", default="-")
    run.add_argument("file", nargs="?", help="the input")
    keys = sub.add_parser("keys", help="the key pairs")
    keys_sub = keys.add_subparsers(dest="action", metavar="ACTION")
    make = keys_sub.add_parser("make", help="make a pair")
    make.add_argument("kind", choices=["release", "boot"], help="which pair")
    make.add_argument("--into", help="directory")
    cli_help.verb_parser(sub, "secret-step", "A unit's step.", examples=["sample secret-step"], exit_codes=[cli_help.OK], hidden=True)
    return parser


def test_commands_are_the_listed_ones_depth_first() -> None:
    words = [c.words for c in cli_docs.commands(sample_parser())]
    assert words == [("run",), ("keys",), ("keys", "make")]


def test_man_page_has_every_section_command_option_example_and_status() -> None:
    page = cli_docs.man_page(sample_parser(), name="sample", section=8, version="1.2.3", manual="Sample Manual")
    assert page.startswith('.\\" SPDX-License-Identifier: MIT\n')
    assert '.TH "SAMPLE" 8 "" "sample 1.2.3" "Sample Manual"' in page
    for heading in (".SH NAME", ".SH SYNOPSIS", ".SH DESCRIPTION", ".SH OPTIONS", ".SH COMMANDS", '.SH "EXIT STATUS"', ".SH EXAMPLES"):
        assert heading in page, heading
    assert "sample \\- Operate the sample\n" in page
    assert '.SS "run"' in page and '.SS "keys make"' in page and '.SS "keys"' in page
    assert "Runs at most once a boot." in page
    assert "\\fB\\-\\-mode {fast,slow}\\fR" in page
    assert "\\fB\\-\\-debug\\fR" in page.split(".SH OPTIONS")[1].split(".SH COMMANDS")[0]
    assert "write the result to OUT (default: \\-)" in page  # argparse's %(default)s expanded
    assert "\\fI{release,boot}\\fR" in page and "\\fIfile\\fR" in page
    # the command's examples and statuses under it; the program's statuses and examples at the end
    run = page.split('.SS "run"')[1].split(".SS")[0]
    assert "sample run \\-\\-mode slow" in run and ".B 1\nit ran and failed" in run
    assert ".B 4\nthe sample is broken" in page.split('.SH "EXIT STATUS"')[1]
    assert page.split(".SH EXAMPLES")[1].count("sample run") == 2  # the program's, then each command's first
    assert "secret" not in page


def test_man_page_escapes_what_roff_would_read_as_requests() -> None:
    assert cli_docs.roff(".starts\n'quote\nplain-dash a\\b") == "\\&.starts\n\\&'quote\nplain\\-dash a\\eb"
    page = cli_docs.man_page(sample_parser(), name="sample", section=1, version="0", manual="M")
    assert "\\&.starts with a dot\\eand has a backslash" in page
    assert not any(line.startswith(".starts") for line in page.splitlines())


def test_man_page_without_statuses_falls_back_to_the_common_ones() -> None:
    parser = argparse.ArgumentParser(prog="bare", description="A bare program.")
    page = cli_docs.man_page(parser, name="bare", section=1, version="0", manual="M")
    statuses = page.split('.SH "EXIT STATUS"')[1].split(".SH")[0]
    assert [code for code, _ in cli_docs.COMMON_EXIT_STATUS] == [0, 1, 2, 130]
    for code, _ in cli_docs.COMMON_EXIT_STATUS:
        assert f".B {code}\n" in statuses
    assert ".SH COMMANDS" not in page


@pytest.mark.parametrize(("make", "name"), [(applianctl_parser, "applianctl"), (builder_parser, "builder")])
def test_real_parsers_every_listed_command_and_option_is_documented(make: object, name: str) -> None:
    assert callable(make)
    parser = make()
    page = cli_docs.man_page(parser, name=name, section=8, version="1.0.0", manual="Appliance Manual")
    completion = cli_docs.bash_completion(parser, name=name)
    listed = cli_docs.commands(parser)
    assert len(listed) >= 10
    hidden = set(cli_docs.subcommands(parser).choices) - {c.words[0] for c in listed}  # type: ignore[union-attr]
    for command in listed:
        entry = page.split(f'.SS "{cli_docs.roff(" ".join(command.words))}"\n', 1)
        assert len(entry) == 2, command.words
        options = [s for a in cli_docs.options(command.parser) for s in a.option_strings if s not in ("-h", "--help", "--debug")]
        for option in options:
            assert cli_docs.roff(option) in page, (command.words, option)
            assert option in completion, (command.words, option)
        assert command.words[-1] in completion
    for word in hidden:
        assert f'.SS "{cli_docs.roff(word)}"' not in page and f" {word} " not in completion, word
    if name == "applianctl":
        assert {"etc-reset", "var-seal", "stagger", "crashloop"} <= hidden


def test_write_puts_the_page_and_completion_where_man_and_bash_look(tmp_path: Path) -> None:
    written = cli_docs.write(sample_parser(), name="sample", section=8, version="1", manual="M",
                             man_dir=tmp_path / "man", completion_dir=tmp_path / "completions")
    assert written == [tmp_path / "man/man8/sample.8", tmp_path / "completions/sample"]
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in written)


def test_load_parser_refuses_what_is_not_a_parser_builder() -> None:
    with pytest.raises(UserError, match="not MODULE:FUNCTION"):
        cli_docs.load_parser("applianctl.__main__")
    with pytest.raises(UserError, match="not an argument parser"):
        cli_docs.load_parser("applianctl.__main__:release_version")
    assert cli_docs.load_parser("builder.__main__:build_parser").prog == "python3 -m builder"


def test_module_command_line_writes_both(tmp_path: Path) -> None:
    # Python itself, as the builder runs it (allowed in the fast tier)
    proc = subprocess.run(
        [sys.executable, "-m", "appliance.cli_docs", "applianctl.__main__:build_parser", "--name", "applianctl",
         "--section", "8", "--version", "9.9.9", "--man-dir", str(tmp_path / "man"), "--completion-dir", str(tmp_path / "c")],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert '"applianctl 9.9.9"' in (tmp_path / "man/man8/applianctl.8").read_text()
    assert (tmp_path / "c/applianctl").read_text().rstrip().endswith("complete -F _applianctl applianctl")


# ---- the real tools: groff, man and bash ----------------------------------------------------------


def _page(tmp_path: Path, make: object = applianctl_parser, name: str = "applianctl") -> Path:
    assert callable(make)
    return cli_docs.write(make(), name=name, section=8, version="1.0.0", manual="Appliance Manual",
                          man_dir=tmp_path / "man", completion_dir=tmp_path / "completions")[0]


@pytest.mark.programs
@pytest.mark.parametrize(("make", "name"), [(applianctl_parser, "applianctl"), (builder_parser, "builder")])
def test_groff_renders_the_page_without_a_warning(tmp_path: Path, make: object, name: str) -> None:
    if shutil.which("groff") is None:
        pytest.skip("groff is not installed")
    page = _page(tmp_path, make, name)
    proc = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(page)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.programs
def test_man_shows_the_page(tmp_path: Path) -> None:
    if shutil.which("man") is None:
        pytest.skip("man is not installed")
    page = _page(tmp_path)
    proc = subprocess.run(["man", "-l", str(page)], capture_output=True, text=True, timeout=60, check=False,
                          env={"PATH": "/usr/bin:/bin", "MANWIDTH": "100", "MANPAGER": "cat", "PAGER": "cat", "LANG": "C.UTF-8"})
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for heading in ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "COMMANDS", "EXIT STATUS", "EXAMPLES"):
        assert f"\n{heading}\n" in text, heading
    assert "applianctl status --json" in text
    assert "   model fetch\n" in text


def _complete(completion: Path, name: str, *words: str, cwd: Path | None = None) -> list[str]:
    """What bash's completion of NAME offers with WORDS typed, the cursor on the last one."""
    script = (f'source {completion}; COMP_WORDS=("$@"); COMP_CWORD=$((${{#COMP_WORDS[@]}} - 1)); '
              f'_{name}; printf "%s\\n" "${{COMPREPLY[@]}}"')
    proc = subprocess.run(["bash", "--norc", "--noprofile", "-c", script, "bash", name, *words],
                          capture_output=True, text=True, timeout=30, check=False, cwd=cwd)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return [w for w in proc.stdout.splitlines() if w]


@pytest.fixture(scope="module")
def completions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("completions")
    for make, name in ((applianctl_parser, "applianctl"), (builder_parser, "builder"), (sample_parser, "sample")):
        cli_docs.write(make(), name=name, section=1, version="0", manual="M", man_dir=directory / "man", completion_dir=directory)
    return directory


@pytest.mark.programs
def test_bash_completes_applianctl_commands_and_their_options(completions: Path) -> None:
    c = completions / "applianctl"
    listed = [cmd.words[0] for cmd in cli_docs.commands(applianctl_parser()) if len(cmd.words) == 1]
    assert _complete(c, "applianctl", "") == listed
    assert _complete(c, "applianctl", "sta") == ["status", "startup-report", "start"]
    assert "--json" in _complete(c, "applianctl", "status", "--")
    assert _complete(c, "applianctl", "--debug", "status", "--pro") == ["--prometheus"]
    assert _complete(c, "applianctl", "model", "") == ["fetch", "verify"]
    assert "--deep" in _complete(c, "applianctl", "model", "verify", "--")
    assert _complete(c, "applianctl", "etc-") == []  # hidden: the initrd's step
    assert _complete(c, "applianctl", "--") == ["--help", "--version", "--debug"]


@pytest.mark.programs
def test_bash_completes_choices_of_options_and_arguments(completions: Path, tmp_path: Path) -> None:
    b = completions / "builder"
    assert _complete(b, "builder", "--profile", "de") == ["demo"]
    assert _complete(b, "builder", "--profile", "=", "pro") == ["production"]  # --profile=pro: bash splits at =
    assert _complete(b, "builder", "--profile", "=", "demo", "bu") == ["build"]
    assert _complete(b, "builder", "--profile", "demo", "key") == ["keys"]
    assert _complete(b, "builder", "keys", "") == ["generate"]
    after = _complete(b, "builder", "keys", "generate", "")  # its one argument given: its options only
    assert "--timestamp" in after and "generate" not in after
    s = completions / "sample"
    assert _complete(s, "sample", "run", "--mode", "") == ["fast", "slow"]
    assert _complete(s, "sample", "keys", "make", "") == ["release", "boot"]
    (tmp_path / "input.txt").write_text("x")
    assert _complete(s, "sample", "run", "--out", "inp", cwd=tmp_path) == ["input.txt"]  # any value: a file name
    assert _complete(s, "sample", "run", "inp", cwd=tmp_path) == ["input.txt"]
    # --out=x is no positional argument: the file is still to come
    assert _complete(s, "sample", "run", "--out", "=", "x", "inp", cwd=tmp_path) == ["input.txt"]
    assert _complete(s, "sample", "run", "--out", "x", "inp", cwd=tmp_path) == ["input.txt"]
    assert _complete(s, "sample", "secret") == []
