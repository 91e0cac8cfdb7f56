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
