# SPDX-License-Identifier: MIT
"""Status part `sealed`: is this boot sealed? Secure Boot enforcing with the appliance's certificate
in the firmware's db (the chain firmware, systemd-boot, kernel image, /usr, and /usr's root hash
signature checked by the kernel against db), a TPM, and the signed
PCR 11 policy systemd-stub found in the kernel image; and /var: LUKS2, how it opens (the unlock
methods of its header, as appliance-var-seal.service found them this boot)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from appliance import efivars, luks, paths
from appliance.errors import UserError
from appliance.safe_read import MAX_RECORD_BYTES, loads_bounded, read_capped
from applianctl.status.document import SealedDetails
from applianctl.status.probes import DEGRADED, NOT_CONFIGURED, OK, Part

TPM = Path("/sys/class/tpm/tpm0")
PCR_SIGNATURE = Path("/run/systemd/tpm2-pcr-signature.json")  # systemd-stub -> initrd -> here
CMDLINE = Path("/proc/cmdline")
_USR_SIGNATURE_OPTION = "root-hash-signature="


def usr_signature_checked(cmdline: Path = CMDLINE) -> bool:
    """Whether this boot's /usr was opened with its root hash signature: the signed command line
    gives systemd-veritysetup the file, the initrd wrote it, and dm-verity opens /usr only when the
    kernel verifies it against the firmware's db (we are running from that /usr)."""
    try:
        words = cmdline.read_text().split()
    except OSError:
        return False
    for word in words:
        key, _, value = word.partition("=")
        if key == "systemd.verity_usr_options":
            paths_given = [o[len(_USR_SIGNATURE_OPTION):] for o in value.split(",") if o.startswith(_USR_SIGNATURE_OPTION)]
            return any(Path(p).is_file() for p in paths_given if p.startswith("/"))
    return False
HINT = "enroll the appliance's keys (README, \"Secure Boot\")"


def enroll_record() -> Path:
    """What the image's Secure Boot key set holds (builder/secureboot.py writes it into /usr)."""
    return paths.LIB_DIR / "secureboot/enroll.json"


def var_seal_record() -> Path:
    return paths.RUN_DIR / "var-seal.json"  # applianctl/var/tpm_seal.py record_path()


@dataclass(frozen=True)
class VarFacts:
    """/var's facts from appliance-var-seal.service's record (None: not known this boot)."""

    encrypted: bool | None = None
    sealed: bool | None = None
    recovery_key: bool | None = None
    unlock: tuple[str, ...] = ()


def _var(record: Path) -> tuple[VarFacts, list[str]]:
    """/var's facts, and the problems with them."""
    try:
        data = read_capped(record, MAX_RECORD_BYTES, what="/var's seal record")
        doc = loads_bounded(data) if data is not None else None
        if doc is None:
            return VarFacts(), ["/var's encryption was not checked this boot (appliance-var-seal.service did not run)"]
        methods = [luks.Method(str(m["kind"]), int(m["keyslot"]), tuple(m["pcrs"]), tuple(m["signed_pcrs"])) for m in doc["methods"]]
        facts = VarFacts(encrypted=bool(doc["encrypted"]), sealed=any(m.sealed for m in methods),
                         recovery_key=any(m.kind == "recovery" for m in methods), unlock=tuple(m.describe() for m in methods))
        problems = [str(p)[:300] for p in doc.get("problems") or []]
    except (OSError, UserError, ValueError, KeyError, TypeError) as e:
        return VarFacts(), [f"/var's seal record is unreadable: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"]
    if facts.encrypted and not facts.sealed and not problems:
        problems.append("/var's key is not sealed to this machine's Secure Boot state (PCR 7)")
    if facts.encrypted and not facts.recovery_key:
        problems.append("/var has no recovery key: a lost TPM would lose /var")
    return facts, problems


def probe_sealed(efivars_dir: Path = efivars.EFIVARS, record: Path | None = None, tpm: Path = TPM,
                 pcr_signature: Path = PCR_SIGNATURE, var_record: Path | None = None, cmdline: Path = CMDLINE) -> Part:
    record = enroll_record() if record is None else record
    state = efivars.secure_boot_state(efivars_dir)
    if not state.efi:
        return Part(NOT_CONFIGURED, "not booted through UEFI: nothing is measured or enforced", SealedDetails(efi=False))
    has_tpm, has_pcr_signature, usr_signature = tpm.exists(), pcr_signature.exists(), usr_signature_checked(cmdline)
    db_trusts: bool | None
    db_error = None
    try:
        expected = json.loads(record.read_text())["appliance_sha256"]
        db_trusts = expected in efivars.db_sha256s(efivars_dir)
    except (OSError, ValueError, KeyError, TypeError, UserError) as e:
        db_trusts = None
        db_error = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
    problems = []
    if state.setup_mode:
        problems.append("the firmware is in setup mode (no keys enrolled): " + HINT)
    elif not state.secure_boot:
        problems.append("Secure Boot is off: any kernel boots on this machine; turn it on in the firmware setup")
    elif db_trusts is False:
        problems.append("the firmware's db does not hold the appliance's certificate (booted through another vendor's loader?)")
    if not has_tpm:
        problems.append("no TPM: /var cannot be sealed to this machine")
    if not has_pcr_signature:
        problems.append("the kernel image carries no signed PCR policy")
    if not usr_signature:
        problems.append("/usr was opened without its root hash signature: only the kernel image's usrhash= vouches for it")
    var, var_problems = _var(var_seal_record() if var_record is None else var_record)
    problems += var_problems
    details = SealedDetails(efi=True, secure_boot=state.secure_boot, setup_mode=state.setup_mode, tpm=has_tpm,
                            pcr_signature=has_pcr_signature, usr_signature=usr_signature, db_trusts_appliance=db_trusts,
                            db_error=db_error, var_encrypted=var.encrypted, var_sealed=var.sealed,
                            var_recovery_key=var.recovery_key, var_unlock=var.unlock)
    if problems:
        return Part(DEGRADED, "; ".join(problems), details)
    return Part(OK, "", details)
