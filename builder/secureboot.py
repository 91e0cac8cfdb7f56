# SPDX-License-Identifier: MIT
"""Secure Boot on the build host: mkosi's signing options, and the key set a firmware in setup mode
enrolls (the installer writes it; systemd-boot's menu offers it too).

The enrollment set is three time-based authenticated variables signed with the appliance's Secure
Boot key (sbvarsign): PK and KEK hold the appliance's certificate only (so only this appliance's key
can change db and dbx), db the appliance's certificate and, unless `os.secure_boot_microsoft_ca` is
false, Microsoft's third-party UEFI CAs and Option ROM CA, so that the server's option ROMs load.
Microsoft's certificates come from python3-virt-firmware's copies (the same ones OVMF enrolls).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from appliance.config import Config
from appliance.run import checked
from builder import keys
from builder.host_tools import MISSING_HINT

X509_GUID = uuid.UUID("a5c059a1-94e4-4aa7-87b5-ab155c2bf072")  # EFI_CERT_X509_GUID
# The owner of the appliance's own entries; fixed so that every build's lists compare equal.
APPLIANCE_OWNER = uuid.UUID("6c8a31a4-7c5e-4bd6-9c1a-5d0c3b1f0a77")
MICROSOFT_OWNER = uuid.UUID("77fa9abd-0359-4d32-bd60-28f4e78f784b")
AUTH_ATTRIBUTES = "NON_VOLATILE,BOOTSERVICE_ACCESS,RUNTIME_ACCESS,TIME_BASED_AUTHENTICATED_WRITE_ACCESS"
# python3-virt-firmware's resource names -> the names the install summary prints
MICROSOFT_DB = (
    ("microsoft.com/ms-uefi-2011", "Microsoft UEFI CA 2011"),
    ("microsoft.com/ms-uefi-2023", "Microsoft UEFI CA 2023"),
    ("microsoft.com/ms-uefi-rom-2023", "Microsoft Option ROM UEFI CA 2023"),
)
ESP_KEYS_DIR = "efi/loader/keys/appliance"  # in the image tree: systemd-boot's menu offers "appliance"
VARIABLES = ("PK", "KEK", "db")


@dataclass(frozen=True)
class BootKeys:
    """The keys mkosi signs with (paths on the build host)."""

    secure_boot_key: Path
    secure_boot_cert: Path
    pcr_key: Path
    pcr_cert: Path


def boot_keys(config: Config, release_key: Path) -> BootKeys:
    """The Secure Boot and PCR policy keys beside RELEASE_KEY; the demo makes them on the fly."""
    (sb_key, sb_cert), (pcr_key, pcr_cert) = keys.boot_keys(release_key.parent, make=config.profile == "demo")
    return BootKeys(sb_key, sb_cert, pcr_key, pcr_cert)


def mkosi_arguments(boot: BootKeys, *, pcr_policy: bool = True) -> list[str]:
    """Sign systemd-boot and the UKI and, with PCR_POLICY, embed the UKI's signed expected PCR 11
    values (the TPM policy /var's key is sealed to; the installer's UKI has none, so it can never
    unlock an installed /var). No auto-enrollment: the installer enrolls, on purpose."""
    signing = [
        "--secure-boot=yes",
        f"--secure-boot-key={boot.secure_boot_key}",
        f"--secure-boot-certificate={boot.secure_boot_cert}",
        "--secure-boot-auto-enroll=no",
    ]
    if not pcr_policy:
        return [*signing, "--sign-expected-pcr=no"]
    return [*signing, "--sign-expected-pcr=yes", f"--sign-expected-pcr-key={boot.pcr_key}",
            f"--sign-expected-pcr-certificate={boot.pcr_cert}"]


def verity_arguments(boot: BootKeys) -> list[str]:
    """Sign /usr's verity root hash (its usr-verity-sig partition) with the Secure Boot key: the
    kernel checks that signature against the firmware's db, where the same certificate is."""
    return [f"--verity-key={boot.secure_boot_key}", f"--verity-certificate={boot.secure_boot_cert}"]


def der(cert_pem: Path) -> bytes:
    return x509.load_pem_x509_certificate(cert_pem.read_bytes()).public_bytes(serialization.Encoding.DER)


def public_key_pem(cert_pem: Path) -> bytes:
    """The public key of CERT_PEM as systemd-repart's and systemd-cryptenroll's --tpm2-public-key= take it."""
    cert = x509.load_pem_x509_certificate(cert_pem.read_bytes())
    return cert.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def signature_list(entries: list[tuple[uuid.UUID, bytes]]) -> bytes:
    """An EFI_SIGNATURE_LIST chain, one list per X.509 certificate (they differ in size)."""
    out = b""
    for owner, cert in entries:
        size = 16 + len(cert)
        out += X509_GUID.bytes_le + struct.pack("<III", 28 + size, 0, size) + owner.bytes_le + cert
    return out


def microsoft_certificates() -> list[tuple[str, bytes]]:
    from virt.firmware.efi import certs

    return [(name, x509.load_pem_x509_certificate(certs.load_cert(resource)).public_bytes(serialization.Encoding.DER))
            for resource, name in MICROSOFT_DB]


def enrollment_set(boot: BootKeys, microsoft_ca: bool, out: Path) -> Path:
    """Write PK.auth, KEK.auth, db.auth and enroll.json (what each holds) into OUT; return OUT."""
    mine = der(boot.secure_boot_cert)
    own = [("appliance " + x509.load_der_x509_certificate(mine).subject.rfc4514_string(), mine)]
    lists = {"PK": own, "KEK": own, "db": own + (microsoft_certificates() if microsoft_ca else [])}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="appliance-esl-") as tmp:
        for name in VARIABLES:
            esl = Path(tmp) / f"{name}.esl"
            owners = [(APPLIANCE_OWNER if data == mine else MICROSOFT_OWNER, data) for _, data in lists[name]]
            esl.write_bytes(signature_list(owners))
            checked(["sbvarsign", "--key", str(boot.secure_boot_key), "--cert", str(boot.secure_boot_cert),
                     "--attr", AUTH_ATTRIBUTES, "--output", str(out / f"{name}.auth"), name, str(esl)],
                    what=f"sbvarsign {name}", hint="run `make setup` (installs sbsigntool)", timeout=None, missing_hint=MISSING_HINT)
    record = {
        "appliance_sha256": hashlib.sha256(mine).hexdigest(),
        **{name: [{"name": n, "sha256": hashlib.sha256(d).hexdigest()} for n, d in lists[name]] for name in VARIABLES},
    }
    (out / "enroll.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return out
