# SPDX-License-Identifier: MIT
"""appliance-attest.service (`applianctl attest-serve`): the device's answers to the fleet's verifier,
over HTTP on loopback (paths.ATTEST), which the proxy's metrics site forwards to under the same
source allowlist and client certificates as /metrics (units/Caddyfile.j2):

- `GET /attest/identity`: the EK (public key, certificate) and the AK (public area, name);
- `POST /attest/quote` with `{"nonce": "<64 hex>"}`: a quote over PCRs 7 and 11 with that nonce,
  the PCR values and the firmware's event log (appliance/attest/evidence.py's Evidence);
- `POST /attest/activate` with `{"credential": "<base64>"}`: `{"secret": "<base64>"}`, the secret
  tpm2_makecredential sealed for this TPM's EK and this AK's name (enrollment's proof).

A TPM is slow and shared (the /var seal, systemd's own measurements): nobody may keep it busy. So
a request body is at most MAX_BODY bytes, one TPM operation runs at a time (another waits for it,
up to BUSY_WAIT_S, then 503), and a token bucket (BURST requests at once, one more each
1/REFILL_PER_S seconds) answers the rest 429 with Retry-After. Errors are JSON shaped like the rest
of the metrics site's: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import dataclasses
import http.server
import json
import math
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from appliance import cli_help, paths
from appliance.caddyfile import ATTEST_MAX_BODY
from appliance.errors import Refused, UserError
from appliance.safe_read import loads_bounded
from appliance.schema import Loader, check

MAX_BODY = ATTEST_MAX_BODY  # the metrics site refuses a larger one before it reaches here
BURST = 5
REFILL_PER_S = 1.0
BUSY_WAIT_S = 30.0  # a quote on a slow firmware TPM takes a second or two; an RSA EK made anew, more
READ_TIMEOUT_S = 10.0  # a request's header and body, from Caddy on loopback
ROUTES = {"/attest/identity": "GET", "/attest/quote": "POST", "/attest/activate": "POST"}
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}\Z")
_BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}\Z")


class Backend(Protocol):
    """What the service asks: applianctl/attest/tpm.py on the device, a stand-in in tests."""

    def identity(self) -> Any: ...

    def quote(self, nonce: bytes) -> Any: ...

    def activate(self, credential: bytes) -> bytes: ...


class TpmBackend:
    """The TPM through tpm2-tools (applianctl/attest/tpm.py)."""

    def identity(self) -> Any:
        from applianctl.attest import tpm

        return tpm.identity()

    def quote(self, nonce: bytes) -> Any:
        from applianctl.attest import tpm

        return tpm.quote(nonce)

    def activate(self, credential: bytes) -> bytes:
        from applianctl.attest import tpm

        return tpm.activate(credential)


class TokenBucket:
    """BURST tokens, one more each 1/PER_S seconds; `take` spends one, or says how long until one."""

    def __init__(self, burst: int = BURST, per_s: float = REFILL_PER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.per_s, self.clock = burst, per_s, clock
        self._tokens = float(burst)
        self._at = clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        """0 when a token was spent, else the seconds until there is one."""
        with self._lock:
            now = self.clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s)
            self._at = now
            if self._tokens >= 1:
                self._tokens -= 1
                return 0.0
            return (1 - self._tokens) / self.per_s


def _nonce(value: str) -> str | None:
    return None if _HEX64.match(value) else "64 hexadecimal digits (32 random bytes)"


def _credential(value: str) -> str | None:
    if not _BASE64.match(value) or len(value) % 4:
        return "the file tpm2_makecredential -o wrote, in base64"
    return None


@dataclasses.dataclass(frozen=True)
class QuoteRequest:
    nonce: str = dataclasses.field(metadata=check(_nonce))


@dataclasses.dataclass(frozen=True)
class ActivateRequest:
    credential: str = dataclasses.field(metadata=check(_credential))


class _RequestLoader(Loader):
    def invalid(self, key: str, value: Any, expected: str) -> UserError:
        return Refused(f"{self.where}: {key or 'the body'}: invalid", hint=f"expected {expected}")

    def unknown(self, key: str, value: Any, known: list[str]) -> UserError:
        return Refused(f"{self.where}: unknown key {key[:40]!r}", hint=f"the keys are {', '.join(known)}")

    def missing(self, key: str, tp: Any) -> UserError:
        return Refused(f"{self.where}: missing key {key!r}", hint=f"send {{\"{key}\": ...}}")


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message[:1000], "type": kind, "param": None, "code": status}}


class Answer(Exception):
    """An answer other than 200, raised where it is decided."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers or {}


class Attestor:
    """The routes' logic, apart from HTTP: the bucket, the one-at-a-time lock, the backend."""

    def __init__(self, backend: Backend, bucket: TokenBucket | None = None, busy_wait_s: float = BUSY_WAIT_S) -> None:
        self.backend = backend
        self.bucket = bucket or TokenBucket()
        self.busy_wait_s = busy_wait_s
        self.tpm = threading.Lock()

    def admit(self, path: str, method: str) -> None:
        """404 for another path, 405 for another method, 429 once the bucket is empty."""
        wanted = ROUTES.get(path)
        if wanted is None:
            raise Answer(404, "Not here: the attestation service serves GET /attest/identity, POST /attest/quote "
                              "and POST /attest/activate.")
        if method != wanted:
            raise Answer(405, f"Method not allowed: {path} takes {wanted}.", headers={"Allow": wanted})
        wait = self.bucket.take()
        if wait > 0:
            raise Answer(429, "Too many attestation requests: the TPM is rate-limited; try again after Retry-After seconds.",
                         "rate_limit_error", {"Retry-After": str(max(1, math.ceil(wait)))})

    def answer(self, path: str, body: bytes) -> dict[str, Any]:
        """The 200 answer to an admitted request on PATH with BODY."""
        if path == "/attest/quote":
            request = self._load(QuoteRequest, body, "the quote request")
            quoted: dict[str, Any] = self._with_tpm(lambda: _dump(self.backend.quote(bytes.fromhex(request.nonce))))
            return quoted
        if path == "/attest/activate":
            request = self._load(ActivateRequest, body, "the activation request")
            try:
                credential = base64.b64decode(request.credential, validate=True)
            except binascii.Error:
                raise Answer(400, "the activation request: credential is not base64") from None
            secret = self._with_tpm(lambda: self.backend.activate(credential))
            return {"secret": base64.b64encode(secret).decode("ascii")}
        identity: dict[str, Any] = self._with_tpm(lambda: _dump(self.backend.identity()))
        return identity

    def _load(self, cls: type, body: bytes, what: str) -> Any:
        try:
            data = loads_bounded(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise Answer(400, f"{what} is not JSON: {str(e)[:200]}") from None
        try:
            return _RequestLoader(what).load(cls, data)
        except UserError as e:
            raise Answer(400, f"{e.message} ({e.hint})" if e.hint else e.message) from None

    def _with_tpm(self, operation: Callable[[], Any]) -> Any:
        if not self.tpm.acquire(timeout=self.busy_wait_s):
            raise Answer(503, "The TPM is busy with another attestation request; try again.", "service_unavailable_error",
                         {"Retry-After": "1"})
        try:
            return operation()
        except Refused as e:
            raise Answer(400, f"{e.message} ({e.hint})" if e.hint else e.message) from None
        except UserError as e:
            print(f"appliance-attest: {e.message}", file=sys.stderr, flush=True)
            raise Answer(500, f"The TPM operation failed: {e.message}", "server_error") from None
        finally:
            self.tpm.release()


def _dump(model: Any) -> dict[str, Any]:
    from appliance.attest.evidence import dump

    return dump(model)


class _Handler(http.server.BaseHTTPRequestHandler):
    server_version = "appliance-attest"
    sys_version = ""
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S
    attestor: Attestor

    def _send(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        raw = (json.dumps(body) + "\n").encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("Cache-Control", "no-store")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(raw)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise Answer(411, "A request body needs a Content-Length (no chunked encoding).")
        length = self.headers.get("Content-Length")
        if length is None:
            if self.command == "POST":
                raise Answer(411, "A request body needs a Content-Length.")
            return b""
        if not length.isdigit() or len(length) > 12:
            raise Answer(400, "The Content-Length is not a number.")
        if int(length) > MAX_BODY:
            raise Answer(413, f"The request body is larger than {MAX_BODY} bytes.")
        body = self.rfile.read(int(length))
        if len(body) != int(length):
            raise Answer(400, "The request body ended before its Content-Length.")
        return body

    def _dispatch(self) -> None:
        path = self.path
        attestor = type(self).attestor
        try:
            attestor.admit(path, self.command)
            self._send(200, attestor.answer(path, self._body()))
        except Answer as a:
            self._send(a.status, error_body(a.status, a.message, a.kind), a.headers)
        except Exception:  # a fault of this service: the journal gets the traceback, the verifier one line
            traceback.print_exc(file=sys.stderr)
            self._send(500, error_body(500, "The attestation service failed; its journal says why.", "server_error"))

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _dispatch

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the metrics site logs every request (Caddy's JSON log)


class Server(http.server.ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def make_server(address: str, attestor: Attestor) -> Server:
    """The service on ADDRESS (host:port; port 0 picks a free one), not yet serving."""
    handler = type("AttestHandler", (_Handler,), {"attestor": attestor})
    return Server(_address(address), handler)


def main(args: argparse.Namespace) -> int:
    server = make_server(args.listen, Attestor(TpmBackend()))
    print(f"appliance-attest: serving on {args.listen}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # hidden (not listed): appliance-attest.service's ExecStart
    p = cli_help.verb_parser(
        sub, "attest-serve", "answer the fleet's verifier: the TPM's identity, quotes, credential activation",
        examples=["applianctl attest-serve", "applianctl attest-serve --listen 127.0.0.1:8093"],
        exit_codes=[(0, "the service stopped"), cli_help.BAD_INPUT],
        details="GET /attest/identity, POST /attest/quote and POST /attest/activate on loopback, behind the metrics "
                f"site; bodies of at most {MAX_BODY} bytes, one TPM operation at a time, {BURST} requests at once and "
                f"{REFILL_PER_S:g} more a second (429 with Retry-After beyond).",
        hidden=True,
    )
    p.add_argument("--listen", default=paths.ATTEST, metavar="HOST:PORT", help="where the service listens")
    p.set_defaults(func=main)
