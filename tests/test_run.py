# SPDX-License-Identifier: MIT
"""One run() mechanism: appliance.run on the device, builder.run on top of it on the build host."""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path

import pytest

from appliance import run as device_run
from appliance.errors import UserError
from builder import run as host_run


def test_the_builder_logs_the_command_under_debug_and_passes_env_and_cwd(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = "import os; print(os.getcwd(), os.environ['APPLIANCE_X'], os.environ['PATH'] != '')"
    with caplog.at_level(logging.DEBUG, logger="builder"):
        result = host_run.run([sys.executable, "-c", script], cwd=tmp_path, env={"APPLIANCE_X": "a b"}, capture=True)
    assert result.stdout == f"{tmp_path} a b True\n"  # ENV adds to the caller's environment
    assert caplog.messages == [f"+ {shlex.join([sys.executable, '-c', script])}"]


def test_a_failing_host_command_is_one_line_with_its_last_stderr_line() -> None:
    with pytest.raises(UserError) as e:
        host_run.run([sys.executable, "-c", "import sys; sys.exit('first\\nmkfs.erofs: no space')"], capture=True, what="mkfs.erofs")
    assert e.value.message == "mkfs.erofs failed: mkfs.erofs: no space"
    assert e.value.hint == "run again with --debug to see the command and its output"


def test_an_uncaptured_host_command_reports_its_exit_status(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UserError, match=r"^mkosi build failed: exit status 3$"):
        host_run.run([sys.executable, "-c", "print('building'); raise SystemExit(3)"], what="mkosi build")
    assert capfd.readouterr().out == "building\n"  # on the terminal, not captured


def test_a_missing_host_tool_points_at_make_setup() -> None:
    with pytest.raises(UserError) as e:
        host_run.run(["appliance-no-such-tool", "x"])
    assert e.value.message == "appliance-no-such-tool: appliance-no-such-tool is not installed"
    assert e.value.hint == "run `make setup` to install the host's tools"


def test_a_missing_program_behind_a_path_directory_one_may_not_search_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's exec search says EACCES, not ENOENT, when a directory on PATH cannot be searched
    and the program is nowhere else: still one line that it is not installed, no traceback."""
    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", "appliance-no-such-tool")

    monkeypatch.setattr(device_run.subprocess, "run", denied)
    with pytest.raises(UserError) as e:
        device_run.checked(["appliance-no-such-tool"], "probe", "h", missing_hint="install it")
    assert e.value.message == "probe: appliance-no-such-tool is not installed" and e.value.hint == "install it"
    with pytest.raises(UserError, match=r"^probe: .*python.*: permission denied$"):
        device_run.checked([sys.executable], "probe", "h")


def test_the_device_runner_has_no_stdin_and_a_timeout() -> None:
    assert device_run.run([sys.executable, "-c", "import sys; print(repr(sys.stdin.read()))"], "read", "h") == "''\n"
    with pytest.raises(UserError, match=r"^sleep: .* did not finish within 0.2 s$"):
        device_run.run([sys.executable, "-c", "import time; time.sleep(5)"], "sleep", "h", timeout=0.2)
