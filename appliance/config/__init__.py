"""The configuration model and its loaders, in one import.

appliance.toml is parsed into frozen dataclasses (`model`, each value checked by `checks`) by the
one schema loader: unknown keys, wrong types and bad values are each one line naming the file, the
key and the value, and a hint. Everything the build produces is derived from `Config`. Loaders:
appliance.toml with its profiles at build (`profiles`), the image's appliance.json on the device
(`device`); the device's configuration with this host's settings laid over it is
`appliance.host_settings.load_device`, outside this package (it needs the Caddyfile's checks,
which need this model).
"""

from __future__ import annotations

from appliance.config.device import from_json, load_image
from appliance.config.model import PROFILES, Config
from appliance.config.profiles import load, problems, with_version

__all__ = ["PROFILES", "Config", "from_json", "load", "load_image", "problems", "with_version"]
