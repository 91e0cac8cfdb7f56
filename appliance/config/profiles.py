# SPDX-License-Identifier: MIT
"""appliance.toml on the build host: the top level is the production profile, [profiles.demo]
overrides it key by key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from appliance.config.model import PROFILES, Config, ConfigLoader, cross_checks
from appliance.errors import ConfigError, UserError
from appliance.patterns import VERSION, VERSION_FORM


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Tables merge key by key; any other value (lists included) is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load(path: Path, profile: str = "production") -> Config:
    """Parse and check PATH for PROFILE; raise ConfigError with a one-line message on any fault."""
    config = _load(path, profile, None)
    assert config is not None
    return config


def problems(path: Path, profile: str = "production") -> tuple[Config | None, list[UserError]]:
    """Every fault of PATH for PROFILE (not only the first), and the configuration when there is none."""
    found: list[UserError] = []
    try:
        config = _load(path, profile, found)
    except ConfigError as e:  # the file itself cannot be read or parsed
        return None, [e]
    return (config if not found else None), found


def _load(path: Path, profile: str, collect: list[UserError] | None) -> Config | None:
    import tomllib  # here: the device never reads TOML

    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}", hint="use --profile production or --profile demo")
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file", hint="run from the project root or pass --config PATH") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}", hint="fix the syntax at the line named") from None
    profiles = raw.pop("profiles", {})
    if not isinstance(profiles, dict) or set(profiles) - set(PROFILES):
        unknown = sorted(set(profiles) - set(PROFILES)) if isinstance(profiles, dict) else profiles
        raise ConfigError(f"{path}: unknown profile(s) {unknown}", hint="profiles.demo is the only profile section")
    if profile != "production":
        raw = _merge(raw, profiles.get(profile, {}))
    config: Config | None = ConfigLoader(path, collect).load(Config, raw, "", profile=profile)
    if config is not None:
        try:
            cross_checks(path, config)
        except ConfigError as e:
            if collect is None:
                raise
            collect.append(e)
            return None
    return config


def with_version(config: Config, version: str) -> Config:
    """CONFIG as release VERSION (`build --version`), checked like appliance.version."""
    if not VERSION.fullmatch(version):
        raise ConfigError(f"--version {version[:40]!r}: invalid", hint=f"expected {VERSION_FORM}, e.g. 1.4.0")
    return dataclasses.replace(config, appliance=dataclasses.replace(config.appliance, version=version))
