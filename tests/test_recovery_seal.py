# SPDX-License-Identifier: MIT
"""/var's recovery key sealed to the operator (appliance/recovery_seal.py) and the operator's side
(`python3 -m builder recovery-key`): the construction spelled out again here (X25519, HKDF-SHA256
salted with both public keys, AES-256-GCM with the context as associated data), every field of a
sealed key checked, a wrong key, another context or any changed byte refused in one line that holds
no key material, and the verb's files, refusals and output."""

from __future__ import annotations

import base64
import json
import os
import tomllib
from pathlib import Path
from typing import Any

import plan_values
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

import builder.__main__
from appliance import recovery_seal
from appliance.errors import UserError
from appliance.signed import install_plan
from builder import flash_report, recovery_key

RECOVERY = "-".join(["cbdefghi", "jklnrtuv"] * 4)
HOST = "gpu-07.example.net"
SHA = "5" * 64
CONTEXT = recovery_seal.report_context(HOST, SHA)


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def test_a_sealed_key_opens_with_the_private_key_as_the_scheme_says() -> None:
    private_pem, public_pem = recovery_seal.new_keypair()
    sealed = recovery_seal.seal(public_pem.decode(), RECOVERY.encode(), CONTEXT)
    assert set(sealed) == {"scheme", "ephemeral", "nonce", "ciphertext"} and sealed["scheme"] == "x25519-hkdf-sha256-aes256gcm"
    assert recovery_seal.problem(sealed) == ""
    assert recovery_seal.open_sealed(private_pem, sealed, CONTEXT) == RECOVERY.encode()
    assert RECOVERY not in json.dumps(sealed) and RECOVERY.replace("-", "") not in json.dumps(sealed)
    # the construction, without the module: X25519, HKDF-SHA256 (salt: ephemeral || recipient, info: the
    # scheme), AES-256-GCM with the context as associated data
    private = serialization.load_pem_private_key(private_pem, password=None)
    assert isinstance(private, X25519PrivateKey)
    ephemeral = base64.b64decode(sealed["ephemeral"])
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

    shared = private.exchange(X25519PublicKey.from_public_bytes(ephemeral))
    key = HKDF(hashes.SHA256(), 32, salt=ephemeral + _raw_public(private), info=b"x25519-hkdf-sha256-aes256gcm").derive(shared)
    plain = AESGCM(key).decrypt(base64.b64decode(sealed["nonce"]), base64.b64decode(sealed["ciphertext"]), CONTEXT)
    assert plain == RECOVERY.encode()
    # an ephemeral key and a nonce of its own each time
    again = recovery_seal.seal(public_pem.decode(), RECOVERY.encode(), CONTEXT)
    assert again["ephemeral"] != sealed["ephemeral"] and again["nonce"] != sealed["nonce"]
    assert recovery_seal.report_context(HOST, SHA) == b"appliance-recovery-key\0" + HOST.encode() + b"\0" + SHA.encode()


def _flip(text: str, index: int) -> str:
    data = bytearray(base64.b64decode(text))
    data[index] ^= 0x01
    return base64.b64encode(bytes(data)).decode()


def test_another_key_another_context_or_a_changed_byte_does_not_open() -> None:
    private_pem, public_pem = recovery_seal.new_keypair()
    other_pem, _ = recovery_seal.new_keypair()
    sealed = recovery_seal.seal(public_pem.decode(), RECOVERY.encode(), CONTEXT)
    cases: list[tuple[bytes, dict[str, Any], bytes]] = [
        (other_pem, sealed, CONTEXT),
        (private_pem, sealed, recovery_seal.report_context("gpu-08.example.net", SHA)),
        (private_pem, sealed, recovery_seal.report_context(HOST, "6" * 64)),
    ]
    for field, size in (("ephemeral", 32), ("nonce", 12), ("ciphertext", len(base64.b64decode(sealed["ciphertext"])))):
        cases += [(private_pem, {**sealed, field: _flip(sealed[field], i)}, CONTEXT) for i in range(size)]
    for key, changed, context in cases:
        with pytest.raises(ValueError) as e:
            recovery_seal.open_sealed(key, changed, context)
        message = str(e.value)
        assert "\n" not in message and RECOVERY not in message
        assert not any(part in message for part in (*key.decode().splitlines()[1:2], *changed.values()) if len(part) > 8)


@pytest.mark.parametrize(("change", "words"), [
    ({"scheme": "x25519-hkdf-sha256-chacha20"}, "scheme"),
    ({"extra": "1"}, "unknown field 'extra'"),
    ({"nonce": None}, "nonce is not base64"),
    ({"nonce": "not base64!"}, "nonce is not base64"),
    ({"nonce": base64.b64encode(b"\0" * 12).decode().rstrip("=") + "\n"}, "nonce is not base64"),
    ({"nonce": base64.b64encode(b"\0" * 11).decode()}, "nonce is 11 bytes, not 12"),
    ({"ephemeral": base64.b64encode(b"\0" * 31).decode()}, "ephemeral is 31 bytes, not 32"),
    ({"ciphertext": base64.b64encode(b"\0" * 15).decode()}, "ciphertext is 15 bytes"),
    ({"ciphertext": base64.b64encode(b"\0" * (recovery_seal.MAX_CIPHERTEXT + 1)).decode()}, "ciphertext is"),
    ({"ciphertext": "A" * 100_000}, "ciphertext is not base64 of at most"),
    ({"ephemeral": "AAAA" + "=" * 2}, "ephemeral is not base64"),
    ({"ephemeral": base64.b64encode(b"\0" * 32).decode()}, "ephemeral key is not a usable X25519 key"),  # a low-order point
])
def test_every_field_of_a_sealed_key_is_checked(change: dict[str, Any], words: str) -> None:
    private_pem, public_pem = recovery_seal.new_keypair()
    sealed: dict[str, Any] = {**recovery_seal.seal(public_pem.decode(), RECOVERY.encode(), CONTEXT), **change}
    with pytest.raises(ValueError, match=words):
        recovery_seal.open_sealed(private_pem, sealed, CONTEXT)
    if "usable" not in words:
        assert words.split()[0] in recovery_seal.problem(sealed)
    without = {k: v for k, v in recovery_seal.seal(public_pem.decode(), b"x", CONTEXT).items() if k != "nonce"}
    assert recovery_seal.problem(without) == "the sealed key has no field 'nonce'"
    assert recovery_seal.problem(["not", "an", "object"]) == "the sealed key is not a JSON object"


def test_the_recipient_is_one_x25519_public_key_and_nothing_else() -> None:
    private_pem, public_pem = recovery_seal.new_keypair()
    public = public_pem.decode()
    assert recovery_seal.check_recipient(public) is None
    assert recovery_seal.check_recipient(public.rstrip("\n")) is None
    ed25519 = Ed25519PrivateKey.generate().public_key().public_bytes(serialization.Encoding.PEM,
                                                                      serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    for bad in ("", "not a key", public + public, "junk\n" + public, public + "junk\n", private_pem.decode(), ed25519,
                plan_values.CA_PEM, public.replace("M", "N", 1), public[:40] + "\n" * 5000 + public[40:]):
        assert recovery_seal.check_recipient(bad) == recovery_seal.RECIPIENT_HINT, bad[:60]
        with pytest.raises(ValueError, match="the recipient is not one X25519 public key"):
            recovery_seal.seal(bad, b"x", CONTEXT)
    with pytest.raises(ValueError, match="more than 512 bytes"):
        recovery_seal.seal(public, b"x" * 513, CONTEXT)
    # a private key that is not X25519, or not a key
    sealed = recovery_seal.seal(public, b"x", CONTEXT)
    ed_private = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption())
    with pytest.raises(ValueError, match="not an X25519 key"):
        recovery_seal.open_sealed(ed_private, sealed, CONTEXT)
    with pytest.raises(ValueError, match="not a PEM private key without a passphrase"):
        recovery_seal.open_sealed(b"not a key", sealed, CONTEXT)
    encrypted = X25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.BestAvailableEncryption(b"passphrase"))
    with pytest.raises(ValueError, match="not a PEM private key without a passphrase"):
        recovery_seal.open_sealed(encrypted, sealed, CONTEXT)


# ------------------------------------------------------------------------------ python3 -m builder recovery-key


def _builder(argv: list[str]) -> int:
    return builder.__main__.main(argv)


def _report(tmp_path: Path, public_pem: str, plain: str = RECOVERY, **change: Any) -> Path:
    doc: dict[str, Any] = {
        "format": 1, "host": HOST, "plan_sha256": SHA, "version": "1.4.0", "reinstalled": False,
        "disk": {"path": "/dev/nvme1n1", "model": "C123", "serial": "S1", "size_bytes": 1 << 40}, "usr_hash": "ab" * 32,
        "secure_boot": "", "attestation": [], "steps": [], "seconds": 300, "summary": " Appliance 1.4.0 installed",
        "recovery_key_sealed": recovery_seal.seal(public_pem, plain.encode(), CONTEXT)}
    doc.update(change)
    doc = {k: v for k, v in doc.items() if v is not None}
    assert flash_report.problem(doc) == ""
    path = tmp_path / "reports" / "gpu-07.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def test_new_writes_the_pair_prints_the_plans_line_and_never_overwrites(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "recovery"
    assert _builder(["recovery-key", "new", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    private, public = out / "recovery.key", out / "recovery.pub"
    assert private.stat().st_mode & 0o777 == 0o600 and out.stat().st_mode & 0o777 == 0o700
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert private.read_text() not in captured.out + captured.err and private.read_text().splitlines()[1] not in captured.out + captured.err
    [line] = captured.out.splitlines()
    assert line.startswith('recovery_recipient = """')
    # the line, pasted into a plan's [report], names the public key, which the plan takes
    text = f'[report]\nurl = "https://10.0.0.5:8443/"\nca = """{plan_values.CA_PEM}"""\n{line}\n'
    plan = install_plan.from_plain(tomllib.loads(text), "plan.toml")
    assert plan.report is not None and plan.report.recovery_recipient == public.read_text()
    # never over a key
    before = private.read_bytes()
    with pytest.raises(UserError, match="a recovery key already exists"):
        recovery_key.new(out)
    assert _builder(["recovery-key", "new", "--out", str(out)]) == 2
    assert private.read_bytes() == before
    public.unlink()
    (out / "recovery.pub").symlink_to("/dev/null")
    with pytest.raises(UserError, match="already exists"):
        recovery_key.new(out)


def test_open_prints_the_key_on_stdout_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    private, public, _ = recovery_key.new(tmp_path / "recovery")
    report = _report(tmp_path, public.read_text())
    assert _builder(["recovery-key", "open", "--key", str(private), str(report)]) == 0
    captured = capsys.readouterr()
    assert captured.out == RECOVERY + "\n" and captured.err == ""


def test_open_refuses_in_one_line_with_a_hint(tmp_path: Path) -> None:
    private, public, _ = recovery_key.new(tmp_path / "recovery")
    other, _, _ = recovery_key.new(tmp_path / "other")
    pem = public.read_text()

    def refused(key: Path, report: Path, words: str) -> UserError:
        with pytest.raises(UserError) as e:
            recovery_key.open_report(key, report)
        assert words in e.value.message, e.value.message
        assert "\n" not in e.value.message and e.value.hint and RECOVERY not in e.value.message + e.value.hint
        for secret in (private, other):
            assert secret.read_text().splitlines()[1] not in e.value.message + e.value.hint
        return e.value

    report = _report(tmp_path, pem)
    refused(other, report, "does not open with")
    # a tampered report: the sealed key moved to another host's name, or a byte of it changed
    doc = json.loads(report.read_text())
    report.write_text(json.dumps({**doc, "host": "gpu-08.example.net"}))
    refused(private, report, "the recovery key of gpu-08.example.net does not open")
    sealed = doc["recovery_key_sealed"]
    report.write_text(json.dumps({**doc, "recovery_key_sealed": {**sealed, "ciphertext": _flip(sealed["ciphertext"], 3)}}))
    refused(private, report, "does not open")
    report.write_text(json.dumps({**doc, "recovery_key_sealed": {**sealed, "nonce": "x"}}))
    refused(private, report, "not an installer's report (recovery_key_sealed: nonce is not base64")
    # no sealed key: a re-install, or a plan without a recipient
    report = _report(tmp_path, pem, reinstalled=True, recovery_key_sealed=None)
    assert "a re-install makes no new key" in refused(private, report, "holds no sealed recovery key").message
    # not a report at all, none, a link
    report.write_text("[]")
    refused(private, report, "not an installer's report")
    refused(private, tmp_path / "none.json", "no such file")
    link = tmp_path / "link.json"
    link.symlink_to(_report(tmp_path, pem))
    refused(private, link, "symbolic link")
    # whoever holds the public key can seal anything: only a recovery key's form is printed
    refused(private, _report(tmp_path, pem, plain="\x1b]0;owned\x07"), "is not a recovery key")
    # the private key is a secret: a regular file of ours, 0600, not a link
    report = _report(tmp_path, pem)
    private.chmod(0o644)
    assert "chmod 600" in refused(private, report, "can be read by others").hint
    private.chmod(0o600)
    key_link = tmp_path / "key-link"
    key_link.symlink_to(private)
    refused(key_link, report, f"--key {key_link}")
    os.mkfifo(tmp_path / "fifo")
    refused(tmp_path / "fifo", report, "is not a regular file")
    assert recovery_key.open_report(private, report) == RECOVERY
