"""The device's view of appliance.toml: the JSON the builder derives from it.

The builder writes `Config.to_json()` to /usr/lib/appliance/appliance.json (read-only, verity
protected). APPLIANCE_CONFIG points elsewhere, for tests.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from appliance.errors import UserError

DEFAULT_PATH = Path("/usr/lib/appliance/appliance.json")


def config_path() -> Path:
    return Path(os.environ.get("APPLIANCE_CONFIG", str(DEFAULT_PATH)))


def load() -> dict[str, Any]:
    path = config_path()
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(
            f"{path}: no appliance configuration",
            hint="this command runs on the appliance; set APPLIANCE_CONFIG to test elsewhere",
        ) from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})", hint="the image is damaged; reinstall or roll back") from None
    return data
