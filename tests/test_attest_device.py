# SPDX-License-Identifier: MIT
"""Remote attestation, the device's side, on a real swtpm through the real tpm2-tools: the identity
(EK read, AK made once and persisted), quotes over a nonce with the PCR values they cover, credential
activation for this EK and AK only, nothing left loaded in the TPM; and appliance-attest.service's
guards: the rate limit, the body bound, the request checks, one TPM operation at a time."""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from appliance import tpm_keys
from appliance.errors import Refused, UserError
from applianctl.attest import service
from testkit.swtpm import running_swtpm

pytestmark = [pytest.mark.programs,
              pytest.mark.skipif(not shutil.which("swtpm") or not shutil.which("tpm2_createak"),
                                 reason="needs swtpm and tpm2-tools (make setup installs them)")]


@pytest.fixture(scope="module")
def tcti(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_swtpm(tmp_path_factory.mktemp("swtpm")) as tcti, pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPM2TOOLS_TCTI", tcti)
        yield tcti


def _tools(*argv: str | Path) -> str:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=True, timeout=60).stdout


def _transients() -> list[str]:
    return [line for line in _tools("tpm2_getcap", "handles-transient").splitlines() if line.strip()]


def _pcr(index: int) -> str:
    out = _tools("tpm2_pcrread", f"sha256:{index}")
    return out.split("0x", 1)[1].split()[0].lower()


def _extra_data(message: bytes) -> bytes:
    """TPMS_ATTEST: magic, type, qualifiedSigner (TPM2B), extraData (TPM2B)."""
    signer = int.from_bytes(message[6:8], "big")
    at = 8 + signer
    size = int.from_bytes(message[at:at + 2], "big")
    return message[at + 2:at + 2 + size]


# ------------------------------------------------------------------ the TPM through tpm2-tools


def test_identity_twice_is_one_ek_and_one_ak_made_once(tcti: str) -> None:
    from applianctl.attest import tpm

    assert tpm_keys.AK_HANDLE not in tpm_keys.persistent_handles()
    first = tpm_keys.ensure_keys()
    assert first.made == ("AK",)  # swtpm_setup left the EK persistent, as some firmware does
    again = tpm_keys.ensure_keys()
    assert again.made == () and again == tpm_keys.Keys(first.ek_pem, first.ek_certificate, first.ak_public, first.ak_name)
    one, two = tpm.identity(), tpm.identity()
    assert one == two and one.ak_name == first.ak_name.hex()
    assert base64.b64decode(one.ak_public) == first.ak_public
    from cryptography import x509

    cert = x509.load_der_x509_certificate(base64.b64decode(one.ek_certificate))  # cut to its DER, no NV padding
    assert "swtpm" in cert.issuer.rfc4514_string()
    spki = cert.public_key().public_bytes(tpm_keys.serialization.Encoding.PEM, tpm_keys.serialization.PublicFormat.SubjectPublicKeyInfo)
    assert spki.decode() == one.ek_public  # the certificate is this EK's
    assert len(tpm_keys.ek_fingerprint(one.ek_public)) == 64
    assert _transients() == []


def test_an_ek_that_is_not_persistent_is_made_persistent(tcti: str) -> None:
    before = tpm_keys.ensure_keys()
    _tools("tpm2_evictcontrol", "-C", "o", "-c", tpm_keys.hex_handle(tpm_keys.EK_HANDLE))
    after = tpm_keys.ensure_keys()
    assert after.made == ("EK",) and after.ek_pem == before.ek_pem and after.ak_name == before.ak_name
    assert tpm_keys.EK_HANDLE in tpm_keys.persistent_handles() and _transients() == []


def test_a_quote_carries_the_nonce_and_the_pcr_values_it_covers(tcti: str, tmp_path: Path) -> None:
    from appliance.attest.evidence import PCRS, dump, load_evidence
    from applianctl.attest import tpm

    _tools("tpm2_pcrextend", "7:sha256=" + "ab" * 32)
    log = tmp_path / "binary_bios_measurements"
    log.write_bytes(b"\x00" * 100)
    nonce = os.urandom(32)
    evidence = tpm.quote(nonce, event_log=log)
    assert load_evidence(json.loads(json.dumps(dump(evidence)))) == evidence
    assert evidence.nonce == nonce.hex() and tuple(p.index for p in evidence.pcrs) == PCRS
    assert {p.index: p.sha256 for p in evidence.pcrs} == {i: _pcr(i) for i in PCRS}
    assert evidence.pcrs[0].sha256 != "0" * 64  # the extend above
    message = base64.b64decode(evidence.quote)
    assert message[:6] == (0xFF544347).to_bytes(4, "big") + (0x8018).to_bytes(2, "big")  # TPM_GENERATED, TPM_ST_ATTEST_QUOTE
    assert _extra_data(message) == nonce
    assert base64.b64decode(evidence.event_log) == log.read_bytes()
    assert evidence.ak_name == tpm.identity().ak_name
    # the signature is the AK's over this quote, as tpm2-tools' own checker says
    (tmp_path / "ak.pub").write_bytes(base64.b64decode(tpm.identity().ak_public))
    (tmp_path / "q.msg").write_bytes(message)
    (tmp_path / "q.sig").write_bytes(base64.b64decode(evidence.signature))
    _tools("tpm2_checkquote", "-u", tmp_path / "ak.pub", "-m", tmp_path / "q.msg", "-s", tmp_path / "q.sig",
           "-q", nonce.hex(), "-g", "sha256")
    assert _transients() == []


def test_a_quote_refuses_a_short_nonce_and_an_event_log_past_its_bound(tcti: str, tmp_path: Path) -> None:
    from appliance.attest.evidence import MAX_EVENT_LOG_BYTES
    from applianctl.attest import tpm

    with pytest.raises(Refused, match="a nonce of 16 bytes"):
        tpm.quote(os.urandom(16))
    big = tmp_path / "log"
    big.write_bytes(b"\x00" * (MAX_EVENT_LOG_BYTES + 1))
    with pytest.raises(UserError, match="more than"):
        tpm.quote(os.urandom(32), event_log=big)
    assert tpm.quote(os.urandom(32), event_log=tmp_path / "none").event_log == ""  # no log: the verifier says so


def _credential(tmp: Path, ek_pem: str, ak_name_hex: str, secret: bytes) -> bytes:
    (tmp / "ek.pem").write_text(ek_pem)
    (tmp / "secret").write_bytes(secret)
    _tools("tpm2_makecredential", "-T", "none", "-u", tmp / "ek.pem", "-G", "rsa", "-n", ak_name_hex,
           "-s", tmp / "secret", "-o", tmp / "credential")
    return (tmp / "credential").read_bytes()


def test_activate_opens_a_credential_for_this_ek_and_ak_only(tcti: str, tmp_path: Path) -> None:
    from applianctl.attest import tpm

    ident = tpm.identity()
    secret = os.urandom(32)
    assert tpm.activate(_credential(tmp_path, ident.ek_public, ident.ak_name, secret)) == secret
    other_name = ident.ak_name[:4] + os.urandom(32).hex()  # another AK's name (same algorithm)
    with pytest.raises(Refused, match="does not open with this TPM's EK and AK"):
        tpm.activate(_credential(tmp_path, ident.ek_public, other_name, secret))
    with pytest.raises(Refused):
        tpm.activate(b"not a credential")
    with pytest.raises(Refused, match="at most"):
        tpm.activate(b"x" * 5000)
    assert _transients() == []
    assert [s for s in _tools("tpm2_getcap", "handles-loaded-session").splitlines() if s.strip()] == []


# ------------------------------------------------------------------ appliance-attest.service


class _Service:
    def __init__(self, attestor: service.Attestor) -> None:
        self.server = service.make_server("127.0.0.1:0", attestor)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
                ) -> tuple[int, dict[str, Any], dict[str, str]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, json.loads(r.read() or b"{}"), dict(r.getheaders())
        finally:
            conn.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Frozen:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def real(tcti: str) -> Iterator[tuple[_Service, _Frozen]]:
    clock = _Frozen()
    s = _Service(service.Attestor(service.TpmBackend(), service.TokenBucket(clock=clock)))
    yield s, clock
    s.close()


def _nonce_body(nonce: bytes) -> bytes:
    return json.dumps({"nonce": nonce.hex()}).encode()


def test_the_service_answers_identity_quote_and_activation_from_the_tpm(real: tuple[_Service, _Frozen], tmp_path: Path) -> None:
    from appliance.attest.evidence import load_evidence, load_identity

    s, _ = real
    status, body, _ = s.request("GET", "/attest/identity")
    ident = load_identity(body)
    assert status == 200
    nonce = os.urandom(32)
    status, body, _ = s.request("POST", "/attest/quote", _nonce_body(nonce))
    assert status == 200 and load_evidence(body).nonce == nonce.hex()
    secret = os.urandom(32)
    credential = base64.b64encode(_credential(tmp_path, ident.ek_public, ident.ak_name, secret)).decode()
    status, body, _ = s.request("POST", "/attest/activate", json.dumps({"credential": credential}).encode())
    assert (status, base64.b64decode(body["secret"])) == (200, secret)
    wrong = base64.b64encode(_credential(tmp_path, ident.ek_public, "000b" + "11" * 32, secret)).decode()
    status, body, _ = s.request("POST", "/attest/activate", json.dumps({"credential": wrong}).encode())
    assert status == 400 and "does not open" in body["error"]["message"] and "secret" not in body


def test_the_service_rate_limits_with_retry_after(real: tuple[_Service, _Frozen]) -> None:
    s, clock = real
    statuses = [s.request("GET", "/attest/identity")[0] for _ in range(service.BURST)]
    assert statuses == [200] * service.BURST
    status, body, headers = s.request("POST", "/attest/quote", _nonce_body(os.urandom(32)))
    assert status == 429 and headers["Retry-After"] == "1" and body["error"]["type"] == "rate_limit_error"
    clock.now += 1 / service.REFILL_PER_S  # one more token
    assert s.request("GET", "/attest/identity")[0] == 200
    assert s.request("GET", "/attest/identity")[0] == 429


class _Fake:
    """A backend that counts TPM operations running at once; each waits for RELEASE."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.started = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()

    def _op(self) -> dict[str, Any]:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.started.set()
        self.release.wait(30)
        with self.lock:
            self.running -= 1
        return {"ok": True}

    def identity(self) -> Any:
        return self._op()

    def quote(self, nonce: bytes) -> Any:
        return self._op()

    def activate(self, credential: bytes) -> bytes:
        self._op()
        return b"s"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_Service, _Fake]]:
    monkeypatch.setattr(service, "_dump", lambda model: model)
    backend = _Fake()
    backend.release.set()
    s = _Service(service.Attestor(backend, service.TokenBucket(burst=1000)))
    yield s, backend
    s.close()


@pytest.mark.parametrize(("body", "why"), [
    (b"{", "not JSON"), (b"\xff\xfe", "not JSON"), (b"[1]", "invalid"), (b'{"nonce": "ab"}', "64 hexadecimal"),
    (json.dumps({"nonce": "g" * 64}).encode(), "64 hexadecimal"), (json.dumps({"nonce": "ab" * 33}).encode(), "64 hexadecimal"),
    (json.dumps({"nonce": 12}).encode(), "invalid"), (b"{}", "missing key 'nonce'"),
    (json.dumps({"nonce": "ab" * 32, "more": 1}).encode(), "unknown key"), (b"[" * 5000 + b"]" * 5000, "not JSON"),
])
def test_a_quote_request_that_is_not_one_nonce_of_64_hex_is_400(fake: tuple[_Service, _Fake], body: bytes, why: str) -> None:
    s, backend = fake
    status, answer, _ = s.request("POST", "/attest/quote", body)
    assert status == 400 and why in answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error"
    assert backend.most == 0  # the TPM was never asked


@pytest.mark.parametrize("credential", ["", "AAA", "AA=A", "****", "A" * 8 + "\n"])
def test_an_activation_request_without_a_base64_credential_is_400(fake: tuple[_Service, _Fake], credential: str) -> None:
    s, backend = fake
    status, _, _ = s.request("POST", "/attest/activate", json.dumps({"credential": credential}).encode())
    assert status == 400 and backend.most == 0


def test_bodies_over_the_bound_or_without_a_length_are_refused_unread(fake: tuple[_Service, _Fake]) -> None:
    s, backend = fake
    padded = b'{"nonce": "' + b"ab" * 32 + b'"}'
    fits = padded + b" " * (service.MAX_BODY - len(padded))
    assert s.request("POST", "/attest/quote", fits)[0] == 200
    status, answer, _ = s.request("POST", "/attest/quote", fits + b" ")
    assert status == 413 and answer["error"]["code"] == 413
    status, _, _ = s.request("POST", "/attest/quote", None, {"Transfer-Encoding": "chunked"})
    assert status == 411
    for headers in ({}, {"Transfer-Encoding": "chunked", "Content-Length": str(len(padded))}):
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.putrequest("POST", "/attest/quote")
        for name, value in headers.items():  # none; or both (which framing wins is ambiguous: refused)
            conn.putheader(name, value)
        conn.endheaders(padded if headers else None)
        assert conn.getresponse().status == 411
        conn.close()
    assert backend.most == 1  # only the one that fits


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/attest/quote", 405), ("POST", "/attest/identity", 405), ("PUT", "/attest/activate", 405),
    ("GET", "/attest/identity/", 404), ("GET", "/attest/identity?x=1", 404), ("GET", "/metrics", 404), ("GET", "/", 404),
])
def test_only_the_three_routes(fake: tuple[_Service, _Fake], method: str, path: str, status: int) -> None:
    s, backend = fake
    got, answer, headers = s.request(method, path, b"{}" if method != "GET" else None)
    assert got == status and answer["error"]["code"] == status and backend.most == 0
    if status == 405:
        assert headers["Allow"] in ("GET", "POST")


def test_one_tpm_operation_at_a_time(fake: tuple[_Service, _Fake]) -> None:
    s, backend = fake
    backend.release.clear()
    results: list[int] = []
    first = threading.Thread(target=lambda: results.append(s.request("GET", "/attest/identity")[0]))
    first.start()
    assert backend.started.wait(10)
    second = threading.Thread(target=lambda: results.append(s.request("POST", "/attest/quote", _nonce_body(os.urandom(32)))[0]))
    second.start()
    time.sleep(0.5)  # the second request is in, waiting for the TPM
    assert backend.running == 1
    backend.release.set()
    first.join(30)
    second.join(30)
    assert results == [200, 200] and backend.most == 1


def test_a_tpm_that_stays_busy_is_503_with_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "_dump", lambda model: model)
    backend = _Fake()
    s = _Service(service.Attestor(backend, service.TokenBucket(burst=10), busy_wait_s=0.3))
    try:
        threading.Thread(target=lambda: s.request("GET", "/attest/identity"), daemon=True).start()
        assert backend.started.wait(10)
        status, answer, headers = s.request("GET", "/attest/identity")
        assert status == 503 and headers["Retry-After"] == "1" and answer["error"]["type"] == "service_unavailable_error"
    finally:
        backend.release.set()
        s.close()


def test_the_token_bucket_refills_one_a_second_up_to_its_burst() -> None:
    clock = _Frozen()
    bucket = service.TokenBucket(burst=5, per_s=1.0, clock=clock)
    assert [bucket.take() for _ in range(5)] == [0.0] * 5
    assert bucket.take() == pytest.approx(1.0)
    clock.now += 0.5
    assert bucket.take() == pytest.approx(0.5)
    clock.now += 100  # never more than the burst
    assert [bucket.take() for _ in range(6)][-1] > 0


# ------------------------------------------------------------------ the installer's enrollment


def test_the_installer_enrolls_the_ek_and_ak_into_its_summary(tcti: str) -> None:
    from installer import install

    keys = tpm_keys.ensure_keys()
    lines = install.enroll_tpm(tpm_keys.ensure_keys)  # this test's swtpm, not conftest's absent TPM
    assert lines == [f" TPM EK      sha256:{tpm_keys.ek_fingerprint(keys.ek_pem)} (with its maker's certificate)",
                     f" TPM AK      {keys.ak_name.hex()} (was there already)"]
    assert _transients() == []


def test_a_tpm_that_fails_at_install_is_one_line_and_no_failed_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from installer import install

    monkeypatch.setenv("TPM2TOOLS_TCTI", "swtpm:host=127.0.0.1,port=1")  # nobody there
    (line,) = install.enroll_tpm(tpm_keys.ensure_keys)
    assert line.startswith(" attestation NOT enrolled (listing the TPM's handles-persistent failed: ")
    assert line.endswith("enrollment will need `applianctl attest identity` on the appliance later")

    def broken() -> tpm_keys.Keys:
        raise RuntimeError("the TPM is in failure mode")

    assert install.enroll_tpm(broken) == [" attestation NOT enrolled (RuntimeError: the TPM is in failure mode): enrollment will "
                                          "need `applianctl attest identity` on the appliance later"]


def test_pcr_values_the_quote_does_not_cover_are_never_sent(tcti: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """tpm2_quote reads the PCRs beside the quote: when an extend falls in between, the values it
    prints are not those the quote signed; they go out only when the quote's digest is theirs."""
    from applianctl.attest import tpm

    real = tpm_keys.tool
    quotes = []

    def moved(argv: list[Any], what: str, **kw: Any) -> Any:
        done = real(argv, what, **kw)
        if argv[0] == "tpm2_quote":
            quotes.append(argv)
            done.stdout = done.stdout.replace("    7 : 0x", "    7 : 0x" + "1" * 64 + "\n    #: 0x")
        return done

    monkeypatch.setattr(tpm_keys, "tool", moved)
    with pytest.raises(UserError, match=f"the PCRs moved during each of {tpm.QUOTE_TRIES} quotes"):
        tpm.quote(os.urandom(32))
    assert len(quotes) == tpm.QUOTE_TRIES


@pytest.mark.parametrize(("configured", "direct"), [(None, "device:/dev/tpm0"), ("device:/dev/tpmrm0", "device:/dev/tpm0"),
                                                     ("device:/dev/tpmrm1", "device:/dev/tpm1"),
                                                     ("swtpm:host=127.0.0.1,port=2321", None), ("device:/dev/tpm0", None)])
def test_activations_session_goes_around_the_kernels_resource_manager(configured: str | None, direct: str | None) -> None:
    from applianctl.attest import tpm

    assert tpm.session_tcti(configured) == direct


def test_every_tool_of_one_activation_talks_to_the_tpm_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy session is made, satisfied, used and flushed through /dev/tpm0: through /dev/tpmrm0
    the kernel would flush it when each tool exits, and the activation would fail on the device."""
    from applianctl.attest import tpm

    seen: list[list[str]] = []
    monkeypatch.setenv("TPM2TOOLS_TCTI", "device:/dev/tpmrm0")
    monkeypatch.setattr(tpm, "_ensure_ak", lambda: None)
    monkeypatch.setattr(tpm_keys, "flush", lambda: None)

    def tool(argv: list[Any], what: str, **kw: Any) -> None:
        seen.append([str(a) for a in argv])
        if argv[0] == "tpm2_activatecredential":
            (Path(str(argv[argv.index("-o") + 1]))).write_bytes(b"s" * 32)
        elif argv[0] == "tpm2_startauthsession":
            Path(str(argv[argv.index("-S") + 1])).write_bytes(b"session")

    flushed: list[tuple[Path, str | None]] = []
    monkeypatch.setattr(tpm_keys, "tool", tool)
    monkeypatch.setattr(tpm_keys, "flush_session", lambda session, tcti=None: flushed.append((session, tcti)))
    assert tpm.activate(b"credential") == b"s" * 32
    assert [argv[0] for argv in seen] == ["tpm2_startauthsession", "tpm2_policysecret", "tpm2_activatecredential"]
    assert all(argv[1:3] == ["-T", "device:/dev/tpm0"] for argv in seen), seen
    assert [tcti for _, tcti in flushed] == ["device:/dev/tpm0"]
