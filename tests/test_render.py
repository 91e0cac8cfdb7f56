# SPDX-License-Identifier: MIT
"""The generated units: the production engine quadlet line by line against the compose stack,
every unit's sandbox exposure, and the generated tree."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance import config
from appliance.errors import ConfigError
from builder import engine_store, render

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = (ROOT / "docs" / "reference-stack.md").read_text()


def _store(c: config.Config) -> engine_store.EngineStore:
    return engine_store.EngineStore(Path("/x"), Path("/y"), "ab" * 32, engine_store.label_for(c.engine.digest))


@pytest.fixture(scope="module")
def production() -> config.Config:
    return config.load(ROOT / "appliance.toml", "production")


def systemd_words(value: str) -> list[str]:
    """VALUE split as systemd splits Environment= and command lines (extract_first_word with
    EXTRACT_UNQUOTE|EXTRACT_CUNESCAPE), then its specifiers resolved: `%%` is a literal `%`;
    any other specifier is left as <%x>, which no configured value may produce."""
    words: list[str] = []
    i, n = 0, len(value)
    while i < n:
        while i < n and value[i] in " \t":
            i += 1
        if i >= n:
            break
        word, quote, started = "", "", False
        while i < n:
            c = value[i]
            if quote:
                if c == quote:
                    quote = ""
                elif c == "\\" and i + 1 < n:
                    i += 1
                    word += {"n": "\n", "t": "\t"}.get(value[i], value[i])
                else:
                    word += c
            elif c in "\"'":
                quote, started = c, True
            elif c in " \t":
                break
            elif c == "\\" and i + 1 < n:
                i += 1
                word += value[i]
            else:
                word += c
            started = True
            i += 1
        assert not quote, f"unterminated quote in {value!r}"
        if started:
            words.append(re.sub(r"%(.)", lambda m: "%" if m[1] == "%" else f"<%{m[1]}>", word))
    return words


def parse_unit(text: str) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in text.split("\n"):  # systemd splits lines on LF only
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            keys.setdefault(key, []).append(value)
    return keys


def replica_unit(c: config.Config, i: int = 0) -> str:
    """Replica I's quadlet as quadlet reads it: the template, then the replica's drop-in."""
    return render.render_template("appliance-engine@.container.j2", c, _store(c)) + render.replica_dropin(c, i)


@pytest.fixture(scope="module")
def quadlet(production: config.Config) -> dict[str, list[str]]:
    return parse_unit(replica_unit(production))


def environment(quadlet: dict[str, list[str]]) -> dict[str, str]:
    """The engine's environment as systemd (and quadlet, which follows its rules) reads it."""
    env: dict[str, str] = {}
    for line in quadlet["Environment"]:
        for word in systemd_words(line):
            name, _, value = word.partition("=")
            env[name] = value
    return env


def test_engine_runs_the_pinned_image_by_digest_never_pulled(quadlet: dict[str, list[str]]) -> None:
    image = re.search(r"`(vllm/vllm-openai-rocm@sha256:[0-9a-f]{64})`", REFERENCE)
    assert image and quadlet["Image"] == [image.group(1)]
    assert quadlet["Pull"] == ["never"]


def test_engine_arguments_are_the_reference_in_order(quadlet: dict[str, list[str]], production: config.Config) -> None:
    (exec_line,) = quadlet["Exec"]
    words = systemd_words(exec_line)
    assert words[:2] == ["serve", production.model.snapshot_path]
    quoted = re.findall(r"`([^`]*)`", REFERENCE.split("Arguments, in order:")[1].split("- Health check")[0])
    assert words[2:] == " ".join(quoted[1:]).split()
    assert quadlet["Entrypoint"] == ['["vllm"]']


def test_engine_container_has_everything_the_compose_service_had(quadlet: dict[str, list[str]]) -> None:
    assert quadlet["RunInit"] == ["true"]
    assert "--ipc=host" in quadlet["PodmanArgs"]
    assert quadlet["AddDevice"] == ["/dev/kfd", "/dev/dri"]
    assert quadlet["AddCapability"] == ["SYS_PTRACE IPC_LOCK"]
    assert quadlet["Ulimit"] == ["memlock=-1:-1"]
    assert quadlet["SeccompProfile"] == ["unconfined"]
    assert quadlet["SecurityLabelDisable"] == ["true"]
    assert quadlet["StopTimeout"] == ["120"]
    engine_env = environment(quadlet)
    for env in re.findall(r"`([A-Z_]+=[^`]+)`", REFERENCE.split("- Environment:")[1].split("- Mounts:")[0]):
        name, _, value = env.partition("=")
        assert engine_env[name] == value  # exactly: HSA_COREDUMP_PATTERN keeps its literal %p
    # health check timings: every 30 s, 5 s timeout, 5 retries; the reference command, bounded
    # by curl itself so that a hung engine fails its checks instead of stalling them
    assert quadlet["HealthCmd"] == ["curl -fsS --max-time 5 http://127.0.0.1:8000/health"]
    assert (quadlet["HealthInterval"], quadlet["HealthTimeout"], quadlet["HealthRetries"]) == (["30s"], ["5s"], ["5"])
    # readiness only: liveness is the progress judge's (a slow /health never kills a busy replica)
    assert quadlet["HealthOnFailure"] == ["none"] and quadlet["Notify"] == ["healthy"]
    # the start period (20 min, not 6) is a startup check bounded by systemd, not podman's
    # HealthStartPeriod, which would ignore a hang for the whole period after a healthy start
    assert "HealthStartPeriod" not in quadlet
    # the startup check is a warm-up request: a one-token completion of the runbook's prompt, from
    # a file of the signed image mounted into the container, each try bounded by curl
    assert quadlet["HealthStartupCmd"] == [
        f"curl -fsS --max-time {render.WARMUP_TIMEOUT_S} -o /dev/null -H Content-Type:application/json "
        f"--data-binary @{render.WARMUP.target} http://127.0.0.1:8000/v1/completions"]
    assert f"{render.WARMUP.source}:{render.WARMUP.target}:ro" in quadlet["Volume"]
    assert quadlet["HealthStartupTimeout"] == [f"{render.WARMUP_TIMEOUT_S}s"]
    assert quadlet["TimeoutStartSec"] == ["1200"]


def test_the_warm_up_body_is_the_smoke_prompt_for_the_served_model(production: config.Config) -> None:
    body = json.loads(render.warmup_body(production))
    assert body == {"model": "deepseek-ai/DeepSeek-V4-Flash-0731", "prompt": "Calculate 17 * 23. Answer with the number only.",
                    "max_tokens": 1, "temperature": 0}


def test_engine_mounts(quadlet: dict[str, list[str]], production: config.Config) -> None:
    volumes = quadlet["Volume"]
    assert f"{production.model.cache_dir}:/root/.cache/huggingface:ro" in volumes
    assert any(v.endswith(":/root/.aiter") for v in volumes)
    assert any(v.endswith(":/var/crash/vllm") for v in volumes)
    for pinned in (*production.engine.overlays, *production.engine.tuning):
        assert any(v.endswith(f":{pinned.target}:ro") for v in volumes), pinned.target
    # and the warm-up request's body (test_engine_container_has_everything_the_compose_service_had)
    assert len(volumes) == 3 + len(production.engine.overlays) + len(production.engine.tuning) + 1


def test_engine_port_only_on_loopback(quadlet: dict[str, list[str]]) -> None:
    assert quadlet["PublishPort"] == ["127.0.0.1:8000:8000"]


@pytest.mark.programs
@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_every_service_is_sandboxed(tmp_path: Path, production: config.Config) -> None:
    render.render_units(production, tmp_path, _store(production))
    # The services that must act on the host itself: the boot check (tests only) and the
    # updater (writes partitions and the ESP). The engine store must mount in the host's
    # namespace (4.0); every other service is held to 3.0.
    exempt = {"appliance-bootcheck.service", "appliance-update.service"}
    for unit in sorted((tmp_path / "usr/lib/systemd/system").glob("*.service")):
        out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)],
                             capture_output=True, text=True).stdout
        exposure = float(re.findall(r"Overall exposure level for \S+: ([0-9.]+)", out)[0])
        if unit.name not in exempt:
            assert exposure <= (4.0 if unit.name == "appliance-engine-store.service" else 3.0), (unit.name, exposure)


# ----------------------------------------------------------------------------- values reach units exactly


def _with_engine(c: config.Config, **changes: object) -> config.Config:
    import dataclasses

    return dataclasses.replace(c, engine=dataclasses.replace(c.engine, **changes))


@pytest.mark.programs
def test_environment_values_with_percent_and_spaces_round_trip(production: config.Config, tmp_path: Path) -> None:
    env = {"HSA_COREDUMP_PATTERN": "/var/crash/vllm/gpucore.%p", "SPACED": "b  c", "PCT": "100%", "EMPTY": "", "LEAD": " x"}
    c = _with_engine(production, env=env, args=(*production.engine.args, "--note", "a b %h"))
    text = render.render_template("appliance-engine@.container.j2", c, _store(c))
    unit = parse_unit(text)
    # the engine always runs offline on the verified snapshot (the engine never fetches weights itself), whatever engine.env says
    # and every engine with PYTHONHASHSEED=0 (so every replica hashes prompt prefix blocks alike)
    # APPLIANCE_REPLICA=%i: the specifier reaches systemd as one, not escaped as the configured "%" are
    assert environment(unit) == {**env, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                 "APPLIANCE_REPLICA": "<%i>"}
    assert systemd_words(unit["Exec"][0])[-2:] == ["--note", "a b %h"]
    # systemd itself accepts every line as written (quadlet parses these settings by its rules)
    if shutil.which("systemd-analyze"):
        service = tmp_path / "roundtrip.service"
        lines = "\n".join(f"Environment={v}" for v in unit["Environment"])
        service.write_text(f"[Service]\nType=oneshot\n{lines}\nExecStart=/bin/true {unit['Exec'][0]}\n")
        done = subprocess.run(["systemd-analyze", "verify", str(service)], capture_output=True, text=True, check=False)
        assert "roundtrip.service" not in done.stderr, done.stderr


def test_any_accepted_environment_value_renders_exactly(production: config.Config) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    data = production.to_json()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20))
    def check(value: str) -> None:
        trial = {**data, "engine": {**data["engine"], "env": {"X": value}}}
        try:
            c = config.from_json(trial, Path("appliance.json"))
        except ConfigError:
            return  # refused in one line: fine
        unit = parse_unit(render.render_template("appliance-engine@.container.j2", c, _store(c)))
        assert environment(unit)["X"] == value

    check()


def test_any_accepted_engine_argument_renders_as_one_exact_word(production: config.Config) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    data = production.to_json()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20))
    def check(value: str) -> None:
        trial = {**data, "engine": {**data["engine"], "args": [*data["engine"]["args"], "--note", value]}}
        try:
            c = config.from_json(trial, Path("appliance.json"))
        except ConfigError:
            return
        unit = parse_unit(render.render_template("appliance-engine@.container.j2", c, _store(c)))
        assert systemd_words(unit["Exec"][0])[-2:] == ["--note", value]

    check()


def test_the_image_carries_the_core_and_applianctl_runs_from_it(tmp_path: Path, production: config.Config) -> None:
    """applianctl in the image imports appliance/ (and never builder/) from the image's own tree,
    with Debian's python3 and no project checkout: it loads the build's appliance.json."""
    import json
    import sys

    render.install_applianctl(tmp_path)
    site = tmp_path / "usr/lib/python3/dist-packages"
    assert (site / "appliance" / "config" / "__init__.py").is_file() and not (site / "builder").exists()
    (tmp_path / "appliance.json").write_text(json.dumps(production.to_json()))
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    code = (
        f"import sys; sys.path[:0] = [{str(site)!r}]\n"
        "import appliance.config, appliance.host_settings, applianctl.__main__, applianctl.status.collect, applianctl.update.command\n"
        "assert appliance.config.__file__.startswith(sys.path[0]), appliance.config.__file__\n"
        "assert 'builder' not in sys.modules\n"
        "print(appliance.host_settings.load_device().served_model)\n"
    )
    done = subprocess.run(
        [python, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False,
        env={"APPLIANCE_CONFIG": str(tmp_path / "appliance.json"), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == production.served_model
