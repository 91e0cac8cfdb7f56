"""Log lines on stderr in vLLM V1's format.

Engine: `(EngineCore_DP0 pid=278) INFO 09-25 13:39:07 [gpu_model_runner.py:2598] message`;
API server (uvicorn): `(APIServer pid=8) INFO:     message`.
"""

from __future__ import annotations

import os
import sys
import threading
import time

ENGINE = "EngineCore_DP0"
API = "APIServer"

_lock = threading.Lock()


def _write(line: str) -> None:
    with _lock:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def log(where: str, message: str, *, level: str = "INFO", proc: str = ENGINE) -> None:
    """One vLLM logger line; WHERE is `file.py:NN` as vLLM shows it."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    _write(f"({proc} pid={os.getpid()}) {level} {stamp} [{where}] {message}")


def uvicorn(message: str) -> None:
    """One uvicorn line of the API server (startup and access log)."""
    _write(f"({API} pid={os.getpid()}) INFO:     {message}")


def raw(line: str) -> None:
    """A line without prefix, as tqdm progress bars appear in vLLM's output."""
    _write(line)
