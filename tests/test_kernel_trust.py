# SPDX-License-Identifier: MIT
"""A kernel image the firmware would refuse is refused by the updater before anything is written.

Seen in QEMU (make test-extended GROUPS=signing): under Secure Boot, an update whose kernel image is
signed by a key outside db was installed; the firmware refused to start it and its boot manager
stayed in its own menu, with nobody there to choose the previous version. Here the kernel images
are real PE files signed by sbsign, and the firmware's db is an efivarfs-shaped directory.
"""

from __future__ import annotations

import datetime
import struct
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from fake_release import bundle, make_pe, sign_pe, usrhash_for
from test_secureboot_enroll import _firmware
from test_update import Device, listed, resign_index, run_update
from test_update import device as device
from test_update import signing_fixture as signing_fixture

from appliance import authenticode, paths
from appliance.errors import Refused

pytestmark = pytest.mark.programs  # starts real programs (make unit, not make check)

Pair = tuple[Path, Path]  # (key, certificate) as PEM files


def _pair(directory: Path, name: str, issuer: tuple[rsa.RSAPrivateKey, x509.Certificate] | None = None,
          ca: bool = False) -> tuple[Pair, rsa.RSAPrivateKey, x509.Certificate]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    signer_key, issuer_name = (key, subject) if issuer is None else (issuer[0], issuer[1].subject)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .sign(signer_key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    key_path, cert_path = directory / f"{name}.key", directory / f"{name}.crt"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return (key_path, cert_path), key, cert


def _der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def _kernel(path: Path) -> Path:
    make_pe(path, {".osrel": b'IMAGE_VERSION="2.0.0"\n', ".cmdline": b"usrhash=" + b"ab" * 32})
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("pki")
    appliance, _, appliance_cert = _pair(d, "appliance")
    foreign, _, foreign_cert = _pair(d, "foreign")
    _, ca_key, ca_cert = _pair(d, "ca", ca=True)
    inter, inter_key, inter_cert = _pair(d, "intermediate", (ca_key, ca_cert), ca=True)
    leaf, _, _ = _pair(d, "leaf", (inter_key, inter_cert))
    return {"appliance": appliance, "appliance_cert": appliance_cert, "foreign": foreign, "foreign_cert": foreign_cert,
            "ca_cert": ca_cert, "intermediate": inter, "leaf": leaf}


def _trusted(path: Path, db: list[x509.Certificate]) -> bool:
    return any(authenticode.trusted_by(s, db) for s in authenticode.signers(path))


def test_the_signer_in_db_is_trusted_and_another_is_not(tmp_path: Path, pki: dict[str, Any]) -> None:
    image = _kernel(tmp_path / "k.efi")
    sign_pe(image, *pki["appliance"])
    assert authenticode.signers(image)[0].subject == "CN=appliance"
    assert _trusted(image, [pki["appliance_cert"]])
    assert not _trusted(image, [pki["foreign_cert"]])
    assert not _trusted(image, [])


def test_a_signer_chained_to_a_ca_in_db_through_an_intermediate_is_trusted(tmp_path: Path, pki: dict[str, Any]) -> None:
    """As Microsoft's UEFI CA signs shim: db holds the CA, the signature carries the intermediate."""
    image = _kernel(tmp_path / "k.efi")
    sign_pe(image, *pki["leaf"], pki["intermediate"][1])
    assert _trusted(image, [pki["ca_cert"]])
    assert not _trusted(image, [pki["appliance_cert"]])


def test_a_db_certificate_riding_in_a_foreign_signature_does_not_make_it_trusted(tmp_path: Path, pki: dict[str, Any]) -> None:
    """Only the certificate the SignerInfo names counts, not every certificate the signature carries."""
    image = _kernel(tmp_path / "k.efi")
    sign_pe(image, *pki["foreign"], pki["appliance"][1])
    assert len(authenticode.signers(image)[0].others) == 1
    assert not _trusted(image, [pki["appliance_cert"]])


def test_an_unsigned_or_damaged_image_says_so_in_one_line(tmp_path: Path, pki: dict[str, Any]) -> None:
    image = _kernel(tmp_path / "k.efi")
    with pytest.raises(authenticode.NotSigned, match="no Authenticode signature"):
        authenticode.signers(image)
    sign_pe(image, *pki["appliance"])
    data = bytearray(image.read_bytes())
    pe = struct.unpack_from("<I", data, 0x3C)[0]
    entry = pe + 24 + 112 + 4 * 8
    offset, size = struct.unpack_from("<II", data, entry)
    for bad_size in (size + 4096, 1 << 30):  # past the end; larger than any signature
        struct.pack_into("<II", data, entry, offset, bad_size)
        (tmp_path / "bad.efi").write_bytes(bytes(data))
        with pytest.raises(authenticode.NotSigned) as e:
            authenticode.signers(tmp_path / "bad.efi")
        assert "\n" not in str(e.value)
    struct.pack_into("<II", data, entry, offset, size)
    data[offset + 8:offset + 40] = b"\x30\x84" + b"\xff" * 30  # the PKCS#7 blob's DER broken
    (tmp_path / "bad.efi").write_bytes(bytes(data))
    with pytest.raises(authenticode.NotSigned):
        authenticode.signers(tmp_path / "bad.efi")


# ------------------------------------------------------------------------------ through the updater


def _secure_boot(device: Device, db: list[x509.Certificate], *, on: bool = True, setup_mode: bool = False) -> None:
    _firmware(device.root, secure_boot=on, setup_mode=setup_mode, db=[_der(c) for c in db])


def test_under_secure_boot_a_kernel_image_db_does_not_trust_is_refused_before_any_write(
        tmp_path: Path, device: Device, signing: Any, pki: dict[str, Any]) -> None:
    key, trusted = signing
    _secure_boot(device, [pki["appliance_cert"]])
    b = bundle(tmp_path, key, "2.0.0", uki_signer=pki["foreign"])
    probe = _kernel(tmp_path / "probe.efi")
    sign_pe(probe, *pki["foreign"])
    fingerprint = authenticode.signers(probe)[0].fingerprint
    with pytest.raises(Refused, match=rf"appliance_2\.0\.0\.efi is signed by CN=foreign \(certificate SHA-256 {fingerprint[:16]}…\), "
                                      r"which this firmware's db does not trust") as e:
        run_update(device, str(b), trusted)
    assert "\n" not in e.value.message and "Secure Boot key" in e.value.hint
    assert device.sysupdate_calls() == [] and device.writes() == []
    # refused as soon as the kernel image was proven: the large /usr image was never downloaded
    fetched = sorted(p.name for p in paths.update_staging_dir().rglob("*") if p.is_file())
    assert fetched and not any(".usr" in name for name in fetched), fetched


def test_under_secure_boot_an_unsigned_kernel_image_is_refused(tmp_path: Path, device: Device, signing: Any,
                                                               pki: dict[str, Any]) -> None:
    key, trusted = signing
    _secure_boot(device, [pki["appliance_cert"]])
    with pytest.raises(Refused, match="has no signature this firmware could check"):
        run_update(device, str(bundle(tmp_path, key, "2.0.0")), trusted)
    assert device.sysupdate_calls() == []


def test_under_secure_boot_a_kernel_image_signed_by_the_enrolled_key_is_installed(
        tmp_path: Path, device: Device, signing: Any, pki: dict[str, Any]) -> None:
    key, trusted = signing
    _secure_boot(device, [pki["foreign_cert"], pki["appliance_cert"]])
    assert run_update(device, str(bundle(tmp_path, key, "2.0.0", uki_signer=pki["appliance"])), trusted) == 0
    assert device.sysupdate_calls() == [["systemd-sysupdate", "--no-pager", "update", "2.0.0"]]


@pytest.mark.parametrize("state", [{"on": False}, {"on": True, "setup_mode": True}], ids=["secure-boot-off", "setup-mode"])
def test_without_secure_boot_enforcing_the_signer_is_not_checked(tmp_path: Path, device: Device, signing: Any,
                                                                 pki: dict[str, Any], state: dict[str, bool]) -> None:
    """The firmware checks nothing then, and the updater does not pretend to."""
    key, trusted = signing
    _secure_boot(device, [pki["appliance_cert"]], **state)
    assert run_update(device, str(bundle(tmp_path, key, "2.0.0", uki_signer=pki["foreign"])), trusted) == 0


def test_a_kernel_image_that_boots_another_usrhash_than_the_index_is_refused(tmp_path: Path, device: Device, signing: Any) -> None:
    """The kernel image must boot the /usr the index signs: here one whose command line names
    another root hash, listed in an index the release key signed, beside a signature partition
    that signs the index's usrhash."""
    key, trusted = signing
    b = bundle(tmp_path, key, "2.0.0")
    uki = b / "appliance_2.0.0.efi"
    make_pe(uki, {".osrel": b'ID=debian\nIMAGE_ID="appliance"\nIMAGE_VERSION="2.0.0"\n',
                  ".cmdline": f"usrhash={usrhash_for('2.0.1')} rw".encode()})
    resign_index(b, key, lambda doc: listed(doc, uki))
    with pytest.raises(Refused, match=r"appliance_2\.0\.0\.efi boots usrhash [0-9a-f]{64}, not bundle\.json's") as e:
        run_update(device, str(b), trusted)
    assert "\n" not in e.value.message
    assert device.sysupdate_calls() == [] and device.writes() == []
