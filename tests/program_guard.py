# SPDX-License-Identifier: MIT
"""The fast tier's guard (`make check`, which sets APPLIANCE_FAST_TIER=1): a test there may start
Python itself (sys.executable) and the tests' own fake programs (files under tests/ or under a
temporary directory, where fakeprog.fake_program writes them), nothing else. Any other attempt to
execute a program (subprocess, asyncio's subprocesses, os.exec*, os.posix_spawn*, os.spawn*,
os.system) is refused before anything runs, and the test fails with a message asking to mark it
`programs` (conftest.py's PROGRAM_FIXTURES for a fixture that starts a daemon), so that such a
test runs in `make unit` rather than slowing the fast tier down unseen.

A program that cannot be found is let through: nothing starts, and the caller sees the
FileNotFoundError it would see on a host without it."""

from __future__ import annotations

import inspect
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

ENV = "APPLIANCE_FAST_TIER"
TESTS = Path(__file__).resolve().parent
MARK = "programs"


class ProgramNotAllowed(RuntimeError):
    """A test in the fast tier tried to start a real program."""


def active() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


_violations: list[str] = []
_roots: list[str] = []


def _python_paths() -> set[str]:
    return {os.path.realpath(p) for p in (sys.executable, getattr(sys, "_base_executable", sys.executable)) if p}


def _resolve(program: str | bytes | os.PathLike[Any], env: Mapping[Any, Any] | None) -> str | None:
    """PROGRAM as the exec would find it (with ENV's PATH, or ours), or None when it does not exist."""
    name = os.fsdecode(program)
    if os.sep in name:
        return name if os.path.exists(name) else None
    path = None
    if env is not None:
        raw = env.get("PATH", env.get(b"PATH"))
        path = os.fsdecode(raw) if raw is not None else None
    return shutil.which(name, path=path if path is not None else os.environ.get("PATH", os.defpath))


def _allowed(resolved: str) -> bool:
    real = os.path.realpath(resolved)
    if real in _python_paths():
        return True
    # A fake program: a file of the tests (fake_bootctl.py), or one a test wrote into a temporary
    # directory (a link there to a real program is the real program).
    return any(real.startswith(root + os.sep) for root in (str(TESTS), *_roots))


def check(argv: Sequence[Any] | str | bytes | os.PathLike[Any], executable: Any = None, env: Mapping[Any, Any] | None = None) -> None:
    """Refuse to execute ARGV unless it is Python or a fake program (see the module's docstring)."""
    if isinstance(argv, str | bytes | os.PathLike):
        argv = [argv]
    if not argv and executable is None:
        return
    program = executable if executable is not None else argv[0]
    resolved = _resolve(program, env)
    if resolved is None or _allowed(resolved):
        return
    shown = " ".join(os.fsdecode(a) if isinstance(a, str | bytes | os.PathLike) else str(a) for a in list(argv)[:6])
    message = (
        f"{resolved}: the fast tier (make check) starts no real program, and this test tried to run `{shown}`; "
        f"mark the test `@pytest.mark.{MARK}` (a module: pytestmark = pytest.mark.{MARK}; a fixture that "
        f"starts a daemon: add it to PROGRAM_FIXTURES in tests/conftest.py) so that it runs in make unit"
    )
    _violations.append(message)
    raise ProgramNotAllowed(message)


_CHILD_PARAMS = inspect.signature(subprocess.Popen._execute_child)  # type: ignore[attr-defined]


def _install(monkeypatch: pytest.MonkeyPatch) -> None:
    original_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def execute_child(self: subprocess.Popen[Any], args: Any, executable: Any, *rest: Any, **kw: Any) -> Any:
        bound = _CHILD_PARAMS.bind_partial(self, args, executable, *rest, **kw).arguments
        env, shell = bound.get("env"), bound.get("shell", False)
        if shell:
            check(["/bin/sh", "-c", args if isinstance(args, str) else " ".join(map(str, args))], None, env)
        else:
            check(args, executable, env)
        return original_child(self, args, executable, *rest, **kw)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", execute_child)

    def wrap_exec(name: str, has_env: bool) -> None:
        original = getattr(os, name)

        def guarded(path: Any, args: Any, *rest: Any, **kw: Any) -> Any:
            env = (rest[0] if rest else kw.get("env")) if has_env else None
            check([path, *list(args)[1:]], None, env)
            return original(path, args, *rest, **kw)

        monkeypatch.setattr(os, name, guarded)

    for name, has_env in (("execv", False), ("execve", True), ("posix_spawn", True), ("posix_spawnp", True)):
        if hasattr(os, name):
            wrap_exec(name, has_env)
    for name in ("spawnv", "spawnve", "spawnvp", "spawnvpe"):
        if hasattr(os, name):
            original_spawn = getattr(os, name)

            def spawn(mode: int, file: Any, args: Any, *rest: Any, _original: Any = original_spawn, **kw: Any) -> Any:
                check([file, *list(args)[1:]], None, rest[0] if rest and isinstance(rest[0], Mapping) else None)
                return _original(mode, file, args, *rest, **kw)

            monkeypatch.setattr(os, name, spawn)

    def system(command: str) -> int:
        check(["/bin/sh", "-c", command])
        raise AssertionError("unreachable")

    monkeypatch.setattr(os, "system", system)


class Plugin:
    """Installed for the whole session when the fast tier is asked for (conftest.py registers it)."""

    def __init__(self) -> None:
        self.monkeypatch = pytest.MonkeyPatch()

    def pytest_configure(self, config: pytest.Config) -> None:
        _roots.extend(sorted({os.path.realpath(tempfile.gettempdir()), "/dev/shm", os.path.realpath("/dev/shm")}))
        # platform.processor() runs `uname -p` once per process (the openai client asks): before the guard.
        platform.processor()
        _install(self.monkeypatch)
        # The release code copies payloads with cp (sparse, reflinked) when it is installed, else with
        # Python: here it takes the Python path, the same bytes; make unit runs cp.
        from builder import release

        self.monkeypatch.setattr(release, "_copy", lambda src, dst: shutil.copyfile(src, dst))

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.monkeypatch.undo()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        report = yield
        if _violations:
            report.outcome = "failed"
            report.longrepr = "\n".join(dict.fromkeys(_violations)) + (f"\n\n{report.longrepr}" if report.longrepr else "")
            _violations.clear()
        return report
