"""`applianctl update SOURCE`: install a signed release bundle into the inactive slot.

SOURCE is a bundle directory or an http(s):// URL of one on any static web server. Nothing in a
bundle is trusted before its one signature is checked, and nothing is written to a slot before
every byte is proven:

1. bundle.json and bundle.json.sig are fetched (small, size-capped) and the signature checked
   against the keys the RUNNING version trusts (paths.TRUSTED_KEYS_DIR).
2. Policy: the version is newer than the running one (a downgrade only with --allow-downgrade),
   min_version is not newer than the running version, the profile is the running one, and the
   partition images fit the inactive slot (sizes from the GPT, `sfdisk -J`).
3. Every file is downloaded (resumable, HTTP Range) into /var/lib/appliance/update/staging/VERSION
   and its SHA-256 and size checked against bundle.json; the release manifest inside is verified
   on its own (signature, version, profile) and the kernel image's command line must carry the
   bundle's usrhash.
4. Only then the inactive slot is blanked (its old boot entry removed, labels emptied, zeroed)
   and systemd-sysupdate writes it from /var/lib/appliance/update/source,
   where the verified files are hard-linked under the names the shipped transfer definitions
   (/usr/lib/sysupdate.d/*.transfer) match: the partitions first, the kernel image last, with
   boot counting (three tries).

Power loss: only the inactive slot and a new boot entry are written, the entry last; an
interrupted run leaves the running version bootable, and running the command again starts over
(downloads resume, a half-written slot is rewritten).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from cryptography.exceptions import InvalidSignature

from applianctl import manifest, paths, slots, state
from applianctl.errors import UserError

BUNDLE_INDEX = "bundle.json"
BUNDLE_SIG = "bundle.json.sig"
BUNDLE_FORMAT = 1
MAX_INDEX_BYTES = 1 << 16
MAX_SIG_BYTES = 256
CHUNK = 1 << 20
HTTP_TIMEOUT = (15.0, 60.0)
FETCH_ATTEMPTS = 5

_VERSION = re.compile(r"^[0-9]+(\.[0-9]+){0,3}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


RESUME = "run the same command again: the download resumes"
NOT_OURS = "the bundle was not written by python3 -m builder release"


class Refused(UserError):
    """The bundle is not acceptable for this host (authenticity, integrity, policy): exit 1."""

    exit_status = 1


# ----------------------------------------------------------------------------------- names


def payload_names(version: str, engine_digest: str, with_engine: bool) -> dict[str, str]:
    """The files a bundle of VERSION holds, by role (mkosi's names for the OS parts)."""
    names = {
        "usr": f"appliance_{version}.usr.raw",
        "usr-verity": f"appliance_{version}.usr-verity.raw",
        "uki": f"appliance_{version}.efi",
        "manifest": "manifest.json",
        "manifest-sig": "manifest.json.sig",
        "sums": "SHA256SUMS",
    }
    if with_engine:
        short = engine_short(engine_digest)
        names["engine"] = f"engine_{short}.raw"
        names["engine-verity"] = f"engine_{short}.verity.raw"
    return names


def engine_short(digest: str) -> str:
    """engine_<first 12 hex digits of the digest>: the engine partition image's name."""
    return digest.removeprefix("sha256:")[:12]


# ----------------------------------------------------------------------------------- bundle index


def _bad(field: str, value: Any, expected: str) -> Refused:
    shown = repr(value)
    return Refused(f"bundle.json: {field} = {shown[:60]}: expected {expected}", hint=NOT_OURS)


def validate_index(index: Any) -> dict[str, Any]:
    """Check the schema of a parsed bundle.json (unknown fields refused); return it."""
    fields = {
        "format", "version", "min_version", "profile", "engine_digest", "usrhash", "files", "partition_sizes", "manifest_sha256", "signer",
    }
    if not isinstance(index, dict):
        raise _bad("bundle", index, "an object")
    if set(index) != fields:
        extra, missing = sorted(set(index) - fields), sorted(fields - set(index))
        raise Refused(
            f"bundle.json: {'unknown field ' + repr(extra[0]) if extra else 'missing field ' + repr(missing[0])}",
            hint="the bundle was written by another version of the builder",
        )
    if index["format"] != BUNDLE_FORMAT:
        raise _bad("format", index["format"], f"{BUNDLE_FORMAT}")
    for key, regex, expected in (
        ("version", _VERSION, "numbers joined by dots"),
        ("min_version", _VERSION, "numbers joined by dots"),
        ("engine_digest", _DIGEST, "sha256: and 64 hex digits"),
        ("usrhash", _SHA256, "64 hex digits"),
        ("manifest_sha256", _SHA256, "64 hex digits"),
        ("signer", _KEY_ID, "a key id of 16 hex digits"),
    ):
        if not isinstance(index[key], str) or not regex.match(index[key]):
            raise _bad(key, index[key], expected)
    if index["profile"] not in manifest.PROFILES:
        raise _bad("profile", index["profile"], "one of " + ", ".join(manifest.PROFILES))
    if manifest.version_tuple(index["min_version"]) > manifest.version_tuple(index["version"]):
        raise _bad("min_version", index["min_version"], f"not newer than version {index['version']}")
    files = index["files"]
    if not isinstance(files, list) or not files:
        raise _bad("files", files, "a list of files")
    names = []
    for i, f in enumerate(files):
        if not isinstance(f, dict) or set(f) != {"name", "sha256", "size"}:
            raise _bad(f"files[{i}]", f, "an object with name, sha256, size")
        if not isinstance(f["name"], str) or not _NAME.match(f["name"]):
            raise _bad(f"files[{i}].name", f["name"], "a plain file name")
        if not isinstance(f["sha256"], str) or not _SHA256.match(f["sha256"]):
            raise _bad(f"files[{i}].sha256", f["sha256"], "64 hex digits")
        if not isinstance(f["size"], int) or isinstance(f["size"], bool) or f["size"] < 0:
            raise _bad(f"files[{i}].size", f["size"], "a size in bytes")
        names.append(f["name"])
    short = engine_short(index["engine_digest"])
    with_engine = f"engine_{short}.raw" in names
    wanted = set(payload_names(index["version"], index["engine_digest"], with_engine).values())
    if len(names) != len(set(names)) or set(names) != wanted:
        odd = sorted(set(names) ^ wanted)
        raise Refused(
            f"bundle.json: the file list is not that of a release bundle (differs in {', '.join(odd) or 'duplicates'})",
            hint=NOT_OURS,
        )
    # the /usr images are shipped without their trailing zeros; these are their full sizes
    sizes, os_names = index["partition_sizes"], payload_names(index["version"], index["engine_digest"], False)
    trimmed = {os_names["usr"], os_names["usr-verity"]}
    if not isinstance(sizes, dict) or set(sizes) != trimmed:
        raise _bad("partition_sizes", sizes, f"the full sizes of {' and '.join(sorted(trimmed))}")
    by_name = {f["name"]: f["size"] for f in files}
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < by_name[name]:
            raise _bad(f"partition_sizes.{name}", size, f"a size of at least the file's {by_name[name]} bytes")
    return index


def verify_index(data: bytes, sig: bytes, keys_dir: Path) -> dict[str, Any]:
    """Check bundle.json's signature against the trusted keys FIRST, then its form and schema."""
    try:
        signature = manifest.decode_signature(sig)
    except manifest.ManifestError as e:
        raise Refused(f"bundle.json.sig: {e.message}", hint="download the bundle again; if it persists, it was tampered with") from None
    keys = manifest.trusted_keys(keys_dir)
    if not keys:
        raise UserError(f"{keys_dir}: no trusted keys (*.pub)", hint="the image is damaged")
    signed_by = None
    for kid, key in keys.items():
        try:
            key.verify(signature, data)
        except InvalidSignature:
            continue
        signed_by = kid
        break
    if signed_by is None:
        claimed = manifest._claimed_signer(data)
        if claimed is not None and claimed not in keys:
            raise Refused(
                f"bundle is signed by key {claimed}, which this version does not trust",
                hint=f"trusted keys: {', '.join(sorted(keys))}; a new key must be shipped in a release signed by an old one first",
            )
        raise Refused("bundle.json's signature does not match any trusted key", hint="the bundle or its signature was changed")
    try:
        index = validate_index(manifest.parse_canonical(data))
    except manifest.ManifestError as e:
        raise Refused(f"bundle.json: {e.message}", hint=e.hint) from None
    if index["signer"] != signed_by:
        raise Refused(f"bundle.json names signer {index['signer']} but was signed by {signed_by}", hint="the bundle is inconsistent")
    return index


# ----------------------------------------------------------------------------------- policy


def check_policy(index: dict[str, Any], running: dict[str, Any], allow_downgrade: bool) -> bool:
    """Refuse a bundle the running version must not take; True when it is a downgrade."""
    new, cur = index["version"], running["version"]
    if manifest.version_tuple(new) == manifest.version_tuple(cur):
        raise Refused(f"bundle version {new} is the running version", hint="nothing to do; a newer bundle is needed to upgrade")
    downgrade = manifest.version_tuple(new) < manifest.version_tuple(cur)
    if downgrade and not allow_downgrade:
        raise Refused(f"bundle version {new} is older than the running version {cur}", hint="to go back on purpose, add --allow-downgrade")
    if manifest.version_tuple(index["min_version"]) > manifest.version_tuple(cur):
        raise Refused(
            f"bundle {new} may only be installed over {index['min_version']} or newer; this is {cur}",
            hint=f"install an intermediate release (at least {index['min_version']}) first",
        )
    if index["profile"] != running["profile"]:
        raise Refused(
            f"bundle is for the {index['profile']} profile; this appliance runs {running['profile']}",
            hint="use a bundle built with the same --profile",
        )
    return downgrade


def check_engine(index: dict[str, Any], running: dict[str, Any]) -> None:
    """The new version must run the engine image this appliance has. A bundle for a new engine
    digest carries the engine partition image, but writing it to a second engine partition is
    not built yet: refused before anything is downloaded, rather than a version that cannot start
    its engine being installed and rolled back."""
    have = str(running["engine_image"]["digest"])
    if index["engine_digest"] != have:
        raise Refused(
            f"bundle {index['version']} runs engine image {engine_short(index['engine_digest'])}, this appliance has "
            f"{engine_short(have)}; installing a new engine image over the air is not supported yet",
            hint="release the new version with the engine digest the appliance runs, or flash an image built with the new engine",
        )


def check_fits(index: dict[str, Any], inactive: slots.Slot) -> None:
    sizes = index["partition_sizes"]
    names = payload_names(index["version"], index["engine_digest"], False)
    targets = [("usr", inactive.usr), ("usr-verity", inactive.verity)]
    for role, part in targets:
        if part is None:
            raise Refused(f"slot {inactive.name} has no {role} partition", hint="the disk was not set up by this image (repart.d)")
        size = sizes[names[role]]
        if size > part.size_bytes:
            raise Refused(
                f"{names[role]} is {size} bytes, larger than slot {inactive.name}'s {role} partition ({part.size_bytes} bytes)",
                hint="this bundle does not fit this appliance's disk layout",
            )


def inactive_slot(host: slots.Host, running_version: str) -> slots.Slot:
    found = slots.slots(host, running_version)
    booted = [s for s in found if s.booted]
    others = [s for s in found if not s.booted]
    if len(found) != 2 or len(booted) != 1:
        raise UserError(
            f"expected two /usr slots, one of them booted; found {len(found)} slot(s), {len(booted)} booted",
            hint="the second slot is made by systemd-repart on first boot; check `sfdisk -l` of the disk",
        )
    return others[0]


# ----------------------------------------------------------------------------------- fetching


class Progress:
    """A one-line progress bar on a terminal; silent otherwise."""

    def __init__(self, name: str, total: int, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.name, self.total, self.last = name, max(total, 1), 0.0

    def update(self, done: int) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.2 and done < self.total):
            return
        self.last = now
        width = 30
        filled = int(width * done / self.total)
        self.stream.write(f"\r{self.name[:40]:40} [{'#' * filled}{'.' * (width - filled)}] {100 * done // self.total:3d}%")
        if done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


class Source:
    """A bundle directory or an http(s) URL of one."""

    def __init__(self, spec: str, ca: str | None = None) -> None:
        self.spec = spec
        self.is_url = spec.startswith(("https://", "http://"))
        if self.is_url:
            import requests

            self.session = requests.Session()
            if ca:
                self.session.verify = ca
            self.base = spec.rstrip("/") + "/"
        else:
            self.dir = Path(spec)
            if not self.dir.is_dir():
                raise UserError(f"{spec}: no such directory", hint="SOURCE is a bundle directory or an https:// URL of one")

    def read_small(self, name: str, limit: int) -> bytes:
        if not self.is_url:
            try:
                with open(self.dir / name, "rb") as f:
                    data = f.read(limit + 1)
            except FileNotFoundError:
                raise UserError(f"{self.dir / name}: no such file", hint="SOURCE must be a bundle directory") from None
        else:
            import requests

            try:
                r = self.session.get(self.base + name, timeout=HTTP_TIMEOUT)
            except requests.RequestException as e:
                what = f"{self.base}{name}: {type(e).__name__}: {e}".splitlines()[0][:300]
                raise UserError(what, hint="check the URL and the network") from None
            if r.status_code != 200:
                raise UserError(f"{self.base}{name}: HTTP {r.status_code}", hint="the URL must point at a bundle directory")
            data = r.content[: limit + 1]
        if len(data) > limit:
            raise Refused(f"{name} is larger than {limit} bytes", hint="this is not a release bundle")
        return data

    def fetch(self, name: str, part: Path, size: int) -> None:
        """Append NAME's bytes to PART from PART's current size on (resume) until SIZE bytes."""
        progress = Progress(name, size)
        for attempt in range(FETCH_ATTEMPTS):
            have = part.stat().st_size if part.exists() else 0
            if have > size:
                part.unlink()
                have = 0
            if have == size:
                progress.update(size)
                return
            try:
                if self.is_url:
                    self._fetch_http(name, part, have, size, progress)
                else:
                    self._fetch_file(name, part, have, size, progress)
            except OSError as e:
                if attempt == FETCH_ATTEMPTS - 1:
                    raise UserError(f"{name}: download failed ({e})"[:300], hint=RESUME) from None
                time.sleep(min(2**attempt, 10) * 0.1)
                continue
        if not part.exists() or part.stat().st_size != size:
            raise UserError(f"{name}: download incomplete", hint=RESUME)

    def _fetch_file(self, name: str, part: Path, have: int, size: int, progress: Progress) -> None:
        src = self.dir / name
        try:
            with open(src, "rb") as fin, open(part, "ab") as fout:
                fin.seek(have)
                _copy(fin, fout, have, size, progress, name)
        except FileNotFoundError:
            raise Refused(f"{src}: missing from the bundle", hint="copy the whole bundle directory") from None

    def _fetch_http(self, name: str, part: Path, have: int, size: int, progress: Progress) -> None:
        import requests

        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with self.session.get(self.base + name, headers=headers, stream=True, timeout=HTTP_TIMEOUT) as r:
                if r.status_code == 416 and have:
                    part.unlink()  # the server has fewer bytes than we do: start over
                    raise OSError("server refused the range; starting over")
                if r.status_code == 404:
                    raise Refused(f"{self.base}{name}: HTTP 404", hint="the bundle on the server is incomplete")
                if r.status_code not in (200, 206):
                    raise OSError(f"HTTP {r.status_code}")
                mode = "ab"
                if r.status_code == 200 or not r.headers.get("Content-Range", "").startswith(f"bytes {have}-"):
                    mode, have = "wb", 0  # no range support: from the start
                with open(part, mode) as fout:
                    _copy(_Iter(r.iter_content(CHUNK)), fout, have, size, progress, name)
        except requests.RequestException as e:
            raise OSError(f"{type(e).__name__}: {e}".splitlines()[0]) from None


class _Iter:
    """iter_content as a file-like read()."""

    def __init__(self, it: Iterator[bytes]) -> None:
        self.it = it

    def read(self, n: int) -> bytes:
        return next(self.it, b"")


def _copy(fin: IO[bytes] | _Iter, fout: IO[bytes], have: int, size: int, progress: Progress, name: str) -> None:
    while have < size:
        chunk = fin.read(CHUNK)
        if not chunk:
            break
        if have + len(chunk) > size:
            raise Refused(f"{name} is larger than bundle.json says ({size} bytes)", hint="the bundle was changed after it was signed")
        fout.write(chunk)
        have += len(chunk)
        progress.update(have)
    fout.flush()
    os.fsync(fout.fileno())
    if have < size:
        raise OSError(f"connection ended after {have} of {size} bytes")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def stage(index: dict[str, Any], source: Source, staging: Path) -> None:
    """Fetch every file of the bundle into STAGING, each checked against bundle.json. A file
    already staged is re-hashed, not trusted; a partial one (NAME.part) is resumed."""
    for f in index["files"]:
        if f["name"].startswith("engine_"):
            continue  # the appliance has this engine image already (check_engine)
        final, part = staging / f["name"], staging / (f["name"] + ".part")
        if final.exists():
            if final.stat().st_size == f["size"] and sha256_file(final) == f["sha256"]:
                continue
            final.unlink()
        source.fetch(f["name"], part, f["size"])
        digest = sha256_file(part)
        if digest != f["sha256"]:
            part.unlink()
            raise Refused(
                f"{f['name']}: SHA-256 {digest[:16]}... does not match bundle.json",
                hint="the file was changed or damaged; nothing was written",
            )
        part.rename(final)
    state.fsync_dir(staging)


# ----------------------------------------------------------------------------------- inside checks


def pe_sections(path: Path) -> dict[str, bytes]:
    """The sections of a PE file (a unified kernel image) by name; only the small ones are read."""
    with open(path, "rb") as f:
        head = f.read(4096)
        if head[:2] != b"MZ":
            raise ValueError("not a PE file")
        pe = struct.unpack_from("<I", head, 0x3C)[0]
        f.seek(pe)
        coff = f.read(24)
        if coff[:4] != b"PE\0\0":
            raise ValueError("not a PE file")
        count, opt_size = struct.unpack_from("<H", coff, 6)[0], struct.unpack_from("<H", coff, 20)[0]
        f.seek(pe + 24 + opt_size)
        table = f.read(40 * count)
        out = {}
        for i in range(count):
            raw = table[40 * i : 40 * (i + 1)]
            name = raw[:8].rstrip(b"\0").decode("ascii", "replace")
            vsize, _, rsize, rptr = struct.unpack_from("<IIII", raw, 8)
            length = min(vsize, rsize) if vsize else rsize
            if name in (".cmdline", ".osrel", ".uname") and length < 65536:
                f.seek(rptr)
                out[name] = f.read(length)
        return out


def uki_facts(path: Path) -> dict[str, str | None]:
    """usrhash= from the kernel image's command line and IMAGE_VERSION from its os-release."""
    try:
        sections = pe_sections(path)
    except (OSError, ValueError, struct.error) as e:
        raise Refused(f"{path.name}: not a unified kernel image ({e})", hint="the bundle is damaged") from None
    cmdline = sections.get(".cmdline", b"").decode("utf-8", "replace").rstrip("\0").split()
    usrhash = next((a.split("=", 1)[1] for a in cmdline if a.startswith("usrhash=")), None)
    osrel = sections.get(".osrel", b"").decode("utf-8", "replace")
    m = re.search(r"^IMAGE_VERSION=\"?([^\"\n]*)\"?$", osrel, re.M)
    return {"usrhash": usrhash, "image_version": m.group(1) if m else None}


def check_staged(index: dict[str, Any], staging: Path, keys_dir: Path) -> None:
    """What is inside the verified files agrees with the signed index."""
    names = payload_names(index["version"], index["engine_digest"], False)
    data, sig = (staging / names["manifest"]).read_bytes(), (staging / names["manifest-sig"]).read_bytes()
    if hashlib.sha256(data).hexdigest() != index["manifest_sha256"]:
        raise Refused("manifest.json does not match bundle.json's manifest_sha256", hint="the bundle is inconsistent")
    try:
        release = manifest.verify(data, sig, keys_dir)
    except manifest.ManifestError as e:
        raise Refused(f"the bundle's release manifest: {e.message}", hint=e.hint) from None
    for key, want in (("version", index["version"]), ("min_version", index["min_version"]), ("profile", index["profile"])):
        if release[key] != want:
            raise Refused(f"the release manifest says {key} {release[key]}, bundle.json {want}", hint="the bundle is inconsistent")
    if release["engine_image"]["digest"] != index["engine_digest"]:
        raise Refused("the release manifest names another engine image than bundle.json", hint="the bundle is inconsistent")
    facts = uki_facts(staging / names["uki"])
    if facts["usrhash"] != index["usrhash"]:
        raise Refused(f"{names['uki']} boots usrhash {facts['usrhash']}, not bundle.json's", hint="the bundle is inconsistent")
    if facts["image_version"] not in (None, index["version"]):
        raise Refused(f"{names['uki']} is version {facts['image_version']}, not {index['version']}", hint="the bundle is inconsistent")


# ----------------------------------------------------------------------------------- writing


def sysupdate_program() -> str:
    return shutil.which("systemd-sysupdate") or "/usr/lib/systemd/systemd-sysupdate"


def source_names(index: dict[str, Any]) -> dict[str, str]:
    """Staged name -> the name systemd-sysupdate matches (sysupdate.d/*.transfer MatchPattern=):
    the partition UUIDs ride in the name (@u), derived from the root hash as systemd expects."""
    version = index["version"]
    usr_uuid, verity_uuid = slots.partuuids_from_usrhash(index["usrhash"])
    names = payload_names(version, index["engine_digest"], False)
    return {
        names["usr"]: f"appliance_{version}_{usr_uuid}.usr.raw",
        names["usr-verity"]: f"appliance_{version}_{verity_uuid}.usr-verity.raw",
        names["uki"]: f"appliance_{version}.efi",
    }


def sysupdate_commands(index: dict[str, Any]) -> list[list[str]]:
    """The systemd-sysupdate run: its transfers write /usr, its verity, and the kernel image last."""
    return [[sysupdate_program(), "--no-pager", "update", index["version"]]]


def link_sources(index: dict[str, Any], staging: Path) -> None:
    """Fill the sysupdate source directory with exactly this bundle's verified files."""
    directory = slots.source_dir()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(mode=0o700, parents=True)
    for staged, linked in source_names(index).items():
        os.link(staging / staged, directory / linked)
    state.fsync_dir(directory)


def prepare_slot(host: slots.Host, inactive: slots.Slot, running_version: str) -> None:
    """Make the inactive slot blank before systemd-sysupdate writes it: the boot entry of the
    version it held goes first (it would boot a slot about to be erased), then the partitions are
    zeroed (the bundle's images stop at their last non-zero block), then labelled empty (last:
    relabelling makes the kernel re-read the table, and the partition nodes vanish for a moment).
    Each step leaves a state the next run starts from again, so a power cut anywhere is harmless."""
    old = inactive.version
    if old is not None and old != running_version:
        for entry in slots.entries(host):
            if entry.version == old:
                entry.path.unlink()
        if host.esp is not None:
            state.fsync_dir(host.esp / "EFI" / "Linux")
    parts = [p for p in (inactive.usr, inactive.verity) if p is not None]
    for part in parts:
        zero = ["blkdiscard", "--zeroout", part.node]
        slots.run(zero, " ".join(zero), "the inactive slot cannot be written", timeout=None)
    disk = slots.usr_disk(host)
    for part in parts:
        if part.label != "_empty":
            argv = [host.sfdisk, "--part-label", disk, str(part.number), "_empty"]
            slots.run(argv, "sfdisk --part-label", "the partition table cannot be written")


@contextmanager
def locked() -> Iterator[None]:
    slots.update_dir().mkdir(parents=True, exist_ok=True)
    with open(slots.update_dir() / "lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError("another update is running", hint="wait for it (systemctl status appliance-update.service)") from None
        yield


def update(
    spec: str,
    *,
    allow_downgrade: bool = False,
    reboot: bool = False,
    ca: str | None = None,
    host: slots.Host | None = None,
    keys_dir: Path | None = None,
    running: dict[str, Any] | None = None,
    confirm: Callable[[str], bool] | None = None,
    say: Callable[[str], None] = lambda line: print(line, flush=True),  # progress, seen at once through a pipe
) -> int:
    host = host or slots.Host()
    keys_dir = keys_dir or paths.TRUSTED_KEYS_DIR
    running = running or slots.running_manifest()
    source = Source(spec, ca)
    with locked():
        # 1. the signature, before anything in the bundle is looked at
        data = source.read_small(BUNDLE_INDEX, MAX_INDEX_BYTES)
        sig = source.read_small(BUNDLE_SIG, MAX_SIG_BYTES)
        index = verify_index(data, sig, keys_dir)
        # 2. policy and fit
        downgrade = check_policy(index, running, allow_downgrade)
        check_engine(index, running)
        inactive = inactive_slot(host, running["version"])
        check_fits(index, inactive)
        version = index["version"]
        if inactive.version == version and any(e.version == version for e in slots.entries(host)):
            say(f"version {version} is already installed in slot {inactive.name}; reboot to start it")
            return 0
        if confirm is not None and not confirm(f"install {version} over {running['version']} into slot {inactive.name}?"):
            raise UserError("not confirmed", hint="add --yes to install without asking")
        # 3. every byte, proven
        staging = slots.staging_dir() / version
        if slots.staging_dir().is_dir():
            for old in slots.staging_dir().iterdir():
                if old.name != version:
                    shutil.rmtree(old, ignore_errors=True)
        staging.mkdir(mode=0o700, parents=True, exist_ok=True)
        stage(index, source, staging)
        check_staged(index, staging, keys_dir)
        say(f"bundle {version} verified ({len(index['files'])} files, signed by {index['signer']})")
        # 4. only now: the inactive slot
        say(f"blanking slot {inactive.name}")
        prepare_slot(host, inactive, running["version"])
        link_sources(index, staging)
        say(f"writing slot {inactive.name}: {version}")
        for command in sysupdate_commands(index):
            hint = "see journalctl -t systemd-sysupdate; run the same command again to start over"
            slots.run(command, "systemd-sysupdate", hint, timeout=None)
        os.sync()
        if downgrade:
            slots.run(["bootctl", "set-oneshot", f"appliance_{version}.efi"], "bootctl set-oneshot", "select the entry in the boot menu")
        state.write_json_atomic(
            slots.last_update_path(),
            {
                "version": version,
                "from_version": running["version"],
                "slot": inactive.name,
                "downgrade": downgrade,
                "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "source": spec,
            },
        )
        shutil.rmtree(slots.source_dir(), ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
    say(f"installed {version} into slot {inactive.name}; it boots next, on trial (3 tries)")
    if reboot:
        slots.run(["systemctl", "reboot"], "systemctl reboot", "reboot by hand")
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    spec = args.source
    if args.from_config:
        from applianctl import config as appliance_config

        spec = appliance_config.load().get("update", {}).get("url", "")
        if not spec:
            print("update.url is empty: no automatic update check")
            return 0
    if not spec:
        raise UserError("no SOURCE given", hint="applianctl update DIRECTORY-or-URL (or --from-config)")
    confirm = None
    if not args.yes and sys.stdin.isatty():

        def confirm(question: str) -> bool:
            return input(question + " [y/N] ").strip().lower() in ("y", "yes")

    try:
        return update(spec, allow_downgrade=args.allow_downgrade, reboot=args.reboot, ca=args.ca, confirm=confirm)
    except Refused as e:
        # the timer's service: an unchanged bundle on the server is not a failure
        if args.from_config and "is the running version" in e.message:
            print(f"up to date: {e.message}")
            return 0
        raise


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("update", help="install a signed release bundle into the inactive slot")
    p.add_argument("source", nargs="?", default="", help="a bundle directory or an https:// URL of one")
    p.add_argument("--reboot", action="store_true", help="reboot into the new version when it is installed")
    p.add_argument("--allow-downgrade", action="store_true", help="accept a signed bundle older than the running version")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--ca", help="CA certificate to trust for an https:// SOURCE (default: the system's)")
    p.add_argument("--from-config", action="store_true", help="use update.url of the configuration (the update timer)")
    p.set_defaults(func=cmd_update)
