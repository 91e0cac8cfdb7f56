# SPDX-License-Identifier: MIT
"""Where the model's weights live on the device, and what the device knows about them.

- The signed weights manifest: /usr/lib/appliance/weights.json, whose SHA-256 the signed release
  manifest pins (model.weights_sha256); both are on the verity-protected /usr.
- The snapshot: config.model.weights_dir on /var (the Hugging Face cache layout the engine is
  given), each file sealed with fs-verity once its SHA-256 is proven.
- Partial downloads: CACHE_DIR/.partial/REVISION/ on the same file system, so that a finished file
  is renamed into place, never copied.
- The fs-verity digests the device measured for files whose manifest line has none:
  /var/lib/appliance/host/weights-verity.json (per-host state that survives upgrades).

The snapshot and the partial files are written through StoreDir only: CACHE_DIR opened once, each
name below it opened relative to its parent's descriptor, no symbolic link followed. The fetch runs
as root over a tree on /var that a restored backup, a copied snapshot or anyone with a foothold on
/var may have changed: a link there must not turn its writes, truncations or reads elsewhere.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import appliance.signed.weights_manifest
from appliance import paths
from appliance.config import Config
from appliance.errors import UserError
from appliance.safe_read import file_kind, read_capped
from appliance.schema import dump_record, load_record
from appliance.schema import shown as schema_shown
from appliance.signed.release_manifest import ManifestError
from applianctl.records import CorruptFile, WeightsCorrupt, WeightsVerity

RECORDED = "weights-verity.json"
CORRUPT = "weights-corrupt.json"  # files whose bytes the kernel refused on a read (model verify --deep)
HOST_SOURCE = "model-source"  # one line: the per-host default SOURCE for `applianctl model fetch`
FETCH_STATE = "weights-fetch.json"  # the last fetch: source, time (per-host state)
MAX_HOST_SOURCE_BYTES = 4096  # a URL or a directory, one line
PART_SUFFIX, JOURNAL_SUFFIX = ".part", ".journal"  # a partial file and its chunk journal, in .partial/REVISION/
PART_MODE = 0o600  # a partial file and its journal: unproven bytes, root's only
FILE_MODE = 0o644  # a weight file once proven and sealed: the engine reads it
NAME_MAX, PATH_MAX = appliance.signed.weights_manifest.NAME_MAX, appliance.signed.weights_manifest.PATH_MAX


# Read at each call, so that tests (and APPLIANCE_* overrides) that move appliance.paths move these.
def weights_manifest() -> Path:
    return paths.LIB_DIR / appliance.signed.weights_manifest.FILE_NAME


def host_dir() -> Path:
    return paths.STATE_DIR / "host"


def verify_result() -> Path:
    return paths.RUN_DIR / "model-verify.json"


@dataclass(frozen=True)
class Store:
    manifest: appliance.signed.weights_manifest.WeightsManifest
    snapshot: Path
    partial: Path
    host_dir: Path

    def target(self, path: str) -> Path:
        return self.snapshot / path

    @property
    def root(self) -> Path:
        """The store's own directory (CACHE_DIR): the snapshot and the partial files are below it."""
        return Path(os.path.commonpath([self.snapshot, self.partial]))

    def rel(self, path: Path) -> str:
        """PATH (the snapshot, the partial directory or a file in them) relative to the root."""
        return path.relative_to(self.root).as_posix()

    def open_dir(self) -> StoreDir:
        return StoreDir(self.root)

    def recorded(self) -> dict[str, str]:
        """The digests this device measured for this revision ({} when none or another revision)."""
        try:
            data = load_record(WeightsVerity, self.host_dir / RECORDED, lenient=True)
        except UserError as e:
            raise UserError(e.message, hint="fetch the weights again: `applianctl model fetch`") from None
        if data is None or data.revision != self.manifest.revision:
            return {}
        return dict(data.files)

    def record(self, digests: dict[str, str]) -> None:
        write_host_record(self.host_dir, RECORDED, WeightsVerity(self.manifest.model, self.manifest.revision,
                                                                  dict(sorted(digests.items()))))

    def corrupt(self) -> dict[str, CorruptFile]:
        """Files a read through fs-verity refused, by path. They stay refused by the check before
        every start until fetched again (a new file, a new inode)."""
        try:
            data = load_record(WeightsCorrupt, self.host_dir / CORRUPT, lenient=True)
        except UserError:
            return {"?": CorruptFile(-1, f"{self.host_dir / CORRUPT} is unreadable")}
        return dict(data.files) if data is not None and data.revision == self.manifest.revision else {}

    def mark_corrupt(self, path: str, inode: int, reason: str) -> None:
        files = {**self.corrupt(), path: CorruptFile(inode, reason)}
        write_host_record(self.host_dir, CORRUPT, WeightsCorrupt(self.manifest.revision, files))

    def clear_corrupt(self, path: str) -> None:
        files = self.corrupt()
        if files.pop(path, None) is not None:
            write_host_record(self.host_dir, CORRUPT, WeightsCorrupt(self.manifest.revision, files))

    def default_source(self, config: Config) -> str:
        """The per-host setting if there is one, else the configuration's model.source."""
        path = self.host_dir / HOST_SOURCE
        data = read_capped(path, MAX_HOST_SOURCE_BYTES, what="the per-host model source",
                           hint=f"{path} holds one line, an https:// mirror or a directory: fix or remove it")
        try:
            line = (data or b"").decode("utf-8").strip()
        except UnicodeDecodeError:
            raise UserError(f"{path}: not UTF-8 text", hint=f"{path} holds one line, an https:// mirror or a directory") from None
        return line or config.model.source


def load_manifest(path: Path | None = None, release: Path | None = None) -> appliance.signed.weights_manifest.WeightsManifest | None:
    """The image's weights manifest, None when the image ships none. Its SHA-256 must be the one the
    release manifest pins (appliance-verify checks that manifest's signature before every start)."""
    path = path or weights_manifest()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    release = release or paths.MANIFEST
    try:
        pinned = json.loads(release.read_bytes()).get("model", {}).get("weights_sha256", "")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"{release}: unreadable ({e})", hint="the image is damaged") from None
    if pinned != appliance.signed.weights_manifest.sha256(data):
        digest = appliance.signed.weights_manifest.sha256(data)
        raise ManifestError(f"{path}: SHA-256 {digest} is not the one the release manifest pins ({pinned or 'none'})",
                            hint="the image is damaged")
    return appliance.signed.weights_manifest.loads(data, str(path))


def open_store(config: Config, manifest: appliance.signed.weights_manifest.WeightsManifest) -> Store:
    if (manifest.model, manifest.revision) != (config.model.id, config.model.revision):
        raise UserError(f"{weights_manifest()}: pins {manifest.model}@{manifest.revision}, the configuration serves "
                        f"{config.model.id}@{config.model.revision}", hint="the image is damaged")
    cache = Path(config.model.cache_dir)
    check_names(manifest, Path(config.model.weights_dir), cache / ".partial" / manifest.revision)
    return Store(manifest, Path(config.model.weights_dir), cache / ".partial" / manifest.revision, host_dir())


def check_names(manifest: appliance.signed.weights_manifest.WeightsManifest, snapshot: Path, partial: Path) -> None:
    """Every file the store will hold for MANIFEST fits the file system's limits: each name (a
    partial file's journal, NAME.part.journal, is the longest) at most NAME_MAX bytes, each whole
    path at most PATH_MAX (the engine opens the files by path)."""
    hint = "the weights manifest names a file this device cannot store: pin the weights again with shorter names"
    for entry in manifest.files:
        journal = f"{partial}/{entry.path}{PART_SUFFIX}{JOURNAL_SUFFIX}"
        name = journal.rsplit("/", 1)[1]
        if len(name.encode()) > NAME_MAX:
            raise ManifestError(f"{weights_manifest()}: {schema_shown(entry.path)}: its partial file's journal would be "
                                f"a name of {len(name.encode())} bytes, more than {NAME_MAX}", hint=hint)
        for full in (f"{snapshot}/{entry.path}", journal):
            if len(full.encode()) > PATH_MAX:
                raise ManifestError(f"{weights_manifest()}: {schema_shown(entry.path)}: on the disk it would be "
                                    f"a path of {len(full.encode())} bytes, more than {PATH_MAX}", hint=hint)


# ----------------------------------------------------------------------------------- no link followed

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _not_followed(path: Path, mode: int, want: str) -> UserError:
    rm = "rm -r" if stat.S_ISDIR(mode) else "rm"
    return UserError(f"{path}: is {file_kind(mode)}, not {want} (nothing in the model store is followed or replaced)",
                     hint=f"remove it: {rm} {path}; then run applianctl model fetch again")


def open_real_dir(path: Path, *, create: bool) -> int:
    """A descriptor of the directory PATH, reached from / one name at a time, each opened relative
    to its parent's descriptor without following a symbolic link (made, 0755, when missing and
    CREATE): what is written there lands in that directory on /var, not where a link points. A
    link, or anything else than a directory, anywhere on the way is refused in one line naming it;
    FileNotFoundError when a part is missing and not CREATE."""
    path = Path(os.path.abspath(path))
    fd = os.open("/", _DIR)
    try:
        done = Path("/")
        for name in path.parts[1:]:
            done = done / name
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                child = _open_real_child(fd, name, done)
            except OSError:
                child = _open_real_child(fd, name, done)
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_real_child(fd: int, name: str, shown: Path) -> int:
    """The directory NAME in FD (O_NOFOLLOW), or why not: what it is when not a directory."""
    try:
        return os.open(name, _DIR, dir_fd=fd)
    except OSError as e:
        try:
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        except OSError:
            raise e from None
        if stat.S_ISDIR(mode):
            raise
        raise _not_followed(shown, mode, "a directory") from None


def write_host_record(directory: Path, name: str, record: Any) -> None:
    """DIRECTORY/NAME holds RECORD (as appliance.atomic.write_record writes it), written through
    a directory descriptor reached without following a link (open_real_dir): the per-host state
    stays on /var, whatever link someone put on the way; a link or a directory at NAME is refused."""
    data = (json.dumps(dump_record(record), indent=2, sort_keys=True) + "\n").encode("utf-8")
    with StoreDir(directory) as d:
        d.write_atomic(name, data, mode=0o644)


def _split(rel: str) -> tuple[str, str]:
    parent, _, name = rel.rpartition("/")
    return parent, name


class StoreDir:
    """The store's directory, opened once; each file and directory below it reached one name at a
    time relative to its parent's descriptor (O_NOFOLLOW): a symbolic link, or anything else than a
    directory where one belongs or a regular file where a file does, is refused in one line naming
    it, with `rm` as the hint. Paths are relative to the root, "/"-separated (from the checked
    manifest). Safe to share between threads."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fd = open_real_dir(root, create=True)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> StoreDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def show(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def refusal(self, rel: str, mode: int, want: str) -> UserError:
        return _not_followed(self.show(rel), mode, want)

    def _refuse_at(self, dir_fd: int, rel: str, want: str, error: OSError) -> Exception:
        try:
            mode = os.stat(_split(rel)[1], dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            return error
        return error if (stat.S_ISDIR(mode) and want == "a directory") else self.refusal(rel, mode, want)

    @contextmanager
    def directory(self, rel: str, create: bool = False) -> Iterator[int | None]:
        """The descriptor of directory REL ("" is the root); None when it is missing and not CREATE."""
        fd = os.dup(self.fd)
        try:
            done: list[str] = []
            for name in rel.split("/") if rel else []:
                done.append(name)
                try:
                    child = os.open(name, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        yield None
                        return
                    with suppress(FileExistsError):
                        os.mkdir(name, 0o755, dir_fd=fd)
                    try:
                        child = os.open(name, _DIR, dir_fd=fd)
                    except OSError as e:
                        raise self._refuse_at(fd, "/".join(done), "a directory", e) from None
                except OSError as e:
                    raise self._refuse_at(fd, "/".join(done), "a directory", e) from None
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def lstat(self, rel: str) -> os.stat_result | None:
        """REL's own status (a link is not followed), None when it is missing."""
        parent, name = _split(rel)
        with self.directory(parent) as d:
            if d is None:
                return None
            try:
                return os.stat(name, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                return None

    def regular(self, rel: str) -> os.stat_result | None:
        """REL's status when it is a regular file, None when it is missing; refused otherwise."""
        st = self.lstat(rel)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise self.refusal(rel, st.st_mode, "a regular file")
        return st

    def open_file(self, rel: str, flags: int) -> int:
        """A descriptor of the regular file REL (os.O_CREAT in FLAGS creates it, mode 0600, and its
        directories). FileNotFoundError when it is missing."""
        parent, name = _split(rel)
        with self.directory(parent, create=bool(flags & os.O_CREAT)) as d:
            if d is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(self.show(rel)))
            try:  # O_NONBLOCK: a FIFO does not block the open (and is refused below)
                fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, PART_MODE, dir_fd=d)
            except FileNotFoundError:
                raise
            except OSError as e:
                raise self._refuse_at(d, rel, "a regular file", e) from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise self.refusal(rel, mode, "a regular file")
        return fd

    def read(self, rel: str, limit: int) -> bytes | None:
        """The bytes of the regular file REL (at most LIMIT + 1 read), None when it is missing."""
        try:
            fd = self.open_file(rel, os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(limit + 1)

    def write_atomic(self, rel: str, data: bytes, mode: int = PART_MODE) -> None:
        """REL holds DATA, whole or not at all, with MODE from the start: a temporary file beside it,
        synced, renamed over it."""
        parent, name = _split(rel)
        with self.directory(parent, create=True) as d:
            assert d is not None
            tmp = f".tmp-{secrets.token_hex(8)}"  # a short name: REL may be near NAME_MAX already
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=d)
            os.fchmod(fd, mode)  # as asked, whatever the umask
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                self.regular(rel)  # a directory or a link at REL is refused, not replaced
                os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
            except BaseException:
                with suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
                raise
            os.fsync(d)

    def chmod(self, rel: str, mode: int) -> None:
        """Set the regular file REL's mode (through its descriptor: no link followed)."""
        fd = self.open_file(rel, os.O_RDONLY)
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def unlink(self, rel: str) -> None:
        """Remove the regular file REL (nothing when it is missing)."""
        if self.regular(rel) is None:
            return
        parent, name = _split(rel)
        with self.directory(parent) as d:
            if d is not None:
                with suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=d)

    def replace(self, src: str, dst: str) -> None:
        """Rename the regular file SRC to DST (its directories made), then sync DST's directory."""
        if self.regular(dst) is None:
            self.lstat(dst)  # its directories: refused when one is not a directory
        src_parent, src_name = _split(src)
        dst_parent, dst_name = _split(dst)
        with self.directory(src_parent) as s, self.directory(dst_parent, create=True) as d:
            assert s is not None and d is not None
            os.replace(src_name, dst_name, src_dir_fd=s, dst_dir_fd=d)
            os.fsync(d)

    def rmtree(self, rel: str) -> None:
        """Remove the directory REL and all in it (a link there is removed, not followed)."""
        parent, name = _split(rel)
        with self.directory(parent) as d:
            if d is None:
                return
            st: Any = None
            with suppress(FileNotFoundError):
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
            if st is None:
                return
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=d, ignore_errors=True)
            else:
                raise self.refusal(rel, st.st_mode, "a directory")
