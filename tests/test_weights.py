# SPDX-License-Identifier: MIT
"""Weights: the manifest from the Hub's own response objects, the fs-verity digest against
`fsverity digest`, fetch (resume after a cut at several points, a wrong byte from an HTTPS server,
a file too large, a full disk), and the check before every start.

The build host's kernel has no fs-verity: sealing and measuring go through FakeVerity, which seals
by inode and measures by computing the digest in user space (so a byte changed at rest shows)."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import appliance.signed.weights_manifest
import applianctl.model.fetch
import applianctl.model.store
from appliance import fetch, fsverity
from appliance.errors import UserError
from appliance.schema import dump_record
from appliance.signed.release_manifest import ManifestError
from appliance.signed.weights_manifest import WeightFile, WeightsManifest
from applianctl import tls
from applianctl.model import verify
from applianctl.model.fetch import CHUNK_BYTES
from builder import weights, weights_mirror
from builder.weights_mirror import Mirror

MODEL, REV = "org/model", "a" * 40


# ----------------------------------------------------------------------------------- fs-verity digest


@pytest.mark.programs
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 128 * 4096, 128 * 4096 + 1, 3 * 1024 * 1024 + 17])
def test_fsverity_digest_matches_the_tool(tmp_path: Path, size: int) -> None:
    data = hashlib.sha256(str(size).encode()).digest() * (size // 32 + 1)
    path = tmp_path / "f"
    path.write_bytes(data[:size])
    ours = fsverity.digest_file(path)
    assert ours == fsverity.digest_bytes(data[:size])
    if shutil.which("fsverity") is None:
        pytest.skip("fsverity is not installed (make setup installs it)")
    out = subprocess.run(["fsverity", "digest", str(path)], capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == f"sha256:{ours}"


def test_fsverity_known_vector_empty_file() -> None:
    # `fsverity digest` of an empty file (fsverity-utils 1.5): SHA-256 of the descriptor with a zero root
    assert fsverity.digest_bytes(b"") == "3d248ca542a24fc62d1c43b916eae5016878e2533c88238480b26128a1f1af95"


# ----------------------------------------------------------------------------------- pin


def _blob_sha1(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class FakeApi:
    """Installs HfApi.list_repo_tree answering the library's own RepoFile/RepoFolder objects, built
    from the tree API's JSON as the library builds them (lfs: size, oid = SHA-256, pointerSize)."""

    def __init__(self, files: dict[str, bytes], lfs: set[str], monkeypatch: pytest.MonkeyPatch | None = None) -> None:
        from huggingface_hub import HfApi
        from huggingface_hub.hf_api import RepoFile, RepoFolder

        self.entries: list[Any] = [RepoFolder(path="sub", oid="0" * 40)]
        for name, data in files.items():
            info = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 134} if name in lfs else None
            self.entries.append(RepoFile(path=name, size=len(data), oid=_blob_sha1(data), lfs=info))
        self.calls: list[tuple[str, str | None]] = []
        fake = self

        def list_repo_tree(api: Any, repo_id: str, *, recursive: bool = False, revision: str | None = None, **kw: Any) -> Iterator[Any]:
            fake.calls.append((repo_id, revision))
            assert recursive
            return iter(fake.entries)

        if monkeypatch is not None:
            monkeypatch.setattr(HfApi, "list_repo_tree", list_repo_tree)
        self.list_repo_tree = lambda *a, **kw: list_repo_tree(None, *a, **kw)


FILES = {"config.json": b'{"a": 1}\n', "sub/model.safetensors": b"\x01" * 10000}


def test_pin_from_hub_objects_uses_lfs_sha256_and_downloads_small_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    api = FakeApi(FILES, lfs={"sub/model.safetensors"}, monkeypatch=monkeypatch)
    downloaded = []

    def fake_download(repo_id: str, filename: str, *, revision: str, local_dir: Path) -> str:
        downloaded.append(filename)
        path = Path(local_dir) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(FILES[filename])
        return str(path)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    model = weights.pin(MODEL, REV, None, offline=False)  # a real HfApi, its tree call answered by the fake
    assert api.calls == [(MODEL, REV)]
    assert downloaded == ["config.json"]  # the LFS file is never downloaded: the Hub gives its SHA-256
    by = {f.path: f for f in model.files}
    assert by["sub/model.safetensors"].sha256 == hashlib.sha256(FILES["sub/model.safetensors"]).hexdigest()
    assert by["sub/model.safetensors"].fsverity == ""  # not computed without the file: the device records it
    assert by["config.json"].sha256 == hashlib.sha256(FILES["config.json"]).hexdigest()
    assert model.total_bytes == sum(len(d) for d in FILES.values())
    assert appliance.signed.weights_manifest.loads(appliance.signed.weights_manifest.dumps(model)) == model


@pytest.mark.parametrize("fault", ["not found", "no network"])
def test_pin_when_the_hub_is_unreachable_is_one_line(monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    import httpx2  # the HTTP client huggingface_hub 2.x is built on: its errors carry its responses
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    url = "https://huggingface.co/api/models/org/model/tree"

    def unreachable(*args: Any, **kw: Any) -> Any:
        if fault == "no network":  # what this build host gets
            raise httpx2.ConnectError("[Errno -2] Name or service not known")
        response = httpx2.Response(404, request=httpx2.Request("GET", url))
        raise HfHubHTTPError(f"404 Client Error: Repository Not Found for url: {url}", response=response)

    monkeypatch.setattr(HfApi, "list_repo_tree", unreachable)
    why = "404 Client Error" if fault == "not found" else r"\[Errno -2\] Name or service not known"
    with pytest.raises(UserError, match=rf"^org/model@a{{40}}: the Hub's file list is not available \({why}") as e:
        weights.pin(MODEL, REV, None, offline=False)
    assert "\n" not in e.value.message and "--offline" in e.value.hint


def test_pin_from_a_local_copy_adds_fsverity_and_refuses_a_differing_copy(tmp_path: Path) -> None:
    for name, data in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    api = FakeApi(FILES, lfs={"sub/model.safetensors"})
    model = weights.pin(MODEL, REV, tmp_path, offline=False, api=api)
    assert all(f.fsverity == fsverity.digest_bytes(FILES[f.path]) for f in model.files)
    (tmp_path / "sub/model.safetensors").write_bytes(b"\x02" * 10000)
    with pytest.raises(UserError, match=r"sub/model.safetensors: SHA-256 .* differs from the Hub's"):
        weights.pin(MODEL, REV, tmp_path, offline=False, api=api)
    (tmp_path / "config.json").write_bytes(b'{"a": 2}\n')
    with pytest.raises(UserError, match=r"config\.json: git blob id differs"):
        weights.pin(MODEL, REV, tmp_path, offline=False, api=FakeApi({**FILES, "sub/model.safetensors": b"\x02" * 10000}, set()))


def test_weights_manifest_refusals() -> None:
    good = appliance.signed.weights_manifest.make(MODEL, REV, [WeightFile("a", 1, "0" * 64)])
    plain = {"model": MODEL, "revision": REV, "total_bytes": 1, "files": [{"path": "a", "size": 1, "sha256": "0" * 64}]}
    assert appliance.signed.weights_manifest.from_plain(plain) == dataclasses.replace(good)
    for change, message in (
        ({"total_bytes": 2}, "total_bytes = 2, but the files add up to 1"),
        ({"files": [{"path": "../a", "size": 1, "sha256": "0" * 64}]}, r"files\[0\].path"),
        ({"files": [{"path": "a", "size": 1, "sha256": "0" * 64, "x": 1}]}, "unknown field"),
        ({"files": [{"path": "a", "size": 1, "sha256": "0" * 64}] * 2, "total_bytes": 2}, "a is listed twice"),
    ):
        with pytest.raises(ManifestError, match=message):
            appliance.signed.weights_manifest.from_plain({**plain, **change})
    with pytest.raises(ManifestError, match="canonical"):
        appliance.signed.weights_manifest.loads(appliance.signed.weights_manifest.dumps(good) + b" ")


def test_demo_manifest_is_committed_and_deterministic() -> None:
    from builder.weights import ROOT

    committed = appliance.signed.weights_manifest.loads((ROOT / "weights/demo.json").read_bytes())
    assert committed == weights.demo_manifest(committed.model, committed.revision)
    assert 120 << 20 < committed.total_bytes < 136 << 20 and len(committed.files) == 5


# ----------------------------------------------------------------------------------- fetch


class FakeVerity:
    """Seals by inode; measures by computing the digest from the bytes now in the file."""

    def __init__(self) -> None:
        self.sealed: set[tuple[int, int]] = set()

    def enable(self, path: Path, dir_fd: int | None = None) -> None:
        st = os.stat(path.name if dir_fd is not None else path, dir_fd=dir_fd, follow_symlinks=False)
        self.sealed.add((st.st_dev, st.st_ino))

    def measure(self, path: Path, dir_fd: int | None = None) -> str | None:
        fd = os.open(path.name if dir_fd is not None else path, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            return fsverity.digest_file(Path(f"/proc/self/fd/{fd}")) if (st.st_dev, st.st_ino) in self.sealed else None
        finally:
            os.close(fd)


def _snapshot(tmp_path: Path, sizes: dict[str, int], with_fsverity: bool = True) -> tuple[Path, WeightsManifest]:
    src = tmp_path / "src"
    files = []
    for i, (name, size) in enumerate(sizes.items()):
        data = (hashlib.sha256(f"{i}".encode()).digest() * (size // 32 + 1))[:size]
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
        files.append(WeightFile(name, size, hashlib.sha256(data).hexdigest(), fsverity.digest_bytes(data) if with_fsverity else ""))
    return src, appliance.signed.weights_manifest.make(MODEL, REV, files)


def _store(tmp_path: Path, manifest: WeightsManifest) -> applianctl.model.store.Store:
    cache = tmp_path / "var/huggingface"
    return applianctl.model.store.Store(manifest, cache / "snapshot", cache / ".partial" / REV, tmp_path / "var/host")


SIZES = {"config.json": 100, "a.safetensors": 3 * CHUNK_BYTES + 12345, "sub/b.safetensors": CHUNK_BYTES}


def test_fetch_from_a_directory_seals_records_and_verifies(tmp_path: Path) -> None:
    src, manifest = _snapshot(tmp_path, SIZES, with_fsverity=False)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    summary = applianctl.model.fetch.fetch(store, applianctl.model.fetch.DirSource(str(src)), verity)
    assert summary["fetched_bytes"] == manifest.total_bytes
    for name in SIZES:
        assert (store.snapshot / name).read_bytes() == (src / name).read_bytes()
        assert verity.measure(store.snapshot / name) is not None
    assert set(store.recorded()) == set(SIZES)  # no digests in the manifest: the device recorded them
    assert not store.partial.exists()
    assert verify.check(store, verity).ok
    # run again: nothing fetched
    assert applianctl.model.fetch.fetch(store, applianctl.model.fetch.DirSource(str(src)), verity)["fetched_files"] == 0


class PowerCut(BaseException):
    """The power goes: nothing of the fetch runs after it (not an Exception: no retry catches it)."""


class CutSource:
    """A directory source whose bytes stop (like a power cut) after CUT bytes of one file."""

    def __init__(self, inner: applianctl.model.fetch.DirSource, path: str, cut: int) -> None:
        self.spec, self.inner, self.path, self.cut = inner.spec, inner, path, cut
        self.starts: list[int] = []

    def open(self, path: str, start: int = 0, *, chunk: int = fetch.CHUNK) -> fetch.Body:
        body = self.inner.open(path, start, chunk=chunk)
        if path != self.path:
            return body
        self.starts.append(start)

        def cut() -> Iterator[bytes]:
            have = start
            for data in body:
                if have + len(data) >= self.cut:
                    yield data[: self.cut - have]
                    raise PowerCut  # the process dies here; nothing else runs
                have += len(data)
                yield data

        return fetch.Body(body.offset, cut(), body.close)


@pytest.mark.parametrize("cut", [1, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1,
                                 2 * CHUNK_BYTES + 777, 3 * CHUNK_BYTES + 12344])
def test_resume_after_a_cut_fetches_at_most_one_chunk_again(tmp_path: Path, cut: int) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    source = CutSource(applianctl.model.fetch.DirSource(str(src)), "a.safetensors", cut)
    with pytest.raises(PowerCut):
        applianctl.model.fetch.fetch(store, source, verity, workers=1)
    part = store.partial / "a.safetensors.part"
    # what the cut left: bytes after the journal's length may be lost (a power cut): drop them
    with store.open_dir() as fs:
        journal = applianctl.model.fetch.read_journal(fs, store.rel(part), manifest.file("a.safetensors"))  # type: ignore[arg-type]
    with open(part, "r+b") as f:
        f.truncate(max(journal.length, min(cut, part.stat().st_size)))
        f.seek(journal.length)
        f.write(b"\xff" * (min(cut, part.stat().st_size) - journal.length))  # garbage past the journal
    source.cut = 1 << 62
    applianctl.model.fetch.fetch(store, source, verity, workers=1)
    resumed_at = source.starts[-1]
    assert resumed_at == journal.length and cut - resumed_at <= CHUNK_BYTES
    assert (store.snapshot / "a.safetensors").read_bytes() == (src / "a.safetensors").read_bytes()
    assert verify.check(store, verity).ok


def test_a_partial_file_changed_at_rest_starts_over(tmp_path: Path) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    source = CutSource(applianctl.model.fetch.DirSource(str(src)), "a.safetensors", 2 * CHUNK_BYTES + 5)
    with pytest.raises(PowerCut):
        applianctl.model.fetch.fetch(store, source, verity, workers=1)
    part = store.partial / "a.safetensors.part"
    with open(part, "r+b") as f:
        f.seek(10)
        f.write(b"X")
    source.cut = 1 << 62
    applianctl.model.fetch.fetch(store, source, verity, workers=1)
    assert source.starts[-1] == 0
    assert (store.snapshot / "a.safetensors").read_bytes() == (src / "a.safetensors").read_bytes()


def test_a_file_too_large_is_refused_naming_it(tmp_path: Path) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    with open(src / "sub/b.safetensors", "ab") as f:
        f.write(b"!")
    store = _store(tmp_path, manifest)
    with pytest.raises(UserError, match=r"^sub/b.safetensors: the source sent more than the 8388608 bytes"):
        applianctl.model.fetch.fetch(store, applianctl.model.fetch.DirSource(str(src)), FakeVerity())
    assert not (store.snapshot / "sub/b.safetensors").exists() and not (store.partial / "sub/b.safetensors.part").exists()


def test_not_enough_space_is_refused_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store = _store(tmp_path, manifest)
    monkeypatch.setattr(applianctl.model.fetch, "free_bytes", lambda path: manifest.total_bytes // 2)
    with pytest.raises(UserError, match=r"^not enough space for the weights: 32.3 MiB to download and 1.0 GiB kept free on /, "
                                        r"16.0 MiB free$") as e:
        applianctl.model.fetch.fetch(store, applianctl.model.fetch.DirSource(str(src)), FakeVerity())
    assert e.value.hint.startswith("free 1.1 GiB more on / ") and e.value.hint.endswith("then run the same command again (it resumes)")
    assert not store.partial.exists()


def test_room_for_the_files_but_not_for_the_reserve_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store = _store(tmp_path, manifest)
    # the files fit; the journal's room does not
    monkeypatch.setattr(applianctl.model.fetch, "free_bytes", lambda path: 2 * manifest.total_bytes)
    with pytest.raises(UserError, match=r"^not enough space for the weights: .* and 1.0 GiB kept free"):
        applianctl.model.fetch.fetch(store, applianctl.model.fetch.DirSource(str(src)), FakeVerity())
    assert not store.partial.exists()


class FillingDisk:
    """A file system of FREE bytes above the reserve once the fetch has started (the first figure,
    its check before downloading, is plenty: something else fills the disk meanwhile), less what
    the store now holds."""

    def __init__(self, store: applianctl.model.store.Store, free: int) -> None:
        self.store, self.free, self.calls = store, free, 0

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.store.root.rglob("*") if p.is_file() and not p.is_symlink())

    def __call__(self, path: Path) -> int:
        self.calls += 1
        return 1 << 40 if self.calls == 1 else fetch.RESERVE_BYTES + self.free - self.used()


def test_a_fetch_stops_at_the_reserve_keeps_its_partial_file_and_the_next_run_resumes(tmp_path: Path) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    source = CutSource(applianctl.model.fetch.DirSource(str(src)), "a.safetensors", 1 << 62)
    with pytest.raises(fetch.ReserveReached) as e:
        applianctl.model.fetch.fetch(store, source, verity, workers=1, free=FillingDisk(store, 10 * CHUNK_BYTES // 8 + (1 << 19)))
    assert re.fullmatch(r"stopped: / would have less than 1.0 GiB free; 2[0-9].[0-9] MiB still to download", e.value.message)
    assert re.fullmatch(r"free 2[0-9].[0-9] MiB more on / \(journalctl --vacuum-size, old files\), "
                        r"then run the same command again \(it resumes\)", e.value.hint)
    part = store.partial / "a.safetensors.part"
    with store.open_dir() as fs:  # the first chunk is durable: the next run resumes after it
        assert applianctl.model.fetch.read_journal(fs, store.rel(part), manifest.file("a.safetensors")).length == CHUNK_BYTES  # type: ignore[arg-type]
    assert not (store.snapshot / "a.safetensors").exists()
    summary = applianctl.model.fetch.fetch(store, source, verity, workers=1, free=lambda path: 1 << 40)
    assert source.starts == [0, CHUNK_BYTES]  # a Range request from the journal's length
    assert summary["fetched_bytes"] == manifest.total_bytes - CHUNK_BYTES
    assert verify.check(store, verity).ok


def test_a_fetch_stops_before_sealing_when_the_merkle_tree_would_take_the_reserve(tmp_path: Path) -> None:
    src, manifest = _snapshot(tmp_path, {"w.safetensors": CHUNK_BYTES})
    store, verity = _store(tmp_path, manifest), FakeVerity()
    source = CutSource(applianctl.model.fetch.DirSource(str(src)), "w.safetensors", 1 << 62)
    with pytest.raises(fetch.ReserveReached, match=r"^stopped: / would have less than 1.0 GiB free; 0.1 MiB still to download$"):
        applianctl.model.fetch.fetch(store, source, verity, workers=1, free=FillingDisk(store, CHUNK_BYTES + 4096))
    assert (store.partial / "w.safetensors.part").stat().st_size == CHUNK_BYTES  # whole, not sealed
    assert verity.sealed == set()
    summary = applianctl.model.fetch.fetch(store, source, verity, workers=1, free=lambda path: 1 << 40)
    assert (source.starts, summary["fetched_bytes"]) == ([0], 0)  # only the sealing and the rename were left
    assert verify.check(store, verity).ok


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.programs
def test_a_full_disk_is_one_line_naming_the_file(tmp_path: Path, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store = applianctl.model.store.Store(manifest, small_tmpfs / "snapshot", small_tmpfs / ".partial" / REV, tmp_path / "host")
    monkeypatch.setattr(applianctl.model.fetch, "free_bytes", lambda path: 1 << 40)  # as if the space went while fetching
    with pytest.raises(UserError, match=r"^(a|sub/b).safetensors: the disk is full") as e:
        applianctl.model.fetch.fetch(store, applianctl.model.fetch.DirSource(str(src)), FakeVerity(), workers=1)
    assert "\n" not in e.value.message


# ----------------------------------------------------------------------------------- HTTPS mirror


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[tuple[str, str, type[Mirror]]]:
    """The local HTTPS mirror (builder/weights_mirror.py) over tmp_path/src."""
    tls.generate(tmp_path / "tls", "mirror.test", [ipaddress.ip_address("127.0.0.1")], group="nonexistent-group")
    with weights_mirror.serve(tmp_path / "src", tmp_path / "tls/server.crt", tmp_path / "tls/server.key") as (port, handler):
        yield f"https://127.0.0.1:{port}/{MODEL}/", str(tmp_path / "tls/ca.crt"), handler


def test_the_mirror_serves_nothing_outside_its_directory(tmp_path: Path, mirror: tuple[str, str, type[Mirror]]) -> None:
    """`make demo` runs it as root on the build host: a request target with .. or a link out of
    the directory gets 404, not the host's files."""
    import http.client
    import ssl

    url, ca, _ = mirror
    (tmp_path / "src").mkdir(exist_ok=True)
    (tmp_path / "secret").write_text("host file")
    (tmp_path / "src/link").symlink_to(tmp_path / "secret")
    (tmp_path / "src/inside").write_text("served")
    port = int(url.split(":")[2].split("/")[0])
    ctx = ssl.create_default_context(cafile=ca)
    for target, status in (("/inside", 200), ("/../secret", 404), ("/a/../../secret", 404), ("/link", 404),
                           ("/resolve/r/../../secret", 404)):
        conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
        conn.putrequest("GET", target, skip_host=True)
        conn.putheader("Host", "127.0.0.1")
        conn.endheaders()
        resp = conn.getresponse()
        assert (target, resp.status) == (target, status) and b"host file" not in resp.read()
        conn.close()


def test_fetch_over_https_and_a_wrong_byte_is_refused_naming_the_file(tmp_path: Path, mirror: tuple[str, str, type[Mirror]]) -> None:
    url, ca, handler = mirror
    _, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    handler.flip, handler.always_flip = frozenset({"sub/b.safetensors"}), True
    source = applianctl.model.fetch.open_source(url, ca, "auto", MODEL, REV)
    with pytest.raises(UserError, match=r"^sub/b.safetensors: SHA-256 [0-9a-f]{64} is not the signed manifest's") as e:
        applianctl.model.fetch.fetch(store, source, verity, workers=3)
    assert "\n" not in e.value.message
    assert not (store.snapshot / "sub/b.safetensors").exists() and not (store.partial / "sub/b.safetensors.part").exists()
    assert all(e["path"].startswith(f"/{MODEL}/resolve/{REV}/") for e in handler.log)  # the Hub's layout
    handler.flip = frozenset()
    applianctl.model.fetch.fetch(store, applianctl.model.fetch.open_source(url, ca, "auto", MODEL, REV), verity, workers=3)
    assert verify.check(store, verity).ok


def test_a_server_error_is_retried_then_one_line_naming_the_file(tmp_path: Path, mirror: tuple[str, str, type[Mirror]],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    url, ca, handler = mirror
    _, manifest = _snapshot(tmp_path, SIZES)
    handler.fail = "config.json"
    monkeypatch.setattr(applianctl.model.fetch.time, "sleep", lambda s: None)
    with pytest.raises(UserError) as e:
        source = applianctl.model.fetch.open_source(url, ca, "auto", MODEL, REV)
        applianctl.model.fetch.fetch(_store(tmp_path, manifest), source, FakeVerity())
    assert e.value.message == "config.json: download failed (the server answered HTTP 503)"
    statuses = [e["status"] for e in handler.log if e["name"] == "config.json"]
    assert statuses == [503] * applianctl.model.fetch.ATTEMPTS  # retried, then named
    handler.fail = ""


def test_https_resume_asks_for_the_journal_length(tmp_path: Path, mirror: tuple[str, str, type[Mirror]]) -> None:
    url, ca, handler = mirror
    _, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    inner = applianctl.model.fetch.open_source(url, ca, "hub", MODEL, REV)
    cut = CutSource(inner, "a.safetensors", 2 * CHUNK_BYTES + 100)  # type: ignore[arg-type]
    with pytest.raises(PowerCut):
        applianctl.model.fetch.fetch(store, cut, verity, workers=1)
    cut.cut = 1 << 62
    applianctl.model.fetch.fetch(store, cut, verity, workers=1)
    ranges = [e["range"] for e in handler.log if e["name"] == "a.safetensors"]
    assert ranges[-1] == f"bytes={2 * CHUNK_BYTES}-"
    assert verify.check(store, verity).ok


# ----------------------------------------------------------------------------------- verify


def test_verify_names_a_missing_changed_unsealed_or_extra_file(tmp_path: Path) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    applianctl.model.fetch.fetch(store, applianctl.model.fetch.DirSource(str(src)), verity)
    expected = {"ok": True, "reason": "", "revision": REV, "files": 3, "bytes": manifest.total_bytes, "deep": False}
    assert dump_record(verify.check(store, verity)) == expected
    target = store.snapshot / "a.safetensors"
    data = bytearray(target.read_bytes())
    data[5] ^= 1
    target.write_bytes(bytes(data))  # same inode: the fake stays "sealed"; the digest changes
    result = verify.check(store, verity)
    assert result.reason == "model weights: a.safetensors was changed (its fs-verity digest is not the signed one)"
    assert result.file == "a.safetensors"
    os.link(target, tmp_path / "keep")  # the old inode stays in use: the new file cannot reuse its number
    target.unlink()
    assert verify.check(store, verity).reason == "model weights: a.safetensors is missing"
    target.write_bytes((src / "a.safetensors").read_bytes())
    assert verify.check(store, verity).reason == "model weights: a.safetensors is not sealed with fs-verity"
    verity.enable(target)
    (store.snapshot / "evil.py").write_text("import os\n")
    assert verify.check(store, verity).reason == "model weights: evil.py is in the snapshot but not in the signed manifest"


def test_a_block_refused_on_read_is_named_and_refused_until_fetched_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, manifest = _snapshot(tmp_path, SIZES)
    store, verity = _store(tmp_path, manifest), FakeVerity()
    applianctl.model.fetch.fetch(store, applianctl.model.fetch.DirSource(str(src)), verity)
    read_all = verify.read_all

    def eio_for_a(path: Path) -> None:  # what fs-verity does with a block changed on the disk
        if path.name == "a.safetensors":
            raise OSError(errno.EIO, "Input/output error")
        read_all(path)

    monkeypatch.setattr(verify, "read_all", eio_for_a)
    assert verify.check(store, verity).ok  # the digest is of the signed contents: constant time cannot see it
    result = verify.check(store, verity, deep=True)
    assert result.reason == ("model weights: a.safetensors: a block was refused on read (Input/output error): "
                                "the file changed on the disk")
    again = verify.check(store, verity)  # from now on before every start too
    assert (again.ok, again.file) == (False, "a.safetensors")
    monkeypatch.setattr(verify, "read_all", read_all)
    summary = applianctl.model.fetch.fetch(store, applianctl.model.fetch.DirSource(str(src)), verity)
    assert summary["fetched_files"] == 1 and store.corrupt() == {}
    assert verify.check(store, verity, deep=True).ok


def test_load_manifest_requires_the_release_pin(tmp_path: Path) -> None:
    _, manifest = _snapshot(tmp_path, {"x": 10})
    data = appliance.signed.weights_manifest.dumps(manifest)
    (tmp_path / "weights.json").write_bytes(data)
    (tmp_path / "manifest.json").write_text(json.dumps({"model": {"weights_sha256": appliance.signed.weights_manifest.sha256(data)}}))
    assert applianctl.model.store.load_manifest(tmp_path / "weights.json", tmp_path / "manifest.json") == manifest
    (tmp_path / "manifest.json").write_text('{"model": {}}')
    with pytest.raises(ManifestError, match="is not the one the release manifest pins"):
        applianctl.model.store.load_manifest(tmp_path / "weights.json", tmp_path / "manifest.json")
    assert applianctl.model.store.load_manifest(tmp_path / "none.json", tmp_path / "manifest.json") is None


# ----------------------------------------------------------------------------------- command line and status


@pytest.fixture
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, WeightsManifest, Path]:
    """A device tree: appliance.json (demo profile, model cache in tmp), weights.json pinned by manifest.json."""
    from appliance import config, paths
    from builder.weights import ROOT

    demo = config.load(ROOT / "appliance.toml", "demo")
    cache = tmp_path / "var/huggingface"
    demo = dataclasses.replace(demo, model=dataclasses.replace(demo.model, id=MODEL, revision=REV, cache_dir=str(cache)))
    lib, run, state = tmp_path / "lib", tmp_path / "run", tmp_path / "state"
    for d in (lib, run, state):
        d.mkdir()
    (lib / "appliance.json").write_text(json.dumps(demo.to_json()))
    monkeypatch.setenv("APPLIANCE_CONFIG", str(lib / "appliance.json"))
    for name, value in {"LIB_DIR": lib, "RUN_DIR": run, "STATE_DIR": state, "MANIFEST": lib / "manifest.json"}.items():
        monkeypatch.setattr(paths, name, value)
    src, manifest = _snapshot(tmp_path, {"config.json": 10, "w.safetensors": 5000})
    data = appliance.signed.weights_manifest.dumps(manifest)
    (lib / "weights.json").write_bytes(data)
    (lib / "manifest.json").write_text(json.dumps({"model": {"weights_sha256": appliance.signed.weights_manifest.sha256(data)}}))
    return src, manifest, Path(demo.model.weights_dir)


def test_model_fetch_and_verify_commands(device: tuple[Path, WeightsManifest, Path], monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    import applianctl.status.weights
    from appliance import paths
    from applianctl.__main__ import main
    from applianctl.model import command
    from applianctl.status import probes

    src, _, snapshot = device
    verity = FakeVerity()
    monkeypatch.setattr(command, "Kernel", lambda: verity)
    assert main(["model", "verify"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == "model weights: config.json is missing"
    part = applianctl.status.weights.probe_weights(_config())
    assert (part.state, part.to_json()["file"], part.to_json()["verified"]) == (probes.DOWN, "config.json", False)
    assert main(["model", "fetch", str(src)]) == 0
    assert "2 files, 5010 bytes in place and sealed" in capsys.readouterr().out
    assert main(["model", "verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    part = applianctl.status.weights.probe_weights(_config())
    assert (part.state, part.to_json()["verified"], part.to_json()["source"], part.to_json()["files"]) == (probes.OK, True, str(src), 2)
    (snapshot / "w.safetensors").write_bytes(b"\0" * 5000)  # the same inode, other bytes
    assert main(["model", "verify"]) == 1
    changed = "w.safetensors was changed (its fs-verity digest is not the signed one)"
    assert capsys.readouterr().err.startswith(f"model weights: {changed}\nhint: ")
    part = applianctl.status.weights.probe_weights(_config())
    assert (part.state, part.reason) == (probes.DOWN, changed)
    (paths.LIB_DIR / "weights.json").unlink()
    assert main(["model", "verify"]) == 0
    assert applianctl.status.weights.probe_weights(_config()).state == probes.NOT_CONFIGURED


def test_model_fetch_at_boot_takes_the_source_handed_over_and_does_nothing_once_the_weights_are_in_place(
        device: tuple[Path, WeightsManifest, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """appliance-model-fetch.service: `applianctl model fetch --at-boot` at every boot."""
    from applianctl.__main__ import main
    from applianctl.model import command

    src, _, snapshot = device
    verity = FakeVerity()
    monkeypatch.setattr(command, "Kernel", lambda: verity)
    creds = tmp_path / "credentials"
    creds.mkdir()
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    # no source anywhere: said in one line, not a failure (the start check names the missing file)
    assert main(["model", "fetch", "--at-boot"]) == 0
    out = capsys.readouterr().out
    assert "config.json is missing; no source to fetch them from" in out and not (snapshot / "config.json").exists()
    # a source handed over with the boot (the credential)
    (creds / command.SOURCE_CREDENTIAL).write_text(f"{src}\n")
    assert main(["model", "fetch", "--at-boot"]) == 0
    assert "2 files, 5010 bytes in place and sealed (2 fetched" in capsys.readouterr().out
    assert main(["model", "verify"]) == 0
    capsys.readouterr()
    # the next boot: nothing fetched, the source not even read
    shutil.rmtree(src)
    assert main(["model", "fetch", "--at-boot"]) == 0
    assert "in place, as signed; nothing to fetch" in capsys.readouterr().out


@pytest.mark.parametrize("hostile", ["http://mirror.test/m/", "relative/dir", "/tmp/x\n/etc", "https://a b/"])
def test_model_fetch_at_boot_refuses_a_credential_that_is_not_a_source(
        device: tuple[Path, WeightsManifest, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], hostile: str) -> None:
    from applianctl.__main__ import main
    from applianctl.model import command

    monkeypatch.setattr(command, "Kernel", FakeVerity)
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / command.SOURCE_CREDENTIAL).write_text(hostile)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    assert main(["model", "fetch", "--at-boot"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and command.SOURCE_CREDENTIAL in err[0] and err[1].startswith("hint: "), err


def test_model_fetch_where_no_appliance_is_installed_names_the_missing_configuration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from appliance import paths
    from applianctl.__main__ import main

    monkeypatch.setenv("APPLIANCE_CONFIG", str(tmp_path / "lib/appliance.json"))
    for name, value in {"LIB_DIR": tmp_path / "lib", "RUN_DIR": tmp_path / "run", "STATE_DIR": tmp_path / "state",
                        "MANIFEST": tmp_path / "lib/manifest.json"}.items():
        monkeypatch.setattr(paths, name, value)
    assert main(["model", "fetch", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"applianctl: {tmp_path / 'lib/appliance.json'}: no appliance configuration"
    assert err[1].startswith("hint: ") and len(err) == 2
    assert "pins no weights" not in "\n".join(err)


def test_model_fetch_on_an_image_without_weights_says_so(device: tuple[Path, WeightsManifest, Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from appliance import paths
    from applianctl.__main__ import main

    (paths.LIB_DIR / "weights.json").unlink()
    assert main(["model", "fetch", str(device[0])]) == 2
    assert "this image pins no weights" in capsys.readouterr().err


def _config() -> Any:
    from appliance.host_settings import load_device

    return load_device()


def test_validate_and_build_refuse_a_missing_or_foreign_weights_manifest(tmp_path: Path) -> None:
    from appliance import config
    from builder import validate
    from builder.weights import ROOT

    demo = config.load(ROOT / "appliance.toml", "demo")
    pinned = dataclasses.replace(demo, model=dataclasses.replace(demo.model, weights_manifest="weights/demo.json"))
    assert weights.problems(pinned, ROOT) == []
    assert weights.release_pin(pinned) == {"weights_sha256": hashlib.sha256((ROOT / "weights/demo.json").read_bytes()).hexdigest()}
    missing = dataclasses.replace(demo, model=dataclasses.replace(demo.model, weights_manifest="weights/none.json"))
    (found,) = [e for e in validate.problems(missing, ROOT) if "weights" in e.message]
    assert found.message.endswith("weights/none.json: no such file (model.weights_manifest)")
    # the demo's weights are generated, not pinned from the Hub
    assert found.hint == "write it with `python3 -m builder --profile demo weights demo`"
    other = dataclasses.replace(pinned, model=dataclasses.replace(pinned.model, revision="b" * 40))
    (found,) = weights.problems(other, ROOT)
    assert "pins standin/tiny-demo@0000000000000000000000000000000000000001, the configuration" in found.message
    assert found.hint == "write it with `python3 -m builder --profile demo weights demo`"
    production = dataclasses.replace(missing, profile="production")
    (found,) = weights.problems(production, ROOT)
    assert found.hint == "write it with `python3 -m builder --profile production weights pin`"
    tree = tmp_path / "tree"
    weights.install(pinned, tree)
    assert (tree / "usr/lib/appliance/weights.json").read_bytes() == (ROOT / "weights/demo.json").read_bytes()
    unpinned = dataclasses.replace(demo, model=dataclasses.replace(demo.model, weights_manifest=""))
    weights.install(unpinned, tmp_path / "none")
    assert not (tmp_path / "none").exists()


def test_sources_https_only_and_ca_for_https_only(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="only https:// is accepted"):
        applianctl.model.fetch.open_source("http://mirror.test/org/model/", None, "auto", MODEL, REV)
    with pytest.raises(UserError, match="--ca applies to an https:// SOURCE only"):
        applianctl.model.fetch.open_source(str(tmp_path), str(tmp_path / "ca.pem"), "auto", MODEL, REV)
    with pytest.raises(UserError, match="no SOURCE given, and none configured"):
        applianctl.model.fetch.open_source("", None, "auto", MODEL, REV)
    hub = applianctl.model.fetch.open_source(f"https://mirror.test/{MODEL}", None, "auto", MODEL, REV)
    plain = applianctl.model.fetch.open_source("https://mirror.test/weights/", None, "auto", MODEL, REV)
    assert isinstance(hub, applianctl.model.fetch.HttpsSource) and isinstance(plain, applianctl.model.fetch.HttpsSource)
    assert (hub.name("sub/a b.safetensors"), plain.name("config.json")) == (f"resolve/{REV}/sub/a%20b.safetensors", "config.json")


@pytest.mark.parametrize(
    ("err", "kernel_has_it", "message", "hint"),
    [
        (errno.ENOTTY, True, "its file system type does not implement fs-verity", "findmnt -T"),
        (errno.EOPNOTSUPP, False, "the running kernel has no fs-verity (built without CONFIG_FS_VERITY)", "CONFIG_FS_VERITY=y"),
        (errno.EOPNOTSUPP, True, "its file system does not have the ext4 verity feature turned on", "appliance-var-verity.service"),
    ],
)
def test_sealing_where_fs_verity_is_missing_says_which_part_lacks_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, kernel_has_it: bool, message: str, hint: str) -> None:
    from applianctl.model import fsverity_seal

    feature = tmp_path / "sys-fs-ext4-features-verity"
    if kernel_has_it:
        feature.write_text("supported\n")
    monkeypatch.setattr(fsverity_seal, "EXT4_VERITY_FEATURE", feature)

    def ioctl(*args: Any) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fsverity_seal.fcntl, "ioctl", ioctl)
    target = tmp_path / "w.safetensors"
    target.write_bytes(b"x")
    with pytest.raises(UserError) as e:
        fsverity_seal.Kernel().enable(target)
    assert e.value.message == f"{target}: {message}" and hint in e.value.hint
    if not kernel_has_it:  # a kernel without fs-verity is not helped by the ext4 feature or a reboot
        assert "reboot" not in e.value.hint and "appliance-var-verity" not in e.value.hint


@pytest.mark.parametrize(("name", "expected"), [
    ("x" * 300 + ".safetensors", "expected a path whose names are at most 255 bytes each"),  # refused by the manifest's loader
    ("x" * 250, "its partial file's journal would be a name of 263 bytes, more than 255"),  # by the store's own limits
    ("/".join(["d" * 99] * 42), "expected a path of at most 4095 bytes"),  # 4,199 bytes
])
def test_model_fetch_of_a_name_the_disk_cannot_hold_is_two_lines_before_anything_is_written(
        device: tuple[Path, WeightsManifest, Path], capsys: pytest.CaptureFixture[str], name: str, expected: str) -> None:
    from appliance import paths
    from applianctl.__main__ import main

    src, _, snapshot = device
    data = canonical_with(appliance.signed.weights_manifest.make(MODEL, REV, [WeightFile(name, 1, "0" * 64)]))
    (paths.LIB_DIR / "weights.json").write_bytes(data)
    (paths.LIB_DIR / "manifest.json").write_text(json.dumps({"model": {"weights_sha256": appliance.signed.weights_manifest.sha256(data)}}))
    assert main(["model", "fetch", str(src)]) == 2
    error, hint = capsys.readouterr().err.splitlines()
    assert error.startswith(f"applianctl: {paths.LIB_DIR / 'weights.json'}: ") and error.endswith(expected)
    assert hint.startswith("hint: ")
    assert not snapshot.parent.parent.parent.exists()  # not even the store's directories


def canonical_with(model: WeightsManifest) -> bytes:
    """MODEL's canonical bytes without the loader's checks (a manifest this builder would not write)."""
    from appliance.schema import plain
    from appliance.signed.release_manifest import canonical

    return canonical(plain(model))
