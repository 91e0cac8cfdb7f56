# SPDX-License-Identifier: MIT
"""Each setting is described once, on its field of the configuration model: docs/configuration.md's
reference and docs/appliance.example.toml are generated from it, and the example loads through the
real loader with every value it shows."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest

from appliance import config, schema
from appliance.config import checks, reference
from appliance.config.model import Config
from appliance.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "run: python3 -m appliance.config.reference --write"
COMMENTED_KEY = re.compile(r"^#([A-Za-z_][A-Za-z0-9_]* = )", re.M)


def model_keys(cls: type = Config, prefix: str = "") -> set[str]:
    """Every key of the model, walked here on its own (not through the generator)."""
    keys = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in reference.GIVEN:
            continue
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        inner = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else None
        if dataclasses.is_dataclass(tp):
            keys |= model_keys(typing.cast(type, tp), key + ".")
        else:
            keys.add(key)
            if inner is not None and dataclasses.is_dataclass(inner):
                keys |= model_keys(typing.cast(type, inner), key + ".")
    return keys


def value_at(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for name in key.split("."):
        value = getattr(value, name)
    return value


def test_every_setting_and_table_has_a_description() -> None:
    found = {s.key: s.doc for s in reference.settings()} | {t.key: t.doc for t in reference.tables()}
    assert set(found) >= model_keys()  # the generator walks every key of the model
    missing = sorted(key for key, doc in found.items() if not doc.endswith("."))
    assert missing == [], "describe these in appliance/config/model.py (_doc): " + ", ".join(missing)


def test_every_required_setting_has_an_example() -> None:
    # the example file sets it: without one it would not load
    assert [s.key for s in reference.settings() if s.required and "example" not in s.field.metadata
            and not s.key.startswith(("engine.overlays.", "engine.tuning.", "update.maintenance_windows."))] == []


def test_every_check_says_what_it_takes() -> None:
    values = {s.key: s.values() for s in reference.settings()}
    assert values["os.device_timeout_sec"] == "a number from 10 to 3600"
    assert values["engine.ipc"] == "one of 'host', 'private'"
    assert values["gpu.min_vram_headroom_mib"] == "a number from 1 to 2147483647"
    assert values["os.ssh_authorized_keys"] == "a list, each " + checks.SSH_KEY_HINT
    assert values["engine.env"].startswith("names: a name of letters")


def test_a_check_that_takes_the_probe_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot say what it takes"):
        reference.Setting("x.y", dataclasses.field(metadata=schema.check(lambda v: None)), str).values()


def test_every_per_host_key_is_a_setting() -> None:
    assert {s.key for s in reference.settings()} >= reference.PER_HOST
    doc = {s.key: s.doc for s in reference.settings()}
    assert doc["proxy.allowed_cidrs"].endswith(reference.PER_HOST_NOTE)
    assert not doc["proxy.https_port"].endswith(reference.PER_HOST_NOTE)


def test_configuration_md_holds_the_generated_reference() -> None:
    path = ROOT / reference.DOC
    current = path.read_text()
    assert current == reference.document(current), REGENERATE
    assert "| `device_timeout_sec` | `90` | a number from 10 to 3600 |" in current


def test_the_example_configuration_is_generated() -> None:
    assert (ROOT / reference.EXAMPLE).read_text() == reference.example_toml(), REGENERATE


def test_a_reference_without_its_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="markers"):
        reference.document("# Configuration\n\nno markers here\n")


def test_the_example_loads_with_every_default() -> None:
    cfg = config.load(ROOT / reference.EXAMPLE, "production")
    keys = {s.key for s in reference.settings()}
    for setting in reference.settings():
        if setting.key.rsplit(".", 1)[0] in keys:
            continue  # a key of a list's table: the list itself is compared
        want = setting.example if setting.required else setting.default
        assert schema.plain(value_at(cfg, setting.key)) == schema.plain(want), setting.key


def test_the_example_uncommented_loads_with_every_value_it_shows(tmp_path: Path) -> None:
    text = (ROOT / reference.EXAMPLE).read_text()
    path = tmp_path / "appliance.toml"
    path.write_text(COMMENTED_KEY.sub(r"\1", text))
    assert len(COMMENTED_KEY.findall(text)) > 50
    cfg = config.load(path, "production")
    keys = {s.key for s in reference.settings()}
    for setting in reference.settings():
        if setting.key.rsplit(".", 1)[0] in keys:
            continue  # a key of a list's table: the list itself is compared
        assert schema.plain(value_at(cfg, setting.key)) == schema.plain(setting.example), setting.key


def test_an_example_the_loader_refuses_is_caught(tmp_path: Path) -> None:
    # the check above is the real loader's: a value it refuses fails the load
    path = tmp_path / "appliance.toml"
    path.write_text(reference.example_toml().replace('name = "dsv4-flash"', 'name = "Not A DNS Name"'))
    with pytest.raises(ConfigError, match=r"appliance\.name"):
        config.load(path, "production")


def test_the_command_prints_what_is_generated(capsys: pytest.CaptureFixture[str]) -> None:
    assert reference.main(["--toml"]) == 0
    assert capsys.readouterr().out == reference.example_toml()
    assert reference.main(["--markdown"]) == 0
    assert capsys.readouterr().out == reference.markdown()


def test_toml_values_are_written_as_toml_reads_them() -> None:
    import tomllib

    values = {"s": 'a "quoted" \\ value', "f": 0.0625, "i": 8, "b": False, "l": ["x", 1], "t": {"k": "v"}}
    text = "\n".join(f"{k} = {reference.toml_value(v)}" for k, v in values.items())
    assert tomllib.loads(text) == values
