# SPDX-License-Identifier: MIT
"""Both command lines: global options anywhere, help for everything, status's exit codes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import applianctl
import applianctl.__main__
import builder.__main__
from appliance.errors import UserError
from applianctl import units

ROOT = Path(__file__).parents[1]


def _walk(parser: argparse.ArgumentParser, path: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(path or parser.prog, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _walk(sub, f"{path} {name}".strip())
    return out


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    return [("builder " + n, p) for n, p in _walk(builder.__main__.build_parser())] + [
        ("applianctl " + n, p) for n, p in _walk(applianctl.__main__.build_parser())
    ]


def test_every_command_and_option_has_help() -> None:
    missing = []
    commands = 0
    for where, parser in _parsers():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help for a in action._choices_actions}
                commands += len(helps)
                missing += [f"{where} {name}" for name, text in helps.items() if not (text or "").strip()]
            elif action.help != argparse.SUPPRESS and not (action.help or "").strip():
                missing.append(f"{where} {'/'.join(action.option_strings) or action.dest}")
    assert commands > 15
    assert missing == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--profile", "demo", "validate"],
        ["validate", "--profile", "demo"],
        ["--debug", "render", "appliance.preset.j2", "--profile", "demo"],
        ["release", "--profile", "demo", "--config", "x.toml"],
    ],
)
def test_builder_global_options_before_or_after_the_verb(argv: list[str]) -> None:
    args = builder.__main__.build_parser().parse_args(argv)
    assert args.profile == "demo"
    assert args.debug == ("--debug" in argv)
    assert args.config == ("x.toml" if "x.toml" in argv else str(ROOT / "appliance.toml"))


def test_builder_defaults_survive_a_command_without_the_options() -> None:
    args = builder.__main__.build_parser().parse_args(["--profile", "demo", "--debug", "boot"])
    assert (args.profile, args.debug) == ("demo", True)
    args = builder.__main__.build_parser().parse_args(["boot"])
    assert (args.profile, args.debug) == ("production", False)


def test_applianctl_debug_before_or_after_the_verb() -> None:
    parser = applianctl.__main__.build_parser()
    assert parser.parse_args(["status", "--debug"]).debug is True
    assert parser.parse_args(["--debug", "status"]).debug is True
    assert parser.parse_args(["status"]).debug is False


def _status(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "APPLIANCE_CONFIG": str(tmp_path / "absent.json")}
    return subprocess.run(
        [sys.executable, "-m", "applianctl", "status", *argv], capture_output=True, text=True, env=env, cwd=ROOT
    )


def test_status_that_cannot_run_is_unknown_3(tmp_path: Path) -> None:
    r = _status(tmp_path)
    assert r.returncode == 3, r.stderr
    assert r.stderr.startswith("applianctl status: unknown: ") and "Traceback" not in r.stderr
    assert "hint: " in r.stderr


def test_status_usage_error_is_unknown_3(tmp_path: Path) -> None:
    r = _status(tmp_path, "--no-such-option")
    assert r.returncode == 3
    assert "unrecognized arguments" in r.stderr


def test_status_that_crashes_is_unknown_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "appliance.json"
    config.write_text("[]")  # valid JSON, not a configuration: the probes cannot run
    monkeypatch.setenv("APPLIANCE_CONFIG", str(config))
    assert applianctl.__main__.main(["status"]) == 3


@pytest.mark.parametrize("case", ["no configuration", "not a configuration", "usage error", "bad value", "refused option", "crash"])
def test_status_that_cannot_run_says_what_and_what_to_do_in_two_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    # docs/status-schema.md: exit 3, stdout empty, stderr one line what and one line hint
    config = tmp_path / "appliance.json"
    if case == "not a configuration":
        config.write_text("[]")  # valid JSON, not a configuration: the probes cannot run
    monkeypatch.setenv("APPLIANCE_CONFIG", str(config))
    if case == "crash":
        from applianctl.status import collect

        def crash() -> None:
            raise RuntimeError("a fault of the code\nsecond line")

        monkeypatch.setattr(collect, "load_device", crash)
    argv = {"usage error": ["status", "--no-such-option"], "bad value": ["status", "--timeout-scale", "abc"],
            "refused option": ["status", "--output", str(tmp_path / "out.prom")]}.get(case, ["status"])
    assert applianctl.__main__.main(argv) == 3
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 2, err
    assert lines[0].startswith("applianctl status: unknown: ") and lines[1].startswith("hint: ")
    assert "usage:" not in err and "Traceback" not in err
    doc = (ROOT / "docs/status-schema.md").read_text()
    assert "stderr is two lines" in doc and '"applianctl status: unknown: WHAT"' in doc


def test_other_commands_keep_exit_2_for_bad_input() -> None:
    with pytest.raises(SystemExit) as e:
        applianctl.__main__.main(["restart"])
    assert e.value.code == 2
    assert applianctl.__main__.main(["restart", "verify"]) == 2


def test_version_is_the_release_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from appliance import paths

    monkeypatch.setattr(paths, "CONFIG_JSON", tmp_path / "appliance.json")
    monkeypatch.setattr(paths, "MANIFEST", tmp_path / "manifest.json")
    with pytest.raises(SystemExit) as e:
        applianctl.__main__.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"applianctl {applianctl.__version__}\n"
    (tmp_path / "manifest.json").write_text(json.dumps({"version": "1.2.2"}))
    (tmp_path / "appliance.json").write_text(json.dumps({"appliance": {"version": "1.2.3"}}))
    with pytest.raises(SystemExit):
        applianctl.__main__.main(["--version"])
    assert capsys.readouterr().out == "applianctl 1.2.3\n"
    (tmp_path / "appliance.json").unlink()
    with pytest.raises(SystemExit):
        applianctl.__main__.main(["--version"])
    assert capsys.readouterr().out == "applianctl 1.2.2\n"


@pytest.mark.parametrize("argv", [["--version", "--profile", "demo"], ["--profile", "demo", "--version"]])
def test_builder_version_names_the_project_and_the_configuration(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        builder.__main__.main(argv)
    assert e.value.code == 0
    import appliance.config

    version = appliance.config.load(ROOT / "appliance.toml", "demo").appliance.version
    out = capsys.readouterr().out
    assert out == f"builder {applianctl.__version__}; {ROOT / 'appliance.toml'} (demo): appliance.version {version}\n"
    # `build --version V` is still the release version to build as, not this option
    assert builder.__main__.build_parser().parse_args(["build", "--version", "1.2.3"]).version == "1.2.3"


def test_builder_version_with_a_missing_configuration(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        builder.__main__.main(["--version", "--config", str(tmp_path / "nonesuch.toml")])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == f"builder {applianctl.__version__}\n"
    assert "nonesuch.toml: no such file" in err and "hint: " in err and "Traceback" not in err


@pytest.mark.parametrize("verb", ["start", "stop", "restart"])
def test_start_stop_restart(verb: str) -> None:
    args = applianctl.__main__.build_parser().parse_args([verb, "proxy"])
    assert (args.func, args.verb) == (units.run_control, verb)
    # every replica, or one alone
    # every replica by name (systemctl's globs match only units in memory)
    assert units.control_argv(verb, "engine", replicas=2) == ["systemctl", verb, "appliance-engine@0.service",
                                                               "appliance-engine@1.service"]
    assert units.control_argv(verb, "engine@1") == ["systemctl", verb, "appliance-engine@1.service"]
    for hostile in ("engine@01", "engine@1x", "engine@-1", "engine@*", "engine@1 proxy"):
        with pytest.raises(UserError):
            units.control_argv(verb, hostile)


def test_logs_since() -> None:
    args = applianctl.__main__.build_parser().parse_args(["logs", "proxy", "--since", "1 hour ago", "-n", "5"])
    assert units.logs_argv(args) == [
        "journalctl", "--no-pager", "-u", "appliance-proxy.service", "-n", "5", "--since", "1 hour ago"
    ]


def test_every_command_module_registers_its_command() -> None:
    for command, module in applianctl.__main__.COMMAND_MODULES.items():
        parser = applianctl.__main__.build_parser(command)
        assert command in _walk_names(parser), (command, module)


def _walk_names(parser: argparse.ArgumentParser) -> set[str]:
    return {name.split()[-1] for name, _ in _walk(parser)}
