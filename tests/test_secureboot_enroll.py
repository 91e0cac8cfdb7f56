# SPDX-License-Identifier: MIT
"""The installer and the firmware's Secure Boot keys: setup mode enrolls db, KEK and PK (PK last) and
reads back that the firmware took them; a firmware that enforces Secure Boot without trusting the
appliance stops the install before any disk write; Secure Boot off is said in the summary; the
EFI_SIGNATURE_LIST parser refuses a malformed chain instead of looping or reading past its end.

The "firmware" is a directory shaped like efivarfs (NAME-GUID: 4 bytes of attributes, then the
data); the payloads are .auth-shaped (EFI_VARIABLE_AUTHENTICATION_2 header, then an ESL of real
X.509 DER certificates)."""

from __future__ import annotations

import datetime
import hashlib
import json
import struct
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st
from test_install import WRITTEN, Recorder, _as_spare_disk, _host_listing, _payload, _plan, _trusted

import appliance.efivars
from appliance.errors import UserError
from installer import install, secureboot

pytestmark = pytest.mark.timeout(60)

SHA256_TYPE = "c1c41626-504c-4092-aca9-41f936934328"  # EFI_CERT_SHA256_GUID: a hash, not a certificate
MICROSOFT = ("Microsoft UEFI CA 2011", "Microsoft UEFI CA 2023", "Microsoft Option ROM UEFI CA 2023")
BOOT_SERVICE_RUNTIME = 0x06


def _cert(name: str) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=3650))
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.DER)


CERTS = {name: _cert(name) for name in ("appliance db", "appliance KEK", "appliance PK", *MICROSOFT)}


def _sha(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def _esl(entries: list[bytes], sig_type: str = appliance.efivars.CERT_X509_GUID, header: bytes = b"") -> bytes:
    """One EFI_SIGNATURE_LIST holding ENTRIES (each after its owner GUID), all of one size."""
    size = 16 + len(entries[0])
    body = b"".join(uuid.UUID(int=7).bytes_le + e for e in entries)
    return uuid.UUID(sig_type).bytes_le + struct.pack("<III", 28 + len(header) + len(body), len(header), size) + header + body


def _chain(ders: list[bytes]) -> bytes:
    return b"".join(_esl([d]) for d in ders)  # one list per certificate, as cert-to-efi-sig-list writes them


def _auth(esl: bytes, signature: bytes = b"") -> bytes:
    """EFI_TIME, WIN_CERTIFICATE_UEFI_GUID (PKCS#7) with SIGNATURE, then the ESL chain."""
    time = struct.pack("<HBBBBBBIhBB", 2025, 6, 1, 12, 0, 0, 0, 0, 0, 0, 0)
    assert len(time) == 16
    cert = struct.pack("<IHH", 24 + len(signature), 0x0200, 0x0EF1) + uuid.UUID(secureboot.PKCS7_GUID).bytes_le
    return time + cert + signature + esl


DB = [CERTS["appliance db"], *(CERTS[n] for n in MICROSOFT)]


def _keys(directory: Path, db: list[bytes] | None = None, *, signature: bytes = b"") -> Path:
    """KEYS_DIR as the builder leaves it."""
    db = DB if db is None else db
    names = {v: k for k, v in CERTS.items()}
    directory.mkdir(parents=True, exist_ok=True)
    doc: dict[str, object] = {"appliance_sha256": _sha(CERTS["appliance db"])}
    for var, ders in (("db", db), ("KEK", [CERTS["appliance KEK"]]), ("PK", [CERTS["appliance PK"]])):
        (directory / f"{var}.auth").write_bytes(_auth(_chain(ders), signature))
        doc[var] = [{"name": names[d], "sha256": _sha(d)} for d in ders]
    (directory / "enroll.json").write_text(json.dumps(doc))
    return directory


def _set(efivars: Path, name: str, guid: str, data: bytes, attributes: int = BOOT_SERVICE_RUNTIME) -> None:
    efivars.mkdir(parents=True, exist_ok=True)
    appliance.efivars.var_path(name, guid, efivars).write_bytes(struct.pack("<I", attributes) + data)


def _firmware(tmp_path: Path, *, secure_boot: bool, setup_mode: bool, db: list[bytes] | None = None) -> Path:
    efivars = tmp_path / "efivars"
    _set(efivars, "SecureBoot", appliance.efivars.GLOBAL_GUID, bytes([secure_boot]))
    _set(efivars, "SetupMode", appliance.efivars.GLOBAL_GUID, bytes([setup_mode]))
    if db is not None:
        _set(efivars, "db", appliance.efivars.IMAGE_SECURITY_GUID, _chain(db), 0x27)
    return efivars


Written = list[tuple[str, bytes]]


@pytest.fixture
def firmware(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Written]]:
    """A fake firmware behind efivarfs: each write is recorded whole, the variable then reads back as the
    firmware keeps it (the ESL without the .auth header), and PK ends setup mode; TAKES_PK=False is a
    firmware that ignores PK, REFUSE a variable whose write fails as SetVariable's EINVAL."""
    writes: Written = []
    real = secureboot._write_var

    def install_fake(*, takes_pk: bool = True, refuse: str = "") -> Written:
        def fake(path: Path, data: bytes) -> None:
            name = path.name.split("-", 1)[0]
            writes.append((path.name, data))
            if name == refuse:
                raise OSError(22, "Invalid argument")
            real(path, data[:4] + secureboot.auth_signature_lists(data[4:]))
            if name == "PK" and takes_pk:
                _set(path.parent, "SetupMode", appliance.efivars.GLOBAL_GUID, b"\x00")

        monkeypatch.setattr(secureboot, "_write_var", fake)
        return writes

    yield install_fake


# ------------------------------------------------------------------------------ enrolling


def test_setup_mode_writes_db_then_kek_then_pk_each_as_attributes_0x27_and_the_auth_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    efivars = _firmware(tmp_path, secure_boot=False, setup_mode=True)
    keys = secureboot.load(_keys(tmp_path / "keys"))
    order: list[str] = []
    real = secureboot._write_var

    def recorded(path: Path, data: bytes) -> None:
        order.append(path.name)
        real(path, data)

    monkeypatch.setattr(secureboot, "_write_var", recorded)
    secureboot.write_keys(keys, efivars)
    guids = appliance.efivars.IMAGE_SECURITY_GUID, appliance.efivars.GLOBAL_GUID
    assert order == [f"db-{guids[0]}", f"KEK-{guids[1]}", f"PK-{guids[1]}"]
    for var in ("db", "KEK", "PK"):
        written = appliance.efivars.var_path(var, secureboot.GUIDS[var], efivars).read_bytes()
        assert written == b"\x27\x00\x00\x00" + (tmp_path / "keys" / f"{var}.auth").read_bytes()


def test_the_check_afterwards_fails_until_the_firmware_left_setup_mode_and_db_holds_the_appliance(tmp_path: Path) -> None:
    efivars = _firmware(tmp_path, secure_boot=False, setup_mode=True)
    keys = secureboot.load(_keys(tmp_path / "keys"))
    secureboot.write_keys(keys, efivars)  # a plain directory: it keeps the writes as they are, still in setup mode
    with pytest.raises(UserError, match=r"still in setup mode \(it did not take PK\).*not enrolled \(the disk is written\)") as e:
        secureboot.verify_enrolled(keys, efivars)
    assert "BMC" in e.value.hint and 'README "Secure Boot"' in e.value.hint
    _set(efivars, "SetupMode", appliance.efivars.GLOBAL_GUID, b"\x00")
    _set(efivars, "db", appliance.efivars.IMAGE_SECURITY_GUID, _chain([CERTS[n] for n in MICROSOFT]), 0x27)
    with pytest.raises(UserError, match="db does not hold the appliance's certificate"):
        secureboot.verify_enrolled(keys, efivars)
    _set(efivars, "db", appliance.efivars.IMAGE_SECURITY_GUID, b"\x01" * 10, 0x27)
    with pytest.raises(UserError, match=r"the firmware's db variable after enrolling: signature list at byte 0: 10 bytes"):
        secureboot.verify_enrolled(keys, efivars)
    _set(efivars, "db", appliance.efivars.IMAGE_SECURITY_GUID, _chain(DB), 0x27)
    secureboot.verify_enrolled(keys, efivars)


def test_enroll_with_a_firmware_that_takes_the_keys_and_one_that_ignores_pk(tmp_path: Path, firmware: Callable[..., Written]) -> None:
    efivars = _firmware(tmp_path, secure_boot=False, setup_mode=True)
    keys = secureboot.load(_keys(tmp_path / "keys", signature=b"\x30\x82PKCS7 signature bytes"))
    writes = firmware()
    secureboot.enroll(keys, efivars)
    assert [n.split("-")[0] for n, _ in writes] == ["db", "KEK", "PK"]
    assert all(data == struct.pack("<I", 0x27) + keys.payloads[n.split("-")[0]] for n, data in writes)
    assert appliance.efivars.secure_boot_state(efivars) == appliance.efivars.SecureBootState(efi=True, secure_boot=False, setup_mode=False)
    assert appliance.efivars.db_sha256s(efivars) == [_sha(d) for d in DB]

    efivars = _firmware(tmp_path / "ignores", secure_boot=False, setup_mode=True)
    firmware(takes_pk=False)
    with pytest.raises(UserError, match="still in setup mode"):
        secureboot.enroll(keys, efivars)


def test_a_write_the_firmware_refuses_names_the_variable_and_pk_is_never_written(
        tmp_path: Path, firmware: Callable[..., Written]) -> None:
    efivars = _firmware(tmp_path, secure_boot=False, setup_mode=True)
    keys = secureboot.load(_keys(tmp_path / "keys"))
    writes = firmware(refuse="KEK")
    with pytest.raises(UserError, match=r"^the firmware refused KEK \(Invalid argument\); db written before it: ") as e:
        secureboot.enroll(keys, efivars)
    assert "\n" not in e.value.message and "BMC" in e.value.hint
    assert [n.split("-")[0] for n, _ in writes] == ["db", "KEK"]


def test_a_variable_that_will_not_open_is_the_same_refusal(tmp_path: Path) -> None:
    efivars = _firmware(tmp_path, secure_boot=False, setup_mode=True)
    keys = secureboot.load(_keys(tmp_path / "keys"))
    appliance.efivars.var_path("PK", appliance.efivars.GLOBAL_GUID, efivars).mkdir()
    with pytest.raises(UserError, match=r"the firmware refused PK \(Is a directory\); db, KEK written before it"):
        secureboot.write_keys(keys, efivars)


# ------------------------------------------------------------------------------ deciding


def test_decide() -> None:
    keys = secureboot.EnrollSet(Path("/k"), _sha(CERTS["appliance db"]), {}, {})
    state = appliance.efivars.SecureBootState
    ours, theirs = [_sha(CERTS["appliance db"])], [_sha(CERTS[MICROSOFT[0]])]
    assert secureboot.decide(state(False, None, None), ours, keys).action == "no-efi"
    assert secureboot.decide(state(True, False, True), [], keys).action == "enroll"
    assert secureboot.decide(state(True, True, False), ours + theirs, keys).action == "trusted"
    assert secureboot.decide(state(True, True, False), theirs, keys).action == "refuse"
    assert secureboot.decide(state(True, False, False), theirs, keys) == secureboot.Decision("off", db_trusts=False)
    assert secureboot.decide(state(True, False, False), ours, keys) == secureboot.Decision("off", db_trusts=True)
    assert secureboot.decide(state(True, None, None), [], keys).action == "off"  # a firmware without Secure Boot


def test_secure_boot_state_reads_the_global_variables(tmp_path: Path) -> None:
    assert appliance.efivars.secure_boot_state(tmp_path / "none") == appliance.efivars.SecureBootState(False, None, None)
    efivars = _firmware(tmp_path, secure_boot=True, setup_mode=False)
    assert appliance.efivars.secure_boot_state(efivars) == appliance.efivars.SecureBootState(True, True, False)
    assert appliance.efivars.read_var("SecureBoot", appliance.efivars.GLOBAL_GUID, efivars) == b"\x01"
    assert appliance.efivars.read_var("PK", appliance.efivars.GLOBAL_GUID, efivars) is None and appliance.efivars.db_sha256s(efivars) == []
    appliance.efivars.var_path("SetupMode", appliance.efivars.GLOBAL_GUID, efivars).write_bytes(b"\x06\x00")
    with pytest.raises(UserError, match="2 bytes, shorter than the 4 bytes of its attributes"):
        appliance.efivars.secure_boot_state(efivars)


# ------------------------------------------------------------------------------ the install


def _recorder() -> Recorder:
    written = _as_spare_disk(_host_listing(), WRITTEN)
    return Recorder({"blockdevices": [next(n for n in written["blockdevices"] if n["name"] == "vda")]})


def _install(tmp_path: Path, efivars: Path, keys: Path, rec: Recorder | None = None, *,
             dry_run: bool = False) -> tuple[int, Recorder, list[str]]:
    rec = _recorder() if rec is None else rec
    tmp_path.mkdir(exist_ok=True)
    plan, plan_dir = _plan(tmp_path)
    out: list[str] = []
    status = install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}),
                             boot_partuuid="", trusted_keys=_trusted(tmp_path)[1], dry_run=dry_run, reboot=False,
                             out=out.append, efivars=efivars, secureboot_keys=keys)
    return status, rec, out


DISK_TOOLS = {"bmaptool", "systemd-repart", "veritysetup", "mount", "efibootmgr"}


def test_secure_boot_on_without_the_appliance_in_db_stops_the_install_before_any_disk_write(tmp_path: Path) -> None:
    """The guard: without the refusal, bmaptool would write a disk this firmware never boots."""
    efivars = _firmware(tmp_path, secure_boot=True, setup_mode=False, db=[CERTS[n] for n in MICROSOFT])
    keys = _keys(tmp_path / "keys")
    rec = Recorder({})
    plan, plan_dir = _plan(tmp_path)
    for dry_run in (False, True):
        with pytest.raises(UserError, match=r"^Secure Boot is on and the firmware is not in setup mode, but its db does not hold "
                                            r"this appliance's certificate .*could never boot; nothing written$") as e:
            install.install(_payload(tmp_path), plan, plan_dir, runner=rec, listing=(_as_spare_disk(_host_listing()), {}),
                            boot_partuuid="", trusted_keys=_trusted(tmp_path)[1], dry_run=dry_run, out=lambda _: None,
                            efivars=efivars, secureboot_keys=keys)
        assert "\n" not in e.value.message and e.value.exit_status == 2
        assert "BMC" in e.value.hint and "setup mode" in e.value.hint and 'README "Secure Boot"' in e.value.hint
        assert not DISK_TOOLS & {c[0] for c in rec.calls} and rec.calls == []
    assert not appliance.efivars.var_path("PK", appliance.efivars.GLOBAL_GUID, efivars).exists()


def test_an_install_in_setup_mode_enrolls_after_the_boot_entry_and_before_the_summary(
        tmp_path: Path, firmware: Callable[..., Written], monkeypatch: pytest.MonkeyPatch) -> None:
    efivars = _firmware(tmp_path, secure_boot=False, setup_mode=True)
    writes = firmware()
    rec = _recorder()
    at_enroll: list[list[str]] = []
    real_enroll = secureboot.enroll

    def enroll(keys: secureboot.EnrollSet, efivars: Path) -> None:
        at_enroll.extend(rec.calls)
        real_enroll(keys, efivars)

    monkeypatch.setattr(secureboot, "enroll", enroll)
    status, _, out = _install(tmp_path, efivars, _keys(tmp_path / "keys"), rec)
    assert status == 0 and [n.split("-")[0] for n, _ in writes] == ["db", "KEK", "PK"]
    assert at_enroll == rec.calls and rec.calls[-1][:3] == ["efibootmgr", "--quiet", "--bootorder"]
    page = out[-1]
    assert (" secure boot keys enrolled (PK, KEK, db: appliance + Microsoft UEFI CA 2011, UEFI CA 2023, Option ROM UEFI CA 2023): "
            "the next boot enforces") in page
    assert "Appliance 1.0.0 installed" in page and "firmware boot entry Boot0003 first in BootOrder" in page


def test_a_firmware_that_ignores_the_keys_leaves_a_bootable_disk_and_a_loud_summary(
        tmp_path: Path, firmware: Callable[..., Written]) -> None:
    """The disk is written by then: the install ends with its summary, which says the appliance
    boots unsealed and why, instead of stopping half-way without one."""
    efivars = _firmware(tmp_path, secure_boot=False, setup_mode=True)
    firmware(takes_pk=False)
    status, _, out = _install(tmp_path, efivars, _keys(tmp_path / "keys"))
    page = out[-1]
    assert status == 0 and "Appliance 1.0.0 installed" in page
    assert " secure boot keys NOT enrolled: " in page and "boots unsealed until they are" in page
    assert "secure boot keys read back" not in page and "the next boot enforces" not in page


def test_a_dry_run_in_setup_mode_says_it_would_enroll_and_writes_nothing(tmp_path: Path, firmware: Callable[..., Written]) -> None:
    efivars = _firmware(tmp_path, secure_boot=False, setup_mode=True)
    writes = firmware()
    status, rec, out = _install(tmp_path, efivars, _keys(tmp_path / "keys"), dry_run=True)
    assert status == 0 and rec.calls == [] and writes == []
    assert out[-1].splitlines() == ["dry run: would write /dev/vda with appliance 1.0.0 (its image checked against the signed "
                                    "bundle index first)",
                                    "dry run: would enroll the secure boot keys (PK, KEK, db: appliance + Microsoft UEFI CA 2011, "
                                    "UEFI CA 2023, Option ROM UEFI CA 2023) after writing: the next boot enforces"]


def test_a_firmware_that_trusts_the_appliance_already_is_left_alone(tmp_path: Path, firmware: Callable[..., Written]) -> None:
    efivars = _firmware(tmp_path, secure_boot=True, setup_mode=False, db=DB)
    writes = firmware()
    status, rec, out = _install(tmp_path, efivars, _keys(tmp_path / "keys"))
    assert status == 0 and writes == [] and rec.calls[0][0] == "bmaptool"
    assert " secure boot enforcing; the firmware already trusts this appliance's certificate" in out[-1]


def test_secure_boot_off_installs_and_says_so_loudly(tmp_path: Path, firmware: Callable[..., Written]) -> None:
    efivars = _firmware(tmp_path, secure_boot=False, setup_mode=False, db=[CERTS[n] for n in MICROSOFT])
    writes = firmware()
    status, rec, out = _install(tmp_path, efivars, _keys(tmp_path / "keys"))
    assert status == 0 and writes == [] and rec.calls[0][0] == "bmaptool"
    assert (' secure boot OFF and the firmware is not in setup mode: this appliance boots unsealed (see README "Secure Boot")\n'
            in out[-1])


def test_a_malformed_db_stops_an_enforcing_install_and_not_an_unsealed_one(tmp_path: Path) -> None:
    efivars = _firmware(tmp_path, secure_boot=True, setup_mode=False)
    _set(efivars, "db", appliance.efivars.IMAGE_SECURITY_GUID, _header(0) + b"\x00" * 48, 0x27)
    with pytest.raises(UserError, match="the firmware's db variable: signature list at byte 0: SignatureListSize 0"):
        _install(tmp_path, efivars, _keys(tmp_path / "keys"))
    _set(efivars, "SecureBoot", appliance.efivars.GLOBAL_GUID, b"\x00")
    status, _, out = _install(tmp_path / "again", efivars, tmp_path / "keys")
    assert status == 0 and " secure boot OFF" in out[-1]


def test_without_efi_the_install_goes_on_as_before(tmp_path: Path) -> None:
    status, rec, out = _install(tmp_path, tmp_path / "no-efivars", tmp_path / "no-keys")
    assert status == 0 and rec.calls[0][0] == "bmaptool"
    assert " secure boot no EFI variables: secure boot keys not enrolled" in out[-1]


def test_an_efi_machine_with_no_keys_in_the_installer_stops_before_writing(tmp_path: Path) -> None:
    efivars = _firmware(tmp_path, secure_boot=False, setup_mode=True)
    with pytest.raises(UserError, match=r"no-keys: missing: this installer has no Secure Boot keys") as e:
        _install(tmp_path, efivars, tmp_path / "no-keys")
    assert "medium is damaged" in e.value.hint


# ------------------------------------------------------------------------------ the installer's keys


@pytest.mark.parametrize(("damage", "said"), [
    (lambda d: (d / "KEK.auth").unlink(), r"KEK\.auth: missing"),
    (lambda d: (d / "enroll.json").write_text("{"), r"enroll\.json: not JSON"),
    (lambda d: (d / "enroll.json").write_text(json.dumps({"appliance_sha256": "0" * 64})),
     "not an object of exactly appliance_sha256, db, KEK and PK"),
    (lambda d: (d / "db.auth").write_bytes(_auth(_chain([CERTS["appliance db"]]))), r"db\.auth: its 1 certificates are not the 4"),
    (lambda d: (d / "PK.auth").write_bytes(b"\x00" * 16 + _chain([CERTS["appliance PK"]])), "not a time-based authenticated variable"),
    (lambda d: (d / "PK.auth").write_bytes(_auth(_chain([CERTS["appliance PK"]]))[:-5]), r"PK\.auth: signature list at byte 0"),
    (lambda d: (d / "db.auth").write_bytes(b"\x00" * (secureboot.MAX_AUTH_BYTES + 1)), "more than 262144"),
])
def test_damaged_keys_are_one_line_refusals(tmp_path: Path, damage: Callable[[Path], object], said: str) -> None:
    keys = _keys(tmp_path / "keys")
    damage(keys)
    with pytest.raises(UserError, match=said) as e:
        secureboot.load(keys)
    assert "\n" not in e.value.message and e.value.hint


def test_enroll_json_must_name_the_appliance_in_db_and_printable_names(tmp_path: Path) -> None:
    keys = _keys(tmp_path / "keys", db=[CERTS[n] for n in MICROSOFT])
    with pytest.raises(UserError, match=r"db\.auth: does not carry the appliance's certificate"):
        secureboot.load(keys)
    keys = _keys(tmp_path / "keys2")
    doc = json.loads((keys / "enroll.json").read_text())
    doc["db"][1]["name"] = "UEFI CA\x1b[2J"
    (keys / "enroll.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match="printable characters"):
        secureboot.load(keys)


def test_an_operator_who_opted_out_of_microsoft_sees_appliance_only(tmp_path: Path) -> None:
    keys = secureboot.load(_keys(tmp_path / "keys", db=[CERTS["appliance db"]]))
    assert secureboot.summary_line(secureboot.Decision("enroll"), keys) == (
        "secure boot keys enrolled (PK, KEK, db: appliance only): the next boot enforces")


# ------------------------------------------------------------------------------ the signature list parser


def test_signature_lists_give_the_x509_hashes_and_skip_other_types() -> None:
    data = _chain(DB) + _esl([b"\xaa" * 32, b"\xbb" * 32], SHA256_TYPE) + _esl([CERTS["appliance KEK"]], header=b"hdr!")
    assert appliance.efivars.signature_list_sha256s(data) == [*(_sha(d) for d in DB), _sha(CERTS["appliance KEK"])]
    assert appliance.efivars.signature_list_sha256s(b"") == []


def _header(list_size: int, header_size: int = 0, sig_size: int = 48) -> bytes:
    return uuid.UUID(appliance.efivars.CERT_X509_GUID).bytes_le + struct.pack("<III", list_size, header_size, sig_size)


@pytest.mark.parametrize(("data", "said"), [
    (_esl([CERTS["appliance db"]])[:20], "20 bytes, shorter than its 28-byte header"),
    (_esl([CERTS["appliance db"]])[:-1], "runs past the end"),
    (_header(0) + b"\x00" * 48, "SignatureListSize 0 is shorter than its headers"),
    (_header(28 + 48, header_size=100) + b"\x00" * 48, "shorter than its headers"),
    (_header(28 + 48, sig_size=8) + b"\x00" * 48, "SignatureSize 8 leaves no data"),
    (_header(28 + 48, sig_size=0) + b"\x00" * 48, "SignatureSize 0 leaves no data"),
    (_header(28 + 48, sig_size=40) + b"\x00" * 48, "not a whole number of SignatureSize 40"),
    (_header(0xFFFFFFFF) + b"\x00" * 48, "SignatureListSize 4294967295 runs past the end"),
    (_chain(DB) + b"\x00" * 5, r"signature list at byte \d+: 5 bytes"),
], ids=lambda value: value if isinstance(value, str) else "list")  # the certificates differ per run
def test_a_malformed_signature_list_is_a_value_error(data: bytes, said: str) -> None:
    with pytest.raises(ValueError, match=said) as e:
        appliance.efivars.signature_list_sha256s(data)
    assert "\n" not in str(e.value)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.lists(st.tuples(st.integers(0, 200), st.integers(0, 0xFFFFFFFF)), max_size=4))
def test_any_bytes_end_in_hashes_or_a_value_error(prefix: bytes, patches: list[tuple[int, int]]) -> None:
    data = bytearray(_chain(DB[:2]) + prefix)
    for at, value in patches:  # a size field overwritten anywhere
        if at + 4 <= len(data):
            data[at:at + 4] = struct.pack("<I", value)
    try:
        hashes_ = appliance.efivars.signature_list_sha256s(bytes(data))
    except ValueError:
        return
    assert len(hashes_) <= len(data) // 17
