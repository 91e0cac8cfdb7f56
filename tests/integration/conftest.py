"""Integration fixtures: build the demo image once per session and boot it in QEMU (TCG)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from builder import build, config, qemu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def demo_config() -> config.Config:
    return config.load(ROOT / "appliance.toml", "demo")


@pytest.fixture(scope="session")
def demo_image(demo_config: config.Config) -> Path:
    """The demo image, built through the builder exactly as `make demo` builds it."""
    return build.build(demo_config).disk_image


@pytest.fixture(scope="session")
def first_boot(demo_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The report of the demo image's first boot (systemd-repart runs, the engine starts); after
    that first look, the boot check drives the stand-in's fault switches through the production
    unit (slow start, crash leaving its offload file, hang) and reports what systemd did."""
    guest = qemu.Guest(demo_image, tmp_path_factory.mktemp("first-boot"))
    yield guest.boot(timeout=2400, credentials={"appliance.scenario": "faults"})


@pytest.fixture(scope="session")
def faults_boot(first_boot: dict[str, Any]) -> dict[str, Any]:
    return first_boot


def flip_byte_in_partition(disk: Path, partition_name: str, needle: bytes) -> int:
    """Flip one byte of NEEDLE inside the named GPT partition of DISK; return the disk offset."""
    import json
    import mmap
    import subprocess

    table = json.loads(subprocess.run(["sfdisk", "-J", str(disk)], capture_output=True, text=True, check=True).stdout)
    sector = table["partitiontable"].get("sectorsize", 512)
    (part,) = [p for p in table["partitiontable"]["partitions"] if p.get("name") == partition_name]
    start, size = part["start"] * sector, part["size"] * sector
    with open(disk, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        found = m.find(needle, start, start + size)
        assert found >= 0, f"{needle!r} not found in partition {partition_name}"
        m[found] ^= 0x01
        m.flush()
    return found


@pytest.fixture(scope="session")
def tampered_boot(demo_image: Path, demo_config: config.Config, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A copy of the demo image with one byte of the demo overlay flipped inside the /usr partition."""
    import subprocess

    work = tmp_path_factory.mktemp("tampered-boot")
    disk = work / "disk.raw"
    subprocess.run(["cp", "--sparse=always", str(demo_image), str(disk)], check=True)
    flip_byte_in_partition(disk, f"appliance_{demo_config.appliance.version}", b'VARIANT = "overlay-demo"')
    return qemu.Guest(disk, work).boot(timeout=1500)
