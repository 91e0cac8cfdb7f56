# SPDX-License-Identifier: MIT
"""Extended QEMU scenario (make test-extended GROUPS=sealed): /var against someone at the console,
and after the TPM's state is lost.

    boot 1  the demo image's first boot, sealed (Secure Boot enforcing, a TPM): systemd-repart makes
            /var LUKS2 sealed to PCR 7 + the signed PCR 11 policy; its recovery key is shown once
            on the console; report
    boot 2  Secure Boot turned off in the firmware (its keys cleared: setup mode) and a boot
            entry added to the ESP (its loader.conf told not to enroll the ESP's key set) that
            boots the genuine, signed kernel image with the signed command line plus
            init=/usr/bin/bash: with Secure Boot off systemd-stub takes the loader's command
            line, so the shell runs as PID 1 on the real root and /usr. Typed at the serial
            console, what anyone at that shell would try: opening /var through the TPM
            (systemd-cryptsetup attach ... tpm2-device=auto); the TPM refuses (PCR 7 differs)
    boot 3  Secure Boot on again and the TPM's state lost (a new, empty swtpm): the TPM cannot open
            /var, the console asks for a passphrase; the recovery key from boot 1's console typed at
            the serial console opens /var and the appliance serves
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from appliance import config, luks
from appliance.attest import evidence, verify
from appliance.signed import bundle_index
from builder import attest, build, qemu, secureboot

pytestmark = [pytest.mark.integration, pytest.mark.extended]

RECOVERY_SHOWN = re.compile(r"/var recovery key \(shown once[^\n]*\n\s*\n\s*([a-z-]{71})\s")
# systemd-cryptsetup 257: "Please enter recovery key for disk appliance-var on /var:"
PROMPT = re.compile(r"(passphrase|recovery key) for disk appliance-var")
ATTACK_START, ATTACK_END = "SEALED-ATTACK-START", "SEALED-ATTACK-END"
SHELL = re.compile(r"no job control in this shell|bash-[0-9.]+# |root@[^\s:]+:/# ")
# The fleet's verifier's nonce for the quote the shell's TPM gives (the test host chose it)
NONCE = secrets.token_hex(32)
IDENTITY_MARK, QUOTE_MARK, ATTEST_END = "SEALED-ATTEST-IDENTITY", "SEALED-ATTEST-QUOTE", "SEALED-ATTEST-END"
ATTACK = ("exec >/dev/ttyS1 2>&1; echo " + ATTACK_START + "; modprobe dm_crypt; "
          "/usr/lib/systemd/systemd-cryptsetup attach attack /dev/disk/by-partlabel/appliance-var none "
          "tpm2-device=auto,headless=1; echo SEALED-ATTACK-RC=$?; ls /dev/mapper; "
          "echo SEALED-ATTACK-SB=$(od -An -tu1 -j4 /sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c); "
          # what this boot proves to the fleet's verifier: its TPM's quote, with the firmware's event log
          "mount -t securityfs securityfs /sys/kernel/security; export TPM2TOOLS_TCTI=device:/dev/tpmrm0; "
          f"echo {IDENTITY_MARK}; /usr/bin/applianctl attest identity --json; "
          f"echo {QUOTE_MARK}; /usr/bin/applianctl attest --nonce {NONCE} --json; echo {ATTEST_END}; "
          "echo " + ATTACK_END + "; sync; echo o > /proc/sysrq-trigger")


def _esp(disk: Path) -> str:
    """mtools' IMAGE@@OFFSET for DISK's ESP (the host has no vfat; mtools needs none)."""
    table = json.loads(subprocess.run(["sfdisk", "-J", str(disk)], capture_output=True, text=True, check=True).stdout)
    part = next(p for p in table["partitiontable"]["partitions"] if p["type"].upper() == "C12A7328-F81F-11D2-BA4B-00A0C93EC93B")
    return f"{disk}@@{int(part['start']) * int(table['partitiontable'].get('sectorsize', 512))}"


def _signed_command_line(uki: Path) -> str:
    return bundle_index.pe_sections(uki)[".cmdline"].rstrip(b"\0\n").decode()


def _attack_entry(guest: qemu.Guest, work: Path) -> dict[str, str]:
    """A boot entry on the ESP (as anyone with the disk or the console's firmware setup could add)
    that boots the genuine kernel image with its signed command line (without the credential
    words: they are not needed here and the kernel's line is 2048 bytes; without /usr's root hash
    signature option: with the firmware's keys cleared the kernel has no db to check it against,
    and the attacker, who writes the line, leaves it out) plus init=bash."""
    esp = _esp(guest.disk)
    listing = subprocess.run(["mdir", "-b", "-i", esp, "::/EFI/Linux"], capture_output=True, text=True, check=True).stdout
    ukis = [line.strip() for line in listing.splitlines() if line.strip().endswith(".efi")]
    assert ukis, listing
    uki_path = ukis[0].removeprefix("::")
    local = work / "uki.efi"
    subprocess.run(["mcopy", "-o", "-i", esp, f"::{uki_path}", str(local)], check=True)
    dropped = ("systemd.set_credential", "rd.systemd.wants", "systemd.verity_usr_options")
    words = [w for w in _signed_command_line(local).split() if not w.startswith(dropped)]
    entry = work / "attack.conf"
    entry.write_text(f"title attack\nefi {uki_path}\noptions {' '.join(words)} init=/usr/bin/bash\n")
    loader = work / "loader.conf"
    # no enrollment of the ESP's key set by systemd-boot on a firmware in setup mode (below)
    loader.write_text("default attack.conf\ntimeout 0\neditor no\nsecure-boot-enroll off\n")
    subprocess.run(["mmd", "-D", "s", "-i", esp, "::/loader/entries"], capture_output=True, check=False)
    subprocess.run(["mcopy", "-o", "-i", esp, str(entry), "::/loader/entries/attack.conf"], check=True)
    subprocess.run(["mcopy", "-o", "-i", esp, str(loader), "::/loader/loader.conf"], check=True)
    return {"uki": uki_path, "options_bytes": str(len(entry.read_text()))}


def _secure_boot_off(vars_fd: Path) -> None:
    """Secure Boot off: the firmware's keys cleared (setup mode), as its setup screen leaves them."""
    qemu.firmware_vars(vars_fd, None)


def _boot_raw(guest: qemu.Guest, timeout: float, *, type_at: tuple[re.Pattern[str], str] | None = None,
              credentials: dict[str, str] | None = None) -> dict[str, Any]:
    """One boot of GUEST whose console is a socket (logged to console.log), so that TEXT can be typed
    at the serial console when PATTERN appears on it; the reports, the console, what was typed."""
    for path in (guest.console_log, guest.report_log):
        path.unlink(missing_ok=True)
    sock_path = guest.dir / "console.sock"
    sock_path.unlink(missing_ok=True)
    creds = {"appliance.bootcheck": "poweroff", **(credentials or {})}
    typed_at: float | None = None
    started = time.monotonic()
    with qemu.Tpm(guest.tpm_state) as tpm:
        cmd = [*qemu.qemu_command(guest.disk, guest.vars, creds, tpm), "-no-reboot",
               "-chardev", f"socket,id=con0,path={sock_path},server=on,wait=off,logfile={guest.console_log},logappend=off",
               "-serial", "chardev:con0", "-serial", f"file:{guest.report_log}"]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        conn: socket.socket | None = None
        try:
            while proc.poll() is None and time.monotonic() - started < timeout:
                if conn is None and sock_path.exists():
                    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    conn.connect(str(sock_path))
                    # keep the console flowing: a socket nobody reads would stall the guest's serial port
                    threading.Thread(target=_drain, args=(conn,), daemon=True).start()
                console = guest.console_log.read_text(errors="replace") if guest.console_log.exists() else ""
                if type_at and typed_at is None and conn is not None and type_at[0].search(console):
                    time.sleep(2)  # the agent has put the terminal in raw mode by the time its prompt shows
                    conn.sendall(type_at[1].encode() + b"\r")
                    typed_at = time.monotonic() - started
                time.sleep(1)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if conn is not None:
                conn.close()
    report_text = guest.report_log.read_text(errors="replace") if guest.report_log.exists() else ""
    return {"reports": qemu.parse_reports(report_text), "report_text": report_text,
            "console": guest.console_log.read_text(errors="replace") if guest.console_log.exists() else "",
            "typed_at": typed_at, "seconds": round(time.monotonic() - started), "returncode": proc.returncode}


def _drain(conn: socket.socket) -> None:
    try:
        while conn.recv(65536):
            pass
    except OSError:
        pass


@pytest.fixture(scope="module")
def sealed_runs(demo_config: config.Config, demo_image: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cert = build.secure_boot_certificate(demo_config)
    work = tmp_path_factory.mktemp("sealed")
    guest = qemu.Guest(demo_image, work / "guest", enroll_cert=cert)
    runs: dict[str, Any] = {"first": guest.boot(timeout=2400)}
    runs["first_console"] = guest.console_log.read_text(errors="replace")
    # boot 2: Secure Boot off, the genuine kernel image with init=bash from an added boot entry
    pristine_esp = work / "esp-loader.conf"
    subprocess.run(["mcopy", "-o", "-i", _esp(guest.disk), "::/loader/loader.conf", str(pristine_esp)], check=True)
    runs["entry"] = _attack_entry(guest, work)
    runs["uki_file"] = work / "uki.efi"  # the kernel image the attack boots, copied off the ESP
    _secure_boot_off(guest.vars)
    runs["attack"] = _boot_raw(guest, 900, type_at=(SHELL, ATTACK))
    # boot 3: the entry gone, Secure Boot on, the TPM's state lost
    esp = _esp(guest.disk)
    subprocess.run(["mdel", "-i", esp, "::/loader/entries/attack.conf"], check=True)
    subprocess.run(["mcopy", "-o", "-i", esp, str(pristine_esp), "::/loader/loader.conf"], check=True)
    qemu.firmware_vars(guest.vars, cert)
    shutil.rmtree(guest.tpm_state)
    found = RECOVERY_SHOWN.search(runs["first_console"])
    runs["recovery_key"] = found.group(1) if found else None
    runs["lost_tpm"] = _boot_raw(guest, 2400, type_at=(PROMPT, runs["recovery_key"] or "no-key-was-shown"))
    shutil.copytree(guest.dir, tmp_path_factory.mktemp("sealed-kept") / "guest", ignore=shutil.ignore_patterns("disk.raw"))
    return runs


def test_the_first_boot_seals_var_and_shows_its_recovery_key_once(sealed_runs: dict[str, Any]) -> None:
    sealed = sealed_runs["first"]["status"]["parts"]["sealed"]
    assert (sealed.get("var_encrypted"), sealed.get("var_sealed"), sealed.get("var_recovery_key")) == (True, True, True), sealed
    key = sealed_runs["recovery_key"]
    assert key is not None and luks.RECOVERY_KEY.match(key), sealed_runs["first_console"][-3000:]
    assert sealed_runs["first_console"].count(key) == 1  # on the console once, in the seal unit's journal line never


def test_with_secure_boot_off_a_shell_as_pid_1_cannot_open_var(sealed_runs: dict[str, Any]) -> None:
    """Secure Boot off lets a genuine kernel image take init=bash from the loader: the shell runs,
    and the TPM still refuses /var's key (PCR 7 records Secure Boot off)."""
    run = sealed_runs["attack"]
    text = run["report_text"]
    assert ATTACK_START in text and ATTACK_END in text, (text[-3000:], run["console"][-3000:])
    body = text.split(ATTACK_START, 1)[1].split(ATTACK_END, 1)[0]
    assert "SEALED-ATTACK-SB= 0" in body, body  # the firmware had Secure Boot off
    rc = re.search(r"SEALED-ATTACK-RC=([0-9]+)", body)
    assert rc is not None and rc.group(1) != "0", body
    assert "attack" not in body.split(rc.group(0), 1)[1], body  # no /dev/mapper/attack


def test_with_secure_boot_off_the_quote_fails_verification_with_the_pcr_7_reason(sealed_runs: dict[str, Any],
                                                                                 demo_config: config.Config) -> None:
    """The same boot, asked by the fleet's verifier: the TPM's quote is genuine and PCR 11 is the
    release's, but PCR 7, replayed from the firmware's event log, records Secure Boot off."""
    text = sealed_runs["attack"]["report_text"]
    assert QUOTE_MARK in text and ATTEST_END in text, text[-3000:]
    identity_text = text.split(IDENTITY_MARK, 1)[1].split(QUOTE_MARK, 1)[0]
    quote_text = text.split(QUOTE_MARK, 1)[1].split(ATTEST_END, 1)[0]
    identity = evidence.load_identity(json.loads(identity_text))
    quoted = evidence.load_evidence(json.loads(quote_text))
    uki = sealed_runs["uki_file"]
    policies, _ = attest.policies_from_uki(uki)
    releases = [verify.ReleasePolicy(demo_config.appliance.version, frozenset(bytes.fromhex(p) for p in policies))]
    certs = [secureboot.der(build.secure_boot_certificate(demo_config))]
    if demo_config.os.secure_boot_microsoft_ca:
        certs.extend(der for _, der in secureboot.microsoft_certificates())
    verdict = verify.check(quoted, nonce=bytes.fromhex(NONCE), ak_public=base64.b64decode(identity.ak_public),
                           releases=releases, secure_boot=verify.SecureBootTrust(db_certificates=tuple(certs)))
    assert not verdict.proven and verdict.code == "secure-boot-off", verdict
    assert verdict.secure_boot == "off" and verdict.release == demo_config.appliance.version, verdict


def test_with_the_tpm_state_lost_the_recovery_key_typed_at_the_serial_console_opens_var(sealed_runs: dict[str, Any]) -> None:
    run = sealed_runs["lost_tpm"]
    assert run["typed_at"] is not None, run["console"][-3000:]
    assert run["reports"], (run["console"][-3000:], run["report_text"][-2000:])
    status = run["reports"][-1]["status"]
    assert status["parts"]["sealed"].get("var_encrypted") is True, status["parts"]["sealed"]
    assert status["state"] != "down" and status["parts"]["engine"]["state"] == "ok", status
