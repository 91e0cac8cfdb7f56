# SPDX-License-Identifier: MIT
"""tools/check-space: `make test` stops in two lines, before building anything, on a disk too full;
and the update's staging on /var keeps the reserve every download keeps."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

from appliance import fetch
from appliance.errors import UserError
from appliance.signed.bundle_index import BundleFile, BundleIndex
from applianctl.update import download

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.programs
def test_too_little_space_is_two_lines_and_exit_2() -> None:
    proc = subprocess.run([ROOT / "tools/check-space", "1000000", "the integration tests"], capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    error, hint = proc.stderr.splitlines()
    assert error.startswith("error: the integration tests: /") and "about 1000000 GiB are needed" in error
    assert hint.startswith("hint: free space there")


@pytest.mark.programs
def test_enough_space_says_nothing() -> None:
    proc = subprocess.run([ROOT / "tools/check-space", "0", "the integration tests"], capture_output=True, text=True, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


# ----------------------------------------------------------------------------------- the update's reserve on /var
#
# applianctl update stages a bundle on /var: checked before (update.download.check_space) and while
# writing (stage: appliance.fetch's Guard before each write), against the one reserve the model
# fetch keeps too; a fake free-space figure stands for a real disk filling.

MIB = 1 << 20


def _bundle(directory: Path, sizes: dict[str, int]) -> BundleIndex:
    directory.mkdir()
    files = []
    for name, size in sizes.items():
        data = (hashlib.sha256(name.encode()).digest() * (size // 32 + 1))[:size]
        (directory / name).write_bytes(data)
        files.append(BundleFile(name, hashlib.sha256(data).hexdigest(), size))
    return BundleIndex(1, "2.0.0", "1.0.0", "demo", "sha256:" + "0" * 64, "0" * 64, tuple(files), {}, "0" * 64, "0" * 16)


class Recording(fetch.DirSource):
    """A bundle directory that notes the offset of each read it opens."""

    def __init__(self, spec: str) -> None:
        super().__init__(spec, fetch.Deadline(60))
        self.opened: list[tuple[str, int]] = []

    def open(self, name: str, offset: int = 0, *, chunk: int = fetch.CHUNK) -> fetch.Body:
        self.opened.append((name, offset))
        return super().open(name, offset, chunk=chunk)


def test_the_update_keeps_the_same_reserve_as_the_model_fetch() -> None:
    import applianctl.model.fetch

    assert download.SPACE_MARGIN_BYTES == fetch.RESERVE_BYTES == 1 << 30
    assert applianctl.model.fetch.appliance.fetch.RESERVE_BYTES is fetch.RESERVE_BYTES  # the one reserve, not a copy


def test_a_staging_download_stops_at_the_reserve_keeps_its_part_file_and_resumes(tmp_path: Path) -> None:
    index = _bundle(tmp_path / "bundle", {"appliance_2.0.0.efi": 3 * MIB, "appliance_2.0.0.usr.raw": 9 * MIB})
    staging = tmp_path / "staging"
    staging.mkdir()

    def filling(path: Path) -> int:  # 10 MiB above the reserve, less what staging now holds
        assert path == staging
        return fetch.RESERVE_BYTES + 10 * MIB - sum(p.stat().st_size for p in staging.iterdir())

    source = Recording(str(tmp_path / "bundle"))
    with pytest.raises(fetch.ReserveReached) as e:
        download.stage(index, source, staging, free=filling)
    assert e.value.message == "stopped: / would have less than 1.0 GiB free; 2.0 MiB still to download"
    assert e.value.hint == "free 2.0 MiB more on / (journalctl --vacuum-size, old files), then run the same command again (it resumes)"
    part = staging / "appliance_2.0.0.usr.raw.part"
    assert (staging / "appliance_2.0.0.efi").stat().st_size == 3 * MIB
    assert part.stat().st_size == 7 * MIB  # kept, to the last byte written
    download.stage(index, source, staging, free=lambda path: 1 << 40)
    assert source.opened[-1] == ("appliance_2.0.0.usr.raw", 7 * MIB)  # resumed, not started over
    assert (staging / "appliance_2.0.0.usr.raw").read_bytes() == (tmp_path / "bundle/appliance_2.0.0.usr.raw").read_bytes()


def test_a_staging_download_within_the_reserve_is_not_stopped(tmp_path: Path) -> None:
    index = _bundle(tmp_path / "bundle", {"appliance_2.0.0.efi": 3 * MIB})
    staging = tmp_path / "staging"
    staging.mkdir()
    download.stage(index, Recording(str(tmp_path / "bundle")), staging, free=lambda path: fetch.RESERVE_BYTES + 3 * MIB)
    assert (staging / "appliance_2.0.0.efi").stat().st_size == 3 * MIB


def test_the_check_before_the_update_downloads_counts_the_reserve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = _bundle(tmp_path / "bundle", {"appliance_2.0.0.efi": 3 * MIB})
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setattr(download, "free_bytes", lambda path: fetch.RESERVE_BYTES + 3 * MIB - 1)
    with pytest.raises(UserError, match=r"MiB free, the bundle needs 3 MiB more plus a margin of 1024 MiB$") as e:
        download.check_space(index, staging)
    assert e.value.hint.startswith("free 0.1 MiB more on / ")  # rounded up: never "0.0 more"
    monkeypatch.setattr(download, "free_bytes", lambda path: fetch.RESERVE_BYTES + 3 * MIB)
    assert download.check_space(index, staging) == 3 * MIB
