# SPDX-License-Identifier: MIT
"""The configuration model (`model`, values checked by `checks`) and its loaders, in one import:
appliance.toml with its profiles at build (`profiles`), the image's appliance.json on the device
(`device`). This host's settings laid over it is `appliance.host_settings.load_device`, outside
this package because it needs the Caddyfile's checks, which need this model.
"""

from __future__ import annotations

from appliance.config.device import from_json, load_image
from appliance.config.model import PROFILES, Config
from appliance.config.profiles import load, problems, with_version

__all__ = ["PROFILES", "Config", "from_json", "load", "load_image", "problems", "with_version"]
