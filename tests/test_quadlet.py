# SPDX-License-Identifier: MIT
"""The engine units as podman's own generator makes them: Debian 13's quadlet (make setup unpacks
it into the host cache) run on the rendered tree, one service per replica instance."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from appliance import config
from builder import engine_store, render
from builder.host_tools import HOST_CACHE

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)

ROOT = Path(__file__).resolve().parents[1]
QUADLET = HOST_CACHE / "podman/usr/libexec/podman/quadlet"


def _generate(c: config.Config, tmp_path: Path) -> Path:
    """Render C's units into a tree and run quadlet on its quadlet directory; the output directory."""
    if not QUADLET.is_file():
        pytest.fail(f"{QUADLET}: missing; run make setup (it unpacks Debian 13's podman there)")
    store = engine_store.EngineStore(Path("/x"), Path("/y"), "ab" * 32, engine_store.label_for(c.engine.digest))
    render.render_units(c, tmp_path / "tree", store)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "QUADLET_UNIT_DIRS": str(tmp_path / "tree" / render.QUADLET_DIR)}
    proc = subprocess.run([str(QUADLET), "-v", str(out)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return out


def _unit(out: Path, name: str) -> tuple[dict[str, list[str]], list[str]]:
    """NAME's keys (every value of each) and its ExecStart split as systemd splits it."""
    keys: dict[str, list[str]] = {}
    for line in (out / name).read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            keys.setdefault(key, []).append(value)
    return keys, shlex.split(keys["ExecStart"][0])


def _option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag]


def test_the_demo_gets_one_service_per_replica_each_on_its_port_waiting_for_the_previous(tmp_path: Path) -> None:
    out = _generate(config.load(ROOT / "appliance.toml", "demo"), tmp_path)
    assert sorted(p.name for p in (out / "multi-user.target.wants").iterdir()) == ["appliance-engine@0.service",
                                                                                 "appliance-engine@1.service"]
    first, argv0 = _unit(out, "appliance-engine@0.service")
    second, argv1 = _unit(out, "appliance-engine@1.service")
    assert _option(argv0, "--publish") == ["127.0.0.1:8000:8000"] and _option(argv1, "--publish") == ["127.0.0.1:8002:8000"]
    # staggered by a wait of its own, not an ordering (After= would wait out the whole start period)
    for keys in (first, second):
        assert not [u for u in " ".join(keys["After"]).split() if u.startswith("appliance-engine@")]
    assert first["ExecStartPre"] == ["/usr/bin/applianctl selftest --replica %i"]
    assert second["ExecStartPre"] == ["/usr/bin/applianctl selftest --replica %i", "/usr/bin/applianctl stagger --replica 1"]
    # the wait counts on top of the start period (the drop-in's value is the one systemd keeps: the last)
    assert first["TimeoutStartSec"] == ["300"] and second["TimeoutStartSec"][-1] == str(300 + 300)
    for keys, argv in ((first, argv0), (second, argv1)):
        # %i reaches systemd as a specifier (the container's name, the replica's number); the
        # configured "%" stay escaped, so systemd hands the engine a literal %p
        assert _option(argv, "--name") == ["appliance-engine-%i"]
        assert "APPLIANCE_REPLICA=%i" in _option(argv, "--env")
        assert "HSA_COREDUMP_PATTERN=/var/crash/vllm/gpucore.%%p" in _option(argv, "--env")
        assert keys["Type"] == ["notify"] and keys["Restart"] == ["always"]


def test_eight_gpus_as_four_replicas_give_each_only_its_own_render_nodes(tmp_path: Path) -> None:
    production = config.load(ROOT / "appliance.toml", "production")
    eight = dataclasses.replace(production, topology=dataclasses.replace(production.topology, gpus=8, layout="4x2"))
    out = _generate(eight, tmp_path)
    assert len(list((out / "multi-user.target.wants").iterdir())) == 4
    _, argv = _unit(out, "appliance-engine@3.service")
    assert _option(argv, "--device") == ["/dev/kfd", "/dev/dri/renderD134", "/dev/dri/renderD135"]
    assert "ROCR_VISIBLE_DEVICES=0,1" in _option(argv, "--env") and _option(argv, "--publish") == ["127.0.0.1:8006:8000"]
    # one engine on every GPU: the whole of /dev/dri, as the compose stack
    (tmp_path / "one").mkdir()
    _, argv = _unit(_generate(production, tmp_path / "one"), "appliance-engine@0.service")
    assert _option(argv, "--device") == ["/dev/kfd", "/dev/dri"] and "--tensor-parallel-size" not in argv
