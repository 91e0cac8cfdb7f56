# SPDX-License-Identifier: MIT
"""Who signed a PE image (a unified kernel image, systemd-boot) for Secure Boot, and whether a
firmware's db trusts that signer: the updater refuses, before it writes anything, a kernel image
the firmware would refuse to start (the firmware's boot manager then stays in its own menu and
nothing brings the previous version back by itself).

This is the firmware's first question only (is the signer's chain rooted in db?); the firmware
still checks the signature itself, and dbx. The signer is the certificate the PKCS#7 SignerInfo
names by issuer and serial number, not any certificate that rides in the signature.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.serialization import Encoding, pkcs7

MAX_SIGNATURE_BYTES = 256 << 10  # the certificate table of a signed kernel image is a few KiB
_CERT_PKCS_SIGNED_DATA = 0x0002
_MAX_CHAIN = 4


class NotSigned(ValueError):
    """The image carries no Authenticode signature that can be read (one line)."""


@dataclass(frozen=True)
class Signer:
    certificate: x509.Certificate
    others: tuple[x509.Certificate, ...]  # the other certificates of the signature (intermediates)

    @property
    def subject(self) -> str:
        return self.certificate.subject.rfc4514_string()

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the certificate (hex): two keys may well carry the same subject."""
        return hashlib.sha256(_der(self.certificate)).hexdigest()


def _certificate_table(path: Path) -> bytes:
    """The PE image's certificate table (data directory 4), bounded by MAX_SIGNATURE_BYTES."""
    with open(path, "rb") as f:
        head = f.read(4096)
        if head[:2] != b"MZ" or len(head) < 0x40:
            raise NotSigned("not a PE file")
        pe = struct.unpack_from("<I", head, 0x3C)[0]
        f.seek(pe)
        coff = f.read(24 + 2)
        if len(coff) < 26 or coff[:4] != b"PE\0\0":
            raise NotSigned("not a PE file")
        magic = struct.unpack_from("<H", coff, 24)[0]
        directories = {0x10B: 96, 0x20B: 112}.get(magic)  # PE32, PE32+
        if directories is None:
            raise NotSigned(f"unknown optional header magic {magic:#x}")
        f.seek(pe + 24 + directories + 4 * 8)
        entry = f.read(8)
        if len(entry) < 8:
            raise NotSigned("the optional header has no certificate table entry")
        offset, size = struct.unpack("<II", entry)
        if not offset or not size:
            raise NotSigned("no Authenticode signature")
        if size > MAX_SIGNATURE_BYTES:
            raise NotSigned(f"a certificate table of {size} bytes (more than {MAX_SIGNATURE_BYTES})")
        f.seek(offset)
        table = f.read(size)
        if len(table) != size:
            raise NotSigned("the certificate table runs past the end of the file")
        return table


def _signed_data_blobs(table: bytes) -> list[bytes]:
    """The PKCS#7 SignedData of each WIN_CERTIFICATE in TABLE (8-byte aligned entries)."""
    out, offset = [], 0
    while offset + 8 <= len(table):
        length, _revision, kind = struct.unpack_from("<IHH", table, offset)
        if length < 8 or offset + length > len(table):
            raise NotSigned(f"a WIN_CERTIFICATE of {length} bytes at {offset} does not fit its table")
        if kind == _CERT_PKCS_SIGNED_DATA:
            out.append(table[offset + 8:offset + length])
        offset += (length + 7) & ~7
    return out


# ------------------------------------------------------------------ just enough DER for SignerInfo


def _tlv(data: bytes, at: int) -> tuple[int, int, int]:
    """(tag, start of value, end of value) of the DER element at AT."""
    if at + 2 > len(data):
        raise NotSigned("the signature's DER ends early")
    tag, first = data[at], data[at + 1]
    at += 2
    if first < 0x80:
        length = first
    else:
        count = first & 0x7F
        if not 1 <= count <= 4 or at + count > len(data):
            raise NotSigned("the signature's DER has a bad length")
        length = int.from_bytes(data[at:at + count], "big")
        at += count
    if at + length > len(data):
        raise NotSigned("the signature's DER runs past its end")
    return tag, at, at + length


def _children(data: bytes, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """(tag, element start, value start, value end) of each element between START and END."""
    out, at = [], start
    while at < end:
        tag, value, stop = _tlv(data, at)
        out.append((tag, at, value, stop))
        at = stop
    return out


def _signer_ids(blob: bytes) -> list[tuple[bytes, int]]:
    """(issuer Name as DER, serial number) of each SignerInfo of a PKCS#7 ContentInfo."""
    _, value, end = _tlv(blob, 0)  # ContentInfo SEQUENCE
    content = _children(blob, value, end)
    if len(content) < 2 or content[1][0] != 0xA0:
        raise NotSigned("the signature is not PKCS#7 SignedData")
    _, signed, signed_end = _tlv(blob, content[1][2])  # [0] EXPLICIT SignedData SEQUENCE
    fields = _children(blob, signed, signed_end)
    if not fields or fields[-1][0] != 0x31:
        raise NotSigned("PKCS#7 SignedData without signerInfos")
    ids = []
    for _, _, info, info_end in _children(blob, fields[-1][2], fields[-1][3]):
        parts = _children(blob, info, info_end)  # version, issuerAndSerialNumber, ...
        if len(parts) < 2 or parts[1][0] != 0x30:
            raise NotSigned("a SignerInfo without issuerAndSerialNumber")
        issuer, serial = _children(blob, parts[1][2], parts[1][3])[:2]
        ids.append((blob[issuer[1]:issuer[3]], int.from_bytes(blob[serial[2]:serial[3]], "big", signed=True)))
    return ids


def signers(path: Path) -> list[Signer]:
    """The signers of the PE image at PATH. NotSigned (one line) when it has no readable signature."""
    found = []
    for blob in _signed_data_blobs(_certificate_table(path)):
        try:
            certs = pkcs7.load_der_pkcs7_certificates(blob)
        except ValueError as e:
            raise NotSigned(f"the signature's certificates cannot be read ({e})") from None
        for issuer, serial in _signer_ids(blob):
            match = [c for c in certs if c.serial_number == serial and c.issuer.public_bytes() == issuer]
            if not match:
                raise NotSigned(f"the signature names a signer (serial {serial:#x}) whose certificate it does not carry")
            found.append(Signer(match[0], tuple(c for c in certs if c is not match[0])))
    if not found:
        raise NotSigned("no Authenticode signature")
    return found


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """ISSUER's name is CERT's issuer and its key made CERT's signature (RSA PKCS#1 v1.5 or
    ECDSA, what Secure Boot certificates use; written out because Debian 12's cryptography has no
    verify_directly_issued_by)."""
    if cert.issuer != issuer.subject or cert.signature_hash_algorithm is None:
        return False
    key = issuer.public_key()
    try:
        if isinstance(key, rsa.RSAPublicKey):
            key.verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), cert.signature_hash_algorithm)
        elif isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(cert.signature_hash_algorithm))
        else:
            return False
    except InvalidSignature:
        return False
    return True


def trusted_by(signer: Signer, db: list[x509.Certificate]) -> bool:
    """Whether SIGNER's certificate is in DB or chains to a certificate in DB (through the
    signature's other certificates, at most a few links)."""
    db_der = {_der(c) for c in db}
    cert = signer.certificate
    for _ in range(_MAX_CHAIN):
        if _der(cert) in db_der or any(_issued_by(cert, anchor) for anchor in db):
            return True
        parents = [c for c in signer.others if c.subject == cert.issuer and c is not cert and _issued_by(cert, c)]
        if not parents:
            return False
        cert = parents[0]
    return False


def _der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(Encoding.DER)
