# SPDX-License-Identifier: MIT
"""The configuration model: the real appliance.toml, and every kind of bad input refused in one line."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from appliance import config, host_settings
from appliance.errors import ConfigError, UserError

ROOT = Path(__file__).resolve().parents[1]
APPLIANCE_TOML = ROOT / "appliance.toml"
REFERENCE = ROOT / "docs" / "reference-stack.md"


def test_production_profile_carries_the_reference_stack() -> None:
    c = config.load(APPLIANCE_TOML, "production")
    reference = REFERENCE.read_text()
    assert c.model.id == "deepseek-ai/DeepSeek-V4-Flash-0731"
    assert c.model.revision == "7872f01b1d1fe23eabc4c98b48bffcef5a386062"
    assert f"`{c.engine.reference}`" in reference
    assert c.model.snapshot_path in reference
    # Every argument, in the reference's order.
    args_text = reference.split("Arguments, in order:")[1].split("- Health check")[0]
    quoted = re.findall(r"`([^`]*)`", args_text)
    reference_args = " ".join(quoted[1:]).split()  # quoted[0] is the model path
    assert quoted[0] == c.model.snapshot_path
    assert list(c.engine.args) == reference_args
    for name, value in c.engine.env.items():
        assert f"`{name}={value}`" in reference
    for pinned in (*c.engine.overlays, *c.engine.tuning):
        assert pinned.sha256 in reference
        assert Path(pinned.file).name in reference
        assert pinned.target.removeprefix("/usr/local/lib/python3.12/dist-packages/") in reference
    assert c.engine.capabilities == ("SYS_PTRACE", "IPC_LOCK")
    assert c.engine.devices == ("/dev/kfd", "/dev/dri")
    assert c.engine.offload_gib == 96.0
    assert c.engine.stop_timeout_s == 120
    assert (c.engine.health.interval_s, c.engine.health.timeout_s, c.engine.health.retries) == (30, 5, 5)
    assert c.expected.kv_cache_tokens == 1927444 and c.expected.model_memory_gib == 156.67
    assert set(c.proxy.allowed_paths) == {
        "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/generate"
    }
    assert c.gpu.required


def test_demo_profile_overrides_only_what_it_names() -> None:
    prod = config.load(APPLIANCE_TOML, "production")
    demo = config.load(APPLIANCE_TOML, "demo")
    assert not demo.gpu.required
    assert demo.engine.image != prod.engine.image
    assert demo.proxy.tls == "internal"
    # untouched settings are inherited; the demo waits longer for an emulated disk
    assert (demo.os.device_timeout_sec, prod.os.device_timeout_sec) == (600, 90)
    assert dataclasses.replace(demo.os, device_timeout_sec=90) == prod.os
    assert demo.engine.stop_timeout_s == prod.engine.stop_timeout_s
    assert demo.engine.health.timeout_s == prod.engine.health.timeout_s


def _with(tmp_path: Path, old: str, new: str) -> Path:
    text = APPLIANCE_TOML.read_text()
    assert old in text, old
    path = tmp_path / "appliance.toml"
    path.write_text(text.replace(old, new, 1))
    return path


BAD = [
    ('digest = "sha256:e68d', 'digest = "sha256:E68d', "engine.digest"),
    ('digest = "sha256:e68d18b2ba50298661bfc49baf01158fbf036645c2362cccf3e8a7a79fe6c69a"', 'digest = "sha256:abc"', "engine.digest"),
    ('revision = "7872f01b1d1fe23eabc4c98b48bffcef5a386062"', 'revision = "7872f01b"', "model.revision"),
    ('allowed_cidrs = ["192.0.2.0/24"]', 'allowed_cidrs = ["192.0.2.1/24"]', "proxy.allowed_cidrs[0]"),
    ('allowed_cidrs = ["192.0.2.0/24"]', 'allowed_cidrs = ["10.0.0.0/33"]', "proxy.allowed_cidrs[0]"),
    ('hostname = "dsv4.example.net"', 'hostname = "dsv4_example.net"', "proxy.hostname"),
    ('hostname = "dsv4.example.net"', 'hostname = "a.example.net { }"', "proxy.hostname"),
    ('acme_email = "ops@example.net"', 'acme_email = "ops@example.net}\\nimport x"', "proxy.acme_email"),
    ('port = 8000', 'port = "8000"', "engine.port"),
    ('port = 8000', 'port = 70000', "engine.port"),
    ('init = true', 'init = "yes"', "engine.init"),
    ('[engine.health]', '[engine.health]\nbogus = 1', "unknown key 'engine.health.bogus'"),
    ('[appliance]', '[appliance]\ncolour = "red"', "unknown key 'appliance.colour'"),
    ('target = "/opt/aiter-configs/dsv4', 'target = "../opt/aiter-configs/dsv4', "engine.tuning[0].target"),
    ('target = "/opt/aiter-configs/dsv4', 'target = "/opt/../etc/dsv4', "engine.tuning[0].target"),
    ('VLLM_ROCM_USE_AITER = "1"', 'VLLM_ROCM_USE_AITER = "1\\nExecStartPre=/bin/evil"', "engine.env.VLLM_ROCM_USE_AITER"),
    ('"--trust-remote-code",', '"--trust-remote-code; rm -rf /",', "engine.args"),
    ('version = "1.0.0"', 'version = "one"', "appliance.version"),
    ('allowed_paths = ["/v1/chat/completions"', 'allowed_paths = ["/v1/chat completions"', "proxy.allowed_paths[0]"),
    # ':' would split a Volume= into other fields; a huge number, inf and a bool do not render
    ('target = "/opt/aiter-configs/dsv4', 'target = "/opt/aiter:configs/dsv4', "engine.tuning[0].target"),
    ("margin_gib = 8\n", "margin_gib = inf\n", "engine.shm.margin_gib"),
    ("stop_timeout_s = 120", "stop_timeout_s = 100000000000000000000", "engine.stop_timeout_s"),
    ('port = 8000', 'port = true', "engine.port"),
    ('timer_action = "install"', 'timer_action = "apply"', "update.timer_action"),
    ('timer_action = "install"', 'timer_action = "install"\nmaintenance_windows = [{start = "24:00", duration_min = 60}]',
     "update.maintenance_windows[0].start"),
    ('timer_action = "install"', 'timer_action = "install"\nmaintenance_windows = [{start = "22:00", duration_min = 2000}]',
     "update.maintenance_windows[0].duration_min"),
    ('timer_action = "install"',
     'timer_action = "install"\nmaintenance_windows = [{start = "22:00", duration_min = 60, days = ["fri", "someday"]}]',
     "update.maintenance_windows[0].days[1]"),
]


def test_maintenance_windows_reach_the_device_as_written(tmp_path: Path) -> None:
    from appliance.config.device import from_json

    path = _with(tmp_path, 'timer_action = "install"',
                 'timer_action = "install"\nmaintenance_windows = [{start = "22:00", duration_min = 240, days = ["sat"]}]')
    loaded = config.load(path, "production")
    (window,) = loaded.update.maintenance_windows
    assert (window.start, window.duration_min, window.days, window.start_min) == ("22:00", 240, ("sat",), 22 * 60)
    assert from_json(loaded.to_json(), tmp_path / "appliance.json").update == loaded.update


@pytest.mark.parametrize(("new", "message", "hint"), [
    ('[appliance]\nverison = "1.1.0"', "unknown key 'appliance.verison' = '1.1.0'",
     "did you mean appliance.version? known keys here: name, version, min_version"),
    ('[appliance]\ncolour = ["red", "green"]', "unknown key 'appliance.colour' = [...]", "known keys here: name, version, min_version"),
    ('[appliance]\ncolour = "' + "r" * 200 + '"', "unknown key 'appliance.colour' = '" + "r" * 56 + "...",
     "known keys here: name, version, min_version"),
    ('[engine.health]\nintervall_s = 5', "unknown key 'engine.health.intervall_s' = 5",
     "did you mean engine.health.interval_s? known keys here: "),
])
def test_an_unknown_key_is_named_with_its_value_and_the_keys_of_its_table(tmp_path: Path, new: str, message: str, hint: str) -> None:
    path = _with(tmp_path, "[engine.health]" if new.startswith("[engine.health]") else "[appliance]", new)
    with pytest.raises(ConfigError) as err:
        config.load(path, "production")
    assert err.value.message == f"{path}: {message}"
    assert err.value.hint.startswith(hint) and "\n" not in err.value.hint


@pytest.mark.parametrize(("old", "new", "key"), BAD)
def test_bad_value_is_one_line_naming_file_key_and_value(tmp_path: Path, old: str, new: str, key: str) -> None:
    path = _with(tmp_path, old, new)
    with pytest.raises(ConfigError) as err:
        config.load(path, "production")
    assert str(path) in err.value.message
    assert key in err.value.message
    assert "\n" not in err.value.message.replace("\\n", "")
    assert err.value.hint


def test_demo_profile_errors_are_checked_too(tmp_path: Path) -> None:
    path = _with(tmp_path, 'allowed_cidrs = ["127.0.0.0/8", "10.0.2.0/24"]', 'allowed_cidrs = ["not-a-net"]')
    config.load(path, "production")  # the production profile does not use that value
    with pytest.raises(ConfigError, match=r"proxy\.allowed_cidrs\[0\]"):
        config.load(path, "demo")


def test_acme_needs_an_email(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="acme_email"):
        config.load(_with(tmp_path, 'acme_email = "ops@example.net"', 'acme_email = ""'), "production")


def test_to_json_round_trips_through_json() -> None:
    import json

    data = json.loads(json.dumps(config.load(APPLIANCE_TOML, "demo").to_json()))
    assert data["engine"]["reference"].startswith("localhost/appliance-standin-engine@sha256:")
    assert data["engine"]["offload_gib"] == 0.0625
    assert data["profile"] == "demo"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "builder", *args], cwd=ROOT, capture_output=True, text=True)


def test_validate_command_ok() -> None:
    result = _cli("--profile", "demo", "validate")
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stdout


def test_validate_reports_every_problem_a_build_would_refuse() -> None:
    """The production profile needs operator-supplied overlays and tables that the repository does
    not carry: the build refuses at once, so validate must say so, every one of them in one run."""
    from builder import pins, validate

    production = config.load(APPLIANCE_TOML, "production")
    expected = validate.problems(production, ROOT)
    if not expected:
        pytest.skip("the operator's files are present: production validates")
    assert [e.message for e in expected][: len(pins.problems(production, ROOT))] == [e.message for e in pins.problems(production, ROOT)]
    result = _cli("--profile", "production", "validate")
    assert result.returncode == 2 and "is valid" not in result.stdout
    lines = result.stderr.strip().split("\n")
    assert lines[:-1] == [f"error: {e.message}" for e in expected]
    assert lines[-1].startswith("hint: ") and "Traceback" not in result.stderr


def test_validate_command_bad_input_exit_2_two_lines_no_traceback(tmp_path: Path) -> None:
    path = _with(tmp_path, 'revision = "7872f01b1d1fe23eabc4c98b48bffcef5a386062"', 'revision = "main"')
    result = _cli("--config", str(path), "validate")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("error: ") and "model.revision" in lines[0] and "'main'" in lines[0]
    assert lines[1].startswith("hint: ")
    assert "Traceback" not in result.stderr


def test_validate_debug_shows_traceback(tmp_path: Path) -> None:
    path = _with(tmp_path, 'revision = "7872f01b1d1fe23eabc4c98b48bffcef5a386062"', 'revision = "main"')
    result = _cli("--debug", "--config", str(path), "validate")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_broken_toml_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "appliance.toml"
    path.write_text("[engine\n")
    result = _cli("--config", str(path), "validate")
    assert result.returncode == 2 and "not valid TOML" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- numbers, strictly


def _demo_json() -> dict[str, object]:
    return config.load(APPLIANCE_TOML, "demo").to_json()


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("shm", "margin_gib", float("inf")),  # rendered /dev/shm size: OverflowError before
        ("shm", "margin_gib", 1e308),  # likewise, once multiplied by 1024
        ("shm", "margin_gib", float("nan")),
        ("health", "interval_s", True),  # bool is not an int
        ("health", "interval_s", 10**30),  # would render a number podman cannot take
        ("health", "retries", 1.5),
    ],
)
def test_numbers_outside_what_renders_are_refused_in_one_line(section: str, key: str, value: object) -> None:
    data = _demo_json()
    engine = dict(data["engine"])  # type: ignore[call-overload]
    engine[section] = {**engine[section], key: value}
    with pytest.raises(ConfigError) as e:
        config.from_json({**data, "engine": engine}, Path("appliance.json"))
    assert f"engine.{section}.{key}" in e.value.message and "\n" not in e.value.message


@pytest.mark.parametrize("size", ["inf", "nan", "1e3", "\u0661\u0662", "-1", "99999999999"])
def test_offload_size_is_ascii_decimal(size: str) -> None:
    data = _demo_json()
    engine = dict(data["engine"])  # type: ignore[call-overload]
    args = [a for a in engine["args"] if not a.startswith("--kv-offloading-size")]
    if "--kv-offloading-size" in engine["args"]:
        i = engine["args"].index("--kv-offloading-size")
        args = [*engine["args"][:i], *engine["args"][i + 2 :]]
    engine["args"] = [*args, "--kv-offloading-size", size]
    engine.pop("offload_gib")
    with pytest.raises(ConfigError, match="kv-offloading-size"):
        config.from_json({**data, "engine": engine}, Path("appliance.json"))


def test_any_number_either_renders_or_is_refused() -> None:
    """Every value the loader accepts renders every unit template; nothing else escapes as a traceback."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from builder import engine_store, render

    data = _demo_json()
    numbers = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans())
    fields = [("health", "interval_s"), ("health", "timeout_s"), ("health", "retries"), ("health", "start_period_s"), ("shm", "margin_gib")]

    @settings(max_examples=200, deadline=None)
    @given(st.sampled_from(fields), numbers)
    def check(where: tuple[str, str], value: object) -> None:
        engine = dict(data["engine"])  # type: ignore[call-overload]
        engine[where[0]] = {**engine[where[0]], where[1]: value}
        try:
            c = config.from_json({**data, "engine": engine}, Path("appliance.json"))
        except ConfigError:
            return
        store = engine_store.EngineStore(Path("x"), Path("y"), "0" * 64, engine_store.label_for(c.engine.digest))
        for name in ("appliance-engine@.container.j2", "appliance-shm-clean.service.j2"):
            render.render_template(name, c, store)

    check()


def test_device_loads_the_image_json_as_the_same_model(tmp_path: Path) -> None:
    import json

    for profile in config.PROFILES:
        c = config.load(APPLIANCE_TOML, profile)
        path = tmp_path / f"{profile}.json"
        path.write_text(json.dumps(c.to_json()))
        assert host_settings.load_device(path) == c
        tampered = c.to_json()
        tampered["engine"]["served_model_name"] = "other"
        tampered["engine"]["surprise"] = 1
        with pytest.raises(ConfigError, match=r"unknown key .engine\.surprise."):
            config.from_json(tampered, path)
        del tampered["engine"]["surprise"]
        with pytest.raises(ConfigError, match="served_model_name"):
            config.from_json(tampered, path)


def test_validate_reports_every_configuration_fault_in_one_run(tmp_path: Path) -> None:
    path = _with(tmp_path, 'revision = "7872f01b1d1fe23eabc4c98b48bffcef5a386062"', 'revision = "main"')
    text = path.read_text().replace("\nmargin_gib = 8\n", "\nmargin_gib = inf\n", 1)
    text = text.replace("\nhttps_port = 443\n", "\nhttps_port = true\n", 1)
    path.write_text(text)
    result = _cli("--config", str(path), "validate")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().split("\n")
    assert len(lines) == 4, result.stderr
    assert "model.revision = 'main'" in lines[0]
    assert "engine.shm.margin_gib = inf" in lines[1]
    assert "proxy.https_port = True" in lines[2]
    assert lines[3].startswith("hint: 3 problems")


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ('VLLM_ROCM_USE_AITER = "1"', 'VLLM_ROCM_USE_AITER = "1\\" X=\\"2"', "engine.env.VLLM_ROCM_USE_AITER"),
        ('VLLM_ROCM_USE_AITER = "1"', 'VLLM_ROCM_USE_AITER = "$HOME"', "engine.env.VLLM_ROCM_USE_AITER"),
        ('"--kv-offloading-size", "96"', '"--kv-offloading-size", "1e999"', "kv-offloading-size"),
    ],
)
def test_hostile_values_are_refused_by_validate_in_one_line(tmp_path: Path, old: str, new: str, key: str) -> None:
    result = _cli("--config", str(_with(tmp_path, old, new)), "validate")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().split("\n")
    assert len(lines) == 2 and key in lines[0] and lines[1].startswith("hint: ")


def test_validate_lists_pin_and_table_problems_together(tmp_path: Path) -> None:
    """A project where an overlay is missing AND a (pinned) tuning table is malformed: one run
    names both, each as the build would refuse it."""
    import shutil

    from builder import pins, tuning, validate

    root = tmp_path / "project"
    for top in ("overlays", "tuning", "firmware"):
        shutil.copytree(ROOT / top, root / top, symlinks=True)
    shutil.copyfile(APPLIANCE_TOML, root / "appliance.toml")
    demo = config.load(APPLIANCE_TOML, "demo")
    (table,) = demo.engine.tuning
    (overlay,) = demo.engine.overlays
    (root / table.file).write_text("not,a,tuning,table\n1,2,3\n")
    pins.write_sums(root)  # the broken table is pinned: only its format is wrong
    (root / overlay.file).unlink()
    found = [e.message for e in validate.problems(demo, root)]
    assert any(m.startswith(f"{overlay.file}: missing") for m in found), found
    with pytest.raises(UserError) as table_error:
        tuning.validate(root / table.file, table.file)
    assert table_error.value.message in found
    with pytest.raises(UserError) as first:
        pins.check(demo, root)  # the build stops at the first
    assert first.value.message == found[0]
