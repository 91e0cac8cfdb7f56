"""The configuration as its many readers take it: the model and its loaders, in one import.

appliance.toml is parsed into frozen dataclasses (appliance/config_types.py, each field checked by
appliance/config_checks.py); a single generic loader walks them, so unknown keys, wrong types and
bad values are all reported the same way: one line naming the file, the key and the value, and a
hint. Everything the build produces is derived from `Config`. The loaders: appliance.toml with its
profiles at build (config_toml), the image's appliance.json on the device (config_device), and that
with the host's own settings laid over it (host_settings.load_device).
"""

from __future__ import annotations

from appliance.config_device import from_json, load_image
from appliance.config_toml import load, problems, with_version
from appliance.config_types import PROFILES, Config
from appliance.host_settings import load_device

__all__ = ["PROFILES", "Config", "from_json", "load", "load_device", "load_image", "problems", "with_version"]
