# SPDX-License-Identifier: MIT
"""The collector of `builder flash --bmc --report-listen HOST:PORT`: where each host's installer
reports what it wrote (installer/report.py), so that its summary reaches the operator.

An HTTPS server (builder/https_server.py) in a thread, with the certificate and key the operator
gives (the key a regular file of theirs that nobody else may read, not a link). The installer
sends only to a server that proves itself with the CA its signed plan names (`[report] ca`); here a
report is taken only for a host of this fleet whose signed plan's SHA-256 it names, with that
plan's host name, and the first one of a host is kept (OUTPUT/reports/NAME.json, 0600, with the
recovery key sealed to the plan's report.recovery_recipient when the installer made one): a second
identical one is answered as the first, a different one refused (409). What it says is then
checked by the flash against the plan (the disk's serial) and against the appliance that answers
on its proxy. Whoever holds a host's plan could send a false report before its installer does:
docs/install.md says what that leaves.

Answers: 204 stored (or the same again), 400 not a report of this installer or not its plan's
host, 404 no host of this fleet (or a path other than /), 405 a method other than POST, 409 a
different report for a host that has one, 411 no Content-Length, 413 larger than MAX_REPORT_BYTES.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import ssl
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from appliance import recovery_seal
from appliance.atomic import atomic_write
from appliance.errors import UserError
from appliance.safe_read import loads_bounded, read_capped
from appliance.schema import CONTROL
from builder.https_server import HTTPSServer

REPORT_FORMAT = 1              # installer/report.py's
MAX_REPORT_BYTES = 64 * 1024   # installer/report.py's
MAX_KEY_BYTES = 64 * 1024
MAX_TEXT = 1024                # a line's value (a step, the Secure Boot line, a disk's model)
MAX_LINES = 64
READ_WAIT_S = 10.0             # a client that sends nothing holds its thread no longer

_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")
KEYS = {"format", "host", "plan_sha256", "version", "reinstalled", "disk", "usr_hash", "secure_boot", "attestation", "steps",
        "seconds", "summary"}
DISK_KEYS = {"path", "model", "serial", "size_bytes"}
SEALED_KEY = "recovery_key_sealed"  # optional: /var's recovery key sealed to the plan's report.recovery_recipient


def _text(value: Any, what: str, limit: int = MAX_TEXT, lines: bool = False) -> str:
    """"" when VALUE is a string of at most LIMIT characters without control characters (line feeds
    too when LINES), else what is wrong with it."""
    if not isinstance(value, str):
        return f"{what} is not a string"
    if len(value) > limit:
        return f"{what} is longer than {limit} characters"
    if CONTROL.search(value.replace("\n", "") if lines else value):
        return f"{what} holds a control character"
    return ""


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def problem(doc: Any) -> str:
    """What is wrong with DOC as an installer's report; "" when nothing is."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("format") != REPORT_FORMAT or isinstance(doc.get("format"), bool):
        return f"format {doc.get('format')!r}, not {REPORT_FORMAT}"
    if set(doc) - {SEALED_KEY} != KEYS:
        wrong = sorted((set(doc) - {SEALED_KEY}) ^ KEYS)[0]
        return f"{'unknown' if wrong in doc else 'missing'} key {wrong[:40]!r}"
    if SEALED_KEY in doc and (wrong := recovery_seal.problem(doc[SEALED_KEY])):
        return f"{SEALED_KEY}: {wrong}"
    if not isinstance(doc["plan_sha256"], str) or not _SHA256.fullmatch(doc["plan_sha256"]):
        return "plan_sha256 is not 64 hexadecimal digits"
    disk = doc["disk"]
    if not isinstance(disk, dict) or set(disk) != DISK_KEYS:
        return "disk is not an object of path, model, serial and size_bytes"
    if not isinstance(doc["reinstalled"], bool):
        return "reinstalled is not true or false"
    if not _count(doc["seconds"]) or not _count(disk["size_bytes"]):
        return "seconds or disk.size_bytes is not a count"
    for key in ("host", "version", "usr_hash", "secure_boot"):
        if wrong := _text(doc[key], key):
            return wrong
    for key in ("path", "model", "serial"):
        if wrong := _text(disk[key], f"disk.{key}"):
            return wrong
    for key in ("attestation", "steps"):
        if not isinstance(doc[key], list) or len(doc[key]) > MAX_LINES:
            return f"{key} is not a list of at most {MAX_LINES} lines"
        if wrong := next((w for i, line in enumerate(doc[key]) if (w := _text(line, f"{key}[{i}]"))), ""):
            return wrong
    return _text(doc["summary"], "summary", MAX_REPORT_BYTES, lines=True)


def ek_fingerprint(doc: dict[str, Any]) -> str:
    """The TPM EK's fingerprint among the report's attestation lines ("" when none)."""
    for line in doc.get("attestation", []):
        if isinstance(line, str) and line.startswith("TPM EK"):
            return next((w for w in line.split() if w.startswith("sha256:")), "")
    return ""


def described(doc: dict[str, Any]) -> str:
    """What the installer wrote, in a few words: appliance V on DISK (serial S)."""
    disk = doc["disk"]
    return f"appliance {doc['version']} on {disk['path']} (serial {disk['serial'] or '-'})"


def report_path(output: Path, name: str) -> Path:
    return output / "reports" / f"{name}.json"


def read_report(output: Path, name: str) -> dict[str, Any] | None:
    """NAME's stored report, checked as it was when it arrived; None when there is none."""
    path = report_path(output, name)
    raw = read_capped(path, 4 * MAX_REPORT_BYTES, what="a stored report", hint=f"move {path} away")
    if raw is None:
        return None
    try:
        doc = loads_bounded(raw)
    except ValueError:
        doc = None
    if problem(doc):
        raise UserError(f"{path}: not a report of an installer ({problem(doc)})", hint=f"move {path} away")
    assert isinstance(doc, dict)
    return doc


def open_secret(path: Path, what: str, hint: str, max_bytes: int) -> int:
    """An open descriptor of PATH, a secret: a regular file of ours that nobody else may read (0600
    or 0400), not reached through a link, at most MAX_BYTES. WHAT names it in each refusal, none of
    which shows its content."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        raise UserError(f"{what}: {e.strerror}", hint=hint) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{what} is not a regular file", hint=hint)
        if st.st_mode & 0o077:
            raise UserError(f"{what} can be read by others (mode {stat.S_IMODE(st.st_mode):04o})", hint=f"chmod 600 {path}")
        if st.st_uid != os.geteuid():
            raise UserError(f"{what} belongs to another user", hint=f"chown {os.geteuid()} {path}")
        if st.st_size > max_bytes:
            raise UserError(f"{what} is larger than {max_bytes} bytes", hint=hint)
    except BaseException:
        os.close(fd)
        raise
    return fd


def tls_context(cert: Path, key: Path) -> ssl.SSLContext:
    """The server's TLS from CERT and KEY; KEY is a secret (open_secret), loaded from the descriptor
    checked, never from what the path names by then."""
    hint = f"give the collector's private key (PEM, no passphrase) in a file of yours: chmod 600 {key}"
    fd = open_secret(key, f"--report-key {key}", hint, MAX_KEY_BYTES)
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            # a key with a passphrase is refused rather than asked for on the terminal
            ctx.load_cert_chain(str(cert), f"/proc/self/fd/{fd}", password=lambda: b"")
        except (ssl.SSLError, OSError) as e:
            raise UserError(f"--report-cert {cert} and --report-key {key} are not a PEM certificate and its key ({e.strerror or e})",
                            hint="give the collector's certificate (the plans' report.ca signs it) and its unencrypted key") from None
    finally:
        os.close(fd)
    return ctx


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = READ_WAIT_S
    server_version = "appliance-flash-collector"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the progress lines say what matters

    def _answer(self, status: int, allow: bool = False) -> None:
        self.send_response(status)
        if allow:
            self.send_header("Allow", "POST")
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()

    def _not_post(self) -> None:
        self._answer(404 if self.path != "/" else 405, allow=self.path == "/")

    do_GET = do_HEAD = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_post

    def do_POST(self) -> None:
        if self.path != "/":
            self._answer(404)
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            self._answer(411)
            return
        if int(length) > MAX_REPORT_BYTES:
            self._answer(413)
            return
        body = self.rfile.read(int(length))
        self._answer(self.server.collector.take(body, self.client_address[0]))


class _Server(HTTPSServer):
    collector: Collector


class Collector:
    """The reports of one flash run: EXPECTED maps each fleet host's signed plan's SHA-256 to its
    name in the fleet; HOSTS each name to its plan's host name (default: the name), which a report
    must carry. Used as a context manager: the server runs in a thread between enter and exit."""

    def __init__(self, address: tuple[str, int], cert: Path, key: Path, expected: dict[str, str], output: Path,
                 say: Callable[[str], None], *, hosts: dict[str, str] | None = None) -> None:
        self.address, self.cert, self.key, self.output, self.say = address, cert, key, output, say
        self.expected = dict(expected)
        self.hosts = dict(hosts or {})
        self.lock = threading.Lock()
        self._reports: dict[str, dict[str, Any]] = {}
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port it listens on (the one given, or the one the system chose for port 0)."""
        return int(self._server.server_address[1]) if self._server is not None else self.address[1]

    def __enter__(self) -> Collector:
        tls = tls_context(self.cert, self.key)
        for name in self.expected.values():  # a stopped run's reports are the first ones still
            stored = read_report(self.output, name)
            if stored is not None and self.expected.get(stored["plan_sha256"]) == name:
                self._reports[name] = stored
        try:
            server = _Server(self.address, _Handler, tls)
        except OSError as e:
            raise UserError(f"--report-listen {self.address[0]}:{self.address[1]}: {e.strerror}",
                            hint="give an address of this machine and a free port, which each plan's report.url names") from None
        server.collector = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="flash-report-collector", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def reports(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return dict(self._reports)

    def report_for(self, name: str) -> dict[str, Any] | None:
        with self.lock:
            return self._reports.get(name)

    def take(self, body: bytes, peer: str) -> int:
        """One POSTed body: its HTTP status (and a progress line where it matters)."""
        try:
            doc = loads_bounded(body)
        except ValueError:
            return 400
        if problem(doc):
            return 400
        name = self.expected.get(doc["plan_sha256"])
        if name is None:
            self.say(f"report from {peer} for no host of this fleet")
            return 404
        want = self.hosts.get(name, name)
        if doc["host"] != want:
            self.say(f"{name}: a report from {peer} for its plan names host {doc['host']!r}, not {want!r}: refused")
            return 400
        with self.lock:
            first = self._reports.get(name)
            if first is not None:
                if first == doc:
                    return 204
                self.say(f"{name}: a different report from {peer} refused: the first one is kept "
                         f"({report_path(self.output, name)}: {described(first)})")
                return 409
            atomic_write(report_path(self.output, name), (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), mode=0o600)
            self._reports[name] = doc
        self.say(f"{name}: the installer reported: {described(doc)}")
        return 204
