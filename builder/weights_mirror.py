# SPDX-License-Identifier: MIT
"""A weights mirror on the build host: HTTPS (Python's ssl) over a directory, with byte ranges,
logging every request (its Range and the bytes actually written). `make demo` and every QEMU boot
serve the demo's generated weights from it (builder.qemu: the guest fetches them at first boot);
the tests also use its switches for the faults the fetcher must refuse. Serves BASE/PATH and the
Hub's BASE/resolve/REVISION/PATH; BASE/flipped/PATH serves PATH with one byte changed when PATH is
in `flip`. Only regular files below the root are served (no `..`, no link out of it)."""

from __future__ import annotations

import http.server
import shutil
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from builder.https_server import HTTPSServer


class Mirror(http.server.BaseHTTPRequestHandler):
    root: Path
    log: list[dict[str, Any]]
    flip: frozenset[str] = frozenset()  # served with a byte changed (under flipped/ only, unless always_flip)
    always_flip = False
    fail = ""  # answered 503
    rate = 0  # bytes per second per connection (0: as fast as it goes)

    def do_GET(self) -> None:
        name = self.path.lstrip("/")
        if "/resolve/" in self.path:  # BASE/resolve/REVISION/PATH
            name = self.path.split("/resolve/", 1)[1].split("/", 1)[1]
        flipped = name.startswith("flipped/")
        name = name.removeprefix("flipped/")
        rng = self.headers.get("Range") or ""
        start = int(rng.removeprefix("bytes=").split("-")[0]) if rng.startswith("bytes=") else 0
        entry: dict[str, Any] = {"path": self.path, "name": name, "range": rng, "start": start, "sent": 0, "status": 200}
        self.log.append(entry)
        path = self.root / name
        inside = path.resolve().is_relative_to(self.root.resolve())
        if name == self.fail or not inside or not path.is_file():
            entry["status"] = 503 if name == self.fail else 404
            self.send_error(entry["status"])
            return
        data = bytearray(path.read_bytes())
        if name in self.flip and (flipped or self.always_flip):
            data[len(data) // 3] ^= 0x01
        if start:
            entry["status"] = 206
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(data) - start))
        self.end_headers()
        view = memoryview(bytes(data))[start:]
        step = self.rate // 10 if self.rate else len(view) or 1
        try:
            for i in range(0, len(view), step):
                self.wfile.write(view[i : i + step])
                entry["sent"] += len(view[i : i + step])
                if self.rate:
                    time.sleep(0.1)
        except OSError:
            pass  # the client went away (a power cut in the QEMU scenario)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serve(root: Path, cert: Path, key: Path, host: str = "127.0.0.1", **switches: Any) -> Iterator[tuple[int, type[Mirror]]]:
    """Serve ROOT over HTTPS; yields (port, the handler class: its `log` and switches)."""
    handler = type("TestMirror", (Mirror,), {"root": root, "log": [], **switches})
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server = HTTPSServer((host, 0), handler, ctx)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


# QEMU's user network shows the build host's loopback to the guest as this address.
GUEST_SEES_HOST = "10.0.2.2"


@contextmanager
def demo(cache: Path | None = None) -> Iterator[tuple[str, str]]:
    """The demo's generated weights (builder.weights.demo_files, written once under the host cache)
    over HTTPS on loopback, with a CA of their own: (the URL the guest uses, the CA's PEM)."""
    import ipaddress

    from cryptography.hazmat.primitives import serialization

    from appliance import certs
    from builder import weights
    from builder.host_tools import HOST_CACHE

    work = (cache or HOST_CACHE) / "demo-weights"
    www = work / "www"
    if not (work / "complete").is_file():
        shutil.rmtree(www, ignore_errors=True)
        weights.write_demo(www)
        (work / "complete").write_text("")
    ca_key, ca = certs.make_ca("weights.appliance.test", certs._now(), [ipaddress.ip_network(GUEST_SEES_HOST)])
    key, cert = certs.make_server(ca_key, ca, "weights.appliance.test", [ipaddress.ip_address(GUEST_SEES_HOST)], certs._now())
    tls = work / "tls"
    tls.mkdir(exist_ok=True)
    (tls / "server.key").write_bytes(certs._key_pem(key))
    (tls / "server.key").chmod(0o600)
    (tls / "server.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    with serve(www, tls / "server.crt", tls / "server.key") as (port, _):
        yield f"https://{GUEST_SEES_HOST}:{port}/", ca.public_bytes(serialization.Encoding.PEM).decode()
