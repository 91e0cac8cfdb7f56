# SPDX-License-Identifier: MIT
"""Build outputs changed after the build, for scenarios the signed chain must refuse."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.serialization import pkcs7

from builder import keys

FOREIGN_USR_SIGNATURE = "foreign-usr-signature"


def foreign_signed(out: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the build output OUT (hard links) whose kernel image is signed again by a Secure
    Boot key made here, which no firmware's db holds."""
    copy = tmp_path_factory.mktemp("foreign-signed") / "out"
    shutil.copytree(out, copy, copy_function=os.link)
    (sb_key, sb_cert), _ = keys.boot_keys(tmp_path_factory.mktemp("foreign-keys"), make=True)
    (uki,) = copy.glob("*.efi")
    data = uki.read_bytes()
    uki.unlink()  # a link to OUT's own kernel image: write a file of its own
    uki.write_bytes(data)
    subprocess.run(["sbattach", "--remove", str(uki)], check=True, capture_output=True)
    subprocess.run(["sbsign", "--key", str(sb_key), "--cert", str(sb_cert), "--output", str(uki), str(uki)], check=True,
                   capture_output=True)
    return copy


def foreign_usr_signature(out: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """OUT's usr-verity-sig partition image signed again, for the same root hash, by a Secure Boot
    key made here (a PKCS#7 detached signature of the root hash's hex digits, as systemd-repart
    makes it): the updater installs it (the root hash is the one the bundle names), the kernel
    refuses it at boot, and /usr is not opened."""
    (sig,) = out.glob("*.usr-verity-sig.raw")
    raw = sig.read_bytes()
    doc = json.loads(raw.rstrip(b"\0"))
    (sb_key, sb_cert), _ = keys.boot_keys(tmp_path_factory.mktemp("foreign-usr-keys"), make=True)
    cert = x509.load_pem_x509_certificate(sb_cert.read_bytes())
    key = serialization.load_pem_private_key(sb_key.read_bytes(), password=None)
    options = [pkcs7.PKCS7Options.DetachedSignature, pkcs7.PKCS7Options.NoCerts, pkcs7.PKCS7Options.Binary,
               pkcs7.PKCS7Options.NoAttributes]
    signature = (pkcs7.PKCS7SignatureBuilder().set_data(doc["rootHash"].encode()).add_signer(cert, key, hashes.SHA256())  # type: ignore[arg-type]
                 .sign(serialization.Encoding.DER, options))
    doc["signature"] = base64.b64encode(signature).decode()
    doc["certificateFingerprint"] = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
    data = json.dumps(doc, separators=(",", ":")).encode()
    assert len(data) <= len(raw), "the new signature does not fit the partition image"
    sig.unlink()  # the build's own file may be linked elsewhere
    sig.write_bytes(data.ljust(len(raw), b"\0"))
