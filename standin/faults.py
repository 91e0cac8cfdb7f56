"""Fault switches: STANDIN_* environment variables and the optional JSON file STANDIN_FAULTS_FILE.

The file's keys are the variable names lower-cased without STANDIN_; it is read once at start and wins
over the environment, so a test can inject a fault into an engine whose unit sets the variables.
With several replicas sharing one file, its optional key "replica" names the one it is for (the
replica number in APPLIANCE_REPLICA, 0 when unset); the others ignore the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


class FaultsError(Exception):
    pass


@dataclass(frozen=True)
class Faults:
    load_seconds: float = 2.0  # how long "loading" lasts (port closed)
    crash_after_s: float | None = None  # exit 1 after this many seconds of serving
    hang_after_s: float | None = None  # stop answering after this many seconds of serving
    crash_leave_mmap: bool = False  # the crash is an os._exit that leaves the mmap file behind
    never_ready: bool = False  # stay loading forever
    token_seconds: float = 0.0  # delay between generated tokens
    kv_cache_tokens: int = 65536  # the GPU KV cache size reported (lower it for a degraded start)


def _number(name: str, value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise FaultsError(f"{name} = {value!r}: not a number") from None
    if isinstance(value, bool) or number < 0 or number != number:
        raise FaultsError(f"{name} = {value!r}: must be a number >= 0")
    return number


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise FaultsError(f"{name} = {value!r}: must be 1 or 0")


def load(environ: Mapping[str, str] | None = None) -> Faults:
    env = os.environ if environ is None else environ
    names = [f.name for f in fields(Faults)]
    raw: dict[str, Any] = {}
    for name in names:
        if (value := env.get("STANDIN_" + name.upper())) not in (None, ""):
            raw[name] = value
    if path := env.get("STANDIN_FAULTS_FILE"):
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            data = {}
        except (OSError, json.JSONDecodeError) as e:
            raise FaultsError(f"{path}: cannot read faults file: {e}") from None
        if not isinstance(data, dict):
            raise FaultsError(f"{path}: the faults file must hold a JSON object")
        unknown = sorted(set(data) - set(names) - {"replica"})
        if unknown:
            raise FaultsError(f"{path}: unknown key(s) {', '.join(unknown)}; known: replica, {', '.join(names)}")
        if str(data.get("replica", 0)) == (env.get("APPLIANCE_REPLICA") or "0"):
            raw.update({k: v for k, v in data.items() if v is not None and k != "replica"})
    kwargs: dict[str, Any] = {}
    for name in names:
        if name not in raw:
            continue
        if name in ("crash_leave_mmap", "never_ready"):
            kwargs[name] = _flag(name, raw[name])
        elif name == "kv_cache_tokens":
            number = _number(name, raw[name])
            if number != int(number) or number < 1:
                raise FaultsError(f"{name} = {raw[name]!r}: must be a whole number >= 1")
            kwargs[name] = int(number)
        else:
            kwargs[name] = _number(name, raw[name])
    return Faults(**kwargs)
