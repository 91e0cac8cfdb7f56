# SPDX-License-Identifier: MIT
"""/var's LUKS2 header as systemd's tools leave it: which key slots open it and how.

One model for the installer (which makes the header), the device's `applianctl var-seal` (which
seals it to the machine at each boot) and status (which shows it). The header is read with
`cryptsetup luksDump --dump-json-metadata`; systemd-cryptenroll and systemd-repart describe each
slot they add with a token: `systemd-tpm2` (with the PCRs it is bound to literally, `tpm2-pcrs`,
and those of a signed policy, `tpm2_pubkey_pcrs`) and `systemd-recovery`. A slot no token
claims is a passphrase (or key file).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from appliance.errors import UserError

VAR_LABEL = "appliance-var"  # the GPT partition label (and LUKS label) of /var
MAPPER_NAME = "appliance-var"  # /dev/mapper/appliance-var, as /etc/crypttab names it
MAX_HEADER_JSON = 4 << 20  # LUKS2's metadata area is at most 4 MiB
SECURE_BOOT_PCR = 7  # the firmware's Secure Boot state and the authorities that verified the boot
KERNEL_IMAGE_PCR = 11  # what systemd-stub measured of the kernel image, and the boot phases
# systemd's recovery keys: 32 random bytes as 64 "modhex" characters in 8 groups of 8
RECOVERY_KEY = re.compile(r"^[cbdefghijklnrtuv]{8}(-[cbdefghijklnrtuv]{8}){7}\Z")

Runner = Callable[[Sequence[str]], str]


@dataclass(frozen=True)
class Method:
    """One way in: a key slot and what opens it."""

    kind: str  # "tpm2", "recovery", "passphrase" (a slot no token claims) or the token's own type
    keyslot: int
    pcrs: tuple[int, ...] = ()  # tpm2: the PCRs bound by value
    signed_pcrs: tuple[int, ...] = ()  # tpm2: the PCRs bound through a signed policy

    @property
    def sealed(self) -> bool:
        """A TPM2 slot that only this machine's Secure Boot state with a kernel image the release's
        policy key signed can open (the appliance's final binding)."""
        return self.kind == "tpm2" and SECURE_BOOT_PCR in self.pcrs and KERNEL_IMAGE_PCR in self.signed_pcrs

    def describe(self) -> str:
        if self.kind != "tpm2":
            return f"{self.kind} (slot {self.keyslot})"
        bound = [f"PCR {p}" for p in self.pcrs] + [f"signed PCR {p}" for p in self.signed_pcrs]
        return f"tpm2 {' + '.join(bound) or 'bound to nothing'} (slot {self.keyslot})"

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "keyslot": self.keyslot, "pcrs": list(self.pcrs), "signed_pcrs": list(self.signed_pcrs)}


def _ints(value: object, what: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, (int, str)) and str(v).isdigit() for v in value):
        raise ValueError(f"{what} is not a list of numbers")
    return tuple(sorted(int(v) for v in value))


_TOKEN_KINDS = {"systemd-tpm2": "tpm2", "systemd-recovery": "recovery"}


def parse_header(text: str) -> list[Method]:
    """The unlock methods of a LUKS2 header's JSON metadata, by key slot; a malformed header is a
    UserError (nothing is enrolled or wiped on a header this cannot read)."""
    try:
        doc = json.loads(text)
        slots = sorted(int(s) for s in doc["keyslots"])
        claimed: dict[int, Method] = {}
        for token in (doc.get("tokens") or {}).values():
            kind = _TOKEN_KINDS.get(str(token.get("type")), str(token.get("type"))[:40])
            for slot in _ints(token.get("keyslots"), "a token's keyslots"):
                pcrs = _ints(token.get("tpm2-pcrs"), "tpm2-pcrs") if kind == "tpm2" else ()
                signed = _ints(token.get("tpm2_pubkey_pcrs"), "tpm2_pubkey_pcrs") if kind == "tpm2" else ()
                claimed[slot] = Method(kind, slot, pcrs, signed)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"/var's LUKS2 header could not be read: {e}",
                        hint="see `cryptsetup luksDump` on the /var partition; nothing was changed") from None
    return [claimed.get(slot, Method("passphrase", slot)) for slot in slots]


def read_header(runner: Runner, device: str) -> list[Method]:
    return parse_header(runner(["cryptsetup", "luksDump", "--dump-json-metadata", device])[:MAX_HEADER_JSON])


def is_luks(runner: Runner, device: str) -> bool:
    """`cryptsetup isLuks` answers with its exit status only."""
    try:
        runner(["cryptsetup", "isLuks", "--type", "luks2", device])
    except UserError:
        return False
    return True


def recovery_key(output: str) -> str:
    """The recovery key systemd-cryptenroll printed (its last line on stdout), checked for its
    format so that nothing else is ever shown as one."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    key = lines[-1] if lines else ""
    if not RECOVERY_KEY.match(key):
        raise UserError("systemd-cryptenroll printed no recovery key", hint="see its messages in the journal; nothing was wiped")
    return key


def tpm2_options(*, literal_pcrs: Sequence[int], public_key: str) -> list[str]:
    """The TPM2 binding options systemd-repart and systemd-cryptenroll share: LITERAL_PCRS by value
    (none: the installer's temporary slot) and PCR 11 through the release's signed policy."""
    return ["--tpm2-device=auto", f"--tpm2-pcrs={'+'.join(str(p) for p in literal_pcrs)}",
            f"--tpm2-public-key={public_key}", f"--tpm2-public-key-pcrs={KERNEL_IMAGE_PCR}"]
