# SPDX-License-Identifier: MIT
"""The build side of Secure Boot: the RSA keys and certificates, the key set a firmware in setup
mode enrolls (really signed by sbvarsign), mkosi's signing options, and the enrolled OVMF variable
store the QEMU boots use (really written by virt-fw-vars)."""

from __future__ import annotations

import hashlib
import json
import shutil
import stat
import struct
import uuid
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa

from appliance import config
from appliance.errors import UserError
from builder import keys, qemu, secureboot

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)

needs_sbvarsign = pytest.mark.skipif(shutil.which("sbvarsign") is None, reason="sbsigntool is not installed (make setup)")


@pytest.fixture
def boot(tmp_path: Path) -> secureboot.BootKeys:
    keys.generate(tmp_path / "keys")
    demo = config.load(Path(__file__).resolve().parents[1] / "appliance.toml", "demo")
    return secureboot.boot_keys(demo, tmp_path / "keys" / "release.key")


def _esl_certificates(auth: bytes) -> list[tuple[uuid.UUID, bytes]]:
    """The (owner, DER) entries of an .auth file: EFI_TIME, WIN_CERTIFICATE (its own length), ESLs."""
    (cert_length,) = struct.unpack_from("<I", auth, 16)
    data, out = auth[16 + cert_length:], []
    while data:
        sig_type = uuid.UUID(bytes_le=data[:16])
        list_size, header_size, sig_size = struct.unpack_from("<III", data, 16)
        assert sig_type == secureboot.X509_GUID and header_size == 0
        body = data[28:list_size]
        for i in range(0, len(body), sig_size):
            out.append((uuid.UUID(bytes_le=body[i:i + 16]), body[i + 16:i + sig_size]))
        data = data[list_size:]
    return out


def test_boot_keys_are_rsa_2048_with_self_signed_code_signing_certificates(tmp_path: Path) -> None:
    (sb_key, sb_cert), (pcr_key, pcr_cert) = keys.boot_keys(tmp_path, make=True)
    for private, cert_path in ((sb_key, sb_cert), (pcr_key, pcr_cert)):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        public = cert.public_key()
        assert isinstance(public, rsa.RSAPublicKey) and public.key_size == 2048
        assert cert.issuer == cert.subject
    # two keys, not one: the firmware's trust and /var's policy are separate decisions
    assert sb_cert.read_bytes() != pcr_cert.read_bytes()


def test_boot_keys_are_never_overwritten_and_missing_ones_are_named(tmp_path: Path) -> None:
    keys.boot_keys(tmp_path, make=True)
    before = (tmp_path / "secureboot.key").read_bytes()
    with pytest.raises(UserError, match="already exists"):
        keys.generate_x509(tmp_path, keys.SECURE_BOOT_NAME, "x")
    assert (tmp_path / "secureboot.key").read_bytes() == before
    with pytest.raises(UserError, match="no secureboot key") as e:
        keys.boot_keys(tmp_path / "elsewhere")
    assert "keys generate --boot" in e.value.hint


@needs_sbvarsign
def test_the_enrollment_set_holds_the_appliance_and_microsofts_uefi_cas(tmp_path: Path, boot: secureboot.BootKeys) -> None:
    out = secureboot.enrollment_set(boot, True, tmp_path / "set")
    mine = secureboot.der(boot.secure_boot_cert)
    record = json.loads((out / "enroll.json").read_text())
    assert record["appliance_sha256"] == hashlib.sha256(mine).hexdigest()
    for name in ("PK", "KEK"):
        assert _esl_certificates((out / f"{name}.auth").read_bytes()) == [(secureboot.APPLIANCE_OWNER, mine)]
    db = _esl_certificates((out / "db.auth").read_bytes())
    assert db[0] == (secureboot.APPLIANCE_OWNER, mine)
    subjects = [x509.load_der_x509_certificate(d).subject.rfc4514_string() for _, d in db[1:]]
    assert len(subjects) == 3 and all("Microsoft" in s for s in subjects), subjects
    assert {o for o, _ in db[1:]} == {secureboot.MICROSOFT_OWNER}
    assert [e["sha256"] for e in record["db"]] == [hashlib.sha256(d).hexdigest() for _, d in db]


@needs_sbvarsign
def test_opting_out_of_microsofts_cas_leaves_only_the_appliance(tmp_path: Path, boot: secureboot.BootKeys) -> None:
    out = secureboot.enrollment_set(boot, False, tmp_path / "set")
    assert _esl_certificates((out / "db.auth").read_bytes()) == [(secureboot.APPLIANCE_OWNER, secureboot.der(boot.secure_boot_cert))]


@needs_sbvarsign
def test_the_pk_payload_is_signed_by_the_appliance_key(tmp_path: Path, boot: secureboot.BootKeys) -> None:
    """A firmware in setup mode checks PK's signature against the certificate it carries: an
    unsigned (empty) PKCS#7 would be refused."""
    auth = (secureboot.enrollment_set(boot, True, tmp_path / "set") / "PK.auth").read_bytes()
    (cert_length,) = struct.unpack_from("<I", auth, 16)
    pkcs7 = auth[16 + 24:16 + cert_length]
    assert len(pkcs7) > 256  # a signature and a certificate, not an empty header
    assert secureboot.der(boot.secure_boot_cert) in pkcs7


def test_mkosi_signs_the_image_with_a_pcr_policy_and_the_installer_without(boot: secureboot.BootKeys) -> None:
    image = secureboot.mkosi_arguments(boot)
    assert "--secure-boot=yes" in image and f"--secure-boot-key={boot.secure_boot_key}" in image
    assert "--sign-expected-pcr=yes" in image and f"--sign-expected-pcr-key={boot.pcr_key}" in image
    assert "--secure-boot-auto-enroll=no" in image
    installer = secureboot.mkosi_arguments(boot, pcr_policy=False)
    assert "--secure-boot=yes" in installer and "--sign-expected-pcr=no" in installer
    assert not any(str(boot.pcr_key) in a for a in installer)


def test_the_enrolled_variable_store_trusts_the_certificate(tmp_path: Path, boot: secureboot.BootKeys) -> None:
    enrolled = qemu.firmware_vars(tmp_path / "vars.fd", boot.secure_boot_cert).read_bytes()
    assert secureboot.der(boot.secure_boot_cert) in enrolled
    blank = qemu.firmware_vars(tmp_path / "blank.fd", None).read_bytes()
    assert blank == qemu.OVMF_VARS.read_bytes() and secureboot.der(boot.secure_boot_cert) not in blank
    assert str(secureboot.APPLIANCE_OWNER) == qemu.ENROLL_OWNER


def test_every_boot_is_sealed_the_firmware_with_smm_and_a_tpm(tmp_path: Path) -> None:
    tpm = qemu.Tpm(tmp_path / "tpm")
    cmd = qemu.qemu_command(tmp_path / "disk", tmp_path / "vars", {}, tpm)
    assert "q35,smm=on" in cmd and "driver=cfi.pflash01,property=secure,value=on" in cmd
    assert any(str(qemu.OVMF_CODE) in a and "secboot" in a for a in cmd)
    assert "tpm-crb,tpmdev=tpm0" in cmd
    # under Secure Boot systemd-stub ignores command-line words from outside the signed image
    assert not any("kernel-cmdline-extra" in a for a in cmd)
    plain = qemu.qemu_command(tmp_path / "disk", tmp_path / "vars", {}, sealed=False)
    assert "q35" in plain and "q35,smm=on" not in plain and not any("tpm" in a for a in plain)


@pytest.mark.skipif(shutil.which("swtpm") is None, reason="swtpm is not installed (make setup)")
def test_the_software_tpm_starts_and_stops(tmp_path: Path) -> None:
    with qemu.Tpm(tmp_path / "tpm") as tpm:
        assert tpm.socket.exists() and tpm.proc is not None and tpm.proc.poll() is None
        proc = tpm.proc
    assert proc.poll() is not None
