"""The A/B slots as the device sees them: partitions, boot entries, boot counting, update state.

Shared by `applianctl update`, `assess`, `rollback` and the status probe (`slots_summary()`).

Everything read from the machine comes through `Host`, so tests point it at a temporary tree and
a fake `sfdisk`; on the device the defaults apply. Environment variables move each default, so
the commands can be driven from a test VM too:

    APPLIANCE_EFIVARS_DIR   /sys/firmware/efi/efivars
    APPLIANCE_CMDLINE       /proc/cmdline
    APPLIANCE_ESP_DIR       the ESP's mount point (default: the first of /efi, /boot, /boot/efi with EFI/Linux)
    APPLIANCE_DISK          the disk behind /usr (default: findmnt + lsblk)
    APPLIANCE_SFDISK        the sfdisk program (default: sfdisk)

Slot A is the lower-numbered /usr partition on the disk, slot B the other; each carries its
verity partition. A slot's version is its GPT label (`appliance_VERSION`, written by mkosi for A
and by systemd-sysupdate for B); `_empty` is a slot that holds no version (fresh, or being written).
Boot entries are unified kernel images `EFI/Linux/appliance_VERSION[+LEFT[-DONE]].efi` on the ESP.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from applianctl import manifest, paths
from applianctl.errors import UserError

EFI_LOADER_GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"
# GPT partition types (x86-64): /usr and its dm-verity hash partition.
USR_TYPE = "8484680C-9521-48C6-9C11-B0720656F69E"
USR_VERITY_TYPE = "77FF5F63-E7B6-4633-ACF4-1565B864C0E6"

IMAGE_ID = "appliance"
_LABEL = re.compile(r"^appliance_([0-9]+(?:\.[0-9]+){0,3})$")
_VERITY_LABEL = re.compile(r"^appliance_([0-9]+(?:\.[0-9]+){0,3})_verity$")
_ENTRY = re.compile(r"^appliance_([0-9]+(?:\.[0-9]+){0,3})(?:\+([0-9]+)(?:-([0-9]+))?)?\.efi$")
_COUNTED = re.compile(r"\+([0-9]+)(?:-([0-9]+))?(?:\.(?:conf|efi))?$")

# Persistent update state on /var, under paths.STATE_DIR (read at each call, so tests can move it).
def update_dir() -> Path:
    return paths.STATE_DIR / "update"


def staging_dir() -> Path:
    """Downloads, one directory per version."""
    return update_dir() / "staging"


def source_dir() -> Path:
    """What systemd-sysupdate reads: the Source Path= of sysupdate.d/*.transfer."""
    return update_dir() / "source"


def last_update_path() -> Path:
    return update_dir() / "last-update.json"


def last_assessment_path() -> Path:
    return update_dir() / "last-assessment.json"

def _env_path(name: str, default: str) -> Path:
    return Path(os.environ.get(f"APPLIANCE_{name}", default))


def _default_esp() -> Path | None:
    if "APPLIANCE_ESP_DIR" in os.environ:
        return Path(os.environ["APPLIANCE_ESP_DIR"])
    for candidate in ("/efi", "/boot", "/boot/efi"):
        if Path(candidate, "EFI", "Linux").is_dir():
            return Path(candidate)
    return None


@dataclass
class Host:
    """Where the slot code looks; every field can be pointed elsewhere by tests."""

    efivars: Path = field(default_factory=lambda: _env_path("EFIVARS_DIR", "/sys/firmware/efi/efivars"))
    cmdline: Path = field(default_factory=lambda: _env_path("CMDLINE", "/proc/cmdline"))
    esp: Path | None = field(default_factory=_default_esp)
    disk: str | None = field(default_factory=lambda: os.environ.get("APPLIANCE_DISK"))
    sfdisk: str = field(default_factory=lambda: os.environ.get("APPLIANCE_SFDISK", "sfdisk"))


# ----------------------------------------------------------------------------------- helpers


def run(argv: list[str], what: str, hint: str, timeout: float | None = 60.0) -> str:
    """Run ARGV; its standard output, or a one-line UserError naming WHAT."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise UserError(f"{what}: {argv[0]} is not installed", hint=hint) from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{what}: {argv[0]} did not finish within {timeout:g} s", hint=hint) from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise UserError(f"{what} failed: {last}", hint=hint)
    return proc.stdout


def read_efi_string(path: Path) -> str:
    """An EFI variable holding a string: 4 bytes of attributes, then NUL-terminated UTF-16LE."""
    return path.read_bytes()[4:].decode("utf-16-le").split("\0", 1)[0]


def efi_var(host: Host, name: str) -> str | None:
    try:
        return read_efi_string(host.efivars / f"{name}-{EFI_LOADER_GUID}")
    except (OSError, UnicodeDecodeError):
        return None


def partuuids_from_usrhash(usrhash: str) -> tuple[str, str]:
    """systemd's convention (repart, gpt-auto): the /usr partition's UUID is the first 128 bits of
    the dm-verity root hash, the hash partition's UUID the last 128 bits."""
    if not re.fullmatch(r"[0-9a-f]{64}", usrhash):
        raise ValueError(f"not a SHA-256 root hash: {usrhash!r}")

    def fmt(h: str) -> str:
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"

    return fmt(usrhash[:32]), fmt(usrhash[32:])


def booted_usrhash(host: Host) -> str | None:
    try:
        args = host.cmdline.read_text().split()
    except OSError:
        return None
    value = next((a.split("=", 1)[1] for a in args if a.startswith("usrhash=")), None)
    return value.lower() if value else None


def running_manifest() -> dict[str, Any]:
    """The running version's release manifest (on the verity-protected /usr)."""
    try:
        return manifest.loads(paths.MANIFEST.read_bytes())
    except FileNotFoundError:
        raise UserError(f"{paths.MANIFEST}: no release manifest", hint="this command runs on the appliance") from None


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# ----------------------------------------------------------------------------------- disk


@dataclass(frozen=True)
class Partition:
    number: int
    node: str
    type: str
    uuid: str
    label: str
    size_bytes: int

    @property
    def version(self) -> str | None:
        m = _LABEL.match(self.label) or _VERITY_LABEL.match(self.label)
        return m.group(1) if m else None


def usr_disk(host: Host) -> str:
    """The whole disk that holds /usr (the dm-verity device's underlying partition's disk)."""
    if host.disk:
        return host.disk
    hint = "set APPLIANCE_DISK to the disk that holds the /usr slots"
    source = run(["findmnt", "-n", "-o", "SOURCE", "/usr"], "findmnt /usr", hint).strip().splitlines()
    if not source:
        raise UserError("/usr is not a mount point", hint=hint)
    out = run(["lsblk", "-n", "-l", "-s", "-p", "-o", "NAME,TYPE", source[0]], f"lsblk {source[0]}", hint)
    for line in out.splitlines():
        name, _, kind = line.strip().rpartition(" ")
        if kind == "disk":
            return name.strip()
    raise UserError(f"no disk found under {source[0]}", hint=hint)


def partitions(host: Host) -> list[Partition]:
    disk = usr_disk(host)
    out = run([host.sfdisk, "-J", disk], f"sfdisk -J {disk}", "the disk's partition table cannot be read")
    try:
        table = json.loads(out)["partitiontable"]
        sector = int(table.get("sectorsize", 512))
        parts = []
        for i, p in enumerate(table.get("partitions", [])):
            node = str(p.get("node", ""))
            m = re.search(r"(\d+)$", node)
            parts.append(
                Partition(
                    number=int(m.group(1)) if m else i + 1,
                    node=node,
                    type=str(p["type"]).upper(),
                    uuid=str(p.get("uuid", "")).lower(),
                    label=str(p.get("name", "")),
                    size_bytes=int(p["size"]) * sector,
                )
            )
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"sfdisk -J {disk}: unexpected output ({type(e).__name__}: {e})", hint="is this a GPT disk?") from None
    return parts


@dataclass(frozen=True)
class Slot:
    name: str  # "A" or "B"
    usr: Partition
    verity: Partition | None
    booted: bool

    @property
    def version(self) -> str | None:
        return self.usr.version


def slots(host: Host, running_version: str | None = None) -> list[Slot]:
    """Both slots, A first. The booted one is found by the usrhash= on the kernel command line
    (its partition UUID), else by the running version's label."""
    parts = partitions(host)
    usr = sorted((p for p in parts if p.type == USR_TYPE), key=lambda p: p.number)
    verity = sorted((p for p in parts if p.type == USR_VERITY_TYPE), key=lambda p: p.number)
    if not usr:
        raise UserError("no /usr partition on the disk", hint="is APPLIANCE_DISK the appliance's disk?")
    usrhash = booted_usrhash(host)
    booted_uuid = partuuids_from_usrhash(usrhash)[0] if usrhash and re.fullmatch(r"[0-9a-f]{64}", usrhash) else None
    out = []
    for i, part in enumerate(usr[:2]):
        by_label = running_version is not None and part.version == running_version
        booted = part.uuid == booted_uuid if booted_uuid is not None else by_label
        out.append(Slot("AB"[i], part, verity[i] if i < len(verity) else None, booted))
    return out


# ----------------------------------------------------------------------------------- boot entries


@dataclass(frozen=True)
class Entry:
    path: Path
    version: str
    tries_left: int | None  # None: not counting (judged good, or never counted)
    tries_done: int | None

    @property
    def id(self) -> str:
        """The boot loader's id of the entry: the file name without the boot counter."""
        return f"appliance_{self.version}.efi"

    @property
    def state(self) -> str:
        if self.tries_left is None:
            return "good"
        return "bad" if self.tries_left == 0 else "on trial"


def parse_entry(path: Path) -> Entry | None:
    m = _ENTRY.match(path.name)
    if not m:
        return None
    left = int(m.group(2)) if m.group(2) is not None else None
    done = int(m.group(3) or 0) if left is not None else None
    return Entry(path, m.group(1), left, done)


def entries(host: Host) -> list[Entry]:
    """The appliance's unified kernel images on the ESP, newest version first."""
    if host.esp is None:
        return []
    try:
        files = list((host.esp / "EFI" / "Linux").iterdir())
    except OSError:
        return []
    found = [e for f in files if (e := parse_entry(f)) is not None]
    return sorted(found, key=lambda e: manifest.version_tuple(e.version), reverse=True)


def booted_entry(host: Host) -> str | None:
    return efi_var(host, "LoaderEntrySelected")


def boot_counting(host: Host) -> dict[str, Any] | None:
    """The boot-counting state of this boot, or None when the booted entry is not counted (it was
    judged good already, or never was on trial). systemd-boot sets LoaderBootCountPath when it
    boots a counted entry; the entry's name carries +LEFT[-DONE] too."""
    count_path = efi_var(host, "LoaderBootCountPath")
    selected = booted_entry(host)
    for name in (count_path, selected):
        if not name:
            continue
        m = _COUNTED.search(name.rsplit("/", 1)[-1].rsplit("\\", 1)[-1])
        if m:
            return {"entry": selected or name, "count_path": count_path, "tries_left": int(m.group(1)), "tries_done": int(m.group(2) or 0)}
    if count_path:
        return {"entry": selected, "count_path": count_path, "tries_left": None, "tries_done": None}
    return None


# ----------------------------------------------------------------------------------- summary


def slots_summary(host: Host | None = None, running_version: str | None = None) -> dict[str, Any]:
    """What `applianctl status` shows about upgrades: both slots with their versions and boot
    entries, which is booted, tries left, the last update and whether it was rolled back and why.
    Never raises: a part that cannot be read is reported in "errors"."""
    host = host or Host()
    errors: list[str] = []
    if running_version is None:
        try:
            running_version = running_manifest()["version"]
        except UserError as e:
            errors.append(e.message)
    found: list[Slot] = []
    try:
        found = slots(host, running_version)
    except UserError as e:
        errors.append(e.message)
    by_version = {e.version: e for e in entries(host)}
    out_slots = []
    for slot in found:
        entry = by_version.get(slot.version or "")
        if slot.version is None:
            state = "empty" if slot.usr.label == "_empty" else f"unknown label {slot.usr.label!r}"
        elif entry is None:
            state = "no boot entry"
        else:
            state = entry.state
        out_slots.append(
            {
                "slot": slot.name,
                "partition": slot.usr.node,
                "label": slot.usr.label,
                "version": slot.version,
                "booted": slot.booted,
                "entry": entry.path.name if entry else None,
                "tries_left": entry.tries_left if entry else None,
                "tries_done": entry.tries_done if entry else None,
                "state": state,
            }
        )
    counting = boot_counting(host)
    last_update = read_json(last_update_path())
    last_assessment = read_json(last_assessment_path())
    rolled_back = False
    reason = None
    if last_assessment and last_assessment.get("ok") is False and last_assessment.get("version") != running_version:
        rolled_back, reason = True, str(last_assessment.get("reason") or "assessment failed")
    elif last_update and last_update.get("version") not in (None, running_version):
        bad = by_version.get(str(last_update.get("version")))
        if bad is not None and bad.state == "bad":
            rolled_back, reason = True, f"rolled back: {bad.path.name} used up its tries without being judged good"
    booted = next((s["slot"] for s in out_slots if s["booted"]), None)
    return {
        "running_version": running_version,
        "booted_slot": booted,
        "booted_entry": booted_entry(host),
        "boot_counting": counting,
        "slots": out_slots,
        "last_update": last_update,
        "last_assessment": last_assessment,
        "rolled_back": rolled_back,
        "rollback_reason": reason,
        "last_rollback": read_json(update_dir() / "last-rollback.json"),
        "errors": errors,
    }
