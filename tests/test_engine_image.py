# SPDX-License-Identifier: MIT
"""The engine image's way into the build (builder/engine_image.py, builder/engine_store.py): every
long step reports progress (a bar on a terminal, lines in a log), checked on the real code path
with the stand-in engine's small image."""

from __future__ import annotations

import dataclasses
import io
import os
import shlex
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
from fakeprog import calls, fake_program

from appliance.config import Config, load
from appliance.errors import UserError
from builder import engine_image, engine_store

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def demo() -> Config:
    return load(REPO / "appliance.toml", "demo")


@pytest.fixture
def layout(tmp_path: Path, demo: Config) -> Path:
    """The stand-in engine as an OCI layout; its digest is the demo profile's pin."""
    path = tmp_path / "standin-layout"
    path.mkdir()
    assert engine_image.build_standin_layout(path, demo.engine.entrypoint) == demo.engine.digest
    return path


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_image, "CACHE", tmp_path / "cache/engine-images")
    monkeypatch.setattr(engine_store, "CACHE", tmp_path / "cache/engine-stores")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_copying_a_layout_directory_reports_its_bytes(layout: Path, demo: Config, capsys: pytest.CaptureFixture[str]) -> None:
    cached = engine_image.obtain(demo, layout)
    assert engine_image.layout_digest(cached) == demo.engine.digest
    (last,) = capsys.readouterr().err.splitlines()  # a small copy: no line before the end
    kib = _size(layout) / 1024
    assert last.startswith(f"copying standin-layout: {kib:.1f} KiB/{kib:.1f} KiB (100%)") and "done in" in last


def test_unpacking_a_layout_archive_reports_its_bytes(
    tmp_path: Path, layout: Path, demo: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = tmp_path / "engine.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(layout, arcname=".")
    engine_image.obtain(demo, archive)
    (last,) = capsys.readouterr().err.splitlines()
    kib = _size(layout) / 1024
    assert last.startswith(f"unpacking engine.tar: {kib:.1f} KiB/{kib:.1f} KiB (100%)") and "done in" in last


@pytest.mark.parametrize("name", ["../escape", "/etc/escape", "blobs/link"])
def test_an_archive_entry_outside_the_layout_or_not_a_file_is_refused(tmp_path: Path, demo: Config, name: str) -> None:
    archive = tmp_path / "engine.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo(name)
        if name.endswith("link"):
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(UserError, match="is not a file or directory inside the archive"):
        engine_image.obtain(demo, archive)
    assert not (tmp_path / "escape").exists() and not list(engine_image.CACHE.parent.glob("*/*"))


def test_a_registry_fetch_says_when_it_starts_and_how_long_it_took(
    tmp_path: Path, layout: Path, demo: Config, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # skopeo copy docker://REF oci:DIR:NAME, stood in by a program that copies the stand-in's layout
    # (no registry here); what is under test is the step around it.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    copy = f"import shutil, sys; shutil.copytree({str(layout)!r}, sys.argv[-1].split(':')[1], dirs_exist_ok=True)"
    fake_program(bin_dir, "skopeo", script_body=f'exec {sys.executable} -c {shlex.quote(copy)} "$@"')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    production = dataclasses.replace(demo, profile="production")
    engine_image.obtain(production, None)
    err = capsys.readouterr().err.splitlines()
    what = f"fetching {demo.engine.reference}"
    assert err[0] == f"{what} ..." and err[-1].startswith(f"{what}: done in ")
    staging = tmp_path / "cache/engine-images" / (demo.engine.digest.replace(":", "-") + ".tmp")
    assert calls(bin_dir / "calls.log") == [
        ["skopeo", "copy", "--quiet", f"docker://{demo.engine.reference}", f"oci:{staging}:appliance"],
    ]


@pytest.mark.programs
@pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("skopeo", "mkfs.erofs", "veritysetup")),
    reason="the engine store is written as root with skopeo, mkfs.erofs and veritysetup (make setup)",
)
def test_packing_and_hashing_the_engine_store_say_when_they_start_and_end(
    layout: Path, demo: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    store = engine_store.make(demo, layout)
    assert len(store.roothash) == 64 and store.erofs.stat().st_size > 0
    err = capsys.readouterr().err.splitlines()
    steps = [
        "copying the engine image into its store",
        "packing the engine store (mkfs.erofs)",
        "hashing the engine store (veritysetup format)",
    ]
    assert [line for line in err if line.endswith(" ...")] == [f"{s} ..." for s in steps]
    for s in steps:
        assert any(line.startswith(f"{s}: done in ") and line.endswith(" s") for line in err), s
