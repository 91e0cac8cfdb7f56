# SPDX-License-Identifier: MIT
"""The install's command lines and order (a recording runner in place of the tools, as osbuild's
mock_command), the dry run and the refusals writing nothing, the image and block map checked
against the signed index before the first write, and installing the same version again writing
the new plan and nothing else. The listings start from the build host's recorded lsblk output; the
selection itself is proven against the recorded decoy matrix (tests/test_select.py)."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import plan_values
import pytest

from appliance import host_settings, recovery_seal, tpm_keys
from appliance.errors import UserError
from appliance.signed import bundle_index, install_plan, release_manifest
from builder import flash_report, keys
from installer import disks, install, report, select

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "disks"
USRHASH = "a" * 32 + "b" * 32
GIB = 1 << 30
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIK0wmN/Cr3JXqmLW7u+g9pTh+wyqDHpSQEIQczXkVx9q ops@example.net"
OLD_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE50UnEzKriRoz0D1nsw3cmLy+5ttE9+lpa4CiQoTVX1 old@example.net"


def _host_listing() -> dict[str, Any]:
    return json.loads((FIXTURES / "build-host.json").read_text())["lsblk"]  # type: ignore[no-any-return]


def _as_spare_disk(doc: dict[str, Any], partitions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The recorded /dev/vda as if it were an unmounted spare disk with a serial (and PARTITIONS)."""
    doc = copy.deepcopy(doc)
    vda = next(n for n in doc["blockdevices"] if n["name"] == "vda")
    vda.update(serial="S64ANS0T512345", mountpoint=None, mountpoints=[None], children=partitions or [])
    return doc


class Recorder:
    """Records each command (one list per call) and answers the few that print something. `mount`
    puts VAR (the files already on the disk's /var) into the mount point; `umount` keeps in VAR
    what is there then, as the disk would."""

    def __init__(self, layout: dict[str, Any], var: dict[str, bytes] | None = None) -> None:
        self.calls: list[list[str]] = []
        self.layout = layout
        self.var = dict(var or {})
        self.boot_entries = "BootCurrent: 0001\nBootOrder: 0001,0000\nBoot0000* UiApp\nBoot0001* UEFI USB\n"

    def __call__(self, argv: Sequence[str]) -> str:
        self.calls.append(list(argv))
        if argv[0] == "lsblk":
            return json.dumps(self.layout)
        if argv[0] == "mount":
            for name, data in self.var.items():
                (Path(argv[2]) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(argv[2]) / name).write_bytes(data)
        if argv[0] == "umount":
            mnt = Path(argv[1])
            self.var = {p.relative_to(mnt).as_posix(): p.read_bytes() for p in mnt.rglob("*") if p.is_file()}
        if argv[:1] == ["efibootmgr"] and "--create" in argv:
            self.boot_entries += "Boot0003* Appliance\n"
        if list(argv) == ["efibootmgr"]:
            return self.boot_entries
        if argv[0] == "systemd-cryptenroll" and "--recovery-key" in argv:
            return RECOVERY + "\n"
        return ""

    @property
    def tools(self) -> list[str]:
        return [c[0] if c[0] != "efibootmgr" or len(c) == 1 else "efibootmgr " + c[2] for c in self.calls if c[0] != "lsblk"]


def _payload(tmp_path: Path) -> install.Payload:
    """A release whose block map says 4 GiB; the (compressed) image itself is small."""
    image = tmp_path / "appliance_1.0.0.raw.zst"
    image.write_bytes(b"zstd frames of the disk image" * 100)
    bmap = tmp_path / "appliance_1.0.0.raw.bmap"
    bmap.write_text(f'<?xml version="1.0" ?>\n<bmap version="2.0">\n    <ImageSize> {4 * GIB} </ImageSize>\n</bmap>\n')
    listed = bundle_index.BundleFile(image.name, hashlib.sha256(image.read_bytes()).hexdigest(), image.stat().st_size)
    return install.Payload(image, bmap, "1.0.0", USRHASH, "engine_0123456789ab", "c" * 64, listed)


def _trusted(tmp_path: Path) -> tuple[Path, Path]:
    """(the release key, the trusted keys directory) of this test, made once."""
    private, trusted = tmp_path / "plan-key" / "release.key", tmp_path / "plan-trusted"
    if not private.exists():
        _, public = keys.generate(private.parent)
        trusted.mkdir()
        shutil.copy(public, trusted / "release.pub")
    return private, trusted


def _sign(tmp_path: Path, plan: install_plan.Plan, name: str = "plan") -> Path:
    private, _ = _trusted(tmp_path)
    plan_dir = tmp_path / name
    plan_dir.mkdir()
    data, sig = install_plan.sign(plan, private)
    (plan_dir / install_plan.PLAN_JSON).write_bytes(data)
    (plan_dir / install_plan.PLAN_SIG).write_bytes(sig)
    return plan_dir


def _plan(tmp_path: Path, hostname: str = "gpu-07", key: str = KEY, name: str = "plan") -> tuple[install_plan.Plan, Path]:
    plan = install_plan.Plan(hostname=hostname, target=install_plan.Target(serial="S64ANS0T512345"),
                           network=host_settings.Network(interfaces=("ens1f0",), addresses=("192.0.2.10/24",)),
                           ssh=host_settings.Ssh(authorized_keys=(key,)))
    return plan, _sign(tmp_path, plan, name)


RECOVERY = "-".join(["cbdefghi", "jklnrtuv"] * 4)
WRITTEN = [
    {"path": "/dev/vda1", "partuuid": "", "parttype": install.bundle_esp(), "partlabel": "esp", "partn": 1, "type": "part"},
    {"path": "/dev/vda2", "partuuid": "aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa", "parttype": install.disks.USR_TYPE,
     "partlabel": "appliance_1.0.0", "partn": 2, "type": "part"},
    {"path": "/dev/vda3", "partuuid": "bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb", "parttype": "77ff5f63-e7b6-4633-acf4-1565b864c0e6",
     "partlabel": "appliance_1.0.0_verity", "partn": 3, "type": "part"},
    {"path": "/dev/vda4", "partuuid": "", "parttype": "0fc63daf", "partlabel": "engine_0123456789ab", "partn": 4, "type": "part"},
    {"path": "/dev/vda5", "partuuid": "", "parttype": "0fc63daf", "partlabel": "engine_0123456789ab-verity", "partn": 5, "type": "part"},
    {"path": "/dev/vda9", "partuuid": "", "parttype": "4d21b016", "partlabel": "appliance-var", "partn": 9, "type": "part"},
]


def test_install_writes_verifies_records_the_plan_and_boots_first(tmp_path: Path) -> None:
    written = _as_spare_disk(_host_listing(), WRITTEN)
    rec = Recorder({"blockdevices": [next(n for n in written["blockdevices"] if n["name"] == "vda")]})
    plan, plan_dir = _plan(tmp_path)
    out: list[str] = []
    status = install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}),
                             boot_partuuid="", trusted_keys=_trusted(tmp_path)[1], signer="0123456789abcdef", out=out.append)
    assert status == 0
    assert rec.tools == ["bmaptool", "systemd-repart", "udevadm", "systemd-cryptenroll", "veritysetup", "veritysetup", "cryptsetup",
                         "mount", "umount", "cryptsetup", "systemd-cryptenroll", "efibootmgr", "efibootmgr --create", "efibootmgr",
                         "efibootmgr --bootorder", "systemctl"]
    image = tmp_path / "appliance_1.0.0.raw.zst"
    assert rec.calls[0] == ["bmaptool", "copy", "--bmap", str(tmp_path / "appliance_1.0.0.raw.bmap"), str(image), "/dev/vda"]
    key_file = str(install.KEY_DIR / "var.key")
    # /var in LUKS2: this run's key file, and a TPM2 slot bound to the release's signed PCR 11 policy alone
    assert rec.calls[1] == ["systemd-repart", "--dry-run=no", "--definitions=/usr/lib/appliance-installer/repart.d",
                            f"--key-file={key_file}", "/dev/vda"]
    crypt = [c for c in rec.calls if c[0] in ("cryptsetup", "systemd-cryptenroll", "mount", "umount")]
    assert crypt[0] == ["systemd-cryptenroll", f"--unlock-key-file={key_file}", "--tpm2-device=auto", "--tpm2-pcrs=",
                        "--tpm2-public-key=/usr/lib/appliance-installer/tpm2-pcr-public-key.pem", "--tpm2-public-key-pcrs=11",
                        "/dev/vda9"]
    assert crypt[1] == ["cryptsetup", "open", "--type", "luks2", f"--key-file={key_file}", "/dev/vda9", "appliance-var-install"]
    assert crypt[2][:2] == ["mount", "/dev/mapper/appliance-var-install"] and crypt[4] == ["cryptsetup", "close", "appliance-var-install"]
    # the key file's slot goes once the recovery key is in; the file itself too
    assert crypt[5] == ["systemd-cryptenroll", f"--unlock-key-file={key_file}", "--recovery-key", "--wipe-slot=password", "/dev/vda9"]
    assert not Path(key_file).exists()
    verity = [c for c in rec.calls if c[0] == "veritysetup"]
    assert verity[0] == ["veritysetup", "verify", "/dev/vda2", "/dev/vda3", USRHASH]
    assert verity[1] == ["veritysetup", "verify", "/dev/vda4", "/dev/vda5", "c" * 64]
    assert next(c for c in rec.calls if c[0] == "mount")[1] == "/dev/mapper/appliance-var-install"
    assert rec.var == {f"lib/appliance/host/{n}": (plan_dir / n).read_bytes() for n in (install_plan.PLAN_JSON, install_plan.PLAN_SIG)}
    create = next(c for c in rec.calls if "--create" in c)
    assert create[create.index("--disk") + 1] == "/dev/vda" and create[create.index("--part") + 1] == "1"
    assert next(c for c in rec.calls if "--bootorder" in c)[-1] == "0003,0001,0000"
    page = out[-1]
    assert "Appliance 1.0.0 installed" in page and "192.0.2.10/24" in page and "S64ANS0T512345" in page
    assert "SHA256:" in page and "ops@example.net" in page
    assert f" RECOVERY    {RECOVERY}" in page and "stored nowhere" in page


def test_the_tpm_enrollment_is_in_the_summary_and_a_failing_tpm_fails_no_install(tmp_path: Path) -> None:
    """Remote attestation's enrollment: the EK's fingerprint and the AK's name on the page; a TPM
    that fails there is one line, and the install still succeeds."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from appliance import tpm_keys

    ek = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key()
    pem = ek.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    keys = tpm_keys.Keys(pem, b"", b"public", bytes.fromhex("000b" + "ab" * 32), ("AK",))

    def broken() -> tpm_keys.Keys:
        raise UserError("listing the TPM's handles-persistent failed: no TPM", hint="")

    for enroll, expected in ((lambda: keys, [f" TPM EK      sha256:{tpm_keys.ek_fingerprint(pem)} (no EK certificate in the TPM)",
                                             f" TPM AK      000b{'ab' * 32} (made now)"]),
                             (broken, [" attestation NOT enrolled (listing the TPM's handles-persistent failed: no TPM): "
                                       "enrollment will need `applianctl attest identity` on the appliance later"])):
        run = tmp_path / str(len(list(tmp_path.iterdir())))
        run.mkdir()
        written = _as_spare_disk(_host_listing(), WRITTEN)
        rec = Recorder({"blockdevices": [next(n for n in written["blockdevices"] if n["name"] == "vda")]})
        plan, plan_dir = _plan(run)
        out: list[str] = []
        status = install.install(_payload(run), plan, plan_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}),
                                 boot_partuuid="", trusted_keys=_trusted(run)[1], signer="0123456789abcdef",
                                 out=out.append, enroll=enroll)
        assert status == 0 and rec.tools[-1] == "systemctl"  # installed, and rebooted into it
        assert all(line in out[-1].splitlines() for line in expected)


EK_PEM = """-----BEGIN PUBLIC KEY-----
MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEHXB0NPEBb5GB0/MPog0XSF6pqVcO
gh7e+1ttcHLzuYzsGr82G83thX++z4gy7JfAtA4t6Ob3symbVcblV9KRig==
-----END PUBLIC KEY-----
"""


def test_the_report_goes_to_the_plans_collector_before_the_reboot_and_never_holds_the_recovery_key(tmp_path: Path) -> None:
    """With the plan's [report], the installer sends what it wrote after the summary and before the
    reboot: its facts and the summary's text, without the recovery key the console shows once."""
    written = _as_spare_disk(_host_listing(), WRITTEN)
    rec = Recorder({"blockdevices": [next(n for n in written["blockdevices"] if n["name"] == "vda")]})
    plan = install_plan.Plan(hostname="gpu-07", proxy=host_settings.Proxy(hostname="gpu-07.example.net"),
                             target=install_plan.Target(serial="S64ANS0T512345"),
                             report=install_plan.Report(url="https://10.0.0.5:8443/", ca=plan_values.CA_PEM))
    plan_dir = _sign(tmp_path, plan)
    out: list[str] = []
    sent: list[tuple[install_plan.Report, bytes]] = []

    def sender(settings: install_plan.Report, doc: dict[str, Any]) -> str:
        sent.append((settings, release_manifest.canonical(doc)))  # the bytes send() posts
        assert rec.tools[-1] != "systemctl"  # before the reboot
        return "report sent to https://10.0.0.5:8443/ (HTTP 204)"

    status = install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}),
                             boot_partuuid="", trusted_keys=_trusted(tmp_path)[1], signer="0123456789abcdef",
                             out=out.append, enroll=lambda: tpm_keys.Keys(EK_PEM, b"", b"p", b"\0\x0b" + b"\xab" * 32, ()),
                             report_sender=sender)
    assert status == 0 and rec.tools[-1] == "systemctl"
    [(settings, body)] = sent
    assert settings == plan.report
    assert f" RECOVERY    {RECOVERY}" in out[-2] and out[-1].startswith("report sent to")
    assert RECOVERY.encode() not in body and RECOVERY.replace("-", "").encode() not in body
    doc = json.loads(body)
    assert doc["plan_sha256"] == hashlib.sha256((plan_dir / install_plan.PLAN_JSON).read_bytes()).hexdigest()
    assert doc["host"] == "gpu-07.example.net" and doc["version"] == "1.0.0" and doc["reinstalled"] is False
    assert doc["disk"]["path"] == "/dev/vda" and doc["disk"]["serial"] == "S64ANS0T512345" and doc["usr_hash"] == USRHASH
    assert doc["attestation"][0].startswith("TPM EK      sha256:") and flash_report.ek_fingerprint(doc).startswith("sha256:")
    assert "Appliance 1.0.0 installed" in doc["summary"] and "RECOVERY" not in doc["summary"]
    assert flash_report.problem(doc) == ""
    # without [report], nothing is sent
    sent.clear()
    plain, plain_dir = _plan(tmp_path, name="plain")
    rec = Recorder({"blockdevices": [next(n for n in written["blockdevices"] if n["name"] == "vda")]})
    install.install(_payload(tmp_path), plain, plain_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}),
                    boot_partuuid="", trusted_keys=_trusted(tmp_path)[1], out=out.append, report_sender=sender)
    assert sent == []


def test_with_a_recipient_the_report_carries_the_recovery_key_sealed_to_it_only(tmp_path: Path) -> None:
    """A plan whose [report] names a recovery_recipient: a fresh install's report carries the key the
    console shows, sealed to that public key and bound to the report's host and plan; never in the
    clear. A re-install makes no key, and its report carries none."""
    reported = install_plan.Report(url="https://10.0.0.5:8443/", ca=plan_values.CA_PEM, recovery_recipient=plan_values.RECIPIENT_PEM)
    plan = install_plan.Plan(hostname="gpu-07", proxy=host_settings.Proxy(hostname="gpu-07.example.net"),
                             target=install_plan.Target(serial="S64ANS0T512345"), report=reported)
    plan_dir = _sign(tmp_path, plan)
    written = _as_spare_disk(_host_listing(), WRITTEN)
    rec = Recorder({"blockdevices": [next(n for n in written["blockdevices"] if n["name"] == "vda")]})
    out: list[str] = []
    sent: list[bytes] = []

    def sender(settings: install_plan.Report, doc: dict[str, Any]) -> str:
        sent.append(release_manifest.canonical(doc))
        return "report sent"

    assert install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}),
                           boot_partuuid="", trusted_keys=_trusted(tmp_path)[1], out=out.append, report_sender=sender) == 0
    [body] = sent
    assert f" RECOVERY    {RECOVERY}" in out[-2] and out[-1] == "report sent"
    assert RECOVERY.encode() not in body and RECOVERY.replace("-", "").encode() not in body
    doc = json.loads(body)
    assert flash_report.problem(doc) == "" and doc["reinstalled"] is False
    context = recovery_seal.report_context(doc["host"], doc["plan_sha256"])
    assert recovery_seal.open_sealed(plan_values.RECIPIENT_KEY, doc["recovery_key_sealed"], context) == RECOVERY.encode()
    other_key, _ = recovery_seal.new_keypair()
    with pytest.raises(ValueError, match="does not open"):
        recovery_seal.open_sealed(other_key, doc["recovery_key_sealed"], context)
    # a re-install: no new key, none in its report
    sent.clear()
    installed, rec = _installed(tmp_path)
    assert install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(installed, {}), boot_partuuid="",
                           trusted_keys=_trusted(tmp_path)[1], out=out.append, report_sender=sender) == 0
    [body] = sent
    doc = json.loads(body)
    assert doc["reinstalled"] is True and "recovery_key_sealed" not in doc and flash_report.problem(doc) == ""
    # a seal that fails (it cannot for a recipient the plan's check took) says so and the report still goes
    doc = {"host": "h", "plan_sha256": "0" * 64}
    assert report.seal_recovery_key(doc, "not a key", RECOVERY).startswith("recovery key NOT sealed into the report (")
    assert "recovery_key_sealed" not in doc


def test_a_partition_udev_has_not_listed_yet_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """lsblk may still list the table bmaptool wrote right after systemd-repart wrote its own."""
    monkeypatch.setattr(install.time, "sleep", lambda _: None)
    stale = _as_spare_disk(_host_listing(), WRITTEN[:1])
    fresh = _as_spare_disk(_host_listing(), WRITTEN)
    rec = Recorder({"blockdevices": [next(n for n in stale["blockdevices"] if n["name"] == "vda")]})
    listings = iter([rec.layout, rec.layout, {"blockdevices": [next(n for n in fresh["blockdevices"] if n["name"] == "vda")]}])

    def runner(argv: Sequence[str]) -> str:
        out = rec(argv)
        return json.dumps(next(listings)) if argv[0] == "lsblk" else out

    assert install._by_partuuid(runner, "/dev/vda", label="appliance_1.0.0") == "/dev/vda2"
    assert [c[0] for c in rec.calls] == ["lsblk", "partx", "udevadm", "lsblk", "partx", "udevadm", "lsblk"]
    monkeypatch.setattr(install, "PARTITION_WAIT_S", 0.0)
    with pytest.raises(UserError, match=r"/dev/vda: no partition appliance-var after writing"):
        install._by_partuuid(rec, "/dev/vda", label="appliance-var")


def test_dry_run_and_refusals_write_nothing(tmp_path: Path) -> None:
    plan, plan_dir = _plan(tmp_path)
    rec = Recorder({})
    out: list[str] = []
    install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}), boot_partuuid="",
                    dry_run=True, out=out.append)
    assert rec.calls == [] and "dry run: would write /dev/vda with appliance 1.0.0" in out[-1]
    with pytest.raises(select.NoSafeChoice, match="no disk matches"):  # the host's real listing: no serial, mounted
        install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(_host_listing(), {}), boot_partuuid="", out=out.append)
    assert rec.calls == []
    assert "in use (mounted at" in out[-1]  # the candidates table was shown


def test_ssh_fingerprint_matches_ssh_keygen() -> None:
    # what `ssh-keygen -lf` printed for this key line
    assert install.ssh_fingerprint(KEY) == "SHA256:FHsTyFHNmvNpw4o7+rp+M1yqMyBF8vXSBRkZtkQ0RKY"


def test_the_disk_must_hold_engine_slot_b_as_the_configuration_sizes_it(tmp_path: Path) -> None:
    from appliance.config import load
    from builder import render

    definitions = tmp_path / "repart.d"
    for profile, slot in (("demo", 64 << 20), ("production", 40 << 30)):
        shutil.rmtree(definitions, ignore_errors=True)
        render.first_boot_repart(load(Path(__file__).resolve().parents[1] / "appliance.toml", profile), definitions)
        extra = install.layout_extra(definitions) - install.LAYOUT_EXTRA
        assert slot < extra <= slot + max(slot // 100, 1 << 20), (profile, extra)  # the slot and its hash tree
    assert install.layout_extra(tmp_path / "none") == install.LAYOUT_EXTRA


# ------------------------------------------------------------------------------ after the first write


def test_every_plan_field_at_its_most_hostile_goes_through_the_install_and_its_summary(tmp_path: Path) -> None:
    """Nothing after bmaptool's first write may fail on a plan value: a plan with every field set to
    the longest or strangest value the plan accepts installs, and its summary renders."""
    plan = install_plan.from_plain(plan_values.HOSTILE, "plan.json")
    assert plan_values.every_field_set(plan) == []  # a field added to the plan is added to HOSTILE too
    target = plan.target
    assert target is not None
    disk = _as_spare_disk(_host_listing(), WRITTEN)
    vda = next(n for n in disk["blockdevices"] if n["name"] == "vda")
    vda.update(serial=target.serial, model=target.model, wwn=target.wwn)  # the disk the plan names by all four
    udev = {"/dev/vda": {"ID_PATH": target.by_path.removeprefix("/dev/disk/by-path/")}}
    rec = Recorder({"blockdevices": [vda]})
    plan_dir = _sign(tmp_path, plan)
    out: list[str] = []
    listing = _as_spare_disk(_host_listing())
    spare = next(n for n in listing["blockdevices"] if n["name"] == "vda")
    spare.update(serial=target.serial, model=target.model, wwn=target.wwn)
    sent: list[dict[str, Any]] = []
    status = install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(listing, udev), boot_partuuid="",
                             trusted_keys=_trusted(tmp_path)[1], signer="0123456789abcdef", reboot=False, out=out.append,
                             report_sender=lambda settings, doc: sent.append(doc) or "report line")
    assert status == 0 and rec.calls[0][0] == "bmaptool"
    # its report too: canonical JSON within the collector's bound, every value as the collector takes it
    assert out[-1] == "report line" and len(sent) == 1
    assert len(release_manifest.canonical(sent[0])) <= report.MAX_REPORT_BYTES
    assert flash_report.problem(sent[0]) == "" and sent[0]["host"] == plan_values.LONGEST_DNS
    page = out[-2]
    page.encode("utf-8")  # printable on the console as it is
    assert not [c for c in page if c != "\n" and (ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f)]
    assert plan.hostname in page and plan.network is not None and all(a in page for a in plan.network.addresses)
    assert plan.ssh is not None and f"SSH keys    {len(plan.ssh.authorized_keys)}" in page
    for key, comment in zip(plan.ssh.authorized_keys, [*plan_values.COMMENTS, ""], strict=True):
        assert f"{install.ssh_fingerprint(key)} {comment.lstrip(' ')}\n" in page + "\n"  # OpenSSH's comment: after the spaces
    # and a plan that sets nothing but the target
    choice = select.choose(disks.from_lsblk(listing, udev), target, boot_partuuid="", required_bytes=1, version="1.0.0")
    bare = install_plan.Plan(target=target)
    assert "SSH keys    0" in install.summary(choice, _payload(tmp_path), bare, [], 1.0, "?")


# ------------------------------------------------------------------------------ the plan's signature


REAL_INSTALL = install.install


def _main(tmp_path: Path, plan_dir: Path, monkeypatch: pytest.MonkeyPatch, trusted: Path) -> tuple[int, Recorder]:
    """python3 -m installer --medium --plan PLAN_DIR with this test's runner and listing in place of the tools."""
    import installer.__main__

    rec = Recorder({"blockdevices": [next(n for n in _as_spare_disk(_host_listing(), WRITTEN)["blockdevices"] if n["name"] == "vda")]})
    monkeypatch.setattr(installer.__main__.paths, "TRUSTED_KEYS_DIR", trusted)
    monkeypatch.setattr(install, "load_payload", lambda medium, keys: _payload(tmp_path))
    monkeypatch.setattr(install, "install", lambda *a, **kw: REAL_INSTALL(
        *a, **kw, runner=rec, listing=(_as_spare_disk(_host_listing()), {}), boot_partuuid="", out=lambda _: None))
    status = installer.__main__.main(["--medium", str(tmp_path), "--plan", str(plan_dir), "--no-reboot"])
    return status, rec


def test_the_installer_writes_nothing_for_a_plan_it_does_not_trust(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from builder import keys

    private, public = keys.generate(tmp_path / "keys")
    other, _ = keys.generate(tmp_path / "other")
    trusted = tmp_path / "trusted"
    trusted.mkdir()
    shutil.copy(public, trusted / "release.pub")
    plan, _ = _plan(tmp_path)

    def plan_dir(name: str, key: Path, change: Callable[[bytes], bytes] = lambda d: d, sig: bool = True) -> Path:
        d = tmp_path / name
        d.mkdir()
        data, signature = install_plan.sign(plan, key)
        (d / install_plan.PLAN_JSON).write_bytes(change(data))
        if sig:
            (d / install_plan.PLAN_SIG).write_bytes(signature)
        return d

    status, rec = _main(tmp_path, plan_dir("good", private), monkeypatch, trusted)
    assert status == 0 and rec.calls[0][:2] == ["bmaptool", "copy"]  # this harness does reach the writes

    for d, said in [
        (plan_dir("another-key", other), "not signed by a key this release trusts"),
        (plan_dir("changed", private, lambda d: d.replace(b"gpu-07", b"gpu-08")), "not signed by a key this release trusts"),
        (plan_dir("unsigned", private, sig=False), "plan.json.sig: missing"),
    ]:
        status, rec = _main(tmp_path, d, monkeypatch, trusted)
        assert status == 2 and rec.calls == [], d.name  # refused before the disks are even listed
        assert said in capsys.readouterr().err, d.name


# ------------------------------------------------------------------------------ the same version again


def _installed(tmp_path: Path, old_plan: bool = True) -> tuple[dict[str, Any], Recorder]:
    """A disk holding 1.0.0 already (its lsblk listing), and a runner whose /var holds the old plan."""
    installed = _as_spare_disk(_host_listing(), WRITTEN)
    var = {}
    if old_plan:
        _, old_dir = _plan(tmp_path, hostname="gpu-06", key=OLD_KEY, name="old-plan")
        var = {f"lib/appliance/host/{n}": (old_dir / n).read_bytes() for n in (install_plan.PLAN_JSON, install_plan.PLAN_SIG)}
    return installed, Recorder({"blockdevices": [next(n for n in installed["blockdevices"] if n["name"] == "vda")]}, var)


def test_the_same_version_again_writes_the_new_plan_and_shows_what_is_on_the_disk(tmp_path: Path) -> None:
    """Rotated SSH keys and a new host name reach the disk: the new plan replaces the old one on
    /var, /usr and the engine store are verified as they are, and nothing else is written."""
    installed, rec = _installed(tmp_path)
    plan, plan_dir = _plan(tmp_path)
    out: list[str] = []
    status = install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(installed, {}), boot_partuuid="",
                             trusted_keys=_trusted(tmp_path)[1], signer="0123456789abcdef", out=out.append)
    assert status == 0
    assert rec.tools == ["veritysetup", "veritysetup", "mount", "umount",
                         "efibootmgr", "efibootmgr --create", "efibootmgr", "efibootmgr --bootorder", "systemctl"]
    assert rec.var == {f"lib/appliance/host/{n}": (plan_dir / n).read_bytes() for n in (install_plan.PLAN_JSON, install_plan.PLAN_SIG)}
    page = out[-1]
    assert "Appliance 1.0.0 re-installed" in page and "only the plan written" in page
    assert "gpu-07" in page and install.ssh_fingerprint(KEY) in page
    assert "gpu-06" not in page and install.ssh_fingerprint(OLD_KEY) not in page
    assert "/usr /dev/vda2 verified" in page and "engine store /dev/vda4 verified" in page


def test_the_summary_shows_the_plan_read_back_from_the_disk_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page is made from the plan as the appliance will read it from /var: when that read
    refuses it, the install stops in one line and no summary claims a plan the disk does not hold."""
    installed, rec = _installed(tmp_path)
    plan, plan_dir = _plan(tmp_path)
    real_write = install.atomic_write

    def torn(path: Path, data: bytes, mode: int = 0o644, group: int | None = None) -> None:
        real_write(path, data[:-2] if path.name == install_plan.PLAN_JSON else data, mode, group)

    monkeypatch.setattr(install, "atomic_write", torn)
    out: list[str] = []
    with pytest.raises(UserError, match=r"/dev/vda9: the plan read back from /var is refused: .*not signed by a key") as e:
        install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(installed, {}), boot_partuuid="",
                        trusted_keys=_trusted(tmp_path)[1], out=out.append)
    assert e.value.hint and e.value.exit_status == 2
    assert not any("Appliance 1.0.0" in page for page in out)
    assert "systemctl" not in rec.tools and "efibootmgr --create" not in rec.tools


def test_the_same_version_again_in_a_dry_run_writes_nothing(tmp_path: Path) -> None:
    installed, rec = _installed(tmp_path)
    plan, plan_dir = _plan(tmp_path)
    before = dict(rec.var)
    out: list[str] = []
    assert install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(installed, {}), boot_partuuid="",
                           dry_run=True, out=out.append) == 0
    assert rec.calls == [] and rec.var == before
    assert out[-1].startswith("dry run: would write only the plan onto /dev/vda's /var (it holds 1.0.0 already")


def test_the_same_version_with_wipe_set_is_written_whole(tmp_path: Path) -> None:
    installed, rec = _installed(tmp_path, old_plan=False)
    plan, _ = _plan(tmp_path)
    wiped = install_plan.Plan(hostname=plan.hostname, target=install_plan.Target(serial="S64ANS0T512345", wipe_existing_data=True))
    out: list[str] = []
    install.install(_payload(tmp_path), wiped, _sign(tmp_path, wiped, "wiped"), runner=rec, listing=(installed, {}),
                    boot_partuuid="", trusted_keys=_trusted(tmp_path)[1], reboot=False, out=out.append)
    assert rec.tools[:2] == ["bmaptool", "systemd-repart"] and "Appliance 1.0.0 installed" in out[-1]


# ------------------------------------------------------------------------------ the payload against the signed index


def test_an_image_the_signed_index_does_not_name_is_never_written(tmp_path: Path) -> None:
    plan, plan_dir = _plan(tmp_path)
    payload = _payload(tmp_path)
    data = bytearray(payload.image.read_bytes())
    data[len(data) // 2] ^= 1
    payload.image.write_bytes(bytes(data))  # same size, one bit changed
    rec = Recorder({})
    with pytest.raises(UserError, match=r"appliance_1\.0\.0\.raw\.zst: SHA-256 [0-9a-f]{16}\.\.\. is not the .* nothing written") as e:
        install.install(payload, plan, plan_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}), boot_partuuid="",
                        out=lambda _: None)
    assert e.value.exit_status == 2 and "builder installer" in e.value.hint
    assert rec.calls == []  # bmaptool never ran
    payload.image.write_bytes(bytes(data) + b"x")
    with pytest.raises(UserError, match=r"raw\.zst: 2901 bytes, the signed bundle index says 2900; nothing written"):
        install.install(payload, plan, plan_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}), boot_partuuid="",
                        out=lambda _: None)
    assert rec.calls == []


def _medium(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A medium's payload as `builder installer` lays it out (a bundle released with the install
    image), its plan, and the keys it is signed with: (medium, plan directory, trusted keys)."""
    from fake_release import bundle as fake_bundle
    from fake_release import make_signing

    key, trusted = make_signing(tmp_path / "signing")
    medium = fake_bundle(tmp_path, key, with_install_image=True)
    plan = install_plan.Plan(hostname="gpu-07", target=install_plan.Target(serial="S64ANS0T512345"))
    data, sig = install_plan.sign(plan, key)
    (medium / "plan").mkdir()
    (medium / "plan" / install_plan.PLAN_JSON).write_bytes(data)
    (medium / "plan" / install_plan.PLAN_SIG).write_bytes(sig)
    return medium, medium / "plan", trusted


def _run_medium(medium: Path, plan_dir: Path, trusted: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, Recorder]:
    """python3 -m installer --medium MEDIUM, the real load_payload, this test's runner and listing."""
    from fake_release import demo_config, usrhash_for

    import installer.__main__

    # the disk as bmaptool and systemd-repart leave it: the partitions this release's index and manifest name
    usr, usr_verity = bundle_index.partuuids_from_usrhash(usrhash_for("2.0.0"))
    engine = "engine_" + bundle_index.engine_short(demo_config("2.0.0").engine.digest)
    layout = copy.deepcopy(WRITTEN)
    layout[1].update(partuuid=usr, partlabel="appliance_2.0.0")
    layout[2].update(partuuid=usr_verity, partlabel="appliance_2.0.0_verity")
    layout[3].update(partlabel=engine)
    layout[4].update(partlabel=engine + "-verity")
    rec = Recorder({"blockdevices": [next(n for n in _as_spare_disk(_host_listing(), layout)["blockdevices"] if n["name"] == "vda")]})
    monkeypatch.setattr(installer.__main__.paths, "TRUSTED_KEYS_DIR", trusted)
    monkeypatch.setattr(install, "install", lambda *a, **kw: REAL_INSTALL(
        *a, **kw, runner=rec, listing=(_as_spare_disk(_host_listing()), {}), boot_partuuid="", out=lambda _: None))
    return installer.__main__.main(["--medium", str(medium), "--plan", str(plan_dir), "--no-reboot"]), rec


@pytest.mark.programs
def test_the_mediums_image_and_block_map_are_checked_before_the_first_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    medium, plan_dir, trusted = _medium(tmp_path)
    status, rec = _run_medium(medium, plan_dir, trusted, monkeypatch)
    assert status == 0 and rec.tools[0] == "bmaptool"  # this harness does reach the writes
    image, bmap = (medium / n for n in bundle_index.install_names("2.0.0").values())
    assert rec.calls[0] == ["bmaptool", "copy", "--bmap", str(bmap), str(image), "/dev/vda"]
    capsys.readouterr()
    for changed, said in ((bmap, "raw.bmap: SHA-256"), (image, "raw.zst: SHA-256")):
        original = changed.read_bytes()
        changed.write_bytes(original.replace(b"0", b"1", 1) if changed == bmap else original[:-1] + bytes([original[-1] ^ 1]))
        status, rec = _run_medium(medium, plan_dir, trusted, monkeypatch)
        err = capsys.readouterr().err
        assert status == 2 and "bmaptool" not in rec.tools, said
        lines = [line for line in err.splitlines() if line.startswith(("installer:", "hint:"))]
        assert len(lines) == 2 and said in lines[0] and "nothing written" in lines[0] and "Traceback" not in err, err
        changed.write_bytes(original)


@pytest.mark.programs
def test_the_mediums_small_files_are_read_with_their_size_capped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    medium, plan_dir, trusted = _medium(tmp_path)
    (medium / "manifest.json").write_bytes(b" " * ((1 << 20) + 1))
    status, rec = _run_medium(medium, plan_dir, trusted, monkeypatch)
    assert status == 2 and rec.calls == []
    assert "manifest.json: 1048577 bytes, more than 1048576" in capsys.readouterr().err
    (medium / "bundle.json").unlink()
    (medium / "bundle.json").symlink_to("/dev/zero")
    status, rec = _run_medium(medium, plan_dir, trusted, monkeypatch)
    assert status == 2 and rec.calls == []
    assert "bundle.json: is a symbolic link (not followed)" in capsys.readouterr().err


def test_a_medium_without_an_install_image_in_its_index_is_refused(tmp_path: Path) -> None:
    from fake_release import bundle as fake_bundle
    from fake_release import make_signing

    key, trusted = make_signing(tmp_path / "signing")
    medium = fake_bundle(tmp_path, key)  # released without --install-image
    with pytest.raises(UserError, match=r"bundle 2\.0\.0 lists no install image \(appliance_2\.0\.0\.raw\.zst\)") as e:
        install.load_payload(medium, trusted)
    assert "--install-image" in e.value.hint


# ------------------------------------------------------------------------------ /var sealed to the TPM


def test_a_machine_without_a_tpm2_is_refused_before_any_write(tmp_path: Path, installer_sees_a_tpm: Path) -> None:
    """/var is sealed to the TPM: with none (or a TPM 1.2) nothing is written, dry run or not."""
    for major in (None, "1"):
        shutil.rmtree(installer_sees_a_tpm)
        installer_sees_a_tpm.mkdir()
        if major:
            (installer_sees_a_tpm / "tpm_version_major").write_text(major + "\n")
        for dry_run in (True, False):
            written = _as_spare_disk(_host_listing(), WRITTEN)
            rec = Recorder({"blockdevices": [next(n for n in written["blockdevices"] if n["name"] == "vda")]})
            plan, plan_dir = _plan(tmp_path, name=f"plan-{major}-{dry_run}")
            with pytest.raises(UserError, match=r"no TPM 2\.0") as e:
                install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}),
                                boot_partuuid="", trusted_keys=_trusted(tmp_path)[1], dry_run=dry_run, out=lambda _: None)
            assert "firmware setup" in e.value.hint
            assert [c[0] for c in rec.calls if c[0] != "lsblk"] == []


def test_the_same_version_over_an_encrypted_var_is_refused_in_one_line(tmp_path: Path) -> None:
    """The installer cannot open a /var sealed to the appliance: it says so and writes nothing,
    rather than format or half-write it."""
    installed, rec = _installed(tmp_path)
    doc = next(n for n in installed["blockdevices"] if n["name"] == "vda")
    for node in doc["children"]:
        if node["partlabel"] == "appliance-var":
            node["fstype"] = "crypto_LUKS"
    rec = Recorder({"blockdevices": [doc]}, rec.var)
    plan, plan_dir = _plan(tmp_path)
    with pytest.raises(UserError, match="encrypted and sealed") as e:
        install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(installed, {}), boot_partuuid="",
                        trusted_keys=_trusted(tmp_path)[1], out=lambda _: None)
    assert "wipe_existing_data" in e.value.hint
    assert [c[0] for c in rec.calls if c[0] != "lsblk"] == []
