# SPDX-License-Identifier: MIT
"""The image's configuration on the device: /usr/lib/appliance/appliance.json (Config.to_json() of
the build), loaded into the same model through the same loader and cross-checks as appliance.toml."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance import paths
from appliance.config.model import PROFILES, Config, ConfigLoader, cross_checks
from appliance.errors import ConfigError

# Values Config.to_json() adds for readers that are not Python; on loading they must equal what
# the model derives, so the file cannot say two different things.
_DERIVED: dict[tuple[str, str], Callable[[Config], Any]] = {
    ("engine", "reference"): lambda c: c.engine.reference,
    ("engine", "offload_gib"): lambda c: c.engine.offload_gib,
    ("engine", "served_model_name"): lambda c: c.engine.served_model_name,
    ("model", "snapshot_path"): lambda c: c.model.snapshot_path,
    ("model", "weights_dir"): lambda c: c.model.weights_dir,
}
DEVICE_HINT = "the image is damaged; reinstall or roll back"


def device_path() -> Path:
    """The image's configuration; APPLIANCE_CONFIG moves it for tests."""
    return Path(os.environ.get("APPLIANCE_CONFIG", str(paths.CONFIG_JSON)))


def no_constant(text: str) -> Any:
    """json.loads' parse_constant: NaN and Infinity are refused."""
    raise ValueError(f"{text} is not a number here")


def from_json(data: Any, path: Path) -> Config:
    """DATA (parsed appliance.json) as the model, through the same loader as appliance.toml."""
    if not isinstance(data, dict) or data.get("profile") not in PROFILES:
        raise ConfigError(f"{path}: profile = {data.get('profile') if isinstance(data, dict) else data!r}: invalid", hint=DEVICE_HINT)
    table = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k != "profile"}
    stored = {}
    for (section, key) in _DERIVED:
        if isinstance(table.get(section), dict) and key in table[section]:
            stored[(section, key)] = table[section].pop(key)
    config: Config = ConfigLoader(path).load(Config, table, "", profile=data["profile"])
    cross_checks(path, config)
    for (section, key), value in stored.items():
        if value != _DERIVED[(section, key)](config):
            raise ConfigError(f"{path}: {section}.{key} = {value!r} does not follow from the configuration", hint=DEVICE_HINT)
    return config


def load_image(path: Path | None = None) -> Config:
    """The image's configuration: its appliance.json as the same frozen model (no per-host settings)."""
    path = path or device_path()
    try:
        data = json.loads(path.read_text(), parse_constant=no_constant)
    except FileNotFoundError:
        raise ConfigError(
            f"{path}: no appliance configuration",
            hint="this command runs on the appliance; set APPLIANCE_CONFIG to test elsewhere",
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})", hint=DEVICE_HINT) from None
    return from_json(data, path)
