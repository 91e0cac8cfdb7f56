# SPDX-License-Identifier: MIT
"""`python3 -m builder validate`: every problem a build would refuse, one line each, before anything is written.

Each check is the build's own (pins.problems, tuning.problems, the templates as the build renders them),
run to the end so that one run lists every problem.
"""

from __future__ import annotations

import sys
from pathlib import Path

import appliance.config
from appliance.config import Config
from appliance.errors import UserError
from builder import pins, tuning, weights


def problems(config: Config, root: Path) -> list[UserError]:
    found = pins.problems(config, root)
    broken = {e.message.split(":", 1)[0] for e in found}
    tables = [(f.file, root / f.file) for f in config.engine.tuning if f.file not in broken and (root / f.file).is_file()]
    found += tuning.problems(tables)
    found += _render_problems(config)
    found += weights.problems(config, root)
    found += _slot_problems(config)
    return found


def _slot_problems(config: Config) -> list[UserError]:
    """The engine store must fit engine.slot_size_gib; known only when this host built it already."""
    from builder import engine_store

    store = engine_store.built(config)
    if store is None:
        return []
    try:
        engine_store.check_fits(store, config)
    except UserError as e:
        return [e]
    return []


def _render_problems(config: Config) -> list[UserError]:
    """Render every template as the build does (with a placeholder root hash)."""
    from builder import engine_store, proxy, render

    store = engine_store.EngineStore(Path("engine.erofs"), Path("engine.verity"), "0" * 64, engine_store.label_for(config.engine.digest))
    found: list[UserError] = []
    for template in sorted(p.name for p in render.UNITS_DIR.glob("*.j2")):
        try:
            if template == proxy.TEMPLATE:
                proxy.render_caddyfile(config)
            else:
                render.render_template(template, config, store)
        except UserError as e:
            found.append(e)
    return found


def run(config_path: Path, profile: str, root: Path, debug: bool = False) -> int:
    """Print every fault with one hint and return 2, or one line saying the profile is valid and return 0."""
    config, found = appliance.config.problems(config_path, profile)
    if config is not None:
        found += problems(config, root)
    if not found:
        assert config is not None
        print(f"{config_path}: profile {config.profile} is valid (engine {config.engine.reference})")
        return 0
    if debug:
        raise found[0]  # --debug: the first problem with its traceback
    for e in found:
        print(f"error: {e.message}", file=sys.stderr)
    hints = list(dict.fromkeys(e.hint for e in found if e.hint)) or ["fix each line above"]
    first = hints[0] if len(found) == 1 else f"{len(found)} problems, each on its own line above; for the first: {hints[0]}"
    print(f"hint: {first}", file=sys.stderr)
    return 2
