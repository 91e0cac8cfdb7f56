# SPDX-License-Identifier: MIT
"""The updater's sources against servers and directories that misbehave: a real HTTPS server on
loopback (Python's ssl, a CA made here) that sends oversized and endless bodies, redirects to
plain HTTP and to another host, trickles a body past the deadline; a CA in the environment that
must not count; a directory source with symbolic links."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import http.server
import ipaddress
import os
import ssl
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from appliance import fetch
from appliance.errors import Refused, UserError
from builder.https_server import HTTPSServer

LIMIT = 1 << 16


def make_ca(directory: Path, name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = directory / f"{name}.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


def make_server_cert(directory: Path, ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    crt, pem = directory / "server.crt", directory / "server.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return crt, pem


Behaviour = Callable[[http.server.BaseHTTPRequestHandler], None]


class Server:
    """HTTPS (or plain HTTP) on 127.0.0.1; each path answered by a behaviour; every request logged."""

    def __init__(self, tls: ssl.SSLContext | None) -> None:
        self.routes: dict[str, Behaviour] = {}
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                server.requests.append(self.path)
                behaviour = server.routes.get(self.path)
                if behaviour is None:
                    self.send_error(404)
                    return
                with contextlib.suppress(OSError):  # the client hung up, as it should
                    behaviour(self)

        self.httpd = HTTPSServer(("127.0.0.1", 0), Handler, tls)
        self.port = self.httpd.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def body(data: bytes, status: int = 200) -> Behaviour:
    def send(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    return send


def redirect(location: str) -> Behaviour:
    def send(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    return send


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    key, ca, ca_path = make_ca(tmp_path, "update-ca")
    _, _, other = make_ca(tmp_path, "other-ca")
    crt, pem = make_server_cert(tmp_path, key, ca)
    return {"ca": ca_path, "other": other, "crt": crt, "key": pem}


@pytest.fixture
def https(pki: dict[str, Path]) -> Iterator[Server]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki["crt"], pki["key"])
    s = Server(ctx)
    yield s
    s.close()


@pytest.fixture
def plain() -> Iterator[Server]:
    s = Server(None)
    yield s
    s.close()


def source(server: Server, ca: Path, seconds: float = 30.0, base: str = "bundle/") -> fetch.HttpsSource:
    return fetch.HttpsSource(server.url + base, str(ca), fetch.Deadline(seconds))


# ----------------------------------------------------------------------------------- HTTPS


def test_a_small_file_is_read_over_https_with_the_given_ca(https: Server, pki: dict[str, Path]) -> None:
    https.routes["/bundle/bundle.json"] = body(b'{"a":1}')
    assert source(https, pki["ca"]).read_small("bundle.json", LIMIT) == b'{"a":1}'


def test_an_oversized_index_is_refused_from_its_content_length_before_the_body(https: Server, pki: dict[str, Path]) -> None:
    sent = threading.Event()

    def huge(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(1 << 30))
        h.end_headers()
        h.wfile.write(b"x" * 1024)
        sent.set()

    https.routes["/bundle/bundle.json"] = huge
    with pytest.raises(Refused, match=f"bundle.json is larger than {LIMIT} bytes"):
        source(https, pki["ca"]).read_small("bundle.json", LIMIT)


def test_an_endless_index_is_cut_at_the_cap_while_streaming(https: Server, pki: dict[str, Path]) -> None:
    written = [0]

    def endless(h: http.server.BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Connection", "close")  # no Content-Length: the body ends when the server says so
        h.end_headers()
        while written[0] < (1 << 30):
            h.wfile.write(b"{" * 4096)
            written[0] += 4096

    https.routes["/bundle/bundle.json"] = endless
    t0 = time.monotonic()
    with pytest.raises(Refused, match="larger than"):
        source(https, pki["ca"]).read_small("bundle.json", LIMIT)
    assert time.monotonic() - t0 < 10
    time.sleep(0.2)
    assert written[0] < 64 * LIMIT  # the client stopped reading: the server could not push a gigabyte


def test_a_redirect_to_plain_http_is_not_followed(https: Server, plain: Server, pki: dict[str, Path]) -> None:
    plain.routes["/bundle/bundle.json"] = body(b"{}")
    https.routes["/bundle/bundle.json"] = redirect(plain.url + "bundle/bundle.json")
    with pytest.raises(Refused, match="another scheme, host or port is not followed"):
        source(https, pki["ca"]).read_small("bundle.json", LIMIT)
    assert plain.requests == []


def test_a_redirect_to_another_host_is_not_followed(https: Server, pki: dict[str, Path]) -> None:
    # the same server under another name (its certificate is valid for both): only the host differs
    https.routes["/bundle/bundle.json"] = redirect(f"https://localhost:{https.port}/elsewhere/bundle.json")
    https.routes["/elsewhere/bundle.json"] = body(b"{}")
    with pytest.raises(Refused, match="redirects to"):
        source(https, pki["ca"]).read_small("bundle.json", LIMIT)
    assert "/elsewhere/bundle.json" not in https.requests


def test_a_redirect_on_the_same_server_is_followed(https: Server, pki: dict[str, Path]) -> None:
    https.routes["/bundle/bundle.json"] = redirect("/v2/bundle.json")
    https.routes["/v2/bundle.json"] = body(b"{}")
    assert source(https, pki["ca"]).read_small("bundle.json", LIMIT) == b"{}"


def test_plain_http_is_refused_before_any_request(plain: Server) -> None:
    with pytest.raises(UserError, match="only https:// is accepted"):
        fetch.open_source(plain.url + "bundle/", None, fetch.Deadline(10))
    assert plain.requests == []


def _slow(h: http.server.BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.send_header("Content-Length", str(1 << 20))
    h.end_headers()
    for _ in range(1000):
        h.wfile.write(b"x")
        h.wfile.flush()
        time.sleep(0.05)  # every byte well within any read timeout


def test_a_slow_loris_body_ends_at_the_deadline(https: Server, pki: dict[str, Path], tmp_path: Path) -> None:
    https.routes["/bundle/big.raw"] = _slow
    t0 = time.monotonic()
    with pytest.raises(fetch.DeadlineExceeded, match=r"deadline of 1\.5 s"):
        source(https, pki["ca"], seconds=1.5).fetch("big.raw", tmp_path / "big.raw.part", 1 << 20)
    assert time.monotonic() - t0 < 4


def test_a_slow_loris_index_ends_at_the_deadline(https: Server, pki: dict[str, Path]) -> None:
    https.routes["/bundle/bundle.json"] = _slow
    t0 = time.monotonic()
    with pytest.raises(fetch.DeadlineExceeded):
        source(https, pki["ca"], seconds=1.0).read_small("bundle.json", 1 << 20)
    assert time.monotonic() - t0 < 3


def test_a_body_larger_than_the_index_says_is_refused(https: Server, pki: dict[str, Path], tmp_path: Path) -> None:
    https.routes["/bundle/f.raw"] = body(b"y" * 5000)
    with pytest.raises(Refused, match=r"larger than bundle\.json says"):
        source(https, pki["ca"]).fetch("f.raw", tmp_path / "f.raw.part", 4096)


@pytest.mark.parametrize("variable", ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE"])
def test_the_given_ca_wins_over_the_environment(
    https: Server, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    https.routes["/bundle/bundle.json"] = body(b"{}")
    monkeypatch.setenv(variable, str(pki["other"]))
    assert source(https, pki["ca"]).read_small("bundle.json", LIMIT) == b"{}"
    # and a CA in the environment does not make an untrusted server trusted
    monkeypatch.setenv(variable, str(pki["ca"]))
    with pytest.raises(UserError, match="not trusted"):
        fetch.HttpsSource(https.url + "bundle/", None, fetch.Deadline(10)).read_small("bundle.json", LIMIT)
    with pytest.raises(UserError, match="not trusted"):
        source(https, pki["other"]).read_small("bundle.json", LIMIT)


@pytest.mark.parametrize(
    "spec",
    ["ftp://example.net/b/", "https://user:pw@127.0.0.1/b/", "https://127.0.0.1/b/?x=1", "https:///b/", "https://127.0.0.1:99999/b/"],
)
def test_odd_urls_are_refused(spec: str) -> None:
    with pytest.raises(UserError):
        fetch.open_source(spec, None, fetch.Deadline(10))


# ----------------------------------------------------------------------------------- directories


def test_a_symlinked_file_in_a_directory_source_is_refused(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (tmp_path / "secret").write_bytes(b"{}")
    os.symlink(tmp_path / "secret", bundle / "bundle.json")
    (bundle / "real.raw").write_bytes(b"z" * 10)
    os.symlink(bundle / "real.raw", bundle / "linked.raw")
    src = fetch.open_source(str(bundle), None, fetch.Deadline(10))
    with pytest.raises(Refused, match="is a symbolic link"):
        src.read_small("bundle.json", LIMIT)
    with pytest.raises(Refused, match="is a symbolic link"):
        src.fetch("linked.raw", tmp_path / "linked.part", 10)
    assert not (tmp_path / "linked.part").exists() or (tmp_path / "linked.part").stat().st_size == 0
    src.fetch("real.raw", tmp_path / "real.part", 10)
    assert (tmp_path / "real.part").read_bytes() == b"z" * 10


def test_a_symlinked_bundle_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bundle").mkdir()
    os.symlink(tmp_path / "bundle", tmp_path / "link")
    with pytest.raises(UserError, match="is a symbolic link"):
        fetch.open_source(str(tmp_path / "link"), None, fetch.Deadline(10))


def test_a_device_or_fifo_in_a_directory_source_is_refused(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    os.mkfifo(bundle / "bundle.json")
    with pytest.raises(Refused, match="not a regular file"):
        fetch.open_source(str(bundle), None, fetch.Deadline(10)).read_small("bundle.json", LIMIT)


def test_an_oversized_index_in_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bundle.json").write_bytes(b" " * (LIMIT + 1))
    with pytest.raises(Refused, match="larger than"):
        fetch.open_source(str(tmp_path), None, fetch.Deadline(10)).read_small("bundle.json", LIMIT)


def test_a_download_reports_progress_in_the_journal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f.raw").write_bytes(b"q" * 5000)
    fetch.open_source(str(tmp_path), None, fetch.Deadline(10)).fetch("f.raw", tmp_path / "out.part", 5000)
    err = capsys.readouterr().err.splitlines()
    assert err and err[-1].startswith("downloading f.raw: 4.9 KiB/4.9 KiB (100%)") and "done in" in err[-1]


# ----------------------------------------------------------------------------------- ranged reads


def ranged(data: bytes) -> Behaviour:
    """DATA with HTTP Range support; a range past its end is answered 416."""

    def send(h: http.server.BaseHTTPRequestHandler) -> None:
        rng = h.headers.get("Range") or ""
        start = int(rng.removeprefix("bytes=").split("-")[0]) if rng.startswith("bytes=") else 0
        if start >= len(data) and start:
            h.send_response(416)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        h.send_response(206 if start else 200)
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Content-Length", str(len(data) - start))
        h.end_headers()
        h.wfile.write(data[start:])

    return send


def test_a_ranged_read_over_https_starts_at_the_offset_or_says_it_does_not(https: Server, pki: dict[str, Path]) -> None:
    data = bytes(range(256)) * 40
    https.routes["/bundle/r.raw"] = ranged(data)
    https.routes["/bundle/whole.raw"] = body(data)  # no range support: from the start
    src = source(https, pki["ca"])
    with src.open("r.raw", 1000, chunk=4096) as b:
        assert b.offset == 1000 and b"".join(b) == data[1000:]
    with src.open("whole.raw", 1000) as b:
        assert b.offset == 0 and b"".join(b) == data
    with pytest.raises(fetch.RangeRefused):
        src.open("r.raw", len(data) + 5)
    with pytest.raises(fetch.HttpStatus) as e:
        src.open("gone.raw")
    assert (e.value.status, e.value.url, str(e.value)) == (404, https.url + "bundle/gone.raw", "HTTP 404")


def test_a_ranged_read_of_a_directory_file(tmp_path: Path) -> None:
    (tmp_path / "f.raw").write_bytes(b"0123456789" * 100)
    src = fetch.DirSource(str(tmp_path), fetch.Deadline(10))
    with src.open("f.raw", 995, chunk=3) as b:
        assert b.offset == 995 and list(b) == [b"567", b"89"]
    with pytest.raises(Refused, match="missing from the bundle"):
        src.open("none.raw")


# ----------------------------------------------------------------------------------- beneath the root


@pytest.fixture
def umask0() -> Iterator[None]:
    """No umask: a file's mode is exactly the one it was created with."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_a_directory_source_never_leaves_its_root(tmp_path: Path) -> None:
    bundle, outside = tmp_path / "bundle", tmp_path / "outside"
    bundle.mkdir()
    outside.mkdir()
    (outside / "f.raw").write_bytes(b"outside")
    (bundle / "real").mkdir()
    (bundle / "real/f.raw").write_bytes(b"inside!")
    os.symlink(outside, bundle / "sub")  # a link on the way, not at the file
    src = fetch.DirSource(str(bundle), fetch.Deadline(10))
    assert src.read_small("real/f.raw", LIMIT) == b"inside!"  # beneath the root, a real directory: read
    with pytest.raises(Refused) as e:
        src.read_small("sub/f.raw", LIMIT)
    assert e.value.message == f"{bundle}/sub: is a symbolic link" and e.value.hint
    for name in ("../outside/f.raw", "real/../../outside/f.raw", f"{outside}/f.raw", "real//f.raw", "./real/f.raw"):
        with pytest.raises(Refused, match=r"not a relative path without '\.\.'"):
            src.read_small(name, LIMIT)
    (bundle / "file").write_bytes(b"x")
    with pytest.raises(Refused, match=r"/bundle/file: a regular file, not a directory"):
        src.read_small("file/f.raw", LIMIT)


def test_a_link_to_a_shorter_file_leaves_none_of_its_bytes_in_a_partial_file(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (tmp_path / "secret").write_bytes(b"secret bytes")
    os.symlink(tmp_path / "secret", bundle / "usr.raw")
    staging = tmp_path / "staging"
    staging.mkdir()
    src = fetch.DirSource(str(bundle), fetch.Deadline(10))
    with pytest.raises(Refused, match="is a symbolic link"):
        fetch.fetch_proven(src, "usr.raw", 1000, "0" * 64, staging)
    assert [p.read_bytes() for p in staging.iterdir()] in ([], [b""])


def fchmods(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files fchmod'ed from now on (each call still made)."""
    names: list[str] = []
    real = os.fchmod

    def spy(fd: int, mode: int) -> None:
        names.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd, mode)

    monkeypatch.setattr(os, "fchmod", spy)
    return names


def test_a_partial_file_is_0600_until_proven_then_0644(tmp_path: Path, umask0: None, monkeypatch: pytest.MonkeyPatch) -> None:
    chmodded = fchmods(monkeypatch)
    bundle, staging = tmp_path / "bundle", tmp_path / "staging"
    bundle.mkdir()
    staging.mkdir()
    data = b"r" * 5000
    (bundle / "f.raw").write_bytes(data[:3000])  # cut short: the partial file stays, for a resume
    src = fetch.DirSource(str(bundle), fetch.Deadline(10))
    with pytest.raises(Refused, match="smaller than"):
        fetch.fetch_proven(src, "f.raw", len(data), hashlib.sha256(data).hexdigest(), staging)
    part = staging / "f.raw.part"
    assert part.read_bytes() == data[:3000] and stat.S_IMODE(part.stat().st_mode) == 0o600
    assert chmodded == []  # created 0600, not made so after: nobody could open it in between
    part.chmod(0o644)  # as an older release left it: made root's only again on resume
    with pytest.raises(Refused, match="smaller than"):
        fetch.fetch_proven(src, "f.raw", len(data), hashlib.sha256(data).hexdigest(), staging)
    assert stat.S_IMODE(part.stat().st_mode) == 0o600
    (bundle / "f.raw").write_bytes(data)
    done = fetch.fetch_proven(src, "f.raw", len(data), hashlib.sha256(data).hexdigest(), staging)
    assert done.read_bytes() == data and stat.S_IMODE(done.stat().st_mode) == 0o644 and not part.exists()


def test_a_partial_file_is_created_0600_over_https_too(https: Server, pki: dict[str, Path], tmp_path: Path,
                                                       umask0: None, monkeypatch: pytest.MonkeyPatch) -> None:
    chmodded = fchmods(monkeypatch)
    https.routes["/bundle/f.raw"] = body(b"s" * 10)
    part = tmp_path / "f.raw.part"
    with pytest.raises(UserError, match="download failed"):
        source(https, pki["ca"]).fetch("f.raw", part, 20)  # the server sends half of it
    assert part.read_bytes() == b"s" * 10 and stat.S_IMODE(part.stat().st_mode) == 0o600 and chmodded == []


def test_a_link_at_the_partial_file_is_refused_not_followed(tmp_path: Path) -> None:
    (tmp_path / "f.raw").write_bytes(b"abc")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, tmp_path / "f.raw.part")
    with pytest.raises(Refused, match=r"f\.raw\.part: is a symbolic link \(not followed\)"):
        fetch.DirSource(str(tmp_path), fetch.Deadline(10)).fetch("f.raw", tmp_path / "f.raw.part", 3)
    assert victim.read_bytes() == b"precious"


EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def test_a_zero_size_file_in_the_index_is_fetched_as_an_empty_file(https: Server, pki: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "empty.raw").write_bytes(b"")
    for i, src in enumerate((fetch.DirSource(str(bundle), fetch.Deadline(10)), source(https, pki["ca"]))):
        staging = tmp_path / f"staging{i}"
        staging.mkdir()
        assert fetch.missing_bytes("empty.raw", 0, staging) == 0
        done = fetch.fetch_proven(src, "empty.raw", 0, EMPTY_SHA256, staging)
        assert done == staging / "empty.raw" and done.read_bytes() == b"" and sorted(staging.iterdir()) == [done]
        assert fetch.fetch_proven(src, "empty.raw", 0, EMPTY_SHA256, staging) == done  # again: proven in place
        with pytest.raises(Refused, match=r"does not match bundle\.json"):  # an index whose hash is not the empty one's
            fetch.fetch_proven(src, "other.raw", 0, "0" * 64, staging)
        assert not (staging / "other.raw").exists() and not (staging / "other.raw.part").exists()
    assert https.requests == []  # nothing to ask the server for
