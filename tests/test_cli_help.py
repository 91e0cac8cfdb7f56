# SPDX-License-Identifier: MIT
"""The command lines as operators expect them: every command's --help has a one-line summary,
examples that parse and its exit statuses; every applianctl command that reports has --json;
NO_COLOR and TERM=dumb leave no escape sequence; a bare applianctl is a usage error on stderr."""

from __future__ import annotations

import argparse
import io
import json
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import applianctl.__main__
import builder.__main__
import installer.__main__
from appliance import cli_help, progress, terminal
from applianctl.engine import preflight, shm, smoke, startup
from applianctl.records import PreflightResult, ShmCheck
from applianctl.selftest import checks
from applianctl.status import collect, probes

ROOT = Path(__file__).parents[1]

PROGRAMS = {
    "applianctl": applianctl.__main__.build_parser,
    "python3 -m builder": builder.__main__.build_parser,
    "python3 -m installer": installer.__main__.build_parser,
}

# applianctl commands that report something, each with --json; and those that do not, with why.
REPORTING = {
    "status", "verify", "tls", "tls show", "slots", "update", "model fetch", "model verify", "selftest", "smoke",
    "preflight", "shm-clean", "startup-report", "judge", "remediation", "attest",
}
NOT_REPORTING = {
    "logs": "the journal itself, as journalctl prints it (journalctl -o json for JSON)",
    "start": "an action: systemctl's own words", "stop": "an action", "restart": "an action",
    "tls generate": "an action; `tls show --json` reports the result",
    "assess": "a boot's step that reboots on failure; `slots --json` holds its verdict",
    "rollback": "an action; `slots --json` reports the slots after it",
    "factory-reset": "an action; `status --json` shows the request",
    "support-bundle": "writes a tarball and prints its path, the only thing it has to say",
    "model": "takes an ACTION", "etc-reset": "the initrd's step", "crashloop": "a unit's step",
    "var-seal": "a unit's step; `status --json` shows its record", "stagger": "a unit's step",
    "attest-serve": "a service (appliance-attest.service); its answers are JSON",
}


def _every(program: str) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return cli_help.walk(PROGRAMS[program]())


def _cases() -> list[tuple[str, tuple[str, ...]]]:
    return [(program, words) for program in PROGRAMS for words, _ in _every(program)]


def _argv(example: str, program: str) -> list[str]:
    """The example's arguments after the program, without a shell redirection."""
    words = shlex.split(example)
    prog = shlex.split(program)
    assert words[: len(prog)] == prog, f"{example!r} does not start with {program!r}"
    words = words[len(prog):]
    return words[: words.index(">")] if ">" in words else words


@pytest.mark.parametrize(("program", "words"), _cases(), ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_every_command_has_a_summary_examples_and_exit_statuses(program: str, words: tuple[str, ...]) -> None:
    parser = dict(_every(program))[words]
    help_ = cli_help.read_help(parser)
    where = " ".join((program, *words))
    assert help_.summary.strip() and "\n" not in help_.summary, f"{where}: no one-line summary"
    assert help_.examples, f"{where}: no example"
    codes = dict(help_.exit_codes)
    assert 0 in codes, f"{where}: exit status 0 not described"
    # a usage error: 2, but 3 for status (monitoring plugins read 2 as "down")
    assert (3 if words == ("status",) else 2) in codes, f"{where}: the usage error's exit status not described"
    text = parser.format_help()
    assert f"{cli_help.EXAMPLES}\n" in text and f"{cli_help.EXIT_STATUS}\n" in text
    top = PROGRAMS[program]()
    for example in help_.examples:
        argv = _argv(example, program)
        assert [w for w in argv if w in words] == list(words), f"{where}: {example!r} runs another command"
        try:
            top.parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{where}: the example {example!r} does not parse (exit {e.code})")


def test_help_reads_back_what_was_written() -> None:
    sub = argparse.ArgumentParser(prog="x").add_subparsers()
    long = "a description long enough to be wrapped onto a second line by the help's own width, " * 2
    p = cli_help.verb_parser(sub, "go", "do it", examples=["x go", "x go --fast"],
                             exit_codes=[(2, "bad input"), (0, "done"), (1, long)], details="Why it matters.")
    assert cli_help.read_help(p) == cli_help.VerbHelp(
        "do it", "Why it matters.", ("x go", "x go --fast"), ((0, "done"), (1, long.strip()), (2, "bad input")))
    with pytest.raises(ValueError, match="example"):
        cli_help.verb_parser(sub, "bare", "no example", examples=[], exit_codes=[cli_help.OK])
    with pytest.raises(ValueError, match="one line"):
        cli_help.verb_parser(sub, "two", "two\nlines", examples=["x two"], exit_codes=[cli_help.OK])
    hidden = cli_help.verb_parser(sub, "step", "a unit's step", examples=["x step"], exit_codes=[cli_help.OK], hidden=True)
    assert "step" not in [a.dest for a in sub._choices_actions] and cli_help.read_help(hidden).examples == ("x step",)


def test_exit_statuses_stated_are_those_the_code_returns() -> None:
    (_, status), = [w for w in _every("applianctl") if w[0] == ("status",)]
    assert set(dict(cli_help.read_help(status).exit_codes)) == {*collect.EXIT_STATUS.values(), collect.UNKNOWN_EXIT}
    (_, selftest), = [w for w in _every("applianctl") if w[0] == ("selftest",)]
    stated = set(dict(cli_help.read_help(selftest).exit_codes))
    assert stated == {checks.EXIT_OK, checks.EXIT_FAILED, 2, checks.EXIT_COULD_NOT_RUN}


def test_every_applianctl_command_that_reports_has_json() -> None:
    commands = {" ".join(words): parser for words, parser in _every("applianctl") if words}
    assert set(commands) == REPORTING | set(NOT_REPORTING), "a command is new or gone: say whether it reports"
    missing = [name for name in sorted(REPORTING) if "--json" not in commands[name]._option_string_actions]
    assert missing == []


# ----------------------------------------------------------------------------------- --json output


def _json_out(capsys: pytest.CaptureFixture[str]) -> Any:
    out = capsys.readouterr().out
    return json.loads(out)


def test_preflight_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(preflight, "load_device", lambda: None)
    monkeypatch.setattr(preflight, "write_record", lambda path, record: None)
    monkeypatch.setattr(preflight, "check", lambda config: PreflightResult(False, "/dev/kfd is missing"))
    assert preflight.main(argparse.Namespace(json=True)) == 1
    doc = _json_out(capsys)
    assert (doc["ok"], doc["reason"]) == (False, "/dev/kfd is missing")


def test_shm_clean_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(shm, "load_device", lambda: None)
    monkeypatch.setattr(shm, "check", lambda config, directory, dry_run: ShmCheck(ok=True, reason="room for the offload"))
    assert shm.run(argparse.Namespace(json=True, dry_run=True)) == 0
    doc = _json_out(capsys)
    assert (doc["ok"], doc["reason"]) == (True, "room for the offload")


def test_startup_report_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(startup, "load_device", lambda: SimpleNamespace(expected=SimpleNamespace()))
    monkeypatch.setattr(startup, "write_record", lambda path, record: None)
    monkeypatch.setattr(startup, "_lines", lambda args: iter(()))
    code = startup.run(argparse.Namespace(json=True, follow=False, source=None))
    doc = _json_out(capsys)
    assert doc["state"] == "loading" and code == (0 if doc["ok"] else 1)


def test_smoke_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(smoke, "load_device", lambda: SimpleNamespace(served_model="m"))
    monkeypatch.setattr(smoke, "smoke", lambda *a: smoke.Result(True, "smoke test passed", 0.01, 0.5, " 391"))
    args = argparse.Namespace(json=True, url="http://127.0.0.1:1", ca=None, insecure=False, model=None, timeout=1.0)
    assert smoke.run(args) == 0
    doc = _json_out(capsys)
    assert (doc["ok"], doc["answer"], doc["model"]) == (True, " 391", "m")


# ----------------------------------------------------------------------------------- colour


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("environ", "escapes"), [
    ({"TERM": "xterm"}, True), ({"TERM": "xterm", "NO_COLOR": "1"}, False), ({"TERM": "dumb"}, False),
    ({"TERM": "xterm", "NO_COLOR": ""}, True),  # no-color.org: set and not empty
])
def test_no_color_and_dumb_terminal_leave_no_escape_sequence(
    environ: dict[str, str], escapes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("TERM", "NO_COLOR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert terminal.escapes(_Terminal()) is escapes
    assert terminal.escapes(io.StringIO()) is False  # not a terminal
    # status, as `applianctl status` prints it on a terminal: coloured or not
    coloured: list[bool] = []
    monkeypatch.setattr(collect, "load_device", lambda: None)
    monkeypatch.setattr(collect, "collect", lambda config, src, deadline: SimpleNamespace(state=probes.DEGRADED))
    monkeypatch.setattr(collect, "render", lambda doc, out, colour: coloured.append(colour))
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert collect.run(argparse.Namespace(json=False, prometheus=False, output=None)) == 1
    assert coloured == [escapes]
    # a progress bar and a step, redrawn in place either way
    bar = _Terminal()
    with progress.Progress("hashing", total=10, unit="files", out=bar, every_s=0) as p:
        for _ in range(10):
            p.advance(1)
    with progress.step("a longer step's name", out=bar, every_s=60):
        pass
    assert ("\033" in bar.getvalue()) is escapes
    assert "\r" in bar.getvalue() and bar.getvalue().endswith("\n")


def test_without_escapes_a_shorter_line_overwrites_a_longer_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "dumb")
    out = _Terminal()
    ticks = iter(range(100))
    with progress.Progress("hashing", total=None, unit="files", out=out, clock=lambda: float(next(ticks))) as p:
        p.advance(123456789)  # "hashing: 123456789 files, ..." then a shorter line
        p.done = 0
        p.advance(1)
    drawn = out.getvalue().split("\r")[1:]
    assert len(drawn) == 3 and "\033" not in out.getvalue()
    assert len(drawn[1]) == len(drawn[0]) and drawn[1].startswith("hashing: 1 files") and drawn[1].endswith(" ")


# ----------------------------------------------------------------------------------- a bare command


def test_bare_applianctl_is_a_usage_error_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert applianctl.__main__.main([]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("usage: applianctl ") and "applianctl: error: a COMMAND is required" in err


def test_bare_programs_exit_2_with_usage_on_stderr() -> None:
    for module in ("applianctl", "builder"):
        done = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 2, (module, done.stderr)
        assert done.stdout == "" and done.stderr.startswith("usage: "), (module, done.stderr)


def test_update_check_json_leaves_stdout_to_the_document(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from applianctl.update import channel, command

    monkeypatch.setattr(command.release, "running_manifest", lambda: SimpleNamespace(version="1.0.0"))
    monkeypatch.setattr(channel, "machine_id", lambda: "0" * 32)
    monkeypatch.setattr(channel, "maintenance_windows", lambda: ())
    monkeypatch.setattr(channel, "system_clock", lambda: 0.0)
    monkeypatch.setattr(channel, "resolve", lambda *a, **kw: SimpleNamespace(describe=lambda now: "stable: nothing newer", bundle=None))
    for as_json in (True, False):
        args = argparse.Namespace(check=True, ca=None, deadline=None, from_config=False, json=as_json)
        assert command._resolve_channel("https://updates.example/stable/channel.json", args) is None
        out, err = capsys.readouterr()
        assert ((err if as_json else out), (out if as_json else err)) == ("stable: nothing newer\n", "")
