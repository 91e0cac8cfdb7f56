# SPDX-License-Identifier: MIT
"""/var's LUKS2 header: read from real headers (cryptsetup makes them here, with the tokens systemd's
tools write), and `applianctl var-seal`'s decisions on a header that changes as systemd-cryptenroll
would change it: the installer's temporary slot replaced on a sealed boot only, a recovery key made
when there is none and renewed once after a factory reset, shown on the consoles and nowhere else."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from appliance import efivars, luks, paths
from appliance.errors import UserError
from applianctl.var import tpm_seal

KEY = "-".join(["cbdefghi", "jklnrtuv"] * 4)
NEW_KEY = "-".join(["vutrnlkj", "ihgfedcb"] * 4)
DEVICE = "/dev/disk/by-partlabel/appliance-var"


def _firmware(tmp_path: Path, *, secure_boot: bool, setup_mode: bool = False) -> Path:
    d = tmp_path / f"efivars-{secure_boot}-{setup_mode}"
    d.mkdir(exist_ok=True)
    for name, value in (("SecureBoot", secure_boot), ("SetupMode", setup_mode)):
        efivars.var_path(name, efivars.GLOBAL_GUID, d).write_bytes(struct.pack("<I", 6) + bytes([value]))
    return d


# ------------------------------------------------------------------------------------ real headers


needs_cryptsetup = pytest.mark.skipif(shutil.which("cryptsetup") is None, reason="cryptsetup is not installed")


def _header(tmp_path: Path, slots: int, tokens: list[dict[str, object]]) -> str:
    """A real LUKS2 header with SLOTS key slots and TOKENS imported, as luksDump prints it."""
    image, key = tmp_path / "var.img", tmp_path / "var.key"
    image.write_bytes(b"\0" * (20 << 20))
    key.write_bytes(b"k" * 32)
    fast = ["--batch-mode", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"]
    subprocess.run(["cryptsetup", "luksFormat", "--type", "luks2", *fast, "--key-file", key, image], check=True)
    for _ in range(slots - 1):
        subprocess.run(["cryptsetup", "luksAddKey", *fast, "--key-file", key, image, key], check=True)
    for token in tokens:
        (tmp_path / "token.json").write_text(json.dumps(token))
        subprocess.run(["cryptsetup", "token", "import", "--disable-external-tokens", "--json-file", tmp_path / "token.json", image],
                       check=True)
    return subprocess.run(["cryptsetup", "luksDump", "--dump-json-metadata", image], check=True, capture_output=True,
                          text=True).stdout


@pytest.mark.programs
@needs_cryptsetup
def test_each_slot_of_a_real_header_is_read_with_its_binding(tmp_path: Path) -> None:
    text = _header(tmp_path, 4, [
        {"type": "systemd-tpm2", "keyslots": ["1"], "tpm2-pcrs": [7], "tpm2_pubkey_pcrs": [11], "tpm2-blob": "AA=="},
        {"type": "systemd-tpm2", "keyslots": ["2"], "tpm2-pcrs": [], "tpm2_pubkey_pcrs": [11], "tpm2-blob": "AA=="},
        {"type": "systemd-recovery", "keyslots": ["3"]},
    ])
    methods = luks.parse_header(text)
    assert [(m.kind, m.keyslot, m.pcrs, m.signed_pcrs) for m in methods] == [
        ("passphrase", 0, (), ()), ("tpm2", 1, (7,), (11,)), ("tpm2", 2, (), (11,)), ("recovery", 3, (), ())]
    assert [m.sealed for m in methods] == [False, True, False, False]
    assert methods[1].describe() == "tpm2 PCR 7 + signed PCR 11 (slot 1)"


def test_a_header_it_cannot_read_is_one_line_and_nothing_is_decided() -> None:
    for text in ("", "{", '{"keyslots": {"x": {}}}', '{"keyslots": {"0": {}}, "tokens": {"0": {"keyslots": "0"}}}'):
        with pytest.raises(UserError, match="LUKS2 header could not be read"):
            luks.parse_header(text)


def test_only_a_recovery_key_in_systemds_format_is_ever_shown() -> None:
    assert luks.recovery_key(f"some notice\n{KEY}\n") == KEY
    for output in ("", "Enter passphrase:", KEY[:-1], KEY.upper(), KEY + "-cbdefghi"):
        with pytest.raises(UserError, match="no recovery key"):
            luks.recovery_key(output)


# ------------------------------------------------------------------------- var-seal's decisions


class FakeLuks:
    """/var's header as systemd-cryptenroll changes it: enrollment first, then the wipe (never of
    the slot just added); luksDump prints it as the real header's JSON."""

    def __init__(self, methods: list[luks.Method], *, is_luks: bool = True) -> None:
        self.slots = {m.keyslot: m for m in methods}
        self.is_luks = is_luks
        self.calls: list[list[str]] = []
        self.keys = iter([KEY, NEW_KEY])

    def _json(self) -> str:
        tokens = {}
        for i, m in enumerate(m for m in self.slots.values() if m.kind != "passphrase"):
            tokens[str(i)] = {"type": {"tpm2": "systemd-tpm2", "recovery": "systemd-recovery"}[m.kind], "keyslots": [str(m.keyslot)],
                              **({"tpm2-pcrs": list(m.pcrs), "tpm2_pubkey_pcrs": list(m.signed_pcrs)} if m.kind == "tpm2" else {})}
        return json.dumps({"keyslots": {str(s): {"type": "luks2"} for s in self.slots}, "tokens": tokens})

    def __call__(self, argv: Sequence[str]) -> str:
        argv = list(argv)
        self.calls.append(argv)
        if argv[:2] == ["cryptsetup", "isLuks"]:
            if not self.is_luks:
                raise UserError("cryptsetup: not a LUKS device", hint="")
            return ""
        if argv[:2] == ["cryptsetup", "luksDump"]:
            return self._json()
        assert argv[0] == "systemd-cryptenroll" and argv[-1] == DEVICE and "--unlock-tpm2-device=auto" in argv
        opts = dict(a.split("=", 1) for a in argv[1:-1] if "=" in a)
        new = max(self.slots, default=-1) + 1
        out = ""
        if "--recovery-key" in argv:
            self.slots[new] = luks.Method("recovery", new)
            out = next(self.keys) + "\n"
        else:
            pcrs = tuple(int(p) for p in opts["--tpm2-pcrs"].split("+") if p)
            self.slots[new] = luks.Method("tpm2", new, pcrs, (int(opts["--tpm2-public-key-pcrs"]),))
        for slot in (int(s) for s in opts.get("--wipe-slot", "").split(",") if s):
            assert slot != new
            del self.slots[slot]
        return out


INSTALLED = [luks.Method("tpm2", 1, (), (11,)), luks.Method("recovery", 2)]  # what the installer leaves
FIRST_BOOT = [luks.Method("tpm2", 0, (7,), (11,))]  # what an image's own first boot (systemd-repart) makes


@pytest.fixture
def device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(paths, "STATE_DIR", tmp_path / "var/lib/appliance")
    monkeypatch.setattr(paths, "RUN_DIR", tmp_path / "run/appliance")
    key = tmp_path / "tpm2-pcr-public-key.pem"
    key.write_text("-----BEGIN PUBLIC KEY-----\n")
    return key


def _seal(fake: FakeLuks, key: Path, efivars_dir: Path, shown: list[str]) -> dict[str, object]:
    return tpm_seal.seal(fake, DEVICE, public_key=key, efivars_dir=efivars_dir, show=lambda k: shown.append(k) or ["/dev/console"])


def test_the_first_sealed_boot_replaces_the_installers_slot_with_one_bound_to_pcr_7(tmp_path: Path, device: Path) -> None:
    fake, shown = FakeLuks(list(INSTALLED)), []
    record = _seal(fake, device, _firmware(tmp_path, secure_boot=True), shown)
    enroll = [c for c in fake.calls if c[0] == "systemd-cryptenroll"]
    assert enroll == [["systemd-cryptenroll", "--unlock-tpm2-device=auto", "--tpm2-device=auto", "--tpm2-pcrs=7",
                       f"--tpm2-public-key={device}", "--tpm2-public-key-pcrs=11", "--wipe-slot=1", DEVICE]]
    assert [(m.kind, m.sealed) for m in fake.slots.values()] == [("recovery", False), ("tpm2", True)]
    assert record["sealed"] is True and record["recovery"] is True and record["problems"] == [] and shown == []
    # the next boot finds nothing to do
    fake.calls.clear()
    again = _seal(fake, device, _firmware(tmp_path, secure_boot=True), shown)
    assert [c for c in fake.calls if c[0] == "systemd-cryptenroll"] == [] and again["changed"] == []


def test_a_boot_without_secure_boot_never_seals_var_to_its_pcr_7(tmp_path: Path, device: Path) -> None:
    """Sealing an unsealed boot's PCR 7 would bind /var to Secure Boot being off (or to setup mode)."""
    for firmware in (_firmware(tmp_path, secure_boot=False), _firmware(tmp_path, secure_boot=True, setup_mode=True),
                     tmp_path / "no-efi"):
        fake = FakeLuks(list(INSTALLED))
        record = _seal(fake, device, firmware, [])
        assert [c for c in fake.calls if c[0] == "systemd-cryptenroll"] == []
        assert record["sealed"] is False and "does not enforce Secure Boot" in str(record["problems"])


def test_an_image_booted_as_built_gets_a_recovery_key_shown_once_on_the_console(tmp_path: Path, device: Path,
                                                                                capsys: pytest.CaptureFixture[str]) -> None:
    fake, shown = FakeLuks(list(FIRST_BOOT)), []
    record = _seal(fake, device, _firmware(tmp_path, secure_boot=True), shown)
    assert shown == [KEY]
    assert [c for c in fake.calls if c[0] == "systemd-cryptenroll"] == [
        ["systemd-cryptenroll", "--unlock-tpm2-device=auto", "--recovery-key", DEVICE]]
    assert record["recovery"] is True and "shown once on /dev/console" in str(record["changed"])
    assert KEY not in json.dumps(record)
    # the next boot makes none
    _seal(fake, device, _firmware(tmp_path, secure_boot=True), shown)
    assert shown == [KEY]


def test_the_command_prints_what_it_did_and_never_the_key(tmp_path: Path, device: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeLuks(list(FIRST_BOOT))
    monkeypatch.setattr(tpm_seal, "_run", fake)
    monkeypatch.setattr(tpm_seal, "PCR_PUBLIC_KEY", device)
    monkeypatch.setattr(efivars, "EFIVARS", _firmware(tmp_path, secure_boot=True))
    consoles = [tmp_path / "console", tmp_path / "tty1"]
    consoles[0].write_text("")
    monkeypatch.setattr(tpm_seal, "CONSOLES", tuple(consoles))
    import argparse
    assert tpm_seal.cmd_var_seal(argparse.Namespace(reseal=False)) == 0
    out = capsys.readouterr().out
    assert "a recovery key made" in out and KEY not in out
    assert KEY in consoles[0].read_text()  # the console got it; the missing tty1 is skipped
    record = json.loads(tpm_seal.record_path().read_text())
    assert KEY not in json.dumps(record) and record["recovery"] is True


def test_a_factory_reset_renews_the_recovery_key_once(tmp_path: Path, device: Path) -> None:
    fake, shown = FakeLuks([luks.Method("tpm2", 0, (7,), (11,)), luks.Method("recovery", 1)]), []
    firmware = _firmware(tmp_path, secure_boot=True)
    _seal(fake, device, firmware, shown)
    assert shown == []  # no reset yet: the installer's key stays
    paths.last_factory_reset_path().parent.mkdir(parents=True, exist_ok=True)
    paths.last_factory_reset_path().write_text(json.dumps({"format": 1, "at": "2026-12-02T01:00:00Z", "by": "operator",
                                                           "kept": [], "deleted": 3}))
    record = _seal(fake, device, firmware, shown)
    assert shown == [KEY]
    renew = [c for c in fake.calls if "--recovery-key" in c]
    assert renew == [["systemd-cryptenroll", "--unlock-tpm2-device=auto", "--recovery-key", "--wipe-slot=1", DEVICE]]
    assert [m.kind for m in fake.slots.values()] == ["tpm2", "recovery"] and "after the factory reset" in str(record["changed"])
    _seal(fake, device, firmware, shown)  # a later boot: that reset's key is already new
    assert shown == [KEY]


def test_a_reset_chosen_in_the_boot_menu_keeps_the_operators_recovery_key(tmp_path: Path, device: Path) -> None:
    """Whoever sits at the console is not known to be the operator: no new key is shown to them."""
    from applianctl.factory_reset import BY_BOOT_MENU

    fake, shown = FakeLuks([luks.Method("tpm2", 0, (7,), (11,)), luks.Method("recovery", 1)]), []
    firmware = _firmware(tmp_path, secure_boot=True)
    paths.last_factory_reset_path().parent.mkdir(parents=True, exist_ok=True)
    paths.last_factory_reset_path().write_text(json.dumps({"format": 1, "at": "2026-12-02T01:00:00Z", "by": BY_BOOT_MENU,
                                                           "kept": [], "deleted": 3}))
    _seal(fake, device, firmware, shown)
    assert shown == [] and not [c for c in fake.calls if "--recovery-key" in c]
    assert [m.kind for m in fake.slots.values()] == ["tpm2", "recovery"]


def test_a_plain_var_is_reported_and_left_alone(tmp_path: Path, device: Path) -> None:
    fake = FakeLuks([], is_luks=False)
    record = _seal(fake, device, _firmware(tmp_path, secure_boot=True), [])
    assert record["encrypted"] is False and "re-install" in str(record["problems"])
    assert [c[:2] for c in fake.calls] == [["cryptsetup", "isLuks"]]


def test_a_passphrase_nobody_described_is_reported(tmp_path: Path, device: Path) -> None:
    fake = FakeLuks([*FIRST_BOOT, luks.Method("passphrase", 1), luks.Method("recovery", 2)])
    record = _seal(fake, device, _firmware(tmp_path, secure_boot=True), [])
    assert "passphrase slot" in str(record["problems"])


def test_status_shows_how_var_opens_and_what_is_missing(tmp_path: Path, device: Path) -> None:
    from applianctl.status import probes, sealed

    firmware = _firmware(tmp_path, secure_boot=True)
    tpm, sig = tmp_path / "tpm0", tmp_path / "sig.json"
    tpm.mkdir()
    sig.write_text("{}")
    enroll = tmp_path / "enroll.json"
    enroll.write_text(json.dumps({"appliance_sha256": "0" * 64}))

    def part(record: dict[str, object] | None) -> probes.Part:
        path = tmp_path / "var-seal.json"
        path.unlink(missing_ok=True)
        if record is not None:
            path.write_text(json.dumps(record))
        return sealed.probe_sealed(firmware, enroll, tpm, sig, path)

    missing = part(None)
    assert missing.to_json()["var_encrypted"] is None and "was not checked this boot" in missing.reason
    fake = FakeLuks(list(INSTALLED))
    record = _seal(fake, device, firmware, [])
    whole = part(record)
    assert whole.to_json()["var_unlock"] == ["recovery (slot 2)", "tpm2 PCR 7 + signed PCR 11 (slot 3)"]
    assert whole.to_json()["var_sealed"] is True and whole.to_json()["var_recovery_key"] is True
    assert "/var" not in whole.reason  # only the db check (no real db here) degrades it
    unsealed = part(_seal(FakeLuks(list(INSTALLED)), device, _firmware(tmp_path, secure_boot=False), []))
    assert unsealed.state == probes.DEGRADED and "does not enforce Secure Boot" in unsealed.reason
    no_recovery = part({**record, "methods": [m for m in record["methods"] if m["kind"] != "recovery"]})  # type: ignore[attr-defined]
    assert "no recovery key" in no_recovery.reason
    plain = part(_seal(FakeLuks([], is_luks=False), device, firmware, []))
    assert plain.to_json()["var_encrypted"] is False and "not encrypted" in plain.reason


def test_a_changed_pcr_7_is_reported_with_the_way_to_seal_again(tmp_path: Path, device: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A firmware or Secure Boot key change moves PCR 7: that boot needed the recovery key, and
    status says how to seal /var to the new value (the PCR 7 it was sealed to is kept on /var)."""
    pcr7 = tmp_path / "pcr-sha256-7"
    monkeypatch.setattr(tpm_seal, "PCR7", pcr7)
    pcr7.write_text("AB" * 32 + "\n")
    firmware = _firmware(tmp_path, secure_boot=True)
    fake = FakeLuks(list(INSTALLED))
    assert _seal(fake, device, firmware, [])["problems"] == []  # sealed now, to this PCR 7
    assert json.loads(tpm_seal.renewed_path().read_text())["sealed_pcr7"] == "ab" * 32
    assert _seal(fake, device, firmware, [])["problems"] == []  # the same PCR 7 on the next boot
    pcr7.write_text("CD" * 32 + "\n")  # a firmware update
    record = _seal(fake, device, firmware, [])
    assert "PCR 7 changed" in str(record["problems"]) and "--reseal" in str(record["problems"])
    assert [c for c in fake.calls if c[0] == "systemd-cryptenroll" and "--tpm2-pcrs=7" in c].__len__() == 1  # never by itself


def test_var_is_made_encrypted_and_opened_through_the_tpm_in_the_image() -> None:
    """The image's first boot makes /var LUKS2 sealed to PCR 7 + signed PCR 11 (systemd-repart in the
    initrd, its options from a credential drop-in), /etc/crypttab opens it through the TPM and
    /etc/fstab mounts only the opened device (a plain /var is never mounted)."""
    import base64

    from builder import build

    root = Path(__file__).resolve().parents[1] / "image/mkosi.extra"
    assert "\nEncrypt=tpm2\n" in (root / "usr/lib/repart.d/30-var.conf").read_text()
    (word,) = [w for w in build.initrd_credentials() if "systemd.unit-dropin.systemd-repart.service:" in w]
    dropin = base64.b64decode(word.partition(":")[2]).decode()
    assert "ExecStart=\n" in dropin and "--tpm2-pcrs=7 " in dropin and "--tpm2-public-key-pcrs=11" in dropin
    crypttab = [line.split() for line in (root / "etc/crypttab").read_text().splitlines() if line and not line.startswith("#")]
    assert crypttab == [["appliance-var", "PARTLABEL=appliance-var", "none", "tpm2-device=auto,x-systemd.device-timeout=5min"]]
    fstab = [line.split() for line in (root / "etc/fstab").read_text().splitlines() if line and not line.startswith("#")]
    assert [f[:2] for f in fstab] == [["/dev/mapper/appliance-var", "/var"]]


# ------------------------------------------------------------------------- its records damaged


def _reset_by_operator() -> None:
    paths.last_factory_reset_path().parent.mkdir(parents=True, exist_ok=True)
    paths.last_factory_reset_path().write_text(json.dumps({"format": 1, "at": "2026-12-02T01:00:00Z", "by": "operator",
                                                           "kept": [], "deleted": 3}))


@pytest.mark.parametrize("damage", ["a directory", "a negative count", "a link"])
def test_a_damaged_factory_reset_record_renews_no_key_and_var_seal_still_runs(tmp_path: Path, device: Path, damage: str,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    where = paths.last_factory_reset_path()
    where.parent.mkdir(parents=True, exist_ok=True)
    if damage == "a directory":
        where.mkdir()
    elif damage == "a negative count":
        where.write_text(json.dumps({"format": 1, "at": "2026-12-02T01:00:00Z", "by": "operator", "kept": [], "deleted": -1}))
    else:
        (tmp_path / "elsewhere.json").write_text(json.dumps({"format": 1, "at": "2026-12-02T01:00:00Z", "by": "operator",
                                                             "kept": [], "deleted": 3}))
        where.symlink_to(tmp_path / "elsewhere.json")
    fake, shown = FakeLuks([luks.Method("tpm2", 0, (7,), (11,)), luks.Method("recovery", 1)]), []
    record = _seal(fake, device, _firmware(tmp_path, secure_boot=True), shown)
    assert shown == [] and record["recovery"] is True
    assert "no recovery key is renewed for it" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["a PCR 7 that is a number", "not JSON", "a directory"])
def test_a_damaged_seal_record_never_renews_the_operators_key_again(tmp_path: Path, device: Path, damage: str,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Taken as none, the record would renew the key once more after the last reset: the one the
    operator wrote down wiped, a new one shown on a console nobody may be watching."""
    pcr7 = tmp_path / "pcr-sha256-7"
    monkeypatch.setattr(tpm_seal, "PCR7", pcr7)
    pcr7.write_text("ab" * 32 + "\n")
    fake, shown = FakeLuks([luks.Method("tpm2", 0, (7,), (11,)), luks.Method("recovery", 1)]), []
    firmware = _firmware(tmp_path, secure_boot=True)
    _reset_by_operator()
    _seal(fake, device, firmware, shown)
    assert shown == [KEY]  # renewed once for that reset
    where = tpm_seal.renewed_path()
    where.unlink()
    if damage == "a directory":
        where.mkdir()
    elif damage == "not JSON":
        where.write_text("{")
    else:
        where.write_text(json.dumps({"sealed_pcr7": 7, "recovery_renewed_for_reset": "2026-12-02T01:00:00Z"}))
    capsys.readouterr()
    record = _seal(fake, device, firmware, shown)
    assert shown == [KEY] and not [c for c in fake.calls[-3:] if "--recovery-key" in c]
    assert "var-seal.json was damaged" in str(record["problems"])
    assert "var-seal.json" in capsys.readouterr().err
    kept = json.loads(where.read_text())  # written anew, a regular file again
    assert kept == {"format": 1, "recovery_renewed_for_reset": "2026-12-02T01:00:00Z", "sealed_pcr7": "ab" * 32}
    assert oct(where.stat().st_mode & 0o777) == "0o600"
    assert _seal(fake, device, firmware, shown)["problems"] == [] and shown == [KEY]  # the next boot: nothing to say
