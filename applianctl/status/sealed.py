"""Status part `sealed`: is this boot sealed? Secure Boot enforcing with the appliance's certificate
in the firmware's db (the chain firmware, systemd-boot, kernel image, /usr), a TPM, and the signed
PCR 11 policy systemd-stub found in the kernel image (what /var's key will be sealed to)."""

from __future__ import annotations

import json
from pathlib import Path

from appliance import efivars, paths
from appliance.errors import UserError
from applianctl.status.probes import DEGRADED, NOT_CONFIGURED, OK, Part

TPM = Path("/sys/class/tpm/tpm0")
PCR_SIGNATURE = Path("/run/systemd/tpm2-pcr-signature.json")  # systemd-stub -> initrd -> here
HINT = "enroll the appliance's keys (README, \"Secure Boot\")"


def enroll_record() -> Path:
    """What the image's Secure Boot key set holds (builder/secureboot.py writes it into /usr)."""
    return paths.LIB_DIR / "secureboot/enroll.json"


def probe_sealed(efivars_dir: Path = efivars.EFIVARS, record: Path | None = None, tpm: Path = TPM,
                 pcr_signature: Path = PCR_SIGNATURE) -> Part:
    record = enroll_record() if record is None else record
    state = efivars.secure_boot_state(efivars_dir)
    if not state.efi:
        return Part(NOT_CONFIGURED, "not booted through UEFI: nothing is measured or enforced", {"efi": False})
    details: dict[str, object] = {
        "efi": True,
        "secure_boot": state.secure_boot,
        "setup_mode": state.setup_mode,
        "tpm": tpm.exists(),
        "pcr_signature": pcr_signature.exists(),
    }
    try:
        expected = json.loads(record.read_text())["appliance_sha256"]
        details["db_trusts_appliance"] = expected in efivars.db_sha256s(efivars_dir)
    except (OSError, ValueError, KeyError, TypeError, UserError) as e:
        details["db_trusts_appliance"] = None
        details["db_error"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    problems = []
    if state.setup_mode:
        problems.append("the firmware is in setup mode (no keys enrolled): " + HINT)
    elif not state.secure_boot:
        problems.append("Secure Boot is off: any kernel boots on this machine; turn it on in the firmware setup")
    elif details["db_trusts_appliance"] is False:
        problems.append("the firmware's db does not hold the appliance's certificate (booted through another vendor's loader?)")
    if not details["tpm"]:
        problems.append("no TPM: /var cannot be sealed to this machine")
    if not details["pcr_signature"]:
        problems.append("the kernel image carries no signed PCR policy")
    if problems:
        return Part(DEGRADED, "; ".join(problems), details)
    return Part(OK, "", details)
