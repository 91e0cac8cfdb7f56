# SPDX-License-Identifier: MIT
"""The verifier against the real tools: systemd's own PCR 11 policy (systemd-measure), a fresh
recording from swtpm (testkit/attest_record.py) proven and its Secure Boot off twin refused, and
tpm2-tools' own quote check and event log replay agreeing with the verifier's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from appliance.attest import event_log, tpm_wire
from appliance.attest.verify import Verdict
from testkit import attest_record
from testkit.swtpm import running_swtpm
from tests import attest_forge
from tests.attest_forge import check, load

pytestmark = pytest.mark.programs

MEASURE = Path(attest_record.SYSTEMD_MEASURE)
needs_tools = pytest.mark.skipif(not MEASURE.exists() or shutil.which("swtpm") is None or shutil.which("tpm2_quote") is None,
                                 reason="systemd-measure, swtpm and tpm2-tools are installed by make setup")


@needs_tools
def test_pcr_policy_digest_is_what_systemd_measure_signs(tmp_path: Path) -> None:
    files = {"linux": b"a kernel\n", "osrel": b"ID=test\n", "cmdline": b"quiet\n", "initrd": b"an initrd\n"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp_path / "pcr.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    (tmp_path / "pcr.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    sections = [f"--{name}={tmp_path / name}" for name in files] + ["--bank=sha256"]
    calculated = subprocess.run([str(MEASURE), "calculate", *sections, "--json=short"], check=True, capture_output=True,
                                text=True, timeout=60).stdout
    values = {e["phase"]: e["hash"] for e in json.loads(calculated)["sha256"]}
    assert len(values) == 4
    with running_swtpm(tmp_path) as tcti:  # systemd 252 asks a TPM for the policy digest
        signed = subprocess.run([str(MEASURE), "sign", *sections, f"--private-key={tmp_path / 'pcr.key'}",
                                 f"--public-key={tmp_path / 'pcr.pub'}", f"--tpm2-device={tcti}"],
                                check=True, capture_output=True, text=True, timeout=120).stdout
    pols = [e["pol"] for e in json.loads(signed)["sha256"]]
    assert [tpm_wire.pcr_policy_digest(11, bytes.fromhex(v)).hex() for v in values.values()] == pols


@needs_tools
def test_a_fresh_recording_from_swtpm_verifies(tmp_path: Path) -> None:
    out = tmp_path / "attest"
    attest_record.record(out)

    def verdict(variant: str, name: str = "evidence.json") -> Verdict:
        ev = load(variant, name, root=out)
        return check(ev, variant, ak_public=attest_forge.ak_public(variant, root=out),
                     releases=attest_forge.releases(root=out), secure_boot=attest_forge.trust(root=out))

    good = verdict("enforcing")
    assert (good.code, good.release, good.secure_boot) == ("ok", attest_forge.RELEASE, "enforcing")
    assert verdict("off").code == "secure-boot-off"
    assert verdict("enforcing", "evidence-pcr7.json").code == "selection"

    # tpm2-tools agrees: the quote checks out, and its replay of the log gives the same PCR 7
    work = out / "enforcing"
    ev = load("enforcing", root=out)
    _checkquote(work, ev.nonce)
    replayed = subprocess.run(["tpm2_eventlog", str(work / "event_log.bin")], check=True, capture_output=True, text=True,
                              timeout=60).stdout
    seven = re.search(r"^\s+7\s*:\s*0x([0-9A-Fa-f]{64})$", replayed, re.M)
    assert seven is not None
    assert seven.group(1).lower() == event_log.replay(event_log.parse((work / "event_log.bin").read_bytes()), 7).hex()


def _checkquote(work: Path, nonce: str) -> None:
    """tpm2_checkquote on the recorded quote: the AK's signature (its public key as PEM) and the nonce."""
    ak = tpm_wire.parse_public((work / "ak.pub").read_bytes())
    pem = ak.key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (work / "ak.pem").write_bytes(pem)
    done = subprocess.run(["tpm2_checkquote", "-u", str(work / "ak.pem"), "-m", str(work / "quote.msg"),
                           "-s", str(work / "quote.sig"), "-q", nonce, "-g", "sha256"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
