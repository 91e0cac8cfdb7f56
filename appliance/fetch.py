# SPDX-License-Identifier: MIT
"""The one download stack (updater, installer, weights fetch): files from a directory or an
https:// URL by ranged read (open(name, offset) -> Body); fetch() resumes into NAME.part,
fetch_proven() checks against the signed index. Nothing a server or a directory sends can make a
caller use more memory, disk or time than it decided beforehand:

- HTTPS only; redirects only to the same scheme, host and port (at most MAX_REDIRECTS).
- The CA given or the system's; the environment (REQUESTS_CA_BUNDLE, proxies) plays no part.
- Small files are read under a byte cap (a larger Content-Length refused before the body); large
  ones stop at the size the signed index gives.
- One deadline: each socket operation gets the time left, and a watchdog shuts the socket at it,
  so a body trickled a byte at a time ends too.
- A directory source's files: beneath its root only (each name opened relative to its parent's
  descriptor, no symbolic link followed, no '..' or absolute path), regular files only.
- A partial file (NAME.part) is created mode 0600; it gets its final mode only once proven.
- Every download keeps RESERVE_BYTES free on its file system (/var), checked before it starts and
  before each write; one that stops there keeps its partial file, for the next run to resume.
"""

from __future__ import annotations

import errno
import http.client
import os
import socket
import ssl
import stat
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import IO, BinaryIO, Protocol

from appliance import atomic, progress
from appliance.errors import Refused, UserError
from appliance.hashing import sha256_file
from appliance.safe_read import file_kind

CHUNK = 1 << 16  # one read: small, so the deadline is checked often
CONNECT_TIMEOUT_S = 15.0
READ_TIMEOUT_S = 60.0  # the longest silence between two reads
MAX_REDIRECTS = 5
FETCH_ATTEMPTS = 5
RESERVE_BYTES = 1 << 30  # kept free on /var by every download: see "the reserve on /var" below

RESUME = "run the same command again: the download resumes"
NET_HINT = "check the URL and the network, then run the same command again"
UNREACHABLE_HINT = "check this host's network and DNS, and the server's name and port in the URL"


class DeadlineExceeded(UserError):
    pass


class Deadline:
    """One deadline for a whole update run."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.clock = seconds, clock
        self.end = clock() + seconds

    def left(self) -> float:
        left = self.end - self.clock()
        if left <= 0:
            raise DeadlineExceeded(f"the update did not finish within its deadline of {self.seconds:g} s", hint=RESUME)
        return left


class RangeRefused(OSError):
    """The server answered a ranged request with HTTP 416: it has fewer bytes than we do."""


class Unreachable(OSError):
    """The server's name did not resolve, or no connection to it was made: nothing was sent."""


def _reason(e: OSError) -> str:
    return (e.strerror or str(e) or type(e).__name__).splitlines()[0][:200]


class HttpStatus(OSError):
    """The server answered STATUS (not 200 or 206) for URL (the one asked for, before any redirect)."""

    def __init__(self, url: str, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.url, self.status = url, status


class Body:
    """A source's file from byte OFFSET on (0 when the source sends it from the start: no range
    support): iterate for its reads, each within the deadline; a context manager (close())."""

    def __init__(self, offset: int, chunks: Iterator[bytes], close: Callable[[], None] = lambda: None) -> None:
        self.offset, self.chunks, self.close = offset, chunks, close

    def __iter__(self) -> Iterator[bytes]:
        return self.chunks

    def __enter__(self) -> Body:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Source(Protocol):
    spec: str

    def read_small(self, name: str, limit: int) -> bytes: ...

    def open(self, name: str, offset: int = 0, *, chunk: int = CHUNK) -> Body: ...

    def fetch(self, name: str, part: Path, size: int, claim: Claim = ...) -> None: ...


def open_source(spec: str, ca: str | None, deadline: Deadline) -> Source:
    """SPEC as a source: an https:// URL or a bundle directory (http:// and other schemes refused)."""
    if "://" in spec:
        return HttpsSource(spec, ca, deadline)
    if ca:
        raise UserError("--ca applies to an https:// SOURCE only", hint="leave out --ca for a bundle directory")
    return DirSource(spec, deadline)


def _too_large(name: str, limit: int) -> Refused:
    return Refused(f"{name} is larger than {limit} bytes", hint="this is not a release bundle")


Claim = Callable[[int], None]  # called before N bytes are written: raises to stop (Guard.claim)


def _no_claim(n: int) -> None:
    pass


def _write_until(body: Body, fout: IO[bytes], have: int, size: int, name: str, bar: progress.Progress,
                 claim: Claim = _no_claim) -> int:
    """Append BODY to FOUT until SIZE bytes; a byte beyond SIZE is refused. Returns the count.
    CLAIM stops it before a write (what was written stays in FOUT, for a resume)."""
    for chunk in body:
        if have + len(chunk) > size:
            raise Refused(f"{name} is larger than bundle.json says ({size} bytes)", hint="the bundle was changed after it was signed")
        claim(len(chunk))
        fout.write(chunk)
        have += len(chunk)
        bar.reach(have)
        if have == size:
            break
    fout.flush()
    os.fsync(fout.fileno())
    return have


def _resumable(fetch_once: Callable[[Path, int, int, progress.Progress], None], name: str, part: Path, size: int,
               deadline: Deadline) -> None:
    """Call FETCH_ONCE until PART holds SIZE bytes; a dropped connection is retried (resumed) a
    few times within the run. Refusals and the deadline are not retried."""
    open_part(part).close()  # there even when SIZE is 0: the caller hashes and renames it
    have = part.stat().st_size
    if have == size:
        return
    bar = progress.Progress(f"downloading {name}", total=size, unit="B")
    bar.reach(min(have, size))
    ok = False
    try:
        for attempt in range(FETCH_ATTEMPTS):
            deadline.left()
            have = part.stat().st_size if part.exists() else 0
            if have > size:
                part.unlink()
                have = 0
            if have == size:
                break
            try:
                fetch_once(part, have, size, bar)
            except Unreachable as e:
                if attempt == FETCH_ATTEMPTS - 1:
                    raise UserError(f"{name}: {e}"[:300], hint=UNREACHABLE_HINT) from None
                time.sleep(min(min(2**attempt, 10) * 0.1, deadline.left()))
            except OSError as e:
                if attempt == FETCH_ATTEMPTS - 1:
                    raise UserError(f"{name}: download failed ({e})"[:300], hint=RESUME) from None
                time.sleep(min(min(2**attempt, 10) * 0.1, deadline.left()))
        if not part.exists() or part.stat().st_size != size:
            raise UserError(f"{name}: download incomplete", hint=RESUME)
        ok = True
    finally:
        bar.finish(failed=not ok)


# ----------------------------------------------------------------------------------- directory


class FileSource:
    """Ranged reads of files that open_file() opens (a subclass says how, and names the errors),
    each read within the deadline."""

    spec: str
    deadline: Deadline

    def open_file(self, name: str) -> BinaryIO:
        raise NotImplementedError

    def open(self, name: str, offset: int = 0, *, chunk: int = CHUNK) -> Body:
        f = self.open_file(name)
        f.seek(offset)

        def chunks() -> Iterator[bytes]:
            while True:
                self.deadline.left()
                data = f.read(chunk)
                if not data:
                    return
                yield data

        return Body(offset, chunks(), f.close)


PART_MODE = 0o600  # a partial file: unproven bytes, readable by root only until proven
FINAL_MODE = 0o644  # a proven file (the signed release's own bytes)


def open_part(part: Path, *, truncate: bool = False) -> IO[bytes]:
    """PART for appending (emptied first when TRUNCATE), created mode 0600 from the start (not
    chmod'ed after: nobody else ever opens it); one left by an older run is made 0600 too. A link
    at PART is refused, not followed."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if truncate else 0)
    try:
        fd = os.open(part, flags, PART_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Refused(f"{part}: is a symbolic link (not followed)", hint=f"remove it: rm {part}; then {RESUME}") from None
        raise
    if stat.S_IMODE(os.fstat(fd).st_mode) != PART_MODE:
        os.fchmod(fd, PART_MODE)
    return os.fdopen(fd, "ab")


def _set_mode(path: Path, mode: int) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # O_NONBLOCK: a FIFO does not block the open


class NotBeneath(Exception):
    """A name a directory source does not open: PART (NAME or a leading part of it) is WHAT."""

    def __init__(self, part: str, what: str) -> None:
        super().__init__(f"{part}: {what}")
        self.part, self.what = part, what


def open_beneath(root_fd: int, name: str) -> int:
    """A descriptor of NAME ("/"-separated) beneath the directory ROOT_FD, one name at a time
    relative to its parent's descriptor, none followed when it is a symbolic link: nothing outside
    the root is reached, whatever is linked where. FileNotFoundError when a part is missing;
    NotBeneath for an absolute path, an empty name, "." or "..", a link on the way or at the
    end, or anything but a directory on the way. The caller checks what the file is (fstat)."""
    parts = name.split("/")
    if "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise NotBeneath(name, "not a relative path without '..'")
    fd = os.dup(root_fd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                child = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                raise
            except OSError as e:
                try:
                    mode = os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode
                except OSError:
                    raise e from None
                if stat.S_ISLNK(mode):
                    raise NotBeneath("/".join(parts[: i + 1]), "a symbolic link") from None
                if not last and not stat.S_ISDIR(mode):
                    raise NotBeneath("/".join(parts[: i + 1]), f"{file_kind(mode)}, not a directory") from None
                raise
            if last:
                return child
            os.close(fd)
            fd = child
        raise AssertionError("unreachable: a name has at least one part")
    finally:
        os.close(fd)


class DirSource(FileSource):
    """A directory (a bundle's here; the model fetch's subclass words its messages for a snapshot).
    It is never left: the root is opened without following a link, every file beneath it through
    open_beneath (no link followed anywhere on the way, no '..'), regular files only. The signed
    index names the files, and a link could make it read a device, /proc or a file of another size."""

    SOURCE_HINT = "SOURCE is a bundle directory or an https:// URL of one"

    def __init__(self, spec: str, deadline: Deadline) -> None:
        self.spec, self.deadline = spec, deadline
        try:
            self.fd = os.open(spec, _DIR_FLAGS)
        except FileNotFoundError:
            raise UserError(f"{spec}: no such directory", hint=self.SOURCE_HINT) from None
        except OSError as e:
            if Path(spec).is_symlink():
                raise UserError(f"{spec}: is a symbolic link", hint="give the directory itself") from None
            raise UserError(f"{spec}: {e.strerror}", hint=self.SOURCE_HINT) from None

    def missing(self, name: str) -> UserError:
        return Refused(f"{self.spec}/{name}: missing from the bundle", hint="copy the whole bundle directory")

    def refused(self, name: str, part: str, what: str) -> UserError:
        """NAME is not read: PART of it is WHAT (a symbolic link, not a regular file...)."""
        if what == "a symbolic link":
            return Refused(f"{self.spec}/{part}: is a symbolic link",
                           hint="a bundle directory holds regular files only (copy it with cp -L)")
        return Refused(f"{self.spec}/{part}: {what}", hint="a bundle directory holds regular files only")

    def open_file(self, name: str) -> BinaryIO:
        try:
            fd = open_beneath(self.fd, name)
        except FileNotFoundError:
            raise self.missing(name) from None
        except NotBeneath as e:
            raise self.refused(name, e.part, e.what) from None
        except OSError as e:
            raise UserError(f"{self.spec}/{name}: {e.strerror}", hint="check the source directory") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self.refused(name, name, "not a regular file")
        return os.fdopen(fd, "rb")

    def read_small(self, name: str, limit: int) -> bytes:
        with self.open_file(name) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise _too_large(name, limit)
        return data

    def fetch(self, name: str, part: Path, size: int, claim: Claim = _no_claim) -> None:
        def once(part: Path, have: int, size: int, bar: progress.Progress) -> None:
            with self.open(name, have) as body, open_part(part) as fout:
                have = _write_until(body, fout, have, size, name, bar, claim)
            if have < size:
                raise Refused(f"{self.spec}/{name} is smaller than bundle.json says ({size} bytes)", hint="copy the whole bundle again")

        _resumable(once, name, part, size, self.deadline)


# ----------------------------------------------------------------------------------- HTTPS


def parse_url(spec: str) -> urllib.parse.SplitResult:
    """An https:// URL of a bundle directory: no credentials, query or fragment; ends with /."""
    hint = "SOURCE is https://HOST[:PORT]/PATH/ of a bundle directory"
    try:
        url = urllib.parse.urlsplit(spec)
        port = url.port
    except ValueError as e:
        raise UserError(f"{spec}: not a URL ({e})", hint=hint) from None
    if url.scheme != "https":
        raise UserError(f"{spec}: only https:// is accepted", hint="serve the bundle over HTTPS (pass its CA with --ca)")
    if not url.hostname or url.username is not None or url.password is not None or url.query or url.fragment:
        raise UserError(f"{spec}: expected https://HOST[:PORT]/PATH/ (no user, query or fragment)", hint=hint)
    if any(ord(c) < 0x21 or ord(c) > 0x7E for c in spec):
        raise UserError(f"{spec!r}: the URL holds spaces or control characters", hint=hint)
    if port == 0:
        raise UserError(f"{spec}: port 0", hint=hint)
    return url._replace(path=url.path if url.path.endswith("/") else url.path + "/")


def _origin(url: urllib.parse.SplitResult) -> tuple[str, str, int]:
    return (url.scheme, (url.hostname or "").lower(), url.port or 443)


class HttpsSource:
    def __init__(self, spec: str, ca: str | None, deadline: Deadline) -> None:
        self.spec, self.deadline = spec, deadline
        self.base = parse_url(spec)
        if ca is not None:
            if not Path(ca).is_file():
                raise UserError(f"{ca}: no such file", hint="--ca takes the PEM certificate of the CA that signed the server's certificate")
            try:
                # only this CA: create_default_context loads the system's (and SSL_CERT_FILE's) only without cafile
                self.context = ssl.create_default_context(cafile=ca)
            except ssl.SSLError as e:
                raise UserError(f"{ca}: not a PEM CA certificate ({e.reason})", hint="--ca takes a PEM file") from None
        else:
            # the system's CAs from OpenSSL's compiled-in paths, not SSL_CERT_FILE/SSL_CERT_DIR
            paths = ssl.get_default_verify_paths()
            self.context = ssl.create_default_context(
                cafile=paths.openssl_cafile if os.path.exists(paths.openssl_cafile) else None,
                capath=paths.openssl_capath if os.path.isdir(paths.openssl_capath) else None,
            )
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2

    def url(self, name: str) -> str:
        return urllib.parse.urlunsplit(self.base._replace(path=self.base.path + name))

    @contextmanager
    def _get(self, name: str, headers: dict[str, str]) -> Iterator[tuple[http.client.HTTPResponse, socket.socket]]:
        """GET NAME; redirects followed only within the same origin. Yields the response (status
        read, body not) and its socket; a watchdog shuts the socket when the deadline passes."""
        url = self.base._replace(path=self.base.path + name)
        for _ in range(MAX_REDIRECTS + 1):
            conn = http.client.HTTPSConnection(
                url.hostname or "", url.port or 443, context=self.context, timeout=min(CONNECT_TIMEOUT_S, self.deadline.left())
            )
            watchdog: threading.Timer | None = None
            try:
                try:
                    self._connect(conn, url)
                    sock = conn.sock
                    assert sock is not None
                    watchdog = threading.Timer(self.deadline.left(), _shut, (sock,))
                    watchdog.daemon = True
                    watchdog.start()
                    target = url.path + (f"?{url.query}" if url.query else "")
                    conn.putrequest("GET", target, skip_accept_encoding=True)
                    for key, value in {"Accept-Encoding": "identity", "User-Agent": "applianctl-update", **headers}.items():
                        conn.putheader(key, value)
                    conn.endheaders()
                    sock.settimeout(min(READ_TIMEOUT_S, self.deadline.left()))
                    resp = conn.getresponse()
                except ssl.SSLCertVerificationError as e:
                    raise UserError(
                        f"{urllib.parse.urlunsplit(url)}: the server's certificate is not trusted ({e.verify_message})",
                        hint="pass the CA that signed it with --ca",
                    ) from None
                except Unreachable:
                    raise
                except (OSError, http.client.HTTPException) as e:
                    self.deadline.left()  # a socket shut by the watchdog reads as the deadline
                    raise OSError(f"{urllib.parse.urlunsplit(url)}: {type(e).__name__}: {e}".splitlines()[0][:300]) from None
                if resp.status in (301, 302, 303, 307, 308):
                    location = resp.getheader("Location") or ""
                    nxt = urllib.parse.urlsplit(urllib.parse.urljoin(urllib.parse.urlunsplit(url), location))
                    if _origin(nxt) != _origin(url):
                        raise Refused(
                            f"{urllib.parse.urlunsplit(url)} redirects to {location[:200]!r}: another scheme, host or port is not followed",
                            hint="point SOURCE at the final https:// URL on the same server",
                        )
                    url = nxt
                    continue
                yield resp, sock
                return
            finally:
                if watchdog is not None:
                    watchdog.cancel()
                conn.close()
        raise Refused(f"{self.url(name)}: more than {MAX_REDIRECTS} redirects", hint="point SOURCE at the final URL")

    def _connect(self, conn: http.client.HTTPSConnection, url: urllib.parse.SplitResult) -> None:
        """CONN's connection and TLS handshake; Unreachable when the name does not resolve or no
        connection is made (a TLS fault is the server's answer, not that)."""
        host, port = url.hostname or "", url.port or 443
        try:
            conn.connect()
        except ssl.SSLError:
            raise
        except socket.gaierror as e:
            raise Unreachable(f"cannot resolve {host}: {_reason(e)}") from None
        except OSError as e:
            self.deadline.left()  # past the deadline: that, not the connection, is what failed
            raise Unreachable(f"cannot connect to {f'[{host}]' if ':' in host else host}:{port}: {_reason(e)}") from None

    def _chunks(self, resp: http.client.HTTPResponse, sock: socket.socket, chunk: int) -> Iterator[bytes]:
        """The body in reads of CHUNK bytes (fewer at its end), each silence within the time left.
        resp.read gathers TLS records in C: one Python step per read, not per 16 KiB record."""
        while not resp.isclosed():  # read() closes it (and with it the socket) at Content-Length
            sock.settimeout(min(READ_TIMEOUT_S, self.deadline.left()))
            try:
                data = resp.read(chunk)
            except (OSError, http.client.HTTPException) as e:
                self.deadline.left()
                raise OSError(f"{type(e).__name__}: {e}".splitlines()[0][:300]) from None
            if not data:
                break
            yield data
        self.deadline.left()  # a watchdog-shut socket ends like a short body

    def read_small(self, name: str, limit: int) -> bytes:
        try:
            with self._get(name, {}) as (resp, sock):
                if resp.status != 200:
                    raise UserError(f"{self.url(name)}: HTTP {resp.status}", hint="the URL must point at a bundle directory")
                length = resp.getheader("Content-Length")
                if length is not None and (not length.isdigit() or int(length) > limit):
                    raise _too_large(name, limit)
                data = bytearray()
                for chunk in self._chunks(resp, sock, CHUNK):
                    data += chunk
                    if len(data) > limit:
                        raise _too_large(name, limit)
                return bytes(data)
        except Unreachable as e:
            raise UserError(str(e), hint=UNREACHABLE_HINT) from None
        except OSError as e:
            raise UserError(str(e), hint=NET_HINT) from None

    def open(self, name: str, offset: int = 0, *, chunk: int = CHUNK) -> Body:
        """NAME from byte OFFSET on (a Range request). A connection that fails is an OSError; HTTP
        416 for a range is RangeRefused, another status than 200 or 206 is HttpStatus."""
        stack = ExitStack()
        try:
            resp, sock = stack.enter_context(self._get(name, {"Range": f"bytes={offset}-"} if offset else {}))
            if resp.status == 416 and offset:
                raise RangeRefused("the server refused the range; starting over")
            if resp.status not in (200, 206):
                raise HttpStatus(self.url(name), resp.status)
        except BaseException:
            stack.close()
            raise
        ranged = resp.status == 206 and (resp.getheader("Content-Range") or "").startswith(f"bytes {offset}-")
        return Body(offset if ranged else 0, self._chunks(resp, sock, chunk), stack.close)

    def fetch(self, name: str, part: Path, size: int, claim: Claim = _no_claim) -> None:
        def once(part: Path, have: int, size: int, bar: progress.Progress) -> None:
            try:
                body = self.open(name, have)
            except RangeRefused:
                part.unlink()  # the server has fewer bytes than we do: start over
                raise
            except HttpStatus as e:
                if e.status == 404:
                    raise Refused(f"{e.url}: HTTP 404", hint="the bundle on the server is incomplete") from None
                raise
            with body, open_part(part, truncate=body.offset != have) as fout:  # no range support: from the start
                have = _write_until(body, fout, body.offset, size, name, bar, claim)
            if have < size:
                raise OSError(f"the connection ended after {have} of {size} bytes")

        _resumable(once, name, part, size, self.deadline)


def _shut(sock: socket.socket) -> None:
    """The deadline passed: wake any read blocked on SOCK (close alone does not)."""
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


# ----------------------------------------------------------------------------------- the reserve on /var
#
# /var also holds the journal, the engine's caches and the device's records: filled to the last
# block, journald drops messages, the engine cannot start and no record can be written whole. So a
# download (the update's staging, the model fetch) stops RESERVE_BYTES short of full: checked
# before it starts (all of it plus the reserve, check_room) and while it writes (Guard, before each
# write), keeping its partial file for the next run to resume. 1 GiB: the least free space
# `applianctl status` accepts on a small disk (applianctl/status/disk.py: 1 GiB or 5 %).

MEASURE_EVERY = 4 << 20  # statvfs at least this often while writing: other writers use the disk too
GIB, MIB = 1 << 30, 1 << 20

FreeBytes = Callable[[Path], int]
RESUME_LATER = "then run the same command again (it resumes)"


def free_bytes(path: Path) -> int:
    """What an unprivileged writer may still use on PATH's file system (PATH or its nearest parent
    that exists)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def mount_point(path: Path) -> Path:
    """The mount point of PATH's file system (what the operator knows it as: /var)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    dev = path.stat().st_dev
    while path != path.parent and path.parent.stat().st_dev == dev:
        path = path.parent
    return path


def size(n: int, up: bool = True) -> str:
    """N bytes for a person, to a tenth of a GiB from 1 GiB on, else of a MiB; rounded UP (what is
    still needed: 1 byte short reads as 0.1 MiB more, not 0.0) or down (what is free)."""
    unit, name = (GIB, "GiB") if n >= GIB else (MIB, "MiB")
    tenths = -(-n * 10 // unit) if up else n * 10 // unit
    return f"{tenths / 10:.1f} {name}"


class ReserveReached(UserError):
    """Writing on would leave less than the reserve free; the partial file is kept."""


def check_room(path: Path, need: int, what: str, *, free: FreeBytes = free_bytes, reserve: int = RESERVE_BYTES) -> None:
    """Refuse, before anything is written, a download of NEED bytes into PATH that would leave less
    than RESERVE free on its file system."""
    have = free(path)
    if have - need < reserve:
        fs = mount_point(path)
        raise UserError(f"not enough space for {what}: {size(need)} to download and {size(reserve)} kept free on {fs}, "
                        f"{size(have, up=False)} free", hint=f"free {size(need + reserve - have)} more on {fs} "
                        f"(journalctl --vacuum-size, old files), {RESUME_LATER}")


class Guard:
    """While downloading REMAINING bytes into PATH: claim(n) before writing n bytes stops the
    download (ReserveReached) when they would take the file system below RESERVE. Thread-safe (the
    model fetch writes four files at once); statvfs every MEASURE_EVERY bytes, the bytes claimed
    since counted off the last figure."""

    def __init__(self, path: Path, remaining: int, *, free: FreeBytes = free_bytes, reserve: int = RESERVE_BYTES) -> None:
        self.path, self.remaining, self.free, self.reserve = path, remaining, free, reserve
        self.lock = threading.Lock()
        self.budget = 0  # bytes that may still be written above the reserve, as last measured
        self.since = MEASURE_EVERY  # bytes claimed since the last measure: measure at the first claim

    def claim(self, n: int) -> None:
        with self.lock:
            if self.since >= MEASURE_EVERY or n > self.budget:
                self.budget, self.since = self.free(self.path) - self.reserve, 0
            if n > self.budget:
                fs = mount_point(self.path)
                left = max(self.remaining, n)
                raise ReserveReached(f"stopped: {fs} would have less than {size(self.reserve)} free; "
                                     f"{size(left)} still to download",
                                     hint=f"free {size(left - max(self.budget, 0))} more on {fs} "
                                          f"(journalctl --vacuum-size, old files), {RESUME_LATER}")
            self.budget -= n
            self.since += n
            self.remaining -= n


# ----------------------------------------------------------------------------------- proven files


def missing_bytes(name: str, size: int, directory: Path) -> int:
    """What is still to fetch of NAME (SIZE bytes) into DIRECTORY, counting a partial NAME.part."""
    final, part = directory / name, directory / (name + ".part")
    have = final.stat().st_size if final.exists() else part.stat().st_size if part.exists() else 0
    return max(size - have, 0)


def _sha256(path: Path, name: str) -> str:
    """PATH's SHA-256, with progress: a /usr image takes a while to hash on a slow disk."""
    with progress.Progress(f"verifying {name}", total=path.stat().st_size) as p:
        return sha256_file(path, p.advance)


def fetch_proven(source: Source, name: str, size: int, sha256: str, directory: Path, claim: Claim = _no_claim) -> Path:
    """NAME from SOURCE as DIRECTORY/NAME, proven by the SIZE and SHA256 a signed index gives. A
    file already there is re-hashed, not trusted; a partial one (NAME.part) is resumed; a file
    that does not match is removed and refused. CLAIM (a Guard's) before each write."""
    final, part = directory / name, directory / (name + ".part")
    if final.exists():
        if final.stat().st_size == size and _sha256(final, name) == sha256:
            return final
        final.unlink()
    source.fetch(name, part, size, claim)
    digest = _sha256(part, name)
    if digest != sha256:
        part.unlink()
        raise Refused(f"{name}: SHA-256 {digest[:16]}... does not match bundle.json",
                      hint="the file was changed or damaged; nothing was written")
    _set_mode(part, FINAL_MODE)  # proven: readable as any file of the release
    part.rename(final)
    atomic.fsync_dir(directory)
    return final
