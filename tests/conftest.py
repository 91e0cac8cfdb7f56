# SPDX-License-Identifier: MIT
"""Shared pytest fixtures. Each engineer's fixtures live in their own marked block."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from repository import FIXTURES

# ---- BEGIN standin / shm / startup fixtures ------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fixtures_dir() -> Path:
    """tests/fixtures/: the recorded real tool outputs and the other test inputs (its README.md)."""
    return FIXTURES


@pytest.fixture
def appliance_json(tmp_path: Path) -> Callable[[str], Path]:
    """Write the device configuration (Config.to_json() of appliance.toml) for PROFILE; returns its path."""
    from appliance.config import load

    def write(profile: str = "demo") -> Path:
        path = tmp_path / f"appliance-{profile}.json"
        path.write_text(json.dumps(load(REPO / "appliance.toml", profile).to_json()))
        return path

    return write


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory on the real /dev/shm tmpfs, removed afterwards."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="pytest-shm-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---- END standin / shm / startup fixtures --------------------------------------------------------------


# ---- the installer's firmware ------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_host_efivars(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """install() reads the build host's EFI variables by default: a test that gives none sees a
    machine without UEFI, never the host's firmware."""
    from installer import install

    monkeypatch.setattr(install, "EFIVARS", tmp_path / "no-efivars")


@pytest.fixture(autouse=True)
def no_host_tpm_enrollment(monkeypatch: pytest.MonkeyPatch) -> None:
    """install() enrolls the TPM's EK and AK by default: a test that gives no enrollment of its own
    sees a TPM that answers nothing, never the build host's TPM (and starts no tpm2-tools)."""
    from appliance import tpm_keys
    from appliance.errors import UserError
    from installer import install

    def absent() -> tpm_keys.Keys:
        raise UserError("no TPM in the unit tests", hint="the enrollment's own tests give one")

    monkeypatch.setattr(install, "ENROLL", absent)


@pytest.fixture(autouse=True)
def installer_sees_a_tpm(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """install() seals /var to the TPM and refuses a machine without one: a test's machine has a
    TPM 2.0 (a sysfs directory of its own) and the install's key file goes to its own directory
    (both outside the test's tmp_path, which some tests read whole)."""
    from installer import install

    machine = tmp_path_factory.mktemp("machine")
    tpm = machine / "sys-class-tpm-tpm0"
    tpm.mkdir()
    (tpm / "tpm_version_major").write_text("2\n")
    monkeypatch.setattr(install, "TPM", tpm)
    monkeypatch.setattr(install, "KEY_DIR", machine / "installer-run")
    return tpm


@pytest.fixture(scope="module")
def mock_systemd() -> Iterator[object]:
    """python-dbusmock's systemd on a private system bus (tests/mock_systemd.py), for one module."""
    from mock_systemd import start_mock_systemd, stop_mock_systemd

    proc, mock = start_mock_systemd()
    try:
        yield mock
    finally:
        stop_mock_systemd(proc)


# ---- the two unit tiers: `programs` and the fast tier's guard ----------------------------------------

# Fixtures that start real programs or daemons: every test using one is marked `programs` (it runs
# in make unit, not in make check). A test that runs a program itself carries the marker directly.
PROGRAM_FIXTURES = frozenset({
    "mock_systemd",  # python-dbusmock's systemd on a private D-Bus daemon
})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROGRAM_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.programs)


def pytest_configure(config: pytest.Config) -> None:
    import program_guard

    if program_guard.active():
        config.pluginmanager.register(program_guard.Plugin(), "program_guard")
