# SPDX-License-Identifier: MIT
"""`applianctl var-seal` (appliance-var-seal.service, every boot once /var is unlocked): /var's LUKS2
header becomes what a sealed appliance needs, and status learns how /var is opened.

- **A TPM2 slot sealed to PCR 7 and the signed PCR 11 policy** (appliance.luks). PCR 7 holds the
  firmware's Secure Boot state and the certificate that verified the boot, so a boot with Secure
  Boot off or through another vendor's signed loader cannot unseal it; the signed PCR 11 policy
  lets every kernel image the release's policy key signed unseal it, so upgrades and rollbacks
  never reseal. The installer runs before the keys are enrolled and cannot know the sealed boot's
  PCR 7: it leaves a slot bound to the signed policy alone, which the first sealed boot replaces
  (one systemd-cryptenroll call: the wipe follows the enrollment). Only a boot that enforces Secure
  Boot seals: sealing an unsealed boot's PCR 7 would bind /var to that.
- **A recovery key.** The installer makes one and shows it in its summary. An image booted as it
  was built (the demo, tests) has none: one is made and shown once on the console, never logged.
  After a factory reset asked for with `applianctl factory-reset` (root, so the operator) a new one
  replaces the old, shown once. A reset chosen in the boot menu keeps the old one: whoever sits at
  the console is not known to be the operator, and a key shown to them would open the /var that
  keeps the host's TLS key and plan.
- **A changed PCR 7** (a firmware or dbx update, other Secure Boot keys) leaves the TPM2 slot
  unable to open /var: that boot asked for the recovery key at the console. The PCR 7 value /var
  was sealed to is kept on /var; a boot that finds another one says so in status, and
  `applianctl var-seal --reseal` (the recovery key typed once more) seals /var to the new value.
Records /run/appliance/var-seal.json for status; STATE_DIR/var-seal.json keeps the sealed PCR 7 and
which factory reset the recovery key was last renewed for.

A damaged record (either of the two it reads) is one line in the journal and a problem in status,
never a var-seal that does not run. A damaged last-factory-reset record renews no key. A damaged
var-seal.json is taken as renewed for the last reset: renewing again would wipe the key the operator
wrote down and show a new one on a console nobody may be watching. It is written anew (what is no
regular file in its place renamed aside), with this boot's PCR 7 as the one sealed to.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from appliance import cli_help, efivars, luks, paths
from appliance.atomic import atomic_write
from appliance.errors import UserError
from appliance.run import call, run
from appliance.safe_read import set_aside
from appliance.schema import dump_record, load_record
from applianctl.factory_reset import BY_BOOT_MENU
from applianctl.records import LastFactoryReset, VarSealState

DEVICE = f"/dev/disk/by-partlabel/{luks.VAR_LABEL}"
PCR_PUBLIC_KEY = Path("/run/systemd/tpm2-pcr-public-key.pem")  # systemd-stub's .pcrpkey, through the initrd
CONSOLES = (Path("/dev/console"), Path("/dev/tty1"))
PCR7 = Path("/sys/class/tpm/tpm0/pcr-sha256/7")
HINT = "see `journalctl -u appliance-var-seal`; /var still opens as before"


def record_path() -> Path:
    return paths.RUN_DIR / "var-seal.json"


def renewed_path() -> Path:
    return paths.STATE_DIR / "var-seal.json"


def _run(argv: Sequence[str]) -> str:
    return run(list(argv), argv[0], hint=HINT, timeout=300)


def show_once(key: str, consoles: Sequence[Path] | None = None) -> list[str]:
    """KEY on the consoles (CONSOLES: never on stdout, which the journal keeps); those it reached,
    each device once (/dev/console may be tty1)."""
    consoles = CONSOLES if consoles is None else consoles
    page = ("\n" + "=" * 72 + "\n /var recovery key (shown once and stored nowhere: write it down now)\n\n    " + key +
            "\n\n It opens /var when the TPM cannot (a firmware or Secure Boot key change, a\n"
            " new main board, a cleared TPM): type it at the console's password prompt.\n" + "=" * 72 + "\n")
    reached: list[str] = []
    seen: set[tuple[int, int, int]] = set()
    for console in consoles:
        try:
            fd = os.open(console, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            identity = (st.st_rdev, 0, 0) if st.st_rdev else (0, st.st_dev, st.st_ino)
            if identity in seen:
                continue
            seen.add(identity)
            os.write(fd, page.encode())
            reached.append(str(console))
        except OSError:
            pass
        finally:
            os.close(fd)
    return reached


def _last_factory_reset() -> tuple[str | None, str | None]:
    """When the last factory reset ran and who asked (its record's `at` and `by`), if one ever did;
    (None, None) when its record is damaged (one line on stderr): no key is renewed for it."""
    try:
        record = load_record(LastFactoryReset, paths.last_factory_reset_path(), lenient=True)
    except UserError as e:
        print(f"var-seal: {e.message}; no recovery key is renewed for it", file=sys.stderr)
        return None, None
    return (record.at, record.by) if record is not None else (None, None)


def _kept(quiet: bool = False) -> VarSealState | None:
    """What STATE_DIR/var-seal.json keeps (nothing when there is none); None when it is damaged
    (one line on stderr unless QUIET)."""
    try:
        return load_record(VarSealState, renewed_path(), lenient=True) or VarSealState()
    except UserError as e:
        if not quiet:
            print(f"var-seal: {e.message}", file=sys.stderr)
        return None


def _keep(**values: str) -> None:
    """VALUES kept in STATE_DIR/var-seal.json with what it keeps already; one line on stderr when
    it cannot be written (the next boot tries again)."""
    path = renewed_path()
    try:
        if (kind := set_aside(path)) is not None:
            print(f"var-seal: {path} was {kind}: moved to {path.name}.damaged", file=sys.stderr)
        kept = dataclasses.replace(_kept(quiet=True) or VarSealState(), **values)
        atomic_write(path, json.dumps(dump_record(kept), sort_keys=True).encode() + b"\n", mode=0o600)
    except OSError as e:
        print(f"var-seal: {path}: cannot write ({e.strerror or e})", file=sys.stderr)


def _pcr7() -> str | None:
    try:
        value = PCR7.read_text().strip().lower()
    except OSError:
        return None
    return value if len(value) == 64 and all(c in "0123456789abcdef" for c in value) else None


def seal(runner: Callable[[Sequence[str]], str] | None = None, device: str = DEVICE, *, public_key: Path | None = None,
         efivars_dir: Path | None = None, show: Callable[[str], list[str]] | None = None) -> dict[str, Any]:
    """Bring /var's header to the sealed binding and a recovery key; return what status shows."""
    runner = _run if runner is None else runner
    public_key = PCR_PUBLIC_KEY if public_key is None else public_key
    efivars_dir = efivars.EFIVARS if efivars_dir is None else efivars_dir
    show = show_once if show is None else show
    record: dict[str, Any] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device,
                              "changed": [], "problems": []}
    if not luks.is_luks(runner, device):
        record.update(encrypted=False, methods=[], sealed=False, recovery=False)
        record["problems"].append("/var is not encrypted (a disk installed before encrypted /var): re-install to seal it")
        return record
    methods = luks.read_header(runner, device)
    reset_at, reset_by = _last_factory_reset()
    kept = _kept()
    if kept is None:  # taken as renewed for the last reset, sealed to this boot's PCR 7 (module docstring)
        kept = VarSealState(recovery_renewed_for_reset=reset_at)
        _keep(**({"recovery_renewed_for_reset": reset_at} if reset_at else {}))
        record["problems"].append(f"{renewed_path()} was damaged: a PCR 7 change before this boot cannot be told, and the "
                                  "recovery key is not renewed for the last factory reset; it is written anew")
    if not any(m.sealed for m in methods):
        state = efivars.secure_boot_state(efivars_dir)
        if not (state.secure_boot and not state.setup_mode):
            record["problems"].append("not sealed to this machine yet: this boot does not enforce Secure Boot, "
                                      "so its PCR 7 is not one to seal to")
        elif not public_key.is_file():
            record["problems"].append(f"not sealed to this machine yet: no signed PCR policy key at {public_key}")
        else:
            temporary = [m.keyslot for m in methods if m.kind == "tpm2"]
            runner(["systemd-cryptenroll", "--unlock-tpm2-device=auto",
                    *luks.tpm2_options(literal_pcrs=[luks.SECURE_BOOT_PCR], public_key=str(public_key)),
                    *([f"--wipe-slot={','.join(str(s) for s in temporary)}"] if temporary else []), device])
            record["changed"].append("sealed to PCR 7 + signed PCR 11" +
                                     (f" (the installer's slot {', '.join(map(str, temporary))} wiped)" if temporary else ""))
            methods = luks.read_header(runner, device)
            if (now := _pcr7()) is not None:
                _keep(sealed_pcr7=now)
    elif (now := _pcr7()) is not None:
        sealed_to = kept.sealed_pcr7
        if sealed_to is None:  # sealed by systemd-repart on this image's first boot
            _keep(sealed_pcr7=now)
        elif sealed_to != now:
            record["problems"].append("PCR 7 changed since /var was sealed (a firmware or Secure Boot key change): the TPM "
                                      "no longer opens /var, so this boot needed the recovery key; seal it again with "
                                      "`applianctl var-seal --reseal` (it asks for the recovery key once more)")
    if reset_by == BY_BOOT_MENU:
        reset_at = None  # the console's reset keeps the operator's key (module docstring)
    old_recovery = [m.keyslot for m in methods if m.kind == "recovery"]
    renew = bool(reset_at) and reset_at != kept.recovery_renewed_for_reset and bool(old_recovery)
    if not old_recovery or renew:
        # the slot it adds opens with the TPM's key; the old recovery slots go only after that
        key = luks.recovery_key(runner(["systemd-cryptenroll", "--unlock-tpm2-device=auto", "--recovery-key",
                                        *([f"--wipe-slot={','.join(map(str, old_recovery))}"] if renew else []), device]))
        reached = show(key)
        record["changed"].append(("a new recovery key after the factory reset" if renew else "a recovery key made") +
                                 (f", shown once on {', '.join(reached)}" if reached else ", but no console took it"))
        if not reached:
            record["problems"].append("the new recovery key reached no console: make another with "
                                      "`systemd-cryptenroll --unlock-tpm2-device=auto --recovery-key " + device + "`")
        methods = luks.read_header(runner, device)
    if reset_at and (renew or not old_recovery):
        _keep(recovery_renewed_for_reset=reset_at)
    record.update(encrypted=True, methods=[m.to_json() for m in methods], sealed=any(m.sealed for m in methods),
                  recovery=any(m.kind == "recovery" for m in methods))
    if any(m.kind == "passphrase" for m in methods):
        record["problems"].append("a passphrase slot no token describes opens /var: wipe it "
                                  "(systemd-cryptenroll --wipe-slot=password " + device + ") unless you made it")
    return record


def reseal(device: str = DEVICE) -> int:
    """After a PCR 7 change: a new TPM2 slot sealed to this boot's PCR 7 (systemd-cryptenroll asks for
    the recovery key on the terminal), the old TPM2 slots wiped after it."""
    state = efivars.secure_boot_state(efivars.EFIVARS)
    if not (state.secure_boot and not state.setup_mode):
        raise UserError("this boot does not enforce Secure Boot: /var is sealed only to a sealed boot's PCR 7",
                        hint="turn Secure Boot on (README, \"Secure Boot\"), boot again, then run this")
    old = [m.keyslot for m in luks.read_header(_run, device) if m.kind == "tpm2"]
    argv = ["systemd-cryptenroll", *luks.tpm2_options(literal_pcrs=[luks.SECURE_BOOT_PCR], public_key=str(PCR_PUBLIC_KEY)),
            *([f"--wipe-slot={','.join(map(str, old))}"] if old else []), device]
    if call(argv, timeout=None, capture=False).returncode != 0:
        raise UserError("systemd-cryptenroll did not seal /var again", hint="see its message above; /var opens as before")
    if (now := _pcr7()) is not None:
        _keep(sealed_pcr7=now)
    print("/var: sealed to this boot's PCR 7 + signed PCR 11")
    return 0


def add_parser(subparsers: Any) -> None:
    # hidden from the list: appliance-var-seal.service's; --reseal is the operator's after a PCR 7 change
    p = cli_help.verb_parser(
        subparsers, "var-seal", "seal /var's key to this machine and make sure a recovery key exists",
        examples=["applianctl var-seal --reseal"],
        exit_codes=[(0, "sealed (what changed, or a problem status shows, on stdout)"),
                    (2, "it cannot be sealed now: not a sealed boot, or systemd-cryptenroll failed (one line and a hint)")],
        details="appliance-var-seal.service runs it at every boot; --reseal is the operator's after a firmware or "
        "Secure Boot key change.",
        hidden=True,
    )
    p.add_argument("--reseal", action="store_true",
                   help="seal /var to this boot's PCR 7 again after a firmware or Secure Boot key change (asks for the recovery key)")
    p.set_defaults(func=cmd_var_seal)


def cmd_var_seal(args: argparse.Namespace) -> int:
    if args.reseal:
        return reseal()
    try:
        record = seal()
    except UserError as e:
        record = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": DEVICE, "changed": [],
                  "problems": [e.message]}
        atomic_write(record_path(), json.dumps(record).encode() + b"\n")
        raise
    atomic_write(record_path(), json.dumps(record).encode() + b"\n")
    for line in record["changed"] + record["problems"]:
        print(f"/var: {line}")
    if not record["changed"] and not record["problems"]:
        print("/var: sealed; " + ", ".join(luks.Method(**{**m, "pcrs": tuple(m["pcrs"]), "signed_pcrs": tuple(m["signed_pcrs"])})
                                            .describe() for m in record["methods"]))
    return 0
