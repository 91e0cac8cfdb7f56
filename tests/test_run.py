# SPDX-License-Identifier: MIT
"""The one runner (appliance.run): its defaults, its errors, its --debug lines, and that the
product runs no program around it."""

from __future__ import annotations

import ast
import shlex
import sys
from pathlib import Path

import pytest

from appliance import run
from appliance.errors import UserError
from tests.repository import ROOT

PRODUCT = ("appliance", "applianctl", "builder", "installer")
RUNNER = Path("appliance/run.py")


@pytest.fixture(autouse=True)
def no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts without --debug, and leaves the runner as it found it."""
    monkeypatch.setattr(run, "_debug", False)


def test_env_adds_to_the_callers_environment_and_cwd_is_where_it_runs(tmp_path: Path) -> None:
    script = "import os; print(os.getcwd(), os.environ['APPLIANCE_X'], os.environ['PATH'] != '')"
    result = run.call([sys.executable, "-c", script], cwd=tmp_path, env={"APPLIANCE_X": "a b"})
    assert result.stdout == f"{tmp_path} a b True\n"


def test_a_failing_command_is_one_line_with_its_last_stderr_line() -> None:
    with pytest.raises(UserError) as e:
        run.checked([sys.executable, "-c", "import sys; sys.exit('first\\nmkfs.erofs: no space')"], "mkfs.erofs", "h")
    assert e.value.message == "mkfs.erofs failed: mkfs.erofs: no space"
    assert e.value.hint == "h"


def test_an_uncaptured_command_shares_the_terminal_and_reports_its_exit_status(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UserError, match=r"^mkosi build failed: exit status 3$"):
        run.checked([sys.executable, "-c", "print('building'); raise SystemExit(3)"], "mkosi build", "h", None, capture=False)
    assert capfd.readouterr().out == "building\n"  # on the terminal, not captured


def test_a_missing_tool_has_its_own_hint() -> None:
    with pytest.raises(UserError) as e:
        run.checked(["appliance-no-such-tool", "x"], "appliance-no-such-tool", "h", missing_hint="run `make setup`")
    assert e.value.message == "appliance-no-such-tool: appliance-no-such-tool is not installed"
    assert e.value.hint == "run `make setup`"


def test_a_missing_program_behind_a_path_directory_one_may_not_search_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's exec search says EACCES, not ENOENT, when a directory on PATH cannot be searched
    and the program is nowhere else: still one line that it is not installed, no traceback."""
    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", "appliance-no-such-tool")

    monkeypatch.setattr(run.subprocess, "run", denied)
    with pytest.raises(UserError) as e:
        run.checked(["appliance-no-such-tool"], "probe", "h", missing_hint="install it")
    assert e.value.message == "probe: appliance-no-such-tool is not installed" and e.value.hint == "install it"
    with pytest.raises(UserError, match=r"^probe: .*python.*: permission denied$"):
        run.checked([sys.executable], "probe", "h")


def test_no_stdin_but_the_input_given_and_a_timeout() -> None:
    read = [sys.executable, "-c", "import sys; print(repr(sys.stdin.read()))"]
    assert run.run(read, "read", "h") == "''\n"
    assert run.run(read, "read", "h", input="a table\n") == "'a table\\n'\n"
    assert run.call(read, None, capture=False, input="x").returncode == 0
    with pytest.raises(UserError, match=r"^sleep: .* did not finish within 0.2 s$"):
        run.run([sys.executable, "-c", "import time; time.sleep(5)"], "sleep", "h", timeout=0.2)


def test_binary_output_stays_bytes() -> None:
    done = run.call_bytes([sys.executable, "-c", "import sys; sys.stdout.buffer.write(bytes([0, 255, 10]))"])
    assert done.returncode == 0 and done.stdout == b"\x00\xff\n"


def test_a_started_program_streams_its_lines() -> None:
    proc = run.start([sys.executable, "-c", "print('one'); print('two')"], stdout=run.PIPE)
    assert proc.stdout is not None
    assert list(proc.stdout) == [b"one\n", b"two\n"]
    assert proc.wait(timeout=30) == 0


def _every_way(tmp_path: Path) -> list[list[str]]:
    """Run a command through each of the runner's ways; the argv of each, in order."""
    ran = []
    argv = [sys.executable, "-c", "import sys; sys.stderr.write('child ran\\n')", "two words", "it's"]
    run.call(argv, input="the input S3CRET", env={"APPLIANCE_TOKEN": "S3CRET"})
    ran.append(argv)
    run.call(argv, None, capture=False, cwd=tmp_path)
    ran.append(argv)
    run.call_bytes(argv)
    ran.append(argv)
    run.checked(argv, "w", "h")
    ran.append(argv)
    run.run(argv, "w", "h")
    ran.append(argv)
    proc = run.start(argv)
    proc.wait(timeout=30)
    ran.append(argv)
    replaced = [sys.executable, "-c", "from appliance import run; run.set_debug(True); "
                "run.replace(['true-or-not-here-appliance', 'x'])"]
    done = run.call(replaced, cwd=ROOT)  # replace() is the last thing a process does: in a child
    assert done.stderr.startswith("+ true-or-not-here-appliance x\n"), done.stderr
    return ran


def test_under_debug_each_command_line_is_printed_quoted_before_it_runs(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run.set_debug(True)
    ran = _every_way(tmp_path)
    err = capfd.readouterr().err
    line = f"+ {shlex.join(ran[0])}"
    assert err.count(line + "\n") == len(ran), err
    assert f"{line}\nchild ran\n" in err  # printed before it runs (the uncaptured one shows its stderr after)
    assert "'two words'" in err and shlex.quote("it's") in err
    assert "S3CRET" not in err  # the environment and the input are never printed


def test_without_debug_nothing_is_printed(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _every_way(tmp_path)
    assert capfd.readouterr().err == "child ran\n"  # the uncaptured command's own stderr, nothing else


class Stop(Exception):
    """Raised where the command line turned the printing on or off: nothing after it runs."""


def test_applianctl_and_the_builder_turn_the_printing_on_with_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    from applianctl.__main__ import main as applianctl_main
    from builder.__main__ import main as builder_main

    seen: list[bool] = []

    def set_debug(on: bool) -> None:
        seen.append(on)
        raise Stop

    monkeypatch.setattr(run, "set_debug", set_debug)
    for main, argv in ((applianctl_main, ["--debug", "stop", "engine"]), (applianctl_main, ["stop", "engine", "--debug"]),
                       (applianctl_main, ["stop", "engine"]), (builder_main, ["--debug", "validate"]),
                       (builder_main, ["validate", "--debug"]), (builder_main, ["validate"])):
        with pytest.raises(Stop):
            main(argv)
    assert seen == [True, True, False, True, True, False]


# The names that start a program without the runner.
SPAWNING_MODULES = {"subprocess", "pty", "asyncio.subprocess"}
OS_SPAWNERS = ("exec", "spawn", "posix_spawn", "system", "popen")
ASYNCIO_SPAWNERS = {"create_subprocess_exec", "create_subprocess_shell"}


def _around_the_runner(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name in SPAWNING_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module in SPAWNING_MODULES:
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "asyncio"):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if a.name.startswith(OS_SPAWNERS) or a.name in ASYNCIO_SPAWNERS]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
            (node.value.id == "os" and node.attr.startswith(OS_SPAWNERS))
            or (node.value.id == "asyncio" and node.attr in ASYNCIO_SPAWNERS)
        ):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return sorted(found)


def test_the_scan_sees_each_way_around_the_runner() -> None:
    source = ("import subprocess\nfrom subprocess import run\nimport os\nos.execvp('a', ['a'])\nos.system('a')\n"
              "from os import posix_spawnp\nimport asyncio\nasyncio.create_subprocess_exec('a')\nimport pty\n")
    assert [line for line, _ in _around_the_runner(ast.parse(source))] == [1, 2, 4, 5, 6, 8, 9]
    assert _around_the_runner(ast.parse("import os\nos.environ\nfrom appliance.run import call\nos.getpid()\n")) == []


def test_the_product_runs_programs_only_through_the_runner() -> None:
    """Every program the product starts goes through appliance/run.py, so that --debug shows each
    command line and each failure reads the same."""
    offenders = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if relative == RUNNER:
                continue
            offenders += [f"{relative}:{line}: {what}" for line, what in _around_the_runner(ast.parse(path.read_text(), str(path)))]
    assert offenders == [], "run programs through appliance.run (call, checked, run, start, replace):\n" + "\n".join(offenders)
    assert not (ROOT / "builder" / "run.py").exists()
