# SPDX-License-Identifier: MIT
"""The stand-in engine as a real process, and free loopback ports, for the tests and the benchmarks.

A test switches a running stand-in's faults through its faults file (standin/faults.py: read again
whenever it changes): `write_faults` for any stand-in started with STANDIN_FAULTS_FILE, or
`StandinProcess(faults_file=...).switch_faults(...)`, which also waits until the stand-in says the
switch is in effect. `hive_reset` kills several at once, as an XGMI hive reset does (testkit/hive.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from testkit.hive import kill_at_once

ROOT = Path(__file__).resolve().parents[1]
# The stand-in's line once a change of its faults file is in effect (standin/__main__.py).
FAULTS_NOW = "stand-in faults now:"


def write_faults(path: Path, faults: dict[str, Any], replica: int | None = None) -> None:
    """Put FAULTS (standin.faults.Faults' names, e.g. {"deadlock_after_s": 0}) in PATH whole, for
    REPLICA only when given; {} clears every switch of a running stand-in."""
    data = dict(faults) if replica is None else {"replica": replica, **faults}
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_spaced_ports(count: int, step: int = 2) -> list[int]:
    """COUNT free loopback ports STEP apart (replicas' ports: Config.replica_port)."""
    for _ in range(100):
        base = free_port()
        ports = [base + step * i for i in range(count)]
        if ports[-1] < 65536 and all(_bindable(p) for p in ports):
            return ports
    raise RuntimeError(f"no {count} free ports {step} apart")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class StandinProcess:
    """`python -m standin serve` on 127.0.0.1:PORT; its stderr collected line by line in .lines."""

    def __init__(self, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 port: int | None = None, pythonpath: Path = ROOT, faults_file: Path | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.faults_file = faults_file
        full_env = {**os.environ, "STANDIN_LOAD_SECONDS": "0", **(env or {}), "PYTHONPATH": str(pythonpath)}
        if faults_file is not None:
            full_env["STANDIN_FAULTS_FILE"] = str(faults_file)
        self.proc = subprocess.Popen(
            # --host/--port last: they win over any in ARGS, as argparse keeps the last value
            [sys.executable, "-m", "standin", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)],
            env=full_env, cwd=pythonpath, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def wait_for_line(self, text: str, timeout: float = 15.0) -> str:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if text in line:
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise TimeoutError(f"no line with {text!r}; got:\n" + "\n".join(self.lines))
                self._changed.wait(min(left, 0.2))

    def count_lines(self, text: str) -> int:
        with self._changed:
            return sum(text in line for line in self.lines)

    def wait_for_count(self, text: str, count: int, timeout: float = 15.0) -> None:
        """Until COUNT lines hold TEXT."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while sum(text in line for line in self.lines) < count:
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise TimeoutError(f"fewer than {count} lines with {text!r}; got:\n" + "\n".join(self.lines))
                self._changed.wait(min(left, 0.2))

    def switch_faults(self, faults: dict[str, Any], timeout: float = 15.0) -> None:
        """Switch the running stand-in's faults to FAULTS (e.g. {"deadlock_after_s": 0}; {} clears
        them) and return once it says they are in effect."""
        if self.faults_file is None:
            raise RuntimeError("start the stand-in with faults_file= to switch its faults while it runs")
        before = self.count_lines(FAULTS_NOW)
        write_faults(self.faults_file, faults)
        self.wait_for_count(FAULTS_NOW, before + 1, timeout)

    def wait_ready(self, timeout: float = 15.0) -> StandinProcess:
        self.wait_for_line("Application startup complete", timeout)
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(5)
        return code


def hive_reset(processes: Sequence[StandinProcess]) -> list[int]:
    """Every one of PROCESSES killed at once (SIGKILL), as an XGMI hive reset ends every process
    holding /dev/kfd (testkit/hive.py); the PIDs killed."""
    return kill_at_once([p.proc.pid for p in processes if p.proc.poll() is None])
