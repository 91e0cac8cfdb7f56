# SPDX-License-Identifier: MIT
"""[topology] in appliance.toml: GPUs and the engine layout (replicas x tensor parallel), checked
against each other, the engine's arguments, the ports and /dev/shm at build, and against a host
at boot (`check_host`); every engine runs with PYTHONHASHSEED=0."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from appliance import config
from appliance.config import model
from appliance.errors import ConfigError
from builder import engine_store, render, validate

ROOT = Path(__file__).resolve().parents[1]
APPLIANCE_TOML = ROOT / "appliance.toml"
GIB = 1 << 30

DEFAULT_TOPOLOGY = 'gpus = 1\nlayout = "1x1"\n# The host'
# An eight-GPU server: 8 replicas x TP1, 8 x 96 GiB offload files + 8 GiB margin in /dev/shm,
# on a host with 1.5 TiB of memory (an MI300X platform carries 1.5 to 3 TiB).
EIGHT_GPUS = {DEFAULT_TOPOLOGY: 'gpus = 8\nlayout = "8x1"\n# The host', "memory_gib = 0\n": "memory_gib = 1536\n"}

PORT_ARG = '"--port", "8000",\n  "--served-model-name", "deepseek-ai'  # production's, not the demo's


def _toml(tmp_path: Path, replacements: dict[str, str], extra: str = "") -> Path:
    text = APPLIANCE_TOML.read_text()
    for old, new in replacements.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = tmp_path / "appliance.toml"
    path.write_text(text + extra)
    return path


def _refused(path: Path, profile: str = "production") -> ConfigError:
    with pytest.raises(ConfigError) as e:
        config.load(path, profile)
    assert "\n" not in e.value.message and e.value.hint and "\n" not in e.value.hint
    return e.value


@pytest.fixture(scope="module")
def production() -> config.Config:
    return config.load(APPLIANCE_TOML, "production")


@pytest.fixture(scope="module")
def demo() -> config.Config:
    return config.load(APPLIANCE_TOML, "demo")


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory) -> config.Config:
    return config.load(_toml(tmp_path_factory.mktemp("eight"), EIGHT_GPUS), "production")


# ------------------------------------------------------------------------------ the default


def test_default_is_one_engine_on_one_gpu() -> None:
    c = config.load(APPLIANCE_TOML, "production")
    assert (c.topology.gpus, c.topology.layout, c.replicas, c.topology.tensor_parallel) == (1, "1x1", 1, 1)
    assert c.topology.replica_gpus(0) == (0,) and c.replica_port(0) == c.engine.port == 8000
    # /dev/shm as before topology: one offload file plus the margin
    assert c.shm_required_bytes == int((c.engine.offload_gib + c.engine.shm.margin_gib) * GIB)
    assert c.shm_size_mib == -(-int((c.engine.offload_gib + c.engine.shm.margin_gib) * 1024 * 1024) // 1024) + 64
    assert c.topology == model.Topology()  # appliance.toml writes out exactly the defaults


def test_the_demo_runs_two_replicas_each_its_own_instance_port_and_devices(demo: config.Config) -> None:
    assert (demo.topology.layout, demo.replicas) == ("2x1", 2)
    assert [demo.replica_port(i) for i in (0, 1)] == [8000, 8002]  # the later two-GPU stack's ports
    assert demo.shm_required_bytes == int((2 * demo.engine.offload_gib + demo.engine.shm.margin_gib) * GIB)
    dropins = [render.replica_dropin(demo, i) for i in (0, 1)]
    assert "PublishPort=127.0.0.1:8000:8000" in dropins[0].splitlines() and "stagger" not in dropins[0]
    # replica 1 publishes its own port (the engine inside listens where replica 0's does) and waits
    # for replica 0 to be healthy, at most stagger_s, on top of its start period
    assert "PublishPort=127.0.0.1:8002:8000" in dropins[1].splitlines()
    assert "ExecStartPre=/usr/bin/applianctl stagger --replica 1" in dropins[1].splitlines()
    assert f"TimeoutStartSec={demo.engine.health.start_period_s + demo.topology.stagger_s}" in dropins[1].splitlines()
    # stagger_s = 0: every replica at once
    at_once = dataclasses.replace(demo, topology=dataclasses.replace(demo.topology, stagger_s=0))
    assert "stagger" not in render.replica_dropin(at_once, 1) and "TimeoutStartSec" not in render.replica_dropin(at_once, 1)


def test_production_replicas_get_only_their_own_gpus_render_nodes(production: config.Config) -> None:
    eight = dataclasses.replace(production, topology=dataclasses.replace(production.topology, gpus=8, layout="4x2"))
    assert production.replica_devices(0) == ("/dev/kfd", "/dev/dri")  # one engine: every GPU, as the compose stack
    assert [eight.replica_devices(i) for i in (0, 3)] == [("/dev/kfd", "/dev/dri/renderD128", "/dev/dri/renderD129"),
                                                         ("/dev/kfd", "/dev/dri/renderD134", "/dev/dri/renderD135")]
    lines = render.replica_dropin(eight, 3).splitlines()
    keys = ("AddDevice=", "Environment=", "PublishPort=", "ExecStartPre=", "TimeoutStartSec=")
    assert [line for line in lines if line.startswith(keys)] == [
        "ExecStartPre=/usr/bin/applianctl stagger --replica 3",
        f"TimeoutStartSec={production.engine.health.start_period_s + 3 * production.topology.stagger_s}",
        "PublishPort=127.0.0.1:8006:8000",
        "AddDevice=/dev/kfd", "AddDevice=/dev/dri/renderD134", "AddDevice=/dev/dri/renderD135",
        "Environment=ROCR_VISIBLE_DEVICES=0,1",
    ]


def test_the_image_tree_has_one_instance_link_and_drop_in_per_replica(demo: config.Config, tmp_path: Path) -> None:
    written = render.render_replicas(demo, tmp_path)
    quadlets = tmp_path / render.QUADLET_DIR
    for i in (0, 1):
        link = quadlets / f"appliance-engine@{i}.container"
        assert link.is_symlink() and str(link.readlink()) == "appliance-engine@.container"
        assert (quadlets / f"appliance-engine@{i}.container.d/10-replica.conf").read_text() == render.replica_dropin(demo, i)
    assert len(written) == 5  # and the warm-up body


def test_production_shm_is_the_reference_stacks_offload_plus_margin(production: config.Config) -> None:
    assert production.offload_bytes_per_replica == 96 * GIB
    assert production.shm_required_bytes == 104 * GIB and production.shm_size_mib == 104 * 1024 + 64
    assert production.shm_need == "96 GiB KV offload + 8 GiB margin"


def test_every_engine_runs_with_pythonhashseed_0(production: config.Config) -> None:
    assert "PYTHONHASHSEED" not in production.engine.env  # not set by hand in appliance.toml
    assert production.engine.environment == {**production.engine.env, "PYTHONHASHSEED": "0"}
    unit = render.render_template("appliance-engine@.container.j2", production, _store(production))
    assert "Environment=PYTHONHASHSEED=0" in unit.splitlines()
    # configured values come first, in their order, and unchanged
    lines = [line.removeprefix("Environment=") for line in unit.splitlines() if line.startswith("Environment=")]
    assert lines.index("PYTHONHASHSEED=0") == len(production.engine.env)


def test_engine_env_may_not_set_another_hash_seed(tmp_path: Path) -> None:
    env = 'VLLM_ROCM_USE_AITER = "1"\nVLLM_ROCM_USE_SKINNY_GEMM'  # production's [engine.env]
    path = _toml(tmp_path, {env: 'PYTHONHASHSEED = "random"\n' + env})
    e = _refused(path)
    assert "engine.env.PYTHONHASHSEED = 'random'" in e.message and "leave PYTHONHASHSEED out" in e.hint
    # repeating the value the appliance sets is harmless
    same = _toml(tmp_path, {env: 'PYTHONHASHSEED = "0"\n' + env})
    assert config.load(same).engine.environment["PYTHONHASHSEED"] == "0"


def _store(c: config.Config) -> engine_store.EngineStore:
    return engine_store.EngineStore(Path("/x"), Path("/y"), "ab" * 32, engine_store.label_for(c.engine.digest))


# ------------------------------------------------------------------------------ the layouts


@pytest.mark.parametrize(
    ("gpus", "layout", "replicas", "tp", "gpus_of_last"),
    [
        (8, "8x1", 8, 1, (7,)),
        (8, "4x2", 4, 2, (6, 7)),
        (8, "2x4", 2, 4, (4, 5, 6, 7)),
        (8, "1x8", 1, 8, tuple(range(8))),
        (2, "2x1", 2, 1, (1,)),
        (2, "1x2", 1, 2, (0, 1)),
    ],
)
def test_presets_validate_and_derive(tmp_path: Path, gpus: int, layout: str, replicas: int, tp: int, gpus_of_last: tuple[int, ...]) -> None:
    path = _toml(tmp_path, {DEFAULT_TOPOLOGY: f'gpus = {gpus}\nlayout = "{layout}"\n# The host'})
    c = config.load(path)
    t = c.topology
    assert (c.replicas, t.tensor_parallel) == (replicas, tp)
    assert t.replica_gpus(replicas - 1) == gpus_of_last
    # the GPUs are shared out exactly once
    assert sorted(g for i in range(replicas) for g in t.replica_gpus(i)) == list(range(gpus))
    assert [c.replica_port(i) for i in range(replicas)] == [8000 + 2 * i for i in range(replicas)]
    assert c.shm_required_bytes == int((replicas * 96 + 8) * GIB)
    with pytest.raises(IndexError):
        t.replica_gpus(replicas)
    with pytest.raises(IndexError):
        c.replica_port(replicas)


def test_the_later_stacks_two_replicas_on_8000_and_8002(tmp_path: Path) -> None:
    c = config.load(_toml(tmp_path, {DEFAULT_TOPOLOGY: 'gpus = 2\nlayout = "2x1"\n# The host'}))
    assert [(c.replica_port(i), c.topology.replica_gpus(i)) for i in range(2)] == [(8000, (0,)), (8002, (1,))]
    assert c.shm_need == "2 x 96 GiB KV offload + 8 GiB margin"


@pytest.mark.parametrize(
    ("gpus", "layout", "words"),
    [
        (8, "8x2", "uses 8 x 2 = 16 GPU(s), topology.gpus = 8"),
        (8, "3x4", "uses 3 x 4 = 12 GPU(s), topology.gpus = 8"),
        (8, "1x1", "uses 1 x 1 = 1 GPU(s), topology.gpus = 8"),
        (2, "1x1", "uses 1 x 1 = 1 GPU(s), topology.gpus = 2"),
    ],
)
def test_a_layout_that_does_not_add_up_to_the_gpus_is_refused(tmp_path: Path, gpus: int, layout: str, words: str) -> None:
    e = _refused(_toml(tmp_path, {DEFAULT_TOPOLOGY: f'gpus = {gpus}\nlayout = "{layout}"\n# The host'}))
    assert f"topology.layout = '{layout}' {words}" in e.message
    presets = {8: "8x1, 4x2, 2x4, 1x8", 2: "2x1, 1x2"}[gpus]
    assert e.hint.endswith(f"for {gpus} GPU(s) one of {presets}")


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('layout = "8"', "topology.layout"),
        ('layout = "8x3"', "topology.layout"),
        ('layout = "9x1"', "topology.layout"),
        ('layout = "0x1"', "topology.layout"),
        ('layout = "8×1"', "topology.layout"),
        ("gpus = 0", "topology.gpus"),
        ("gpus = 16", "topology.gpus"),
    ],
)
def test_malformed_values_are_refused_in_one_line(tmp_path: Path, line: str, key: str) -> None:
    old = 'layout = "1x1"\n' if line.startswith("layout") else "gpus = 1\n"
    e = _refused(_toml(tmp_path, {f"\n{old}": f"\n{line}\n"}))
    assert f"{key} = " in e.message and "invalid" in e.message and e.hint.startswith("expected ")


@pytest.mark.parametrize("form", ["--tensor-parallel-size {}", "--tensor-parallel-size={}", "-tp {}"])
def test_tensor_parallel_argument_must_agree_with_the_layout(tmp_path: Path, form: str) -> None:
    arg = ", ".join(f'"{w}"' for w in form.format(2).split())
    two = {DEFAULT_TOPOLOGY: 'gpus = 2\nlayout = "1x2"\n# The host', '"--trust-remote-code",': f'"--trust-remote-code", {arg},'}
    assert config.load(_toml(tmp_path, two)).topology.tensor_parallel == 2
    wrong = {DEFAULT_TOPOLOGY: 'gpus = 2\nlayout = "2x1"\n# The host', '"--trust-remote-code",': f'"--trust-remote-code", {arg},'}
    e = _refused(_toml(tmp_path, wrong))
    assert re.search(r"engine\.args has (--tensor-parallel-size|-tp) 2 but topology\.layout = '2x1' \(tensor parallel 1\)", e.message)


def test_data_parallel_is_not_a_way_to_make_replicas(tmp_path: Path) -> None:
    e = _refused(_toml(tmp_path, {'"--trust-remote-code",': '"--trust-remote-code", "--data-parallel-size", "2",'}))
    assert "--data-parallel-size 2" in e.message and "topology.layout" in e.hint


def test_replica_ports_must_be_free(tmp_path: Path) -> None:
    # 8 replicas from 9429 reach 9443, the metrics port
    replacements = {**EIGHT_GPUS, "port = 8000\n": "port = 9429\n", PORT_ARG: PORT_ARG.replace("8000", "9429")}
    e = _refused(_toml(tmp_path, replacements))
    assert "9429..9443 include port 9443, which is taken" in e.message
    replacements = {**EIGHT_GPUS, "port = 8000\n": "port = 65530\n", PORT_ARG: PORT_ARG.replace("8000", "65530")}
    assert "run past 65535" in _refused(_toml(tmp_path, replacements)).message


# ------------------------------------------------------------------------------ eight GPUs


def test_eight_gpu_production_configuration_loads_and_validates(eight: config.Config, production: config.Config) -> None:
    assert (eight.topology.gpus, eight.replicas, eight.topology.tensor_parallel) == (8, 8, 1)
    assert eight.shm_required_bytes == (8 * 96 + 8) * GIB
    assert eight.shm_size_mib == (8 * 96 + 8) * 1024 + 64
    # every template renders as the build renders it; the only problems left are the ones the
    # one-GPU production profile has too (the overlays and tables the operator supplies)
    assert validate._render_problems(eight) == []
    assert [e.message for e in validate.problems(eight, ROOT)] == [e.message for e in validate.problems(production, ROOT)]
    unit = render.render_template("appliance-shm-clean.service.j2", eight, _store(eight))
    assert f"size={(8 * 96 + 8) * 1024 + 64}M" in unit
    # and the device reads the image's appliance.json back as the same configuration
    assert config.from_json(eight.to_json(), Path("appliance.json")) == eight


def test_shm_too_small_for_eight_offload_files_is_refused(tmp_path: Path) -> None:
    # 8 x 96 + 8 + 32 reserved = 808 GiB does not fit in 512 GiB
    e = _refused(_toml(tmp_path, {**EIGHT_GPUS, "memory_gib = 0\n": "memory_gib = 512\n"}))
    assert "/dev/shm needs 776 GiB (8 x 96 GiB KV offload + 8 GiB margin) + 32 GiB reserved" in e.message
    assert "topology.memory_gib = 512" in e.message
    assert "at most 59 GiB per replica" in e.hint  # (512 - 32 - 8) / 8
    # the same memory fits eight replicas of 59 GiB each
    fits = {**EIGHT_GPUS, "memory_gib = 0\n": "memory_gib = 512\n", '"--kv-offloading-size", "96"': '"--kv-offloading-size", "59"'}
    assert config.load(_toml(tmp_path, fits)).shm_required_bytes == (8 * 59 + 8) * GIB
    # one GiB over is refused
    over = {**fits, "memory_reserve_gib = 32\n": "memory_reserve_gib = 33\n"}
    _refused(_toml(tmp_path, over))


def test_validate_command_names_a_layout_that_does_not_fit_in_one_line(tmp_path: Path) -> None:
    path = _toml(tmp_path, {DEFAULT_TOPOLOGY: 'gpus = 8\nlayout = "8x2"\n# The host'})
    found = config.problems(path, "production")[1]
    assert [e.message for e in found] == [f"{path}: topology.layout = '8x2' uses 8 x 2 = 16 GPU(s), topology.gpus = 8"]


# ------------------------------------------------------------------------------ at boot


def test_check_host_passes_a_host_that_fits(eight: config.Config, production: config.Config) -> None:
    assert model.check_host(eight, 8, 1536 * GIB, eight.shm_size_mib << 20) == []
    assert model.check_host(production, 1, 235 * GIB, production.shm_size_mib << 20) == []
    # today's one-GPU appliance on an eight-GPU server: the other seven stay idle
    assert model.check_host(production, 8, 2048 * GIB, production.shm_size_mib << 20) == []


def test_check_host_names_missing_gpus(eight: config.Config) -> None:
    assert model.check_host(eight, 7, 1536 * GIB, eight.shm_size_mib << 20) == [
        "7 GPU(s) seen, topology 8x1 (8 replica(s) x tensor parallel 1) needs 8"
    ]
    assert len(model.check_host(eight, 0, 1536 * GIB, eight.shm_size_mib << 20)) == 1


def test_check_host_ignores_gpus_where_none_are_required() -> None:
    demo = config.load(APPLIANCE_TOML, "demo")
    assert not demo.gpu.required
    assert model.check_host(demo, 0, 64 * GIB, demo.shm_size_mib << 20) == []


def test_check_host_names_a_small_shm_and_small_memory(eight: config.Config) -> None:
    need = eight.shm_required_bytes
    assert model.check_host(eight, 8, 1536 * GIB, need) == []  # exactly enough
    (line,) = model.check_host(eight, 8, 1536 * GIB, need - 1)
    assert line.startswith("/dev/shm holds 776.00 GiB, the 8 replica(s) need 776.00 GiB (8 x 96 GiB KV offload + 8 GiB margin)")
    (line,) = model.check_host(eight, 8, need + 32 * GIB - 1, need)
    assert line.startswith("808.00 GiB of memory, the 8 replica(s) need 776.00 GiB in /dev/shm") and "32 GiB to spare" in line
    assert len(model.check_host(eight, 1, 64 * GIB, 4 * GIB)) == 3


def test_topology_travels_in_appliance_json(eight: config.Config) -> None:
    data = eight.to_json()
    assert data["topology"] == {"gpus": 8, "layout": "8x1", "memory_gib": 1536.0, "memory_reserve_gib": 32.0, "stagger_s": 300}
    data["topology"]["layout"] = "4x2"
    assert config.from_json(data, Path("appliance.json")).topology.tensor_parallel == 2
    data["topology"]["layout"] = "8x2"
    with pytest.raises(ConfigError):
        config.from_json(data, Path("appliance.json"))
    assert dataclasses.replace(eight.topology, layout="2x4").replica_gpus(1) == (4, 5, 6, 7)


# ------------------------------------------------------------------------------ the kernel driver (item 5)


def test_the_inbox_driver_is_the_default(production: config.Config) -> None:
    assert production.os.amdgpu == "inbox" and production.os.amdgpu_dkms_package == ""


@pytest.mark.parametrize(("lines", "says"), [
    ('amdgpu = "dkms"\namdgpu_dkms_package = "firmware/README.md"\namdgpu_dkms_sha256 = "' + "a" * 64 + '"\n',
     "Debian's kernel loads only modules signed by Debian's key"),
    ('amdgpu = "dkms"\n', "needs os.amdgpu_dkms_package and os.amdgpu_dkms_sha256"),
    ('amdgpu = "inbox"\namdgpu_dkms_package = "firmware/README.md"\n', "apply with os.amdgpu = \"dkms\" only"),
    ('amdgpu = "dkms-latest"\n', "os.amdgpu"),
    ('amdgpu = "dkms"\namdgpu_dkms_package = "../../etc/passwd"\namdgpu_dkms_sha256 = "' + "a" * 64 + '"\n', "amdgpu_dkms_package"),
], ids=["dkms-under-secure-boot", "dkms-unpinned", "package-without-dkms", "unknown-driver", "package-outside-the-repository"])
def test_amdgpu_dkms_is_refused_in_one_line(tmp_path: Path, lines: str, says: str) -> None:
    """A sealed appliance boots under Secure Boot, where Debian's kernel would not load modules
    DKMS built (appliance/config/model.py AMDGPU_DKMS_UNDER_SECURE_BOOT): refused at build."""
    e = _refused(_toml(tmp_path, {'amdgpu = "inbox"\n': lines}))
    assert says in e.message, e.message
