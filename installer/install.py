# SPDX-License-Identifier: MIT
"""The install: check the release's disk image and block map against the signed bundle index, write
the image to the chosen disk, verify /usr and the engine store against the signed root hashes, store
the plan on /var, put a firmware boot entry first, print a summary of what is now on the disk.

A disk that already holds the medium's version (and may not be wiped) is re-installed: its /usr and
engine store are verified as they are (read-only), only the new plan is written onto its /var.

`bmaptool copy` writes the image's used blocks, then `systemd-repart` with the first-boot definitions
makes slot B and /var, inside LUKS2; systemd-cryptenroll adds a TPM2 slot bound to the release's signed PCR 11 policy only
(the keys are not enrolled yet, so the sealed boot's PCR 7 is unknown here; the first sealed boot
replaces it, applianctl/var/tpm_seal.py) and a key file of this run's own, in RAM, with which the plan is
written and which is then replaced by the recovery key the summary shows once.
`systemd-repart --copy-from=IMAGE` would make the same layout but copies zeros too: measured 2.8x
bmaptool's time against 0.4-1x for this (bench/install.py). A re-install cannot open a /var sealed
to the appliance, and says so.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance import hashing, luks, paths, progress, tpm_keys
from appliance.atomic import atomic_write
from appliance.config import checks
from appliance.efivars import EFIVARS
from appliance.errors import UserError
from appliance.run import run
from appliance.safe_read import read_capped
from appliance.signed import bundle_index, install_plan, release_manifest
from installer import disks, report, secureboot, select

# put there by builder/installer_uki.py; not /usr/lib/repart.d, which the installer's own boot would apply
REPART_DEFINITIONS = Path("/usr/lib/appliance-installer/repart.d")
VAR_LABEL = luks.VAR_LABEL
PCR_PUBLIC_KEY = Path("/usr/lib/appliance-installer/tpm2-pcr-public-key.pem")  # builder/installer_uki.py
TPM = Path("/sys/class/tpm/tpm0")
KEY_DIR = Path("/run/appliance-installer")  # RAM: the installer runs from its initrd
INSTALL_MAPPER = "appliance-var-install"
HOST_SUBDIR = "lib/appliance/host"  # on /var: /var/lib/appliance/host
BOOT_LABEL = "Appliance"
SYSTEMD_BOOT = r"\EFI\systemd\systemd-bootx64.efi"
GIB = 1 << 30
# first boot's additions besides engine slot B: /usr B, its verity and signature, root grown to 1 GiB, /var's minimum
LAYOUT_EXTRA = 3 * GIB + 64 * (1 << 20) + 10 * (1 << 20) + 1 * GIB + 1 * GIB  # B's signature: repart's 10 MiB minimum
_SIZE_MIN = re.compile(r"^SizeMinBytes=([0-9]+)$", re.M)


def layout_extra(definitions: Path = REPART_DEFINITIONS) -> int:
    """What first boot adds to the image: LAYOUT_EXTRA plus engine slot B as sized in DEFINITIONS."""
    extra = LAYOUT_EXTRA
    for name in paths.ENGINE_B_REPART:
        m = _SIZE_MIN.search((definitions / name).read_text()) if (definitions / name).is_file() else None
        extra += int(m.group(1)) if m else 0
    return extra

Runner = Callable[[Sequence[str]], str]


def _run(argv: Sequence[str]) -> str:
    return run(list(argv), f"{argv[0]}", hint="the install stopped; the candidates and the console log say where", timeout=3600)


@dataclass(frozen=True)
class Payload:
    """The release's disk image (zstd) and its block map, as the signed bundle index lists them,
    and the signed facts the written disk is checked against."""

    image: Path
    bmap: Path
    version: str
    usrhash: str
    engine_label: str
    engine_roothash: str
    image_file: bundle_index.BundleFile  # the image's size and SHA-256 in the signed index


INCOMPLETE = "the medium is incomplete; make it again with python3 -m builder installer"
CHANGED = ("the medium (or the download) is damaged or was changed: make it again with python3 -m builder installer "
           "and write the stick with python3 -m builder flash (or download again)")


def _read_small(directory: Path, name: str, max_bytes: int) -> bytes:
    data = read_capped(directory / name, max_bytes, what=f"the release's {name}", hint=INCOMPLETE)
    if data is None:
        raise UserError(f"{directory / name}: missing", hint=INCOMPLETE)
    return data


def check_against_index(path: Path, listed: bundle_index.BundleFile) -> None:
    """PATH is the file the signed index lists as LISTED: its size first (no read), then its
    SHA-256, read in 1 MiB chunks with progress (a production image is GBs: minutes on a USB stick)."""
    try:
        size = path.stat().st_size
    except OSError:
        raise UserError(f"{path}: missing", hint=INCOMPLETE) from None
    if size != listed.size:
        raise UserError(f"{path.name}: {size} bytes, the signed bundle index says {listed.size}; nothing written", hint=CHANGED)
    with progress.Progress(f"checking {path.name} against the signed bundle index", total=size) as p:
        digest = hashing.sha256_file(path, p.advance)
    if digest != listed.sha256:
        raise UserError(f"{path.name}: SHA-256 {digest[:16]}... is not the {listed.sha256[:16]}... the signed bundle index names; "
                        "nothing written", hint=CHANGED)


def load_payload(directory: Path, trusted_keys: Path) -> Payload:
    """The release in DIRECTORY (a medium or a downloaded bundle), its signatures checked first, each
    small file read with its size capped; the block map checked against the signed index here
    (its <ImageSize> decides which disks are large enough), the image before it is written."""
    index = bundle_index.verify_index(_read_small(directory, bundle_index.BUNDLE_INDEX, bundle_index.MAX_INDEX_BYTES),
                                _read_small(directory, bundle_index.BUNDLE_SIG, bundle_index.MAX_SIG_BYTES), trusted_keys)
    man = release_manifest.verify(_read_small(directory, "manifest.json", release_manifest.MAX_MANIFEST_BYTES),
                          _read_small(directory, "manifest.json.sig", bundle_index.MAX_SIG_BYTES), trusted_keys)
    if man.version != index.version:
        raise UserError(f"{directory}: bundle {index.version} but manifest {man.version}", hint="the medium is inconsistent")
    names = bundle_index.install_names(index.version)
    listed = {f.name: f for f in index.files}
    if names["install-image"] not in listed:
        raise UserError(f"{directory}: bundle {index.version} lists no install image ({names['install-image']})",
                        hint="release it with python3 -m builder release --install-image, then make the medium again")
    bmap = directory / names["install-bmap"]
    check_against_index(bmap, listed[names["install-bmap"]])
    eng = man.engine_image
    return Payload(directory / names["install-image"], bmap, index.version, index.usrhash, eng.store_label, eng.store_roothash,
                   listed[names["install-image"]])


_IMAGE_SIZE = re.compile(rb"<ImageSize>\s*([0-9]{1,15})\s*</ImageSize>")


def image_size(bmap: Path) -> int:
    """The disk image's size from its block map (the image itself may be compressed)."""
    m = _IMAGE_SIZE.search(bmap.read_bytes()[:65536])
    if not m:
        raise UserError(f"{bmap}: no <ImageSize>", hint="the block map is damaged; make the medium or the bundle again")
    return int(m.group(1))


def required_bytes(payload: Payload, definitions: Path = REPART_DEFINITIONS) -> int:
    return image_size(payload.bmap) + layout_extra(definitions)


# how long the kernel's and udev's view of a new partition table may lag behind it
PARTITION_WAIT_S = 60.0


def _by_partuuid(runner: Runner, disk: str, label: str | None = None, partuuid: str | None = None) -> str:
    """The node of DISK's partition with LABEL or PARTUUID. udev's database (which lsblk reads) can
    still show bmaptool's table after systemd-repart's is on disk (seen in QEMU), so re-read and retry."""
    deadline = time.monotonic() + PARTITION_WAIT_S
    while True:
        doc = json.loads(runner(["lsblk", "--json", "-O", "-b", disk]))
        for node in doc["blockdevices"][0].get("children") or []:
            if (label and node.get("partlabel") == label) or (partuuid and (node.get("partuuid") or "").lower() == partuuid):
                return str(node["path"])
        if time.monotonic() >= deadline:
            raise UserError(f"{disk}: no partition {label or partuuid} after writing",
                            hint="the image's layout is not what this installer expects")
        with contextlib.suppress(UserError):  # partx refuses when there is nothing to update; udev may still be behind
            runner(["partx", "--update", disk])
        runner(["udevadm", "trigger", "--settle", "--action=change", disk])
        time.sleep(1)


def verify_written(runner: Runner, disk: str, payload: Payload) -> list[str]:
    data_uuid, hash_uuid = bundle_index.partuuids_from_usrhash(payload.usrhash)
    usr = _by_partuuid(runner, disk, partuuid=data_uuid.lower())
    usr_verity = _by_partuuid(runner, disk, partuuid=hash_uuid.lower())
    runner(["veritysetup", "verify", usr, usr_verity, payload.usrhash])
    engine = _by_partuuid(runner, disk, label=payload.engine_label)
    engine_verity = _by_partuuid(runner, disk, label=payload.engine_label + "-verity")
    runner(["veritysetup", "verify", engine, engine_verity, payload.engine_roothash])
    return [f"/usr {usr} verified (root hash {payload.usrhash[:16]}...)",
            f"engine store {engine} verified (root hash {payload.engine_roothash[:16]}...)"]


def check_tpm(tpm: Path) -> None:
    """/var is sealed to the TPM: a machine without a TPM 2.0 is refused before the first write."""
    try:
        major = (tpm / "tpm_version_major").read_text().strip()
    except OSError:
        major = ""
    if major != "2":
        raise UserError("this machine has no TPM 2.0 (/sys/class/tpm/tpm0): /var could not be sealed to it; nothing written",
                        hint="turn the TPM on in the firmware setup (often Security > TPM or fTPM/PTT), then run the installer again")


def var_key_file(directory: Path | None = None) -> Path:
    """A random key for the new /var, in RAM (KEY_DIR), readable by root only; replaced by the recovery key."""
    directory = KEY_DIR if directory is None else directory
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / "var.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(64))
    return path


def _var_fstype(runner: Runner, disk: str) -> str:
    doc = json.loads(runner(["lsblk", "--json", "-O", "-b", disk]))
    node: dict[str, Any] = next((n for n in doc["blockdevices"][0].get("children") or [] if n.get("partlabel") == VAR_LABEL), {})
    return str(node.get("fstype") or "")


def write_plan(runner: Runner, disk: str, plan_dir: Path, trusted_keys: Path, key_file: Path | None = None) -> install_plan.Plan:
    """The signed plan into /var/lib/appliance/host on DISK's /var, each file whole (a temporary
    name, fsync, rename: a cut between the two renames leaves a pair the appliance refuses, never a
    plan it half applies); then read back as the appliance reads it on boot. Returns the plan now on
    the disk, which is what the summary shows."""
    hint = "sign the plan again: python3 -m builder plan PLAN.toml"
    data = read_capped(plan_dir / install_plan.PLAN_JSON, install_plan.MAX_PLAN_BYTES, what="an install plan", hint=hint)
    sig = read_capped(plan_dir / install_plan.PLAN_SIG, install_plan.MAX_PLAN_SIG_BYTES, what="a plan's signature", hint=hint)
    if data is None or sig is None:
        raise UserError(f"{plan_dir}: the signed plan is gone (plan.json and plan.json.sig)", hint=hint)
    var = _by_partuuid(runner, disk, label=VAR_LABEL)
    if key_file is not None:  # the LUKS2 /var this install made
        runner(["cryptsetup", "open", "--type", "luks2", f"--key-file={key_file}", var, INSTALL_MAPPER])
        var = f"/dev/mapper/{INSTALL_MAPPER}"
    mnt = Path(tempfile.mkdtemp(prefix="appliance-var-"))
    try:
        runner(["mount", var, str(mnt)])
    except UserError:
        if key_file is not None:
            runner(["cryptsetup", "close", INSTALL_MAPPER])
        raise
    try:
        host = mnt / HOST_SUBDIR
        host.mkdir(parents=True, exist_ok=True)
        os.chmod(host, 0o700)
        atomic_write(host / install_plan.PLAN_SIG, sig)
        atomic_write(host / install_plan.PLAN_JSON, data)
        try:
            written = install_plan.load_signed(host, trusted_keys)
        except UserError as e:
            raise UserError(f"{var}: the plan read back from /var is refused: {e.message}",
                            hint="the disk may be failing; run the installer again, or name another disk") from None
        if written is None:
            raise UserError(f"{var}: no plan read back from /var after writing it",
                            hint="the disk may be failing; run the installer again, or name another disk")
        os.sync()
    finally:
        runner(["umount", str(mnt)])
        if key_file is not None:
            runner(["cryptsetup", "close", INSTALL_MAPPER])
        if not os.path.ismount(mnt):  # never remove what is still mounted there
            shutil.rmtree(mnt, ignore_errors=True)
    return written


def recovery_key(runner: Runner, disk: str, key_file: Path) -> str:
    """The recovery key, enrolled with the install's key file, which goes: after this only the
    recovery key and the TPM open /var (systemd-cryptenroll wipes after it enrolls)."""
    var = _by_partuuid(runner, disk, label=VAR_LABEL)
    out = runner(["systemd-cryptenroll", f"--unlock-key-file={key_file}", "--recovery-key", "--wipe-slot=password", var])
    key_file.unlink(missing_ok=True)
    return luks.recovery_key(out)


def boot_first(runner: Runner, disk: str) -> str:
    """A firmware boot entry for systemd-boot on DISK's ESP, first in BootOrder; older entries with our
    label are removed so that re-installs do not pile them up."""
    doc = json.loads(runner(["lsblk", "--json", "-O", "-b", disk]))
    esp = next(n for n in doc["blockdevices"][0].get("children") or [] if (n.get("parttype") or "").lower() == bundle_esp())
    partn = str(esp.get("partn") or esp["path"].rstrip("0123456789p")[-1:])
    listing = runner(["efibootmgr"])
    for line in listing.splitlines():
        if line.startswith("Boot") and line[4:8].isalnum() and BOOT_LABEL in line:
            runner(["efibootmgr", "--quiet", "--bootnum", line[4:8], "--delete-bootnum"])
    runner(["efibootmgr", "--quiet", "--create", "--disk", disk, "--part", partn, "--loader", SYSTEMD_BOOT, "--label", BOOT_LABEL])
    order = runner(["efibootmgr"])
    new = next(line[4:8] for line in order.splitlines() if line.startswith("Boot") and BOOT_LABEL in line and line[4:8] != "Orde")
    rest = next((line.split(":", 1)[1].strip() for line in order.splitlines() if line.startswith("BootOrder")), "")
    runner(["efibootmgr", "--quiet", "--bootorder", ",".join([new, *[b for b in rest.split(",") if b and b != new]])])
    return new


def bundle_esp() -> str:
    return "c12a7328-f81f-11d2-ba4b-00a0c93ec93b"


def ssh_fingerprint(key_line: str) -> str:
    """OpenSSH's SHA256 fingerprint of an authorized key line (as ssh-keygen -l prints it); the plan's
    keys were parsed as OpenSSH parses them when it was loaded (checks.ssh_key_blob)."""
    blob = checks.ssh_key_blob(key_line)[1]
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


# the TPM's enrollment (the tests put a TPM of their own here: never the build host's)
ENROLL: Callable[[], tpm_keys.Keys] = tpm_keys.ensure_keys


def enroll_tpm(enroll: Callable[[], tpm_keys.Keys] | None = None) -> list[str]:
    """Remote attestation's enrollment: the TPM's EK read (made persistent when it is not) and the
    appliance's AK made and persisted (appliance/tpm_keys.py), for the summary: the EK's fingerprint
    and the AK's name, which `builder attest enroll` then proves against the running appliance.
    A TPM that fails here fails no install: one line says so, and the appliance makes both on the
    first `applianctl attest identity` (or the first request of the fleet's verifier)."""
    try:
        keys = (enroll or ENROLL)()
    except Exception as e:  # whatever the TPM does, the install goes on
        text = e.message if isinstance(e, UserError) else f"{type(e).__name__}: {e}"
        why = (text.splitlines() or [type(e).__name__])[0][:200]
        return [f" attestation NOT enrolled ({why}): enrollment will need `applianctl attest identity` on the appliance later"]
    return [f" TPM EK      sha256:{keys.ek_fingerprint}"
            + (" (with its maker's certificate)" if keys.ek_certificate else " (no EK certificate in the TPM)"),
            f" TPM AK      {keys.ak_name.hex()}" + (" (made now)" if "AK" in keys.made else " (was there already)")]


def summary(choice: select.Choice, payload: Payload, plan: install_plan.Plan, steps: list[str], seconds: float, signer: str,
            secure_boot: str = "", recovery: str = "", attestation: Sequence[str] = ()) -> str:
    """The page an operator reads after the install. PLAN is the one read back from the disk's /var,
    so that every value shown is on the disk; SECURE_BOOT is secureboot.summary_line(); ATTESTATION
    is enroll_tpm()'s lines."""
    disk = choice.disk
    net = plan.network
    addresses = ", ".join(net.addresses) + (" + DHCP" if net.dhcp else "") if net else "DHCP on every Ethernet link (image default)"
    head = (f" Appliance {payload.version} re-installed: it was on the disk already; only the plan written"
            if choice.installed else f" Appliance {payload.version} installed")
    lines = [
        "=" * 72,
        head,
        "=" * 72,
        f" disk        {disk.path}  {disk.model or '-'}  serial {disk.serial or '-'}  {disk.size / GIB:.1f} GiB",
    ]
    others = [v for v in disk.appliance_versions() if v != payload.version] if choice.installed else []
    if others:
        lines.append(f" also on it  /usr of {', '.join(others)}")
    lines += [
        f" host name   {plan.hostname or '(image default)'}",
        f" addresses   {addresses}",
    ]
    if net and net.bond:
        lines.append(f" links       bond {net.bond} over {', '.join(net.interfaces)}" + (f", VLAN {net.vlan}" if net.vlan else ""))
    keys = plan.ssh.authorized_keys if plan.ssh else ()
    lines.append(f" SSH keys    {len(keys)}" + "".join(f"\n             {ssh_fingerprint(k)} {checks.ssh_key_blob(k)[2]}" for k in keys))
    lines += [
        f" release key {signer} (signed the release and this plan)",
        f" /usr        {payload.usrhash[:32]}...",
        *([f" secure boot {secure_boot.removeprefix('secure boot ')}"] if secure_boot else []),
        *attestation,
        *([" /var        LUKS2, opened by the TPM (PCR 7 + signed PCR 11 from the first sealed boot on)",
           f" RECOVERY    {recovery}",
           "             shown here once and stored nowhere: write it down. It opens /var at the",
           "             console when the TPM cannot (firmware or Secure Boot keys changed, TPM cleared)."]
          if recovery else []),
        " CA          " + ("not touched" if choice.installed else "made on first boot")
        + ": its fingerprint is on the appliance's console (tty1)",
        *[f" checked     {s}" for s in steps],
        f" took        {seconds:.0f} s",
        "=" * 72,
    ]
    return "\n".join(lines)


def install(payload: Payload, plan: install_plan.Plan, plan_dir: Path, *, runner: Runner = _run,
            listing: tuple[dict[str, Any], dict[str, dict[str, str]]] | None = None, sys_root: Path | None = None,
            boot_partuuid: str | None = None, trusted_keys: Path | None = None,
            dry_run: bool = False, json_out: bool = False, signer: str = "", reboot: bool = True,
            out: Callable[[str], None] = print, efivars: Path | None = None, secureboot_keys: Path | None = None,
            tpm: Path | None = None, enroll: Callable[[], tpm_keys.Keys] | None = None,
            report_sender: Callable[[install_plan.Report, dict[str, Any]], str] = report.send) -> int:
    """Choose, check the image, write, verify, record the plan, make the boot entry, enroll the Secure
    Boot keys in setup mode, enroll the TPM's EK and AK for remote attestation, summarise; return the
    exit status. LISTING and SYS_ROOT stand in for lsblk/udev and sysfs, EFIVARS for efivarfs, ENROLL
    for the TPM, REPORT_SENDER for installer.report.send (tests); a disk holding PAYLOAD's version
    already gets only the plan (its /usr and engine store verified as they are). With the plan's
    [report], what it wrote (without the recovery key, unless sealed to the plan's report.recovery_recipient)
    goes to the flash run's collector before the reboot."""
    if plan.target is None:
        raise UserError("the install plan has no [target]", hint="name the disk: target.serial, wwn, model or by_path")
    started = time.monotonic()
    doc, udev = listing if listing is not None else disks.read(runner)
    found = disks.from_lsblk(doc, udev, disks.SYSFS if listing is None else sys_root)
    boot = disks.boot_partuuid() if boot_partuuid is None else boot_partuuid
    try:
        choice = select.choose(found, plan.target, boot_partuuid=boot, required_bytes=required_bytes(payload),
                               version=payload.version)
    except select.NoSafeChoice as e:
        out(select.dumps(e.candidates, None) if json_out else select.table(e.candidates, None))
        raise
    out(select.dumps(choice.candidates, choice.disk) if json_out else select.table(choice.candidates, choice.disk))
    # before the first write: a firmware that enforces Secure Boot without trusting the appliance refuses here
    efivars = EFIVARS if efivars is None else efivars
    decision, keys = secureboot.prepare(efivars, secureboot.KEYS_DIR if secureboot_keys is None else secureboot_keys)
    if not choice.installed:
        check_tpm(TPM if tpm is None else tpm)
    if dry_run:
        out((f"dry run: would write only the plan onto {choice.disk.path}'s /var (it holds {payload.version} already; "
             "its /usr and engine store would be verified as they are)" if choice.installed else
             f"dry run: would write {choice.disk.path} with appliance {payload.version} "
             "(its image checked against the signed bundle index first)") + "\n" + secureboot.dry_run_line(decision, keys))
        return 0
    key_file: Path | None = None
    if not choice.installed:
        check_against_index(payload.image, payload.image_file)  # before the first write
        runner(["bmaptool", "copy", "--bmap", str(payload.bmap), str(payload.image), choice.disk.path])
        key_file = var_key_file()
        runner(["systemd-repart", "--dry-run=no", f"--definitions={REPART_DEFINITIONS}", f"--key-file={key_file}", choice.disk.path])
        runner(["udevadm", "settle"])
        # systemd-cryptenroll, not repart: its empty --tpm2-pcrs= is documented to bind no PCR by value
        var = _by_partuuid(runner, choice.disk.path, label=VAR_LABEL)
        runner(["systemd-cryptenroll", f"--unlock-key-file={key_file}", *luks.tpm2_options(literal_pcrs=[], public_key=str(PCR_PUBLIC_KEY)),
                var])
    elif _var_fstype(runner, choice.disk.path) == "crypto_LUKS":
        raise UserError(f"{choice.disk.path}: its /var is encrypted and sealed to the appliance, so the installer cannot "
                        "write a new plan into it; nothing written",
                        hint="set target.wipe_existing_data = true in the plan to install afresh (the weights are fetched again), "
                             "or change the settings on the appliance")
    steps = verify_written(runner, choice.disk.path, payload)
    on_disk = write_plan(runner, choice.disk.path, plan_dir, paths.TRUSTED_KEYS_DIR if trusted_keys is None else trusted_keys,
                         key_file)
    steps.append(f"plan on {choice.disk.path}'s /var read back: signed by a trusted key")
    recovery = recovery_key(runner, choice.disk.path, key_file) if key_file is not None else ""
    entry = boot_first(runner, choice.disk.path)
    steps.append(f"firmware boot entry Boot{entry} first in BootOrder")
    secure_boot = secureboot.summary_line(decision, keys)
    if decision.action == "enroll" and keys is not None:
        try:
            secureboot.enroll(keys, efivars)
            steps.append("secure boot keys read back: the firmware left setup mode and its db trusts the appliance")
        except UserError as e:
            # the disk is written and boots: say loudly that it boots unsealed, rather than stop half-way
            secure_boot = f"secure boot keys NOT enrolled: {e.message}; it boots unsealed until they are ({e.hint})"
    attestation = enroll_tpm(enroll)  # the EK and the AK: remote attestation's enrollment
    took = time.monotonic() - started
    out(summary(choice, payload, on_disk, steps, took, signer, secure_boot, recovery, attestation))
    if plan.report is not None:
        # what it wrote, to the flash run's collector; the recovery key in the clear stays on this console
        plan_json = read_capped(plan_dir / install_plan.PLAN_JSON, install_plan.MAX_PLAN_BYTES, what="an install plan",
                                hint="sign the plan again: python3 -m builder plan PLAN.toml") or b""
        doc = report.document(choice, payload, on_disk, plan_json, steps, took, secure_boot, attestation,
                              summary(choice, payload, on_disk, steps, took, signer, secure_boot, "", attestation))
        # a fresh install's key, sealed to the plan's recipient only (a re-install makes none)
        if recovery and plan.report.recovery_recipient and (
                unsealed := report.seal_recovery_key(doc, plan.report.recovery_recipient, recovery)):
            out(unsealed)
        out(report_sender(plan.report, doc))
    if reboot:
        # stdout is block-buffered off a terminal: the summary must be out before the reboot
        sys.stdout.flush()
        runner(["systemctl", "reboot"])
    return 0
