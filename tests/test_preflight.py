# SPDX-License-Identifier: MIT
"""`applianctl preflight` before every engine start: the weights, then the topology against the
host it boots on (memory for every replica's offload file, the KFD's GPUs), then the GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from appliance import config
from applianctl.engine import preflight

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("SYS", "DEV", "PROC"):
        (tmp_path / name.lower()).mkdir()
        monkeypatch.setattr(preflight, name, tmp_path / name.lower())
    return tmp_path


def _memory(host: Path, gib: float) -> None:
    (host / "proc/meminfo").write_text(f"MemTotal:       {int(gib * GIB / 1024)} kB\nMemFree: 1 kB\n")


def _gpus(host: Path, count: int) -> None:
    """A KFD topology of one CPU node and COUNT GPU nodes, and what amdgpu shows in sysfs."""
    (host / "dev/kfd").touch()
    (host / "sys/module/amdgpu").mkdir(parents=True, exist_ok=True)
    for node in range(count + 1):
        d = host / f"sys/class/kfd/kfd/topology/nodes/{node}"
        d.mkdir(parents=True)
        (d / "gpu_id").write_text("0\n" if node == 0 else f"{40000 + node}\n")
    for card in range(count):
        d = host / f"sys/class/drm/card{card}/device"
        d.mkdir(parents=True)
        (d / "mem_info_vram_total").write_text(str(192 * GIB))


def _with_weights(c: config.Config, host: Path) -> config.Config:
    c = dataclasses.replace(c, model=dataclasses.replace(c.model, cache_dir=str(host / "hf")))
    Path(c.model.weights_dir).mkdir(parents=True)
    (Path(c.model.weights_dir) / "config.json").write_text("{}")
    return c


def test_the_demos_two_replicas_fit_its_guest_and_not_a_smaller_one(host: Path) -> None:
    demo = _with_weights(config.load(ROOT / "appliance.toml", "demo"), host)
    _memory(host, 4)  # QEMU's guest
    assert preflight.check(demo).ok
    _memory(host, 1)
    result = preflight.check(demo)
    assert not result.ok and result.reason.startswith("1.00 GiB of memory, the 2 replica(s) need 0.38 GiB in /dev/shm"), result


def test_an_eight_gpu_topology_needs_the_eight_gpus_and_their_memory(host: Path) -> None:
    production = config.load(ROOT / "appliance.toml", "production")
    eight = _with_weights(dataclasses.replace(production, topology=dataclasses.replace(production.topology, gpus=8, layout="8x1")),
                          host)
    _memory(host, 2048)
    _gpus(host, 7)
    result = preflight.check(eight)
    assert not result.ok and result.reason == "7 GPU(s) seen, topology 8x1 (8 replica(s) x tensor parallel 1) needs 8", result
    d = host / "sys/class/kfd/kfd/topology/nodes/8"
    d.mkdir(parents=True, exist_ok=True)
    (d / "gpu_id").write_text("40008\n")
    assert preflight.check(eight).ok
    _memory(host, 512)  # 8 x 96 GiB of offload files cannot fit
    result = preflight.check(eight)
    assert not result.ok and "the 8 replica(s) need" in result.reason, result
