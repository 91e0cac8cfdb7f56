# SPDX-License-Identifier: MIT
"""The stand-in engine as a plain process on a free loopback port (as the demo image runs it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from testkit.standin import free_port

__all__ = ["MODEL", "free_port", "start_standin", "stop"]

ROOT = Path(__file__).parents[1]
MODEL = "standin/tiny-demo"


def start_standin(port: int, name: str = MODEL, **env: str) -> subprocess.Popen[bytes]:
    """The other team's stand-in engine, as the demo image runs it."""
    full_env = {**os.environ, "STANDIN_LOAD_SECONDS": "0", "STANDIN_SHM_DIR": "/nonexistent", **env}
    argv = [sys.executable, "-m", "standin", "serve", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        [*argv, "--served-model-name", name],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    end = time.monotonic() + 15
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        assert proc.poll() is None, "the stand-in exited"
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the stand-in did not open its port")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
