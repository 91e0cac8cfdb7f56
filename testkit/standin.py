# SPDX-License-Identifier: MIT
"""The stand-in engine as a real process, and free loopback ports, for the tests and the benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
                 port: int | None = None, pythonpath: Path = ROOT) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "STANDIN_LOAD_SECONDS": "0", **(env or {}), "PYTHONPATH": str(pythonpath)}
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
