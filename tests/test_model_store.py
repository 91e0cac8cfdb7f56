# SPDX-License-Identifier: MIT
"""The model store is written only through its own directory: a symbolic link, a FIFO or a
directory where the store holds something else is refused in one line naming it (nothing outside
the store is written, read or truncated); names are checked against the file system's limits when
the weights manifest is loaded; the per-host source is read capped, no link followed."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_weights import MODEL, REV, SIZES, FakeVerity, _snapshot, _store

import applianctl.model.store
from appliance.errors import UserError
from appliance.signed import weights_manifest
from appliance.signed.release_manifest import ManifestError
from applianctl.model import fetch, verify
from applianctl.records import WeightsFetch

PRECIOUS = b"not the store's\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_bytes(PRECIOUS)
    return victim


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    return outside


def _link(at: Path, to: Path) -> Path:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(to)
    return at


# Each sets up one thing in the store and returns (the path refused, what it is, what it should be).
Plant = Callable[[applianctl.model.store.Store, Path], tuple[Path, str, str]]
PLANTS: dict[str, Plant] = {
    "a symlinked snapshot subdirectory": lambda s, t: (_link(s.snapshot / "sub", _outside(t)), "a symbolic link", "a directory"),
    "a symlinked snapshot": lambda s, t: (_link(s.snapshot, _outside(t)), "a symbolic link", "a directory"),
    "a symlinked weight file": lambda s, t: (_link(s.snapshot / "config.json", _victim(t)), "a symbolic link", "a regular file"),
    "a symlinked .part": lambda s, t: (_link(s.partial / "a.safetensors.part", _victim(t)), "a symbolic link", "a regular file"),
    "a symlinked journal": lambda s, t: (_link(s.partial / "a.safetensors.part.journal", _victim(t)), "a symbolic link",
                                         "a regular file"),
    "a symlinked partial directory": lambda s, t: (_link(s.partial, _outside(t)), "a symbolic link", "a directory"),
    "a symlinked .partial": lambda s, t: (_link(s.partial.parent, _outside(t)), "a symbolic link", "a directory"),
    "a file where a directory belongs": lambda s, t: (_file(s.snapshot / "sub"), "a regular file", "a directory"),
    "a directory where a weight file belongs": lambda s, t: (_dir(s.snapshot / "config.json"), "a directory", "a regular file"),
    "a FIFO as a .part": lambda s, t: (_fifo(s.partial / "a.safetensors.part"), "a FIFO", "a regular file"),
}


def _file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(PRECIOUS)
    return path


def _dir(path: Path) -> Path:
    (path / "inside").mkdir(parents=True)
    return path


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_anything_but_directories_and_regular_files_in_the_store_is_refused_naming_it(tmp_path: Path, plant: str) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    path, kind, want = PLANTS[plant](store, tmp_path)
    with pytest.raises(UserError) as e:
        fetch.fetch(store, fetch.DirSource(str(src)), verity, workers=1)
    assert e.value.message == f"{path}: is {kind}, not {want} (nothing in the model store is followed or replaced)"
    rm = "rm -r" if kind == "a directory" else "rm"
    assert e.value.hint == f"remove it: {rm} {path}; then run applianctl model fetch again"
    assert not (tmp_path / "outside").exists() or list((tmp_path / "outside").iterdir()) == []  # nothing written through a link
    assert not (tmp_path / "victim").exists() or (tmp_path / "victim").read_bytes() == PRECIOUS  # nor truncated
    # as the hint says: removed, the fetch completes
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    fetch.fetch(store, fetch.DirSource(str(src)), verity, workers=1)
    assert verify.check(store, verity).ok


def test_a_link_put_in_place_of_the_partial_directory_after_a_cut_is_not_followed(tmp_path: Path) -> None:
    from test_weights import CutSource, PowerCut

    src, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    source = CutSource(fetch.DirSource(str(src)), "a.safetensors", 2 * fetch.CHUNK_BYTES + 5)
    with pytest.raises(PowerCut):
        fetch.fetch(store, source, verity, workers=1)
    outside = _outside(tmp_path)
    store.partial.rename(outside / "moved")  # swapped for a link between two runs
    _link(store.partial, outside / "moved")
    before = {p: p.read_bytes() for p in (outside / "moved").rglob("*") if p.is_file()}
    source.cut = 1 << 62
    with pytest.raises(UserError, match=r"\.partial/a{40}: is a symbolic link, not a directory"):
        fetch.fetch(store, source, verity, workers=1)
    assert {p: p.read_bytes() for p in (outside / "moved").rglob("*") if p.is_file()} == before


def test_the_store_directory_itself_a_link_is_refused(tmp_path: Path) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store = _store(tmp_path, manifest)
    _link(store.root, _outside(tmp_path))
    with pytest.raises(UserError, match=r"huggingface: is a symbolic link, not a directory") as e:
        fetch.fetch(store, fetch.DirSource(str(src)), FakeVerity())
    assert e.value.hint == f"remove it: rm {store.root}; then run applianctl model fetch again"
    assert list((tmp_path / "outside").iterdir()) == []


# ----------------------------------------------------------------------------------- names


def _plain(path: str) -> dict[str, object]:
    return {"model": MODEL, "revision": REV, "total_bytes": 1, "files": [{"path": path, "size": 1, "sha256": "0" * 64}]}


@pytest.mark.parametrize(("path", "expected"), [
    ("x" * 300, "a path whose names are at most 255 bytes each"),
    ("d/" + "x" * 256, "a path whose names are at most 255 bytes each"),
    ("/".join(["d" * 99] * 42), "a path of at most 4095 bytes"),  # 4,199 bytes, each name within NAME_MAX
    ("a//b", "a relative path without '..'"),
    ("/etc/passwd", "a relative path without '..'"),
    ("a/../b", "a relative path without '..'"),
    ("a\x00b", "a relative path without '..'"),
    ("a\nb", "a relative path without '..'"),
])
def test_a_name_the_file_system_cannot_hold_is_refused_when_the_manifest_is_loaded(path: str, expected: str) -> None:
    with pytest.raises(ManifestError, match=r"^weights manifest: files\[0\]\.path = '.*: expected ") as e:
        weights_manifest.from_plain(_plain(path))
    assert expected in e.value.message and "\n" not in e.value.message and len(e.value.message) < 200


def test_names_at_the_limits_load() -> None:
    assert weights_manifest.from_plain(_plain("x" * 255)).files[0].path == "x" * 255
    assert len(weights_manifest.from_plain(_plain("/".join(["d" * 99] * 40) + "/" + "x" * 95)).files[0].path) == 4095


def test_the_store_checks_its_own_prefix_and_suffixes_against_the_limits() -> None:
    cache = Path("/var/lib/appliance/huggingface")
    snapshot, partial = cache / "hub/models--org--model/snapshots" / REV, cache / ".partial" / REV
    fits = weights_manifest.make(MODEL, REV, [weights_manifest.WeightFile("x" * (255 - len(".part.journal")), 1, "0" * 64)])
    applianctl.model.store.check_names(fits, snapshot, partial)
    long_name = weights_manifest.make(MODEL, REV, [weights_manifest.WeightFile("x" * 250, 1, "0" * 64)])  # its journal: 263 bytes
    journal_too_long = (r"^/usr/lib/appliance/weights.json: 'x{30,}\.\.\.: "
                        r"its partial file's journal would be a name of 263 bytes, more than 255$")
    with pytest.raises(ManifestError, match=journal_too_long) as e:
        applianctl.model.store.check_names(long_name, snapshot, partial)
    assert e.value.hint.startswith("the weights manifest names a file this device cannot store")
    deep = "/".join(["d" * 99] * 40) + "/" + "x" * 90  # 4,090 bytes: the manifest's limit, not the store's
    with pytest.raises(ManifestError, match=r": on the disk it would be a path of 41[0-9]{2} bytes, more than 4095$"):
        deep_manifest = weights_manifest.make(MODEL, REV, [weights_manifest.WeightFile(deep, 1, "0" * 64)])
        applianctl.model.store.check_names(deep_manifest, snapshot, partial)


# ----------------------------------------------------------------------------------- the per-host source


def _config_for_source(source: str) -> Any:
    """As much of a Config as default_source reads."""
    return SimpleNamespace(model=SimpleNamespace(source=source))


def _host_store(tmp_path: Path) -> applianctl.model.store.Store:
    _, manifest = _snapshot(tmp_path, {"config.json": 10})
    store = _store(tmp_path, manifest)
    store.host_dir.mkdir(parents=True)
    return store


def test_the_per_host_source_is_one_line(tmp_path: Path) -> None:
    store = _host_store(tmp_path)
    (store.host_dir / applianctl.model.store.HOST_SOURCE).write_text("https://mirror.example/org/model\n")
    assert store.default_source(_config_for_source("")) == "https://mirror.example/org/model"
    (store.host_dir / applianctl.model.store.HOST_SOURCE).unlink()
    assert store.default_source(_config_for_source("/media/usb")) == "/media/usb"


@pytest.mark.parametrize("fault", ["a symbolic link", "a FIFO", "too large", "a directory"])
def test_a_per_host_source_someone_else_could_have_put_there_is_refused_in_one_line(tmp_path: Path, fault: str) -> None:
    store = _host_store(tmp_path)
    path = store.host_dir / applianctl.model.store.HOST_SOURCE
    if fault == "a symbolic link":
        (tmp_path / "elsewhere").write_text("https://evil.example/org/model\n")
        path.symlink_to(tmp_path / "elsewhere")
        expected = "is a symbolic link (not followed)"
    elif fault == "a FIFO":
        os.mkfifo(path)  # would block a plain read for ever
        expected = "is a FIFO, not a regular file"
    elif fault == "too large":
        path.write_bytes(b"x" * (applianctl.model.store.MAX_HOST_SOURCE_BYTES + 1))
        expected = f"{applianctl.model.store.MAX_HOST_SOURCE_BYTES + 1} bytes, more than {applianctl.model.store.MAX_HOST_SOURCE_BYTES}"
    else:
        path.mkdir()
        expected = "is a directory, not a regular file"
    with pytest.raises(UserError) as e:
        store.default_source(_config_for_source(""))
    assert e.value.message == f"{path}: {expected}" and e.value.hint


def test_a_journal_or_a_weight_file_that_became_a_directory_meanwhile_is_refused_not_replaced(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    with applianctl.model.store.StoreDir(root) as fs:
        (root / "j").mkdir()
        with pytest.raises(UserError, match=r"/j: is a directory, not a regular file"):
            fs.write_atomic("j", b"{}")
        fs.write_atomic("p", b"x")
        (root / "snap/w").mkdir(parents=True)
        with pytest.raises(UserError, match=r"/snap/w: is a directory, not a regular file"):
            fs.replace("p", "snap/w")
        assert (root / "p").read_bytes() == b"x" and [p.name for p in root.iterdir() if p.name.startswith(".tmp")] == []


def test_a_store_file_is_opened_without_following_a_link_and_only_when_regular(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    with applianctl.model.store.StoreDir(root) as fs:  # what every open in the store goes through, whatever was checked before it
        _link(root / "part", _victim(tmp_path))
        with pytest.raises(UserError, match=r"/cache/part: is a symbolic link, not a regular file"):
            fs.open_file("part", os.O_RDWR | os.O_CREAT)
        with pytest.raises(UserError, match=r"/cache/part: is a symbolic link, not a regular file"):
            fs.read("part", 100)
        _fifo(root / "fifo")
        with pytest.raises(UserError, match=r"/cache/fifo: is a FIFO, not a regular file"):
            fs.open_file("fifo", os.O_RDWR)
    assert (tmp_path / "victim").read_bytes() == PRECIOUS


# ----------------------------------------------------------------------------------- a directory source never leaves its root


def _store_bytes(store: applianctl.model.store.Store) -> list[bytes]:
    return [p.read_bytes() for p in store.root.rglob("*") if p.is_file() and not p.is_symlink()]


@pytest.mark.parametrize("where", ["the file", "a directory on the way"])
def test_a_directory_source_with_a_link_in_the_path_is_refused_and_none_of_its_bytes_stay(tmp_path: Path, where: str) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store = _store(tmp_path, manifest)
    secret = b"a file outside the source, shorter than the signed size\n"
    outside = _outside(tmp_path)
    if where == "the file":
        (outside / "secret").write_bytes(secret)
        (src / "a.safetensors").unlink()
        _link(src / "a.safetensors", outside / "secret")
        linked = f"{src}/a.safetensors"
    else:
        (outside / "b.safetensors").write_bytes(secret)
        shutil.rmtree(src / "sub")
        _link(src / "sub", outside)
        linked = f"{src}/sub"
    name = "a.safetensors" if where == "the file" else "sub/b.safetensors"
    with pytest.raises(UserError) as e:
        fetch.fetch(store, fetch.DirSource(str(src)), FakeVerity(), workers=1)
    assert e.value.message == f"{name}: {linked} is a symbolic link (a source directory is read without following links)"
    assert e.value.hint == f"copy the snapshot with its links resolved (cp -rL {src} DIR), then fetch from DIR"
    assert not any(secret in data for data in _store_bytes(store))


def test_a_directory_source_opens_nothing_but_names_beneath_it(tmp_path: Path) -> None:
    src, _ = _snapshot(tmp_path, SIZES)
    (tmp_path / "secret").write_bytes(PRECIOUS)
    source = fetch.DirSource(str(src))
    for name in ("../secret", f"{tmp_path}/secret", "sub/../../secret"):
        with pytest.raises(UserError, match=r"is not a relative path without '\.\.'"):
            source.open(name)
    assert b"".join(source.open("sub/b.safetensors")) == (src / "sub/b.safetensors").read_bytes()


# ----------------------------------------------------------------------------------- partial files are root's only


@pytest.fixture
def umask0() -> Any:
    """No umask: a file's mode is exactly the one it was created with."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_partial_files_are_0600_until_proven_and_sealed_then_0644(tmp_path: Path, umask0: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from test_weights import CutSource, PowerCut

    chmodded: list[str] = []  # the files fchmod'ed (each call still made)
    real = os.fchmod

    def spy(fd: int, mode: int) -> None:
        chmodded.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd, mode)

    monkeypatch.setattr(os, "fchmod", spy)

    src, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    source = CutSource(fetch.DirSource(str(src)), "a.safetensors", fetch.CHUNK_BYTES + 5)
    with pytest.raises(PowerCut):
        fetch.fetch(store, source, verity, workers=1)
    part = store.partial / "a.safetensors.part"
    journal = store.partial / "a.safetensors.part.journal"
    assert part.stat().st_size > 0 and journal.exists()
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (part, journal)} == {p.name: "0o600" for p in (part, journal)}
    assert [name for name in chmodded if name.endswith(".part")] == []  # created 0600, not made so after
    part.chmod(0o644)  # as an older release left it: root's only again once resumed
    source.cut = 1 << 62
    fetch.fetch(store, source, verity, workers=1)
    assert {oct(p.stat().st_mode & 0o777) for p in store.snapshot.rglob("*") if p.is_file()} == {"0o644"}
    assert verify.check(store, verity).ok


def test_a_partial_file_left_0644_by_an_older_release_is_made_0600_when_resumed(tmp_path: Path) -> None:
    from test_weights import CutSource, PowerCut

    src, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    source = CutSource(fetch.DirSource(str(src)), "a.safetensors", fetch.CHUNK_BYTES + 5)
    with pytest.raises(PowerCut):
        fetch.fetch(store, source, verity, workers=1)
    part = store.partial / "a.safetensors.part"
    part.chmod(0o644)
    with pytest.raises(PowerCut):  # cut again, at once: what the resume did to the partial file shows
        fetch.fetch(store, source, verity, workers=1)
    assert part.stat().st_mode & 0o777 == 0o600


# ----------------------------------------------------------------------------------- records on /var, through real directories


@pytest.mark.parametrize("linked", ["the host directory", "a directory above it"])
def test_a_record_is_not_written_through_a_linked_host_directory(tmp_path: Path, linked: str) -> None:
    src, manifest = _snapshot(tmp_path, SIZES, with_fsverity=False)  # no digests: the fetch records the measured ones
    store = _store(tmp_path, manifest)
    elsewhere = _outside(tmp_path)  # e.g. /etc: what a link on /var must not turn the root-run fetch's writes to
    store = applianctl.model.store.Store(manifest, store.snapshot, store.partial, tmp_path / "state/lib/host")
    at = store.host_dir if linked == "the host directory" else store.host_dir.parent
    _link(at, elsewhere)
    with pytest.raises(UserError) as e:
        fetch.fetch(store, fetch.DirSource(str(src)), FakeVerity(), workers=1)
    assert e.value.message == f"{at}: is a symbolic link, not a directory (nothing in the model store is followed or replaced)"
    assert e.value.hint == f"remove it: rm {at}; then run applianctl model fetch again"
    assert list(elsewhere.rglob("*")) == [] and not store.snapshot.exists()  # refused before the download
    with pytest.raises(UserError, match="is a symbolic link, not a directory"):  # the fetch command's own record too
        applianctl.model.store.write_host_record(
            store.host_dir, applianctl.model.store.FETCH_STATE, WeightsFetch("/src", REV, "2000-01-01T00:00:00Z"))
    assert list(elsewhere.rglob("*")) == []
    at.unlink()  # as the hint says
    fetch.fetch(store, fetch.DirSource(str(src)), FakeVerity(), workers=1)
    assert set(store.recorded()) == set(SIZES) and (store.host_dir / applianctl.model.store.RECORDED).stat().st_mode & 0o777 == 0o644


def test_the_store_is_not_reached_through_a_linked_directory_above_it(tmp_path: Path) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    cache = _store(tmp_path, manifest)
    store = applianctl.model.store.Store(manifest, cache.snapshot, cache.partial, tmp_path / "state/host")  # a real host directory
    outside = _outside(tmp_path)
    _link(store.root.parent, outside)  # .../var -> outside: the cache would land outside /var
    with pytest.raises(UserError, match=rf"^{tmp_path}/var: is a symbolic link, not a directory"):
        fetch.fetch(store, fetch.DirSource(str(src)), FakeVerity(), workers=1)
    assert list(outside.iterdir()) == []


# ----------------------------------------------------------------------------------- empty files


def test_a_zero_size_file_in_the_weights_manifest_is_fetched_as_an_empty_file(tmp_path: Path) -> None:
    src, manifest = _snapshot(tmp_path, {**SIZES, "empty.txt": 0, "sub/__init__.py": 0})
    store, verity = _store(tmp_path, manifest), FakeVerity()
    summary = fetch.fetch(store, fetch.DirSource(str(src)), verity, workers=2)
    assert summary["fetched_files"] == len(SIZES) + 2
    assert (store.snapshot / "empty.txt").read_bytes() == b"" and (store.snapshot / "sub/__init__.py").read_bytes() == b""
    assert verify.check(store, verity).ok
    assert fetch.fetch(store, fetch.DirSource(str(src)), verity)["fetched_files"] == 0
