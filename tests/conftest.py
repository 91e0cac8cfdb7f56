"""Shared pytest fixtures. Each engineer's fixtures live in their own marked block."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# ---- BEGIN standin / shm / startup fixtures ------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"


@pytest.fixture
def shared_fixtures() -> Path:
    """../shared/fixtures: the recorded real tool outputs (read in place, never copied)."""
    return SHARED_FIXTURES


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
