"""The A/B slots and boot entries as the device sees them: the one model for status, update, assess,
rollback and `applianctl slots`.

Facts come from the tools that own them:
- boot entries: `bootctl list --json=short` (id, path, triesLeft/triesDone, isDefault,
  isSelected); when bootctl cannot say (not installed, no ESP found, older systemd), the ESP's
  EFI/Linux is read instead, and `View.entries_source` says which;
- this boot: the EFI variables systemd-boot sets (LoaderEntrySelected, LoaderBootCountPath);
- the slots: the GPT of the disk behind /usr (`sfdisk -J`: type, label, UUID, size); the booted
  slot by the usrhash= on the kernel command line (its partition UUID);
- optionally `systemd-sysupdate list --json=short` (the versions sysupdate sees installed).

Everything read from the machine comes through `Host`, so tests point it at a temporary tree and
fake programs; on the device the defaults apply. Environment variables move each default:

    APPLIANCE_EFIVARS_DIR   /sys/firmware/efi/efivars
    APPLIANCE_CMDLINE       /proc/cmdline
    APPLIANCE_ESP_DIR       the ESP's mount point (default: the first of /efi, /boot, /boot/efi with EFI/Linux)
    APPLIANCE_DISK          the disk behind /usr (default: findmnt + lsblk)
    APPLIANCE_SFDISK        the sfdisk program (default: sfdisk)
    APPLIANCE_BOOTCTL       the bootctl program (default: bootctl)

Slot A is the lower-numbered /usr partition on the disk, slot B the other; each carries its
verity partition. A slot's version is its GPT label (`appliance_VERSION`, written by mkosi for A
and by systemd-sysupdate for B); `_empty` is a slot that holds no version (fresh, or being written).
Boot entries are unified kernel images `EFI/Linux/appliance_VERSION[+LEFT[-DONE]].efi`.

A version is judged by its entry's name: no counter = good (never counted, or blessed by
systemd-bless-boot after boot-complete.target); `+LEFT[-DONE]` with LEFT > 0 = on trial;
`+0[-DONE]` = bad (used up its tries, or marked so by a rollback).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance import manifest, paths
from appliance.bundle import USR_TYPE, USR_VERITY_TYPE, partuuids_from_usrhash
from appliance.errors import UserError
from appliance.hashing import SHA256
from appliance.run import call, run
from applianctl.slots import engine

EFI_LOADER_GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"
BOOTCTL_TIMEOUT_S = 10.0

_V = r"[0-9]{1,9}(?:\.[0-9]{1,9}){0,3}"
_LABEL = re.compile(rf"^appliance_({_V})\Z")
_VERITY_LABEL = re.compile(rf"^appliance_({_V})_verity\Z")
_ENTRY = re.compile(rf"^appliance_({_V})(?:\+([0-9]{{1,4}})(?:-([0-9]{{1,4}}))?)?\.efi\Z")
_COUNTED = re.compile(r"\+([0-9]+)(?:-([0-9]+))?(?:\.(?:conf|efi))?\Z")

GOOD, ON_TRIAL, BAD = "good", "on trial", "bad"


# Persistent update state on /var, under paths.STATE_DIR (read at each call, so tests can move it).
def update_dir() -> Path:
    return paths.update_dir()


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


def last_rollback_path() -> Path:
    return update_dir() / "last-rollback.json"


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
    bootctl: str = field(default_factory=lambda: os.environ.get("APPLIANCE_BOOTCTL", "bootctl"))


# ----------------------------------------------------------------------------------- helpers


def read_efi_string(path: Path) -> str:
    """An EFI variable holding a string: 4 bytes of attributes, then NUL-terminated UTF-16LE."""
    return path.read_bytes()[4:].decode("utf-16-le").split("\0", 1)[0]


def efi_var(host: Host, name: str) -> str | None:
    try:
        return read_efi_string(host.efivars / f"{name}-{EFI_LOADER_GUID}")
    except (OSError, UnicodeDecodeError):
        return None


def booted_usrhash(host: Host) -> str | None:
    try:
        args = host.cmdline.read_text().split()
    except OSError:
        return None
    value = next((a.split("=", 1)[1] for a in args if a.startswith("usrhash=")), None)
    return value.lower() if value else None


def running_manifest() -> manifest.Manifest:
    """The running version's release manifest (on the verity-protected /usr)."""
    try:
        return manifest.load(manifest.parse_canonical(paths.MANIFEST.read_bytes()))
    except FileNotFoundError:
        raise UserError(f"{paths.MANIFEST}: no release manifest", hint="this command runs on the appliance") from None


def running_engine_digest(running_version: str | None) -> str | None:
    """The running version's engine digest, from its signed manifest on /usr; None when it cannot
    be read or is another version's."""
    try:
        running = running_manifest()
    except (UserError, OSError, ValueError):
        return None
    return running.engine_image.digest if running_version in (None, running.version) else None


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
    return parse_sfdisk(out, disk)


def parse_sfdisk(out: str, disk: str) -> list[Partition]:
    """The partitions in `sfdisk -J DISK`'s output (a partition without a name has no "name")."""
    try:
        table = json.loads(out)["partitiontable"]
        sector = int(table.get("sectorsize", 512))
        parts = []
        for i, p in enumerate(table.get("partitions", [])):
            node = str(p.get("node", ""))
            m = re.search(r"(\d+)\Z", node)
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
    return usr_slots(partitions(host), host, running_version)


def usr_slots(parts: list[Partition], host: Host, running_version: str | None) -> list[Slot]:
    usr = sorted((p for p in parts if p.type == USR_TYPE), key=lambda p: p.number)
    verity = sorted((p for p in parts if p.type == USR_VERITY_TYPE), key=lambda p: p.number)
    if not usr:
        raise UserError("no /usr partition on the disk", hint="is APPLIANCE_DISK the appliance's disk?")
    usrhash = booted_usrhash(host)
    booted_uuid = partuuids_from_usrhash(usrhash)[0] if usrhash and SHA256.match(usrhash) else None
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
    is_default: bool | None = None  # from bootctl; None when it could not tell
    is_selected: bool | None = None

    @property
    def id(self) -> str:
        """The boot loader's id of the entry: the file name without the boot counter."""
        return f"appliance_{self.version}.efi"

    @property
    def state(self) -> str:
        if self.tries_left is None:
            return GOOD
        return BAD if self.tries_left == 0 else ON_TRIAL

    def renamed(self, tries_left: int | None) -> Path:
        """This entry's path with the counter +TRIES_LEFT (None: no counter, judged good)."""
        suffix = "" if tries_left is None else f"+{tries_left}"
        return self.path.with_name(f"appliance_{self.version}{suffix}.efi")


def parse_entry(path: Path) -> Entry | None:
    m = _ENTRY.match(path.name)
    if not m:
        return None
    left = int(m.group(2)) if m.group(2) is not None else None
    done = int(m.group(3) or 0) if left is not None else None
    return Entry(path, m.group(1), left, done)


def _scan_entries(host: Host) -> list[Entry]:
    if host.esp is None:
        return []
    try:
        files = list((host.esp / "EFI" / "Linux").iterdir())
    except OSError:
        return []
    return [e for f in files if (e := parse_entry(f)) is not None]


def parse_bootctl_list(text: str) -> list[Entry]:
    """The appliance's entries in `bootctl list --json=short` (systemd 257: an array of objects
    with type, id, path, triesLeft/triesDone when counting, isDefault, isSelected). The file
    name in "path" is authoritative for version and counter; bootctl's id drops the counter."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("not a JSON array")
    out = []
    for item in data:
        if not isinstance(item, dict) or item.get("type") != "type2" or not isinstance(item.get("path"), str):
            continue
        entry = parse_entry(Path(item["path"]))
        if entry is None:
            continue
        left, done = item.get("triesLeft"), item.get("triesDone")
        if (left is None) != (entry.tries_left is None) or (isinstance(left, int) and left != entry.tries_left):
            raise ValueError(f"{entry.path.name}: triesLeft {left!r} disagrees with the file name")
        out.append(
            Entry(
                entry.path,
                entry.version,
                entry.tries_left,
                done if isinstance(done, int) else entry.tries_done,
                is_default=item.get("isDefault") if isinstance(item.get("isDefault"), bool) else None,
                is_selected=item.get("isSelected") if isinstance(item.get("isSelected"), bool) else None,
            )
        )
    return out


def read_entries(host: Host) -> tuple[list[Entry], str]:
    """The appliance's boot entries, newest version first, and where they were read from."""
    argv = [host.bootctl, "--no-pager", "list", "--json=short"]
    if host.esp is not None:
        argv.append(f"--esp-path={host.esp}")
    source = "bootctl"
    try:
        proc = call(argv, BOOTCTL_TIMEOUT_S)
        if proc.returncode != 0:
            raise OSError((proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1])
        found = parse_bootctl_list(proc.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        found, source = _scan_entries(host), f"ESP scan (bootctl: {str(e)[:160] or type(e).__name__})"
    return sorted(found, key=lambda e: manifest.version_tuple(e.version), reverse=True), source


def entries(host: Host) -> list[Entry]:
    return read_entries(host)[0]


def booted_entry(host: Host) -> str | None:
    return efi_var(host, "LoaderEntrySelected")


def boot_counting(host: Host) -> dict[str, Any] | None:
    """Whether THIS boot was counted, from the EFI variables systemd-boot set at boot (they do not
    change when systemd-bless-boot renames the file later in the same boot: for "judged yet?",
    ask View.running_state()). None when the booted entry was not counted."""
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


# ----------------------------------------------------------------------------------- sysupdate


def sysupdate_list(program: str | None = None) -> dict[str, Any]:
    """`systemd-sysupdate list --json=short` (systemd 257: {"current": V, "all": [V...],
    "appstreamUrls": [...]}, "current+pending" instead of "current" while a version is pending)."""
    import shutil

    argv = [program or shutil.which("systemd-sysupdate") or "/usr/lib/systemd/systemd-sysupdate", "--no-pager", "list", "--json=short"]
    out = run(argv, "systemd-sysupdate list", "see journalctl -t systemd-sysupdate", timeout=30.0)
    try:
        data = json.loads(out)
    except ValueError as e:
        raise UserError(f"systemd-sysupdate list: not JSON ({e})", hint="systemd 257 or newer is needed") from None
    if not isinstance(data, dict):
        raise UserError("systemd-sysupdate list: not a JSON object", hint="systemd 257 or newer is needed")
    current = data.get("current", data.get("current+pending"))
    return {"current": current, "pending": "current+pending" in data, "all": [str(v) for v in data.get("all") or []]}


# ----------------------------------------------------------------------------------- the view


@dataclass
class View:
    """Both slots, the boot entries and this boot, read once."""

    running_version: str | None
    slots: list[Slot]
    entries: list[Entry]
    entries_source: str
    booted_entry: str | None
    counting: dict[str, Any] | None
    errors: list[str] = field(default_factory=list)
    sysupdate: dict[str, Any] | None = None
    engine_slots: list[engine.EngineSlot] = field(default_factory=list)
    # version -> engine digest, from signed data: the running manifest, the updater's record
    engines: dict[str, str] = field(default_factory=dict)
    running_engine: str | None = None

    def entry(self, version: str | None) -> Entry | None:
        return next((e for e in self.entries if e.version == version), None) if version else None

    @property
    def booted(self) -> Slot | None:
        return next((s for s in self.slots if s.booted), None)

    @property
    def other(self) -> Slot | None:
        return next((s for s in self.slots if not s.booted), None) if len(self.slots) == 2 and self.booted else None

    def running_entry(self) -> Entry | None:
        """The entry booted now: bootctl's isSelected, else the running version's."""
        selected = [e for e in self.entries if e.is_selected]
        if len(selected) == 1 and (self.running_version is None or selected[0].version == self.running_version):
            return selected[0]
        return self.entry(self.running_version)

    def running_state(self) -> tuple[str, str]:
        """(GOOD | ON_TRIAL | BAD | "unknown", one line why) for the running version, from its
        entry's name as it is NOW (systemd-bless-boot drops the counter once it is judged good)."""
        entry = self.running_entry()
        if entry is None:
            return "unknown", f"no boot entry for the running version {self.running_version} ({self.entries_source})"
        if entry.state == ON_TRIAL:
            return ON_TRIAL, f"{entry.path.name}: {entry.tries_left} tries left, not yet judged by its boot assessment"
        if entry.state == BAD:
            return BAD, f"{entry.path.name}: out of tries (failed its assessment or was rolled back)"
        return GOOD, f"{entry.path.name}: judged good"

    def bootable_engines(self, leaving: str | None = None) -> dict[str, str | None]:
        """Every version with a bootable entry (good or on trial) but LEAVING -> its engine digest
        (None: not known)."""
        return {e.version: self.engines.get(e.version) for e in self.entries if e.state != BAD and e.version != leaving}

    def engine_slot_for(self, new_digest: str) -> engine.EngineChoice:
        """Where an update to a version running NEW_DIGEST writes its engine: the version in the
        inactive /usr slot leaves (its entry is removed before anything is written)."""
        leaving = self.other.version if self.other is not None and self.other.version != self.running_version else None
        return engine.choose_engine_slot(self.engine_slots, self.bootable_engines(leaving), new_digest)

    def slot_state(self, slot: Slot) -> str:
        entry = self.entry(slot.version)
        if slot.version is None:
            return "empty" if slot.usr.label == "_empty" else f"unknown label {slot.usr.label!r}"
        if entry is None:
            return "no boot entry"
        return entry.state

    def to_json(self) -> dict[str, Any]:
        state, why = self.running_state()
        out_slots = []
        for slot in self.slots:
            entry = self.entry(slot.version)
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
                    "default": entry.is_default if entry else None,
                    "state": self.slot_state(slot),
                }
            )
        return {
            "running_version": self.running_version,
            "running_state": state,
            "running_state_reason": why,
            "booted_slot": self.booted.name if self.booted else None,
            "booted_entry": self.booted_entry,
            "boot_counting": self.counting,
            "slots": out_slots,
            "entries": [
                {"path": str(e.path), "version": e.version, "state": e.state, "tries_left": e.tries_left, "tries_done": e.tries_done,
                 "default": e.is_default, "selected": e.is_selected}
                for e in self.entries
            ],
            "entries_source": self.entries_source,
            "sysupdate": self.sysupdate,
            "errors": self.errors,
            "running_engine": self.running_engine,
            "engine_slots": [
                {
                    "slot": e.name,
                    "partition": e.data.node,
                    "label": e.data.label,
                    "typed": e.typed,
                    "verity_partition": e.verity.node if e.verity else None,
                    "digest": e.short,
                    "running": e.running,
                    "used_by": engine.users(e, {x.version: self.engines.get(x.version) for x in self.entries}),
                }
                for e in self.engine_slots
            ],
        }


def read(
    host: Host | None = None, running_version: str | None = None, *, with_sysupdate: bool = False, running_engine: str | None = None
) -> View:
    """Everything about the slots, read once. Never raises: what cannot be read is in .errors.
    RUNNING_ENGINE: the running version's engine digest when the caller holds its manifest (else
    read from /usr)."""
    host = host or Host()
    errors: list[str] = []
    if running_version is None:
        try:
            running_version = running_manifest().version
        except UserError as e:
            errors.append(e.message)
    found: list[Slot] = []
    parts: list[Partition] = []
    try:
        parts = partitions(host)
        found = usr_slots(parts, host, running_version)
    except UserError as e:
        errors.append(e.message)
    running_engine = running_engine or running_engine_digest(running_version)
    engines = engine.recorded()
    if running_version is not None and running_engine is not None:
        engines[running_version] = running_engine
    listed, source = read_entries(host)
    view = View(running_version, found, listed, source, booted_entry(host), boot_counting(host), errors,
                engine_slots=engine.find(parts, running_engine), engines=engines, running_engine=running_engine)
    if with_sysupdate:
        try:
            view.sysupdate = sysupdate_list()
        except UserError as e:
            view.sysupdate = {"error": e.message}
    return view


# ----------------------------------------------------------------------------------- summary


def slots_summary(host: Host | None = None, running_version: str | None = None) -> dict[str, Any]:
    """What `applianctl status` shows about upgrades: View.to_json() plus the last update,
    assessment and rollback, whether the last update was rolled back and why, and the staged update."""
    from applianctl.update import staged as update_staged  # it imports the updater's modules, which import this one

    view = read(host, running_version)
    out = view.to_json()
    running_version = view.running_version
    last_update = read_json(last_update_path())
    last_assessment = read_json(last_assessment_path())
    last_rollback = read_json(last_rollback_path())
    rolled_back, by = False, None
    reason = None
    if last_assessment and last_assessment.get("ok") is False and last_assessment.get("version") != running_version:
        rolled_back, by, reason = True, "appliance", str(last_assessment.get("reason") or "assessment failed")
    elif (last_rollback and last_update and last_rollback.get("to_version") == running_version
          and last_rollback.get("from_version") == last_update.get("version") != running_version):
        # the operator went back from the last update: a choice, not a fault
        rolled_back, by = True, "operator"
        reason = f"applianctl rollback from {last_rollback.get('from_version')} at {last_rollback.get('at')}"
    elif last_update and last_update.get("version") not in (None, running_version):
        bad = view.entry(str(last_update.get("version")))
        if bad is not None and bad.state == BAD:
            rolled_back, by, reason = True, "appliance", f"rolled back: {bad.path.name} used up its tries without being judged good"
    out.update(
        {
            "last_update": last_update,
            "last_assessment": last_assessment,
            "rolled_back": rolled_back,
            "rollback_reason": reason,
            "rolled_back_by": by,
            "last_rollback": last_rollback,
            "staged": update_staged.read(),
        }
    )
    return out
