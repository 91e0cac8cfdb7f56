# SPDX-License-Identifier: MIT
"""TPM 2.0 wire structures a verifier reads (TPM 2.0 Library, Part 2: Structures), big-endian:

- TPMS_ATTEST of a quote (what `tpm2_quote -m` writes): `parse_attest`
- TPMT_SIGNATURE (`tpm2_quote -s`, tss format): `parse_signature`, checked by `verify_signature`
- TPM2B_PUBLIC (`tpm2_createak -u`, tss format): `parse_public`, with the object's name
- the PolicyPCR digest systemd's signed PCR policies carry: `pcr_policy_digest`

Every parser reads only what the structure says, bounds every size and count before use, and
refuses short input and trailing bytes with one `Refused` line; nothing else escapes it.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from appliance.errors import Refused

HINT = "the evidence was not written by a TPM 2.0 through tpm2-tools: ask the device again"

TPM_GENERATED_VALUE = 0xFF544347
TPM_ST_ATTEST_QUOTE = 0x8018
TPM_CC_POLICY_PCR = 0x0000017F

# TPM_ALG_ID
ALG_RSA = 0x0001
ALG_SHA1 = 0x0004
ALG_AES = 0x0006
ALG_SHA256 = 0x000B
ALG_SHA384 = 0x000C
ALG_SHA512 = 0x000D
ALG_NULL = 0x0010
ALG_SM3_256 = 0x0012
ALG_SM4 = 0x0013
ALG_RSASSA = 0x0014
ALG_RSAES = 0x0015
ALG_RSAPSS = 0x0016
ALG_OAEP = 0x0017
ALG_ECDSA = 0x0018
ALG_ECDH = 0x0019
ALG_ECDAA = 0x001A
ALG_SM2 = 0x001B
ALG_ECSCHNORR = 0x001C
ALG_ECMQV = 0x001D
ALG_KDF1_SP800_56A = 0x0020
ALG_KDF2 = 0x0021
ALG_KDF1_SP800_108 = 0x0022
ALG_ECC = 0x0023
ALG_CAMELLIA = 0x0026

ALG_NAMES = {ALG_RSA: "rsa", ALG_SHA1: "sha1", ALG_SHA256: "sha256", ALG_SHA384: "sha384", ALG_SHA512: "sha512",
             ALG_NULL: "null", ALG_SM3_256: "sm3_256", ALG_RSASSA: "rsassa", ALG_RSAPSS: "rsapss",
             ALG_ECDSA: "ecdsa", ALG_ECC: "ecc"}
# the hashes a name, a signature or a PCR digest may use here, with their digest sizes
HASHES: dict[int, tuple[str, int]] = {ALG_SHA1: ("sha1", 20), ALG_SHA256: ("sha256", 32),
                                      ALG_SHA384: ("sha384", 48), ALG_SHA512: ("sha512", 64)}
_SIGNING_HASHES: dict[int, hashes.HashAlgorithm] = {ALG_SHA256: hashes.SHA256(), ALG_SHA384: hashes.SHA384(),
                                                    ALG_SHA512: hashes.SHA512()}
_CURVES: dict[int, type[ec.EllipticCurve]] = {0x0003: ec.SECP256R1, 0x0004: ec.SECP384R1, 0x0005: ec.SECP521R1}

# TPMA_OBJECT bits
FIXED_TPM = 1 << 1
FIXED_PARENT = 1 << 4
SENSITIVE_DATA_ORIGIN = 1 << 5
RESTRICTED = 1 << 16
DECRYPT = 1 << 17
SIGN = 1 << 18

# bounds (Part 2's limits for the structures read here, with room for larger TPMs)
MAX_DIGEST = 64  # sizeof(TPMU_HA): SHA-512
MAX_NAME = 2 + MAX_DIGEST  # nameAlg || digest
MAX_EXTRA_DATA = MAX_DIGEST  # TPM2B_DATA holds at most a TPMT_HA
MAX_PCR_BANKS = 16  # HASH_COUNT is the number of implemented hashes
MAX_SIZEOF_SELECT = 8  # PCR_SELECT_MAX: 3 for the 24 PCRs of the PC Client profile
MAX_RSA_BYTES = 512  # RSA 4096
MAX_ECC_COORDINATE = 66  # P-521
MAX_POLICY = MAX_DIGEST
MAX_PUBLIC = 1024  # a TPM2B_PUBLIC: RSA 4096 with a policy is under 600 bytes
MAX_ATTEST = 1024
MAX_SIGNATURE = 1024
PC_CLIENT_PCRS = 24


def _refused(what: str, message: str) -> Refused:
    return Refused(f"{what}: {message}", hint=HINT)


class Reader:
    """Big-endian fields read off BYTES one after another; every read checked against what is left."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.offset = 0
        self.what = what

    def fail(self, message: str) -> Refused:
        return _refused(self.what, f"{message} (at byte {self.offset})")

    def take(self, size: int, field: str) -> bytes:
        if size > len(self.data) - self.offset:
            raise self.fail(f"{field}: {size} bytes, only {len(self.data) - self.offset} left (truncated)")
        chunk = self.data[self.offset:self.offset + size]
        self.offset += size
        return chunk

    def u8(self, field: str) -> int:
        return self.take(1, field)[0]

    def u16(self, field: str) -> int:
        value: int = struct.unpack(">H", self.take(2, field))[0]
        return value

    def u32(self, field: str) -> int:
        value: int = struct.unpack(">I", self.take(4, field))[0]
        return value

    def u64(self, field: str) -> int:
        value: int = struct.unpack(">Q", self.take(8, field))[0]
        return value

    def tpm2b(self, field: str, limit: int) -> bytes:
        """A TPM2B_*: a 16-bit size, then that many bytes, the size at most LIMIT."""
        size = self.u16(f"{field} size")
        if size > limit:
            raise self.fail(f"{field}: size {size}, more than the {limit} bytes it can hold")
        return self.take(size, field)

    def end(self) -> None:
        if self.offset != len(self.data):
            raise _refused(self.what, f"{len(self.data) - self.offset} trailing bytes after the structure")


def alg_name(alg: int) -> str:
    return ALG_NAMES.get(alg, f"0x{alg:04x}")


# ----------------------------------------------------------------------------------- TPMS_ATTEST


@dataclass(frozen=True)
class PcrSelection:
    hash_alg: int  # TPM_ALG_ID of the bank
    pcrs: tuple[int, ...]  # the selected PCR indexes, ascending


@dataclass(frozen=True)
class Attest:
    """A TPMS_ATTEST of type TPM_ST_ATTEST_QUOTE."""

    magic: int
    type: int
    qualified_signer: bytes
    extra_data: bytes  # the verifier's nonce (qualifyingData)
    clock: int  # milliseconds the TPM has been powered, in total
    reset_count: int  # TPM resets (reboots) since the TPM was cleared
    restart_count: int  # restarts and resumes since the last reset
    safe: bool
    firmware_version: int
    pcr_selection: tuple[PcrSelection, ...]
    pcr_digest: bytes


def read_pcr_selection(r: Reader) -> tuple[PcrSelection, ...]:
    """A TPML_PCR_SELECTION."""
    count = r.u32("TPML_PCR_SELECTION count")
    if count > MAX_PCR_BANKS:
        raise r.fail(f"TPML_PCR_SELECTION count {count}, more than {MAX_PCR_BANKS} banks")
    banks = []
    for _ in range(count):
        hash_alg = r.u16("TPMS_PCR_SELECTION hash")
        size = r.u8("sizeofSelect")
        if size > MAX_SIZEOF_SELECT:
            raise r.fail(f"sizeofSelect {size}, more than {MAX_SIZEOF_SELECT}")
        bits = r.take(size, "pcrSelect")
        banks.append(PcrSelection(hash_alg, tuple(i for i in range(size * 8) if bits[i // 8] >> (i % 8) & 1)))
    return tuple(banks)


def parse_attest(data: bytes) -> Attest:
    """The TPMS_ATTEST of a quote; Refused for another structure, short or trailing data."""
    if len(data) > MAX_ATTEST:
        raise _refused("the quote", f"{len(data)} bytes, more than the {MAX_ATTEST} of a TPMS_ATTEST")
    r = Reader(data, "the quote (TPMS_ATTEST)")
    magic = r.u32("magic")
    if magic != TPM_GENERATED_VALUE:
        raise r.fail(f"magic 0x{magic:08x}, not TPM_GENERATED_VALUE 0x{TPM_GENERATED_VALUE:08x}")
    kind = r.u16("type")
    if kind != TPM_ST_ATTEST_QUOTE:
        raise r.fail(f"type 0x{kind:04x}, not TPM_ST_ATTEST_QUOTE 0x{TPM_ST_ATTEST_QUOTE:04x}")
    signer = r.tpm2b("qualifiedSigner", MAX_NAME)
    extra = r.tpm2b("extraData", MAX_EXTRA_DATA)
    clock = r.u64("clock")
    resets = r.u32("resetCount")
    restarts = r.u32("restartCount")
    safe = r.u8("safe")
    if safe > 1:
        raise r.fail(f"safe = {safe}, not a TPMI_YES_NO")
    firmware = r.u64("firmwareVersion")
    selection = read_pcr_selection(r)
    digest = r.tpm2b("pcrDigest", MAX_DIGEST)
    r.end()
    return Attest(magic, kind, signer, extra, clock, resets, restarts, bool(safe), firmware, selection, digest)


# ----------------------------------------------------------------------------------- TPMT_SIGNATURE


@dataclass(frozen=True)
class Signature:
    sig_alg: int  # ALG_ECDSA or ALG_RSASSA
    hash_alg: int
    r: int = 0  # ECDSA
    s: int = 0
    rsa: bytes = b""  # RSASSA


def parse_signature(data: bytes) -> Signature:
    """A TPMT_SIGNATURE by ECDSA or RSASSA; Refused for another scheme, short or trailing data."""
    if len(data) > MAX_SIGNATURE:
        raise _refused("the signature", f"{len(data)} bytes, more than the {MAX_SIGNATURE} of a TPMT_SIGNATURE")
    r = Reader(data, "the signature (TPMT_SIGNATURE)")
    sig_alg = r.u16("sigAlg")
    if sig_alg not in (ALG_ECDSA, ALG_RSASSA):
        raise r.fail(f"sigAlg {alg_name(sig_alg)}, not ecdsa or rsassa")
    hash_alg = r.u16("hash")
    if sig_alg == ALG_ECDSA:
        sig_r = r.tpm2b("signatureR", MAX_ECC_COORDINATE)
        sig_s = r.tpm2b("signatureS", MAX_ECC_COORDINATE)
        r.end()
        return Signature(sig_alg, hash_alg, r=int.from_bytes(sig_r, "big"), s=int.from_bytes(sig_s, "big"))
    sig = r.tpm2b("sig", MAX_RSA_BYTES)
    r.end()
    return Signature(sig_alg, hash_alg, rsa=sig)


# ----------------------------------------------------------------------------------- TPM2B_PUBLIC


@dataclass(frozen=True)
class AkPublic:
    """An attestation key's public area: the key, its TPM name (nameAlg || H(TPMT_PUBLIC))."""

    key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey
    name: bytes
    name_alg: int
    attributes: int  # TPMA_OBJECT
    scheme: int  # the signing scheme the key is bound to (ALG_NULL: any)
    scheme_hash: int  # its hash (ALG_NULL with it)

    @property
    def restricted_signing_key(self) -> bool:
        return not attribute_faults(self.attributes)


def attribute_faults(attributes: int) -> list[str]:
    """Why TPMA_OBJECT ATTRIBUTES are not those of an attestation key: restricted, sign, not decrypt,
    fixedTPM and fixedParent (it never leaves this TPM), sensitiveDataOrigin (the TPM made it)."""
    faults = [f"not {name}" for bit, name in ((RESTRICTED, "restricted"), (SIGN, "sign"), (FIXED_TPM, "fixedTPM"),
                                                (FIXED_PARENT, "fixedParent"),
                                                (SENSITIVE_DATA_ORIGIN, "sensitiveDataOrigin"))
              if not attributes & bit]
    if attributes & DECRYPT:
        faults.append("decrypt (a storage or encryption key)")
    return faults


def _symmetric(r: Reader) -> None:
    """A TPMT_SYM_DEF_OBJECT: NULL for a signing key, or a block cipher with key bits and mode."""
    alg = r.u16("symmetric algorithm")
    if alg == ALG_NULL:
        return
    if alg not in (ALG_AES, ALG_SM4, ALG_CAMELLIA):
        raise r.fail(f"symmetric algorithm {alg_name(alg)}, not a block cipher or null")
    r.u16("symmetric keyBits")
    r.u16("symmetric mode")


def _scheme(r: Reader, allowed: dict[int, int], what: str) -> tuple[int, int]:
    """A TPMT_*_SCHEME: the scheme, then as many 16-bit details as ALLOWED gives it (hash, count)."""
    scheme = r.u16(what)
    if scheme == ALG_NULL:
        return scheme, ALG_NULL
    if scheme not in allowed:
        raise r.fail(f"{what} {alg_name(scheme)}, not one this structure can hold")
    details = [r.u16(f"{what} details") for _ in range(allowed[scheme])]
    return scheme, details[0] if details else ALG_NULL


_ECC_SCHEMES = {ALG_ECDSA: 1, ALG_ECDH: 1, ALG_SM2: 1, ALG_ECSCHNORR: 1, ALG_ECMQV: 1, ALG_ECDAA: 2}
_RSA_SCHEMES = {ALG_RSASSA: 1, ALG_RSAPSS: 1, ALG_OAEP: 1, ALG_RSAES: 0}
_KDF_SCHEMES = {ALG_KDF1_SP800_56A: 1, ALG_KDF2: 1, ALG_KDF1_SP800_108: 1}


def parse_public(data: bytes) -> AkPublic:
    """A TPM2B_PUBLIC of an ECC or RSA key (as `tpm2_createak -u` writes it); Refused otherwise, for
    short or trailing data, and for a point off its curve. The attributes are not judged here."""
    if len(data) > MAX_PUBLIC:
        raise _refused("the AK public", f"{len(data)} bytes, more than the {MAX_PUBLIC} of a TPM2B_PUBLIC")
    outer = Reader(data, "the AK public (TPM2B_PUBLIC)")
    area = outer.tpm2b("publicArea", MAX_PUBLIC)
    outer.end()
    r = Reader(area, "the AK public (TPMT_PUBLIC)")
    kind = r.u16("type")
    name_alg = r.u16("nameAlg")
    if name_alg not in HASHES:
        raise r.fail(f"nameAlg {alg_name(name_alg)}, not sha1, sha256, sha384 or sha512")
    attributes = r.u32("objectAttributes")
    r.tpm2b("authPolicy", MAX_POLICY)
    _symmetric(r)
    key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey
    if kind == ALG_ECC:
        scheme, scheme_hash = _scheme(r, _ECC_SCHEMES, "ECC scheme")
        curve_id = r.u16("curveID")
        _scheme(r, _KDF_SCHEMES, "KDF scheme")
        x = r.tpm2b("unique.x", MAX_ECC_COORDINATE)
        y = r.tpm2b("unique.y", MAX_ECC_COORDINATE)
        r.end()
        curve = _CURVES.get(curve_id)
        if curve is None:
            raise r.fail(f"curveID 0x{curve_id:04x}, not NIST P-256, P-384 or P-521")
        try:
            key = ec.EllipticCurvePublicNumbers(int.from_bytes(x, "big"), int.from_bytes(y, "big"), curve()).public_key()
        except ValueError:
            raise r.fail(f"the point is not on {curve.name}") from None
    elif kind == ALG_RSA:
        scheme, scheme_hash = _scheme(r, _RSA_SCHEMES, "RSA scheme")
        bits = r.u16("keyBits")
        exponent = r.u32("exponent") or 65537
        modulus = r.tpm2b("unique.rsa", MAX_RSA_BYTES)
        r.end()
        if bits not in (2048, 3072, 4096) or len(modulus) * 8 != bits:
            raise r.fail(f"keyBits {bits} with a {len(modulus)}-byte modulus, not RSA 2048, 3072 or 4096")
        try:
            key = rsa.RSAPublicNumbers(exponent, int.from_bytes(modulus, "big")).public_key()
        except (ValueError, UnsupportedAlgorithm):
            raise r.fail("the RSA key is not one a verifier accepts") from None
    else:
        raise r.fail(f"type {alg_name(kind)}, not an ECC or RSA key")
    hash_name, _ = HASHES[name_alg]
    name = struct.pack(">H", name_alg) + hashlib.new(hash_name, area).digest()
    return AkPublic(key, name, name_alg, attributes, scheme, scheme_hash)


# ----------------------------------------------------------------------------------- checks


def verify_signature(ak: AkPublic, sig: Signature, message: bytes) -> str | None:
    """None when SIG by AK is good over MESSAGE, else why not (one line)."""
    algorithm = _SIGNING_HASHES.get(sig.hash_alg)
    if algorithm is None:
        return f"the signature's hash is {alg_name(sig.hash_alg)}, not sha256, sha384 or sha512"
    if ak.scheme != ALG_NULL and (sig.sig_alg, sig.hash_alg) != (ak.scheme, ak.scheme_hash):
        return (f"the signature is {alg_name(sig.sig_alg)}-{alg_name(sig.hash_alg)}, the AK signs only "
                f"{alg_name(ak.scheme)}-{alg_name(ak.scheme_hash)}")
    try:
        if isinstance(ak.key, ec.EllipticCurvePublicKey):
            if sig.sig_alg != ALG_ECDSA:
                return f"the signature is {alg_name(sig.sig_alg)}, the AK is an ECC key"
            ak.key.verify(encode_dss_signature(sig.r, sig.s), message, ec.ECDSA(algorithm))
        else:
            if sig.sig_alg != ALG_RSASSA:
                return f"the signature is {alg_name(sig.sig_alg)}, the AK is an RSA key"
            ak.key.verify(sig.rsa, message, padding.PKCS1v15(), algorithm)
    except InvalidSignature:
        return "the signature does not verify with the enrolled AK over the quote"
    return None


def pcr_policy_digest(pcr: int, value: bytes) -> bytes:
    """The sha256 policy digest of TPM2_PolicyPCR over sha256 PCR PCR holding VALUE, from a zero
    digest: what systemd-measure signs (the `pol` of a UKI's .pcrsig) and systemd-cryptsetup
    unlocks with. policyDigest' = H(policyDigest || TPM_CC_PolicyPCR || pcrs || H(values))."""
    if not 0 <= pcr < PC_CLIENT_PCRS:
        raise ValueError(f"PCR {pcr}: not one of the {PC_CLIENT_PCRS} PCRs")
    select = bytearray(3)
    select[pcr // 8] |= 1 << (pcr % 8)
    selection = struct.pack(">IHB", 1, ALG_SHA256, len(select)) + bytes(select)
    return hashlib.sha256(bytes(32) + struct.pack(">I", TPM_CC_POLICY_PCR) + selection
                          + hashlib.sha256(value).digest()).digest()
