"""The generated image tree (builder/render.py, no mkosi): a production tree carries no test
machinery, a demo tree carries the boot check; every unit's sandbox exposure is held to 3.0."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance import config
from builder import engine_store, render

ROOT = Path(__file__).resolve().parents[1]

# What only test machinery does: act on a plan or a boot-check request passed in as a credential,
# or write to a serial port other than the console (ttyS1 is often the BMC's serial-over-LAN).
TEST_MACHINERY = re.compile(r"bootcheck|appliance\.plan|ttyS[1-9]|/dev/hvc|hvc[0-9]|ImportCredential=appliance")


def _tree(profile: str, tmp_path: Path) -> Path:
    c = config.load(ROOT / "appliance.toml", profile)
    erofs, verity = tmp_path / "engine.erofs", tmp_path / "engine.verity"
    erofs.write_bytes(b"e")
    verity.write_bytes(b"v")
    store = engine_store.EngineStore(erofs, verity, "ab" * 32, engine_store.label_for(c.engine.digest))
    tree = tmp_path / profile
    with pytest.MonkeyPatch.context() as m:
        # Production's overlays are third-party files the operator supplies (not in the repository);
        # what they are does not matter here, only that they are installed where the units say.
        m.setattr(render, "install_engine_files", _placeholder_engine_files)
        render.generate_tree(c, tree, store)
    return tree


def _placeholder_engine_files(c: config.Config, tree: Path) -> None:
    for kind, files in (("overlays", c.engine.overlays), ("tuning", c.engine.tuning)):
        for pinned in files:
            target = tree / render.device_path(kind, pinned).lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("# placeholder\n")


@pytest.fixture(scope="module")
def production_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tree("production", tmp_path_factory.mktemp("tree"))


@pytest.fixture(scope="module")
def demo_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tree("demo", tmp_path_factory.mktemp("tree"))


def _machinery(tree: Path) -> dict[str, list[str]]:
    """Every file under TREE whose name or text matches TEST_MACHINERY, with what matched."""
    found: dict[str, list[str]] = {}
    for path in sorted(p for p in tree.rglob("*") if p.is_file() or p.is_symlink()):
        if "__pycache__" in path.parts:
            continue
        name = str(path.relative_to(tree))
        hits = TEST_MACHINERY.findall(name)
        if path.is_file():
            hits += TEST_MACHINERY.findall(path.read_bytes().decode("utf-8", "replace"))
        if hits:
            found[name] = sorted(set(hits))
    return found


def test_production_tree_has_no_test_machinery(production_tree: Path) -> None:
    assert _machinery(production_tree) == {}


def test_production_tree_is_not_empty(production_tree: Path) -> None:
    # the scan above must have something to scan: applianctl, the units, the preset
    assert (production_tree / "usr/lib/python3/dist-packages/applianctl/__main__.py").is_file()
    assert (production_tree / "usr/lib/systemd/system/appliance-verify.service").is_file()
    preset = (production_tree / "usr/lib/systemd/system-preset/10-appliance.preset").read_text()
    assert "enable appliance-proxy.service" in preset
    assert not (production_tree / "usr/lib/python3/dist-packages/demo").exists()


def test_demo_tree_has_the_boot_check(demo_tree: Path) -> None:
    found = _machinery(demo_tree)
    unit = "usr/lib/systemd/system/appliance-bootcheck.service"
    assert "ttyS1" in found[unit]
    assert "python3 -m demo.bootcheck" in (demo_tree / unit).read_text()
    assert (demo_tree / "usr/lib/python3/dist-packages/demo/bootcheck.py").is_file()
    assert "appliance.plan" in found["usr/lib/python3/dist-packages/demo/bootcheck.py"]
    presets = "".join(p.read_text() for p in (demo_tree / "usr/lib/systemd/system-preset").iterdir())
    assert "enable appliance-bootcheck.service" in presets
    # Only the demo package, its unit and its preset are test machinery.
    assert {n.split("/")[-1] for n in found} <= {"appliance-bootcheck.service", "appliance-bootcheck-trial.service",
                                                "20-appliance-demo.preset", "bootcheck.py", "__init__.py"}


def test_bootcheck_is_not_an_applianctl_verb() -> None:
    from applianctl.__main__ import COMMAND_MODULES

    assert "bootcheck" not in COMMAND_MODULES


# ------------------------------------------------------------------------- sandbox exposure
# Every service in either tree scores at most 3.0 in `systemd-analyze security --offline=true`.
# Exceptions, each with the reason its unit's comments give. The engine (a quadlet-generated
# unit, not in this tree) needs host IPC, devices and SYS_PTRACE for ROCm.
EXPOSURE_LIMIT = 3.0
EXCEPTIONS: dict[str, float] = {
    # being sandboxed by their owners (issue 12); each entry goes when its unit reaches 3.0
    "appliance-update.service": 9.6,
    "appliance-engine-store.service": 3.9,
    "appliance-bootcheck.service": 9.6,
    "appliance-bootcheck-trial.service": 9.6,  # test-only, like the boot check: hashes both slots
}


def _exposure(unit: Path) -> float:
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True, text=True).stdout
    found = re.findall(r"Overall exposure level for \S+: ([0-9.]+)", out)
    assert found, out
    return float(found[0])


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("profile", ["production", "demo"])
def test_every_service_within_exposure_limit(profile: str, production_tree: Path, demo_tree: Path) -> None:
    tree = production_tree if profile == "production" else demo_tree
    units = sorted((tree / "usr/lib/systemd/system").glob("*.service"))
    assert len(units) >= 8
    scores = {u.name: _exposure(u) for u in units}
    over = {n: s for n, s in scores.items() if s > EXCEPTIONS.get(n, EXPOSURE_LIMIT)}
    assert over == {}, scores
