# SPDX-License-Identifier: MIT
"""The install plan: one host's settings (appliance/host_settings.py) and the disk that receives
the appliance. The operator writes TOML (`python3 -m builder plan` checks and signs it); the device
keeps it in /var/lib/appliance/host, outside the A/B slots so it survives upgrades and rollbacks,
and accepts only canonical JSON signed by a release key, exactly as the release manifest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import host_settings, schema
from appliance.config import checks
from appliance.config.checks import MAX_GIB
from appliance.config.model import ConfigLoader
from appliance.errors import ConfigError, UserError
from appliance.safe_read import read_capped
from appliance.signed import release_manifest

PLAN_JSON = "plan.json"
PLAN_SIG = "plan.json.sig"
# The largest signed plan (plan.json): `builder plan` signs none larger, the installer and the device
# read none larger.
MAX_PLAN_BYTES = 256 * 1024
MAX_PLAN_SIG_BYTES = 4096  # the written form is 89 bytes

_SERIAL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._:/+-]{0,63}\Z")
_WWN = re.compile(r"^(0x[0-9a-f]{16}([0-9a-f]{16})?|eui\.[0-9a-f]{16,32}|nvme\.[0-9a-f-]{8,120}|naa\.[0-9a-f]{16,32})\Z")
_BY_PATH = re.compile(r"^(/dev/disk/by-path/)?[A-Za-z0-9][A-Za-z0-9:._-]{0,127}\Z")


def _optional(regex: re.Pattern[str], hint: str) -> dict[str, Any]:
    """"" (not given) or a value matching REGEX."""
    return schema.check(lambda v: None if v == "" or regex.fullmatch(v) else hint)


def _when(ok: Any, hint: str) -> dict[str, Any]:
    return schema.check(lambda v: None if ok(v) else hint)


@dataclass(frozen=True)
class Target:
    """Which disk receives the appliance. Every selector given must match; exactly one disk may."""

    serial: str = field(default="", metadata=_optional(_SERIAL, "a disk serial as lsblk shows it"))
    wwn: str = field(default="", metadata=_optional(_WWN, "a WWN as lsblk shows it, e.g. 0x5000c500a1b2c3d4 or eui.00253852a1b2c3d4"))
    model: str = field(default="", metadata=_optional(_SERIAL, "a disk model as lsblk shows it"))
    by_path: str = field(default="", metadata=_optional(_BY_PATH, "a /dev/disk/by-path name such as pci-0000:41:00.0-nvme-1"))
    # Whole GiB (the signed form has no floats); max 0: no upper limit.
    min_size_gib: int = field(default=0, metadata=_when(lambda v: 0 <= v <= MAX_GIB, f"0 to {MAX_GIB:g}"))
    max_size_gib: int = field(default=0, metadata=_when(lambda v: 0 <= v <= MAX_GIB, f"0 (no limit) to {MAX_GIB:g}"))
    # A disk with partitions or a file system signature is written only when this is true.
    wipe_existing_data: bool = False

    @property
    def selectors(self) -> dict[str, str]:
        """The identity selectors the plan gives (not the size range)."""
        given = {"serial": self.serial, "wwn": self.wwn, "model": self.model, "by_path": self.by_path}
        return {k: v for k, v in given.items() if v}


@dataclass(frozen=True)
class Attestation:
    """What the fleet's verifier trusts of this host's TPM (`builder attest enroll --plan`; the
    device does not read it): the CAs that sign its EK certificate, or a software TPM (tests)."""

    ek_ca: str = field(default="", metadata=schema.multiline(lambda v: None if v == "" else checks.is_pem_certificates(v)))
    accept_software_tpm: bool = False


def _recipient_hint(pem: str) -> str | None:
    from appliance import recovery_seal  # only where a plan names a recipient

    return recovery_seal.check_recipient(pem)


@dataclass(frozen=True)
class Report:
    """Where the installer sends what it wrote (its summary without the recovery key) for the
    operator who runs `builder flash --bmc` (the device does not read it): the URL of that run's
    collector, and the PEM certificate (or CA) the collector's certificate must chain to, the only
    trust the installer gives that connection; and optionally the operator's X25519 public key, to
    which a fresh install's recovery key is sealed in the report (`builder recovery-key`)."""

    url: str = field(metadata=_when(lambda v: v and checks.is_https_url(v) is None,
                                    "an https:// URL where `builder flash --bmc --report-listen` listens, e.g. https://10.0.0.5:8443/"))
    ca: str = field(metadata=schema.multiline(
        lambda v: None if v and checks.is_pem_certificates(v) is None else
        "the collector's certificate or its CA, in PEM (-----BEGIN CERTIFICATE----- ...), nothing else"))
    # the public key /var's recovery key is sealed to in the report (appliance/recovery_seal.py); "": not sent
    recovery_recipient: str = field(default="", metadata=schema.multiline(
        lambda v: None if v == "" else _recipient_hint(v)))


@dataclass(frozen=True)
class Plan(host_settings.HostSettings):
    """The host's settings (hostname, network, ssh, proxy, update, weights), the target disk,
    what the verifier trusts of its TPM and where the installer reports."""

    target: Target | None = None
    attestation: Attestation | None = None
    report: Report | None = None


def _cross_checks(where: str, plan: Plan) -> None:
    host_settings.cross_checks(where, plan)
    target = plan.target
    if target is not None:
        if not target.selectors:
            raise ConfigError(f"{where}: target names no disk", hint="give target.serial, target.wwn, target.model or target.by_path")
        if target.max_size_gib and target.min_size_gib > target.max_size_gib:
            raise ConfigError(f"{where}: target.min_size_gib is larger than target.max_size_gib", hint="swap them")


class _PlanLoader(ConfigLoader):
    """Worded as appliance.toml's faults; no control character in any string (each reaches the
    installer's console, a networkd file or authorized_keys)."""

    printable = True


def from_plain(data: Any, where: str) -> Plan:
    """DATA (a parsed TOML or JSON document) as a Plan, checked."""
    plan: Plan = _PlanLoader(Path(where)).load(Plan, data)
    _cross_checks(where, plan)
    return plan


def load_toml(path: Path) -> Plan:
    """The operator's plan file, checked (one line and a hint on any fault)."""
    import tomllib

    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file", hint="write an install plan (see docs/install.md)") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML: {e}", hint="fix the syntax at the line named") from None
    return from_plain(raw, str(path))


def to_document(plan: Plan, signer: str) -> dict[str, Any]:
    """The signed form: the plan's settings (silent ones left out) and the signer's key id."""
    doc = {k: v for k, v in schema.plain(plan).items() if v is not None}
    for section in (host_settings.HOST_SECTION.get(s, s) for s in host_settings.OVERLAY):
        if section in doc:
            doc[section] = {k: v for k, v in doc[section].items() if v is not None}
    doc["signer"] = signer
    return doc


def dumps(plan: Plan, signer: str) -> bytes:
    return release_manifest.canonical(to_document(plan, signer))


def sign(plan: Plan, private_key_path: Path, where: str = "the install plan") -> tuple[bytes, bytes]:
    """(plan.json bytes, plan.json.sig bytes) signed with the release key at PRIVATE_KEY_PATH; a plan
    whose signed form is larger than the device reads (MAX_PLAN_BYTES) is refused, not signed."""
    key = release_manifest.load_private_key(private_key_path)
    data = dumps(plan, release_manifest.key_id(key.public_key()))
    if len(data) > MAX_PLAN_BYTES:
        raise ConfigError(f"{where}: signed, the plan would be {len(data)} bytes, more than the {MAX_PLAN_BYTES} the appliance reads",
                          hint="make it smaller: fewer or shorter SSH keys and comments")
    return data, release_manifest.encode_signature(key.sign(data))


class PlanRefused(UserError):
    """A plan that is not signed by a trusted key, or not exactly what was signed."""


def verify(data: bytes, sig: bytes, trusted_keys_dir: Path, where: str = PLAN_JSON) -> Plan:
    """The plan in DATA, only if SIG is a trusted key's signature over exactly these bytes."""
    return from_plain(verify_document(data, sig, trusted_keys_dir, where), where)


def verify_document(data: bytes, sig: bytes, trusted_keys_dir: Path, where: str = PLAN_JSON) -> dict[str, Any]:
    """The document in DATA (its signer taken out), only if SIG is a trusted key's signature over
    exactly these bytes and the document names that key; its values are not checked yet (from_plain):
    a signed plan whose values this version refuses is not the same fault as a forged one."""
    if len(data) > MAX_PLAN_BYTES:
        raise PlanRefused(f"{where}: {len(data)} bytes, more than {MAX_PLAN_BYTES}", hint="this is not an install plan")
    try:
        signature = release_manifest.decode_signature(sig)
    except release_manifest.ManifestError as e:
        raise PlanRefused(f"{where}: {e.message}", hint="sign the plan: python3 -m builder plan PLAN.toml") from None
    keys = release_manifest.trusted_keys(trusted_keys_dir)
    signed_by = release_manifest.signer_of(data, signature, keys)
    if signed_by is None:
        raise PlanRefused(f"{where}: not signed by a key this release trusts",
                          hint="sign it with the release key: python3 -m builder plan PLAN.toml")
    try:
        doc = release_manifest.parse_canonical(data)
    except release_manifest.ManifestError as e:
        raise PlanRefused(f"{where}: {e.message}", hint="the plan was changed after it was signed") from None
    if not isinstance(doc, dict) or doc.pop("signer", None) != signed_by:
        raise PlanRefused(f"{where}: names another signer than the key that signed it", hint="the plan is inconsistent")
    return doc


def load_signed(directory: Path, trusted_keys_dir: Path) -> Plan | None:
    """The verified plan in DIRECTORY (plan.json + plan.json.sig); None when there is no plan.
    A plan without its signature, or with a bad one, is refused: nothing unsigned is used."""
    doc = load_signed_document(directory, trusted_keys_dir)
    return None if doc is None else from_plain(doc, str(directory / PLAN_JSON))


def load_signed_document(directory: Path, trusted_keys_dir: Path) -> dict[str, Any] | None:
    """As load_signed, the signed document before its values are checked (verify_document)."""
    data_path, sig_path = directory / PLAN_JSON, directory / PLAN_SIG
    # Regular files only, capped before reading: a FIFO or a link to /dev/zero must not hang the boot.
    hint = "put the signed plan there: python3 -m builder plan PLAN.toml writes plan.json and plan.json.sig"
    try:
        data = read_capped(data_path, MAX_PLAN_BYTES, what="an install plan", hint=hint)
        sig = read_capped(sig_path, MAX_PLAN_SIG_BYTES, what="a plan's signature", hint=hint)
    except UserError as e:
        raise PlanRefused(e.message, hint=e.hint) from None
    if data is None and sig is None:
        return None
    if data is None or sig is None:
        raise PlanRefused(f"{data_path if data is None else sig_path}: missing (a plan needs plan.json and plan.json.sig)",
                          hint="sign the plan: python3 -m builder plan PLAN.toml")
    return verify_document(data, sig, trusted_keys_dir, str(data_path))
