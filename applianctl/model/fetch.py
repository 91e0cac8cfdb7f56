# SPDX-License-Identifier: MIT
"""`applianctl model fetch [SOURCE]`: the pinned weights onto /var, every byte checked, resumable.

SOURCE: an https:// mirror in the Hub's layout (BASE/resolve/REVISION/PATH) or a plain one
(BASE/PATH), or a local directory holding the snapshot's files (never left: no link followed),
read by range through appliance.fetch's bounded sources. Here: files in parallel, and resume
across power cuts.

Each file goes to .partial/ in CHUNK_BYTES chunks, fsync'd at each boundary, with a journal of the
durable length and each chunk's CRC-32. A resume cuts the file back to the journal's length and,
since hashlib cannot save a hash's state, re-hashes that prefix, checking the CRCs on the way (damage
at rest starts over at once). Per-chunk hashes in the manifest would tie it to our chunk size and
lose the Hub's own LFS hashes. A file enters the snapshot only after its SHA-256 matches, sealed
with fs-verity, its digest checked against the manifest's or, where it has none, recorded for
applianctl/model/verify.py.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import stat
import threading
import time
import urllib.parse
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import appliance.fetch
from appliance import progress
from appliance.errors import Refused, UserError
from appliance.safe_read import loads_bounded
from appliance.schema import dump_record, from_json
from appliance.signed import weights_manifest
from applianctl.model.fsverity_seal import Verity
from applianctl.model.store import FILE_MODE, JOURNAL_SUFFIX, PART_MODE, PART_SUFFIX, Store, StoreDir, open_real_dir
from applianctl.records import FetchJournal

CHUNK_BYTES = 8 << 20  # fsync + journal granularity: the most a resume fetches twice per file
READ_BYTES = 1 << 20  # one read from the source
WORKERS = 4  # files fetched at once
ATTEMPTS = 5  # tries per file within one run (a dropped connection resumes)
DEADLINE_S = 7 * 24 * 3600.0  # the whole run; 156 GiB at 10 MB/s takes under 5 hours
RETRY_HINT = "run the same command again: the download resumes where it stopped"


class _Stopped(UserError):
    """Another file failed: this one stops where it is (its journal stays valid)."""


class Source(Protocol):
    spec: str

    def open(self, name: str, offset: int = 0, *, chunk: int = ...) -> appliance.fetch.Body:
        """NAME's bytes from OFFSET on (the body's offset is 0 when the source starts from the beginning)."""


# ----------------------------------------------------------------------------------- sources


class DirSource(appliance.fetch.DirSource):
    """A local directory holding the snapshot's files, never left: the core's directory source
    (no symbolic link followed anywhere beneath it, no '..', regular files only). A Hugging Face
    cache's snapshot links into its blobs: it is copied with the links resolved first (cp -rL)."""

    SOURCE_HINT = "SOURCE is an https:// mirror or a directory holding the snapshot's files"

    def __init__(self, spec: str, deadline: appliance.fetch.Deadline | None = None) -> None:
        super().__init__(spec, deadline or appliance.fetch.Deadline(DEADLINE_S))

    def missing(self, name: str) -> UserError:
        return Refused(f"{name}: missing from {self.spec}", hint="copy the whole snapshot")

    def refused(self, name: str, part: str, what: str) -> UserError:
        if what == "a symbolic link":
            return Refused(f"{name}: {self.spec}/{part} is a symbolic link (a source directory is read without following links)",
                           hint=f"copy the snapshot with its links resolved (cp -rL {self.spec} DIR), then fetch from DIR")
        return Refused(f"{name}: {self.spec}/{part} is {what}", hint="the source holds the snapshot's files only")


class HttpsSource:
    """An HTTPS mirror through the core's bounded client; PATH named in the mirror's layout."""

    def __init__(self, spec: str, ca: str | None, layout: str, revision: str, deadline: appliance.fetch.Deadline) -> None:
        self.spec, self.layout, self.revision = spec, layout, revision
        self.client = appliance.fetch.HttpsSource(spec, ca, deadline)

    def name(self, path: str) -> str:
        quoted = urllib.parse.quote(path)
        return f"resolve/{self.revision}/{quoted}" if self.layout == "hub" else quoted

    def open(self, name: str, offset: int = 0, *, chunk: int = appliance.fetch.CHUNK) -> appliance.fetch.Body:
        try:
            return self.client.open(self.name(name), offset, chunk=chunk)
        except appliance.fetch.RangeRefused:
            return appliance.fetch.Body(0, iter(()))  # the server has fewer bytes than we do: start over
        except appliance.fetch.HttpStatus as e:
            if e.status in (401, 403, 404, 410):
                raise Refused(f"{name}: the server answered HTTP {e.status} for {e.url}",
                              hint="check SOURCE (and --layout): the mirror must hold this revision's files") from None
            raise OSError(f"the server answered HTTP {e.status}") from None


def open_source(spec: str, ca: str | None, layout: str, model_id: str, revision: str) -> Source:
    if not spec:
        raise UserError("no SOURCE given, and none configured",
                        hint="give one (`applianctl model fetch https://MIRROR/ORG/NAME` or `applianctl model fetch DIR`), "
                        "or set model.source")
    if "://" not in spec:
        if ca:
            raise UserError("--ca applies to an https:// SOURCE only", hint="leave out --ca for a directory")
        return DirSource(spec)
    if layout == "auto":
        layout = "hub" if urllib.parse.urlsplit(spec).path.rstrip("/").endswith("/" + model_id) else "plain"
    return HttpsSource(spec, ca, layout, revision, appliance.fetch.Deadline(DEADLINE_S))


# ----------------------------------------------------------------------------------- one file


@dataclass
class Journal:
    """What is durably on disk of a partial file: LENGTH bytes, in chunks with these CRC-32s."""

    length: int
    chunks: list[int]


MAX_JOURNAL_BYTES = 1 << 20  # 4 bytes a chunk at most (a 156 GiB file has 20,000 chunks)


def read_journal(fs: StoreDir, part: str, entry: weights_manifest.WeightFile) -> Journal:
    """The journal of the partial file PART (relative to the store's directory)."""
    rel = part + JOURNAL_SUFFIX
    raw = fs.read(rel, MAX_JOURNAL_BYTES)
    if raw is None or len(raw) > MAX_JOURNAL_BYTES:
        return Journal(0, [])
    try:
        data = from_json(FetchJournal, loads_bounded(raw.decode("utf-8")), str(fs.show(rel)), lenient=True)
    except (ValueError, UserError):  # damaged: the file starts over
        return Journal(0, [])
    if (data.sha256, data.size) != (entry.sha256, entry.size) or not 0 <= data.length <= entry.size:
        return Journal(0, [])  # another file's
    if len(data.chunks) != -(-data.length // CHUNK_BYTES):
        return Journal(0, [])
    return Journal(data.length, list(data.chunks))


def write_journal(fs: StoreDir, part: str, entry: weights_manifest.WeightFile, journal: Journal) -> None:
    record = FetchJournal(entry.sha256, entry.size, journal.length, tuple(journal.chunks))
    fs.write_atomic(part + JOURNAL_SUFFIX, (json.dumps(dump_record(record), indent=2, sort_keys=True) + "\n").encode())


def tree_bytes(size: int) -> int:
    """What sealing a file of SIZE bytes adds on the disk: the fs-verity Merkle tree, stored past
    its end (about 1/127 of it), and a block or two of descriptor."""
    return size // 127 + 2 * 4096


class FileFetch:
    """One file from SOURCE into PART, then sealed and renamed to TARGET, both through the store's
    directory (FS); every write first claimed from GUARD (the reserve on /var)."""

    def __init__(self, entry: weights_manifest.WeightFile, store: Store, fs: StoreDir, source: Source, verity: Verity,
                 bar: progress.Progress, stop: threading.Event, guard: appliance.fetch.Guard) -> None:
        self.entry, self.store, self.fs, self.source, self.verity = entry, store, fs, source, verity
        self.bar, self.stop, self.guard = bar, stop, guard
        self.counted = 0  # bytes of this file shown as done (a retry does not count them twice)
        self.part = part_of(store, entry)
        self.target = f"{store.rel(store.snapshot)}/{entry.path}"

    def resume_point(self) -> tuple[Journal, Any]:
        """Cut PART back to what the journal vouches for, re-hash it (checking each chunk); the
        journal and the hash of the prefix."""
        journal = read_journal(self.fs, self.part, self.entry)
        digest = hashlib.sha256()
        with os.fdopen(self.fs.open_file(self.part, os.O_RDWR | os.O_CREAT), "r+b") as f:
            if stat.S_IMODE(os.fstat(f.fileno()).st_mode) != PART_MODE:
                os.fchmod(f.fileno(), PART_MODE)  # left by an older release, 0644: root's only until proven
            if os.fstat(f.fileno()).st_size < journal.length:
                journal = Journal(0, [])
            f.truncate(journal.length)
            f.seek(0)
            for i, expected in enumerate(journal.chunks):
                chunk = f.read(min(CHUNK_BYTES, journal.length - i * CHUNK_BYTES))
                if zlib.crc32(chunk) != expected:
                    journal = Journal(0, [])  # changed at rest: from the start
                    f.truncate(0)
                    digest = hashlib.sha256()
                    break
                digest.update(chunk)
            os.fsync(f.fileno())
        return journal, digest

    def run(self) -> int:
        """Fetch (retrying dropped connections), check, seal, rename. Returns the bytes fetched."""
        fetched = 0
        if self.fs.regular(self.part) is not None and _measure(self.fs, self.verity, self.part) is not None:
            attempts = 0  # sealed, then cut before the rename: only the rename is left
            self.bar.advance(self.entry.size, resumed=True)
        else:
            attempts = ATTEMPTS
        for attempt in range(attempts):
            journal, digest = self.resume_point()
            if attempt == 0 and journal.length:
                self.counted = journal.length
                self.bar.advance(journal.length, resumed=True)
            try:
                fetched += self._download(journal, digest)
                break
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    hint = "free space on /var (applianctl status shows the disk part), then run the same command again"
                    raise UserError(f"{self.entry.path}: the disk is full ({self.fs.show(self.part).parent})", hint=hint) from None
                if attempt == ATTEMPTS - 1 or self.stop.is_set():
                    raise UserError(f"{self.entry.path}: download failed ({e})".splitlines()[0][:300], hint=RETRY_HINT) from None
                time.sleep(min(2**attempt, 10) * 0.2)
        self._finish()
        return fetched

    def _download(self, journal: Journal, digest: Any) -> int:
        entry = self.entry
        fetched = 0
        if journal.length < entry.size:
            fetched, digest = self._stream(journal, digest)
        if not hmac.compare_digest(digest.hexdigest(), entry.sha256):
            self.discard()
            raise Refused(f"{entry.path}: SHA-256 {digest.hexdigest()} is not the signed manifest's {entry.sha256}; "
                          "the source sent other bytes (removed)", hint="fix or replace the source; the file was not used")
        return fetched

    def discard(self) -> None:
        self.fs.unlink(self.part)
        self.fs.unlink(self.part + JOURNAL_SUFFIX)

    def _stream(self, journal: Journal, digest: Any) -> tuple[int, Any]:
        """Append the source's bytes from the journal's length on; the bytes fetched and the digest
        of the whole file (DIGEST, or a new one when the source starts from the beginning)."""
        entry = self.entry
        body = self.source.open(entry.path, journal.length, chunk=READ_BYTES)
        if body.offset != journal.length:
            if body.offset:
                body.close()
                raise OSError(f"the source resumed at byte {body.offset}, not {journal.length}")
            journal, digest = Journal(0, []), hashlib.sha256()  # the source starts from the beginning: so do we
        fetched = 0
        with body, os.fdopen(self.fs.open_file(self.part, os.O_RDWR), "r+b") as f:
            f.truncate(journal.length)
            f.seek(journal.length)
            have = journal.length
            crc = 0
            for data in body:
                if self.stop.is_set():
                    raise _Stopped(f"{entry.path}: stopped (another file failed)", hint=RETRY_HINT)
                if have + len(data) > entry.size:
                    self.discard()  # what it sent first may well be right; a source that lies about a file is not used
                    raise Refused(f"{entry.path}: the source sent more than the {entry.size} bytes the signed manifest gives",
                                  hint="the source does not hold this revision's file")
                view = memoryview(data)
                while view:
                    room = CHUNK_BYTES - have % CHUNK_BYTES
                    piece, view = view[:room], view[room:]
                    self.guard.claim(len(piece))  # stops at the reserve; the journal's chunks stay for a resume
                    f.write(piece)
                    digest.update(piece)
                    crc = zlib.crc32(piece, crc)
                    have += len(piece)
                    fetched += len(piece)
                    if have > self.counted:
                        self.bar.advance(have - self.counted)
                        self.counted = have
                    if have % CHUNK_BYTES == 0 or have == entry.size:
                        f.flush()
                        os.fsync(f.fileno())
                        journal = Journal(have, [*journal.chunks, crc])
                        write_journal(self.fs, self.part, entry, journal)
                        crc = 0
        if have < entry.size:
            raise OSError(f"the source ended after {have} of {entry.size} bytes")
        return fetched, digest

    def _finish(self) -> None:
        """Seal, check the fs-verity digest, rename into the snapshot. Idempotent after a cut."""
        entry = self.entry
        st = self.fs.regular(self.part)
        if st is not None:
            if st.st_size != entry.size or read_journal(self.fs, self.part, entry).length != entry.size:
                raise UserError(f"{entry.path}: the partial file is incomplete", hint=RETRY_HINT)
            if _measure(self.fs, self.verity, self.part) is None:
                self.guard.claim(tree_bytes(entry.size))  # the Merkle tree the kernel writes
                parent, _, _ = self.part.rpartition("/")
                with self.fs.directory(parent) as d:
                    self.verity.enable(self.fs.show(self.part), dir_fd=d)
            self.fs.chmod(self.part, FILE_MODE)  # proven and sealed: now the engine may read it
            self.fs.replace(self.part, self.target)
            self.fs.unlink(self.part + JOURNAL_SUFFIX)


# ----------------------------------------------------------------------------------- all files


def part_of(store: Store, entry: weights_manifest.WeightFile) -> str:
    """ENTRY's partial file, relative to the store's directory."""
    return f"{store.rel(store.partial)}/{entry.path}{PART_SUFFIX}"


def _measure(fs: StoreDir, verity: Verity, rel: str) -> str | None:
    parent, _, _ = rel.rpartition("/")
    with fs.directory(parent) as d:
        return None if d is None else verity.measure(fs.show(rel), dir_fd=d)


def _sealed(store: Store, fs: StoreDir, entry: weights_manifest.WeightFile, verity: Verity, recorded: dict[str, str]) -> bool:
    """ENTRY is in place: the right size, sealed, with the expected fs-verity digest."""
    target = f"{store.rel(store.snapshot)}/{entry.path}"
    st = fs.lstat(target)
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
        return False
    measured = _measure(fs, verity, target)
    expected = entry.fsverity or recorded.get(entry.path, "")
    return measured is not None and bool(expected) and hmac.compare_digest(measured, expected)


def free_bytes(path: Path) -> int:
    return appliance.fetch.free_bytes(path)


def needed_bytes(store: Store, fs: StoreDir, todo: list[weights_manifest.WeightFile]) -> int:
    """What the files still need on disk: the bytes not yet durable, plus the fs-verity Merkle tree."""
    return sum(entry.size - read_journal(fs, part_of(store, entry), entry).length + tree_bytes(entry.size) for entry in todo)


def fetch(store: Store, source: Source, verity: Verity, workers: int = WORKERS, out: Any = None,
          free: appliance.fetch.FreeBytes | None = None) -> dict[str, Any]:
    """Fetch every file of STORE's manifest that is not in place; returns a summary. Refused before
    it starts, and stopped while it writes, when /var would keep less than the reserve free
    (appliance.fetch.RESERVE_BYTES; FREE measures a file system's free bytes)."""
    free = free_bytes if free is None else free
    # where the digests will be recorded: a link on the way is refused now, not after the download
    os.close(open_real_dir(store.host_dir, create=True))
    with store.open_dir() as fs:
        return _fetch(store, fs, source, verity, workers, out, free)


def _fetch(store: Store, fs: StoreDir, source: Source, verity: Verity, workers: int, out: Any,
           free: appliance.fetch.FreeBytes) -> dict[str, Any]:
    recorded, corrupt = store.recorded(), store.corrupt()
    todo = [e for e in store.manifest.files if e.path in corrupt or not _sealed(store, fs, e, verity, recorded)]
    snapshot = store.rel(store.snapshot)
    for entry in todo:  # a file in the snapshot that is not exactly right is fetched again
        fs.unlink(f"{snapshot}/{entry.path}")  # a link or a directory there is refused, not removed
    need = needed_bytes(store, fs, todo)
    appliance.fetch.check_room(store.partial, need, "the weights", free=free)
    guard = appliance.fetch.Guard(store.partial, need, free=free)
    partial = store.rel(store.partial)
    with fs.directory(partial, create=True):
        pass
    total = sum(e.size for e in todo)
    lock, stop = threading.Lock(), threading.Event()
    started = time.monotonic()
    with progress.Progress(f"fetching {len(todo)} weight files", total=total, eta=True, out=out) as bar:

        def one(entry: weights_manifest.WeightFile) -> int:
            try:
                n = FileFetch(entry, store, fs, source, verity, bar, stop, guard).run()
                digest = _measure(fs, verity, f"{snapshot}/{entry.path}")
                _check_or_record(store, fs, entry, digest, recorded, lock)
                with lock:
                    store.clear_corrupt(entry.path)
            except BaseException:
                stop.set()
                raise
            return n

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = [pool.submit(one, e) for e in todo]
            errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:  # the file that failed first, not one stopped because of it
            raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
    fs.rmtree(partial)
    return {"files": len(store.manifest.files), "fetched_files": len(todo), "fetched_bytes": int(bar.fresh),
            "bytes": store.manifest.total_bytes, "elapsed_s": round(time.monotonic() - started, 3)}


def _check_or_record(store: Store, fs: StoreDir, entry: weights_manifest.WeightFile, digest: str | None, recorded: dict[str, str],
                     lock: threading.Lock) -> None:
    if digest is None:
        raise UserError(f"{entry.path}: not sealed with fs-verity after sealing", hint="check that /var supports fs-verity")
    if entry.fsverity:
        if not hmac.compare_digest(digest, entry.fsverity):
            fs.unlink(f"{store.rel(store.snapshot)}/{entry.path}")
            raise Refused(f"{entry.path}: fs-verity digest {digest} is not the signed manifest's {entry.fsverity} (removed)",
                          hint="the file's SHA-256 matched: report this; run the same command again")
        return
    with lock:
        recorded[entry.path] = digest
        store.record(recorded)
