# SPDX-License-Identifier: MIT
"""Every command line the project prints works as printed.

Collected from README.md, docs/*.md, appliance.toml's comments and the hints the tools print
(`hint=` in builder/, applianctl/, appliance/, testkit/, bench/). Host-side ones that need no image or VM
(`validate`, `render`) are run; every other one must at least parse with the real parser.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import applianctl.__main__
import builder.__main__

ROOT = Path(__file__).parents[1]
CMD = re.compile(r"(?:python3 -m builder|applianctl)(?: [^`\n;()]*)?")
MAKE = re.compile(r"^make ([a-z][a-z0-9-]*)$")  # a quoted `make TARGET` in the documents
RUN_HERE = {"validate", "render"}  # need neither an image nor a VM nor root
# Words in a command line that stand for something the reader fills in.
PLACEHOLDERS = {"{config.profile}": "demo", "{verb}": "restart", "{part}": "engine", "--replica I": "--replica 1", "engine@I": "engine@1"}


def _documents() -> list[tuple[str, str]]:
    """(where, text) of every place a command may be quoted."""
    out: list[tuple[str, str]] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
            out += [(path.name, line.split(" #")[0]) for line in block.splitlines()]
        out += [(path.name, code) for code in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    for line in (ROOT / "appliance.toml").read_text().splitlines():
        if "#" in line:
            comment = line.split("#", 1)[1]
            out += [("appliance.toml", code) for code in re.findall(r"`([^`]+)`", comment)] or [("appliance.toml", comment)]
    for path in sorted(itertools.chain(*(ROOT.glob(f"{d}/*.py") for d in ("builder", "applianctl", "appliance", "testkit", "bench")))):
        for m in re.finditer(r"hint=f?(?:\"([^\"]*)\"|'([^']*)')", path.read_text()):
            hint = m.group(1) or m.group(2)
            # A hint that quotes its command in backticks says where the command ends.
            quoted = re.findall(r"`([^`]+)`", hint)
            out += [(f"{path.parent.name}/{path.name} hint", text) for text in quoted or [hint]]
    return out


def _expand(command: str) -> list[str]:
    """COMMAND with its optional parts ([--reboot]) both left out and put in."""
    for key, value in PLACEHOLDERS.items():
        command = command.replace(key, value)
    optional = re.findall(r"\[([^\]]*)\]", command)
    bare = re.sub(r"\s*\[[^\]]*\]", "", command)
    full = re.sub(r"\[([^\]]*)\]", r"\1", command)
    return [bare, full] if optional else [command]


def commands() -> list[tuple[str, str]]:
    found: dict[str, str] = {}
    for where, text in _documents():
        if where.endswith(".md") and MAKE.match(text.strip()):
            found.setdefault(text.strip(), where)
        for m in CMD.finditer(text):
            command = m.group(0).strip().rstrip(".,:")
            for variant in _expand(command):
                found.setdefault(variant, where)
    return sorted((where, command) for command, where in found.items())


COMMANDS = commands()


def test_the_sources_are_read() -> None:
    # Guards against the extraction silently finding nothing.
    quoted = [c for _, c in COMMANDS]
    assert "python3 -m builder --profile demo validate" in quoted
    assert any(c.startswith("applianctl status") for c in quoted)
    assert any("hint" in where for where, _ in COMMANDS)
    assert len(COMMANDS) > 25


def _make_targets() -> set[str]:
    return set(re.findall(r"(?m)^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text()))


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[c for _, c in COMMANDS])
def test_command_works_as_printed(where: str, command: str) -> None:
    words = shlex.split(command)
    if "--help" in words or words[1:] == ["--version"] or words[:4] == ["python3", "-m", "builder", "--version"]:
        on_device = words[0] == "applianctl"
        parser = applianctl.__main__.build_parser() if on_device else builder.__main__.build_parser()
        with pytest.raises(SystemExit) as e:  # argparse prints the help (or version) and exits 0
            parser.parse_args(words[1:] if on_device else words[3:])
        assert e.value.code == 0
        return
    if words[0] == "make":
        assert words[1] in _make_targets(), f"{where}: no make target {words[1]!r}"
        return
    if words[0] == "applianctl":
        args = words[1:]
        applianctl.__main__.build_parser(applianctl.__main__._command(args)).parse_args(args)  # SystemExit fails the test
        return
    args = words[3:]
    parsed = builder.__main__.build_parser().parse_args(args)
    if parsed.command == "validate" and parsed.profile == "production" and (missing := _operator_files_missing()):
        # The production profile needs third-party files the operator copies in: validate must
        # name each one, one line each, and exit 2 (not pass, not a traceback).
        r = subprocess.run([sys.executable, "-m", "builder", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        assert all(name in r.stderr for name in missing) and "Traceback" not in r.stderr
        assert r.stderr.rstrip().splitlines()[-1].startswith("hint: ")
        return
    if parsed.command in RUN_HERE:
        r = subprocess.run([sys.executable, "-m", "builder", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{where}: {command}\n{r.stderr}"
        assert r.stdout.strip()
        assert "Traceback" not in r.stderr


def _operator_files_missing() -> list[str]:
    import appliance.config

    config = appliance.config.load(ROOT / "appliance.toml", "production")
    return [f.file for f in (*config.engine.overlays, *config.engine.tuning) if not (ROOT / f.file).is_file()]


@pytest.mark.parametrize("profile", ["production", "demo"])
def test_render_lists_only_templates_that_render(profile: str) -> None:
    r = subprocess.run([sys.executable, "-m", "builder", "render", "nonesuch"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    listed = r.stderr.split("hint: one of: ", 1)[1].strip().split(", ")
    assert len(listed) >= 5
    for name in listed:
        out = subprocess.run(
            [sys.executable, "-m", "builder", "render", name, "--profile", profile], cwd=ROOT, capture_output=True, text=True
        )
        assert out.returncode == 0, f"render {name} --profile {profile}: {out.stderr}"
        assert out.stdout.strip() and "Traceback" not in out.stderr


def _plan_examples() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", (ROOT / "docs" / "install.md").read_text(), re.S)


def test_install_md_has_a_plan_example() -> None:
    assert _plan_examples(), "docs/install.md: no ```toml plan block found"


@pytest.mark.parametrize("index", range(len(_plan_examples())))
def test_the_plan_examples_in_install_md_are_valid_plans(index: int, tmp_path: Path) -> None:
    # `python3 -m builder plan` reads the file with this loader: the example must pass it as written.
    from appliance.signed import install_plan

    path = tmp_path / "gpu-07.toml"
    path.write_text(_plan_examples()[index])
    plan = install_plan.load_toml(path)
    assert plan.ssh is not None and plan.ssh.authorized_keys
